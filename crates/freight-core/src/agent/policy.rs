//! How an agent chooses the transport of each transfer: the configured policy (with
//! `FREIGHT_TRANSPORT` applied), the fabric it opens, and the facts it gathers about a
//! peer and the memory on both sides for the protocol's decision
//! ([`freight_proto::path_choice::choose`]).

use std::sync::Arc;

use freight_proto::error::{Error, Result};
use freight_proto::path_choice::{self, FabricFacts, PathFacts, PathPolicy, TransferPath, TransportKind};
use freight_proto::region::{MemKind, RegionInfo};

use crate::config::AgentConfig;
use crate::peer::Peer;
use crate::transport::cuda as gpu;
use crate::transport::fabric::{self, Fabric};
use crate::transport::gpu_bounce;

/// The configuration's transport policy, with `FREIGHT_TRANSPORT` applied (logged, so
/// that a run's logs say which transport was asked for and by whom).
pub(super) fn transport_policy(agent: &str, config: &AgentConfig) -> Result<PathPolicy> {
    let mut policy =
        PathPolicy { enabled: config.transports.clone(), require: config.require, required_by: "configuration".into() };
    let env = std::env::var(path_choice::TRANSPORT_ENV).ok();
    if path_choice::apply_transport_env(&mut policy, env.as_deref())? {
        tracing::warn!(agent, configured = ?config.require, by = %policy.required_by, "the environment overrides the configured transport");
    }
    match policy.require {
        Some(t) => {
            tracing::info!(agent, transport = %t, by = %policy.required_by, "every transfer must use one transport")
        }
        None => tracing::debug!(agent, enabled = ?policy.enabled, "transports chosen per path"),
    }
    Ok(policy)
}

/// Opens the fabric transport where the policy requires it or a provider is named
/// (by the configuration or [`fabric::PROVIDER_ENV`]). Failing to open it is an error
/// only where it is required; a named provider that cannot open is logged and left out.
pub(super) fn open_fabric(agent: &str, config: &AgentConfig, policy: &PathPolicy) -> Result<Option<Arc<Fabric>>> {
    if !policy.enabled.contains(&TransportKind::Fabric) {
        return Ok(None);
    }
    let cfg = config.fabric.with_env(|name| std::env::var(name).ok())?;
    let required = policy.require == Some(TransportKind::Fabric);
    if !required && cfg.provider.is_none() {
        return Ok(None);
    }
    match Fabric::open(&cfg) {
        Ok(f) => Ok(Some(Arc::new(f))),
        Err(e) if required => {
            let why = match e {
                Error::TransportUnavailable(why) => why,
                other => other.to_string(),
            };
            Err(Error::TransportUnavailable(format!(
                "fabric is required ({}) but cannot be opened: {why}",
                policy.required_by
            )))
        }
        Err(e) => {
            tracing::warn!(agent, provider = ?cfg.provider, error = %e, "the fabric transport cannot be opened; not offering it");
            Ok(None)
        }
    }
}

/// What a transfer's two ends are, as far as choosing its path goes.
pub(super) struct Ends<'a> {
    pub local: MemKind,
    pub remote: MemKind,
    /// Whether every remote region lies in memory this host can map (shm), or why not.
    pub shared: std::result::Result<(), String>,
    /// A region of each side, where GPU memory is involved: what the cuda transport and
    /// staging through host memory need to know.
    pub local_region: Option<&'a RegionInfo>,
    pub remote_region: Option<&'a RegionInfo>,
}

/// The path a transfer to `peer` between `ends` takes, and why; or why none can serve.
pub(super) fn choose(
    policy: &PathPolicy,
    fabric: Option<&Fabric>,
    peer: &Peer,
    ends: Ends<'_>,
) -> Result<TransferPath> {
    let (gpu, staging) = if ends.local == MemKind::Vram || ends.remote == MemKind::Vram {
        (
            gpu::path_facts(ends.local_region, ends.remote_region, peer.same_host),
            gpu_bounce::path_facts(ends.local_region, ends.remote_region),
        )
    } else {
        (Err("no GPU memory on either side".into()), Ok(()))
    };
    let facts = PathFacts {
        same_host: peer.same_host,
        peer_transports: peer.md.transports.clone(),
        local_kind: ends.local,
        remote_kind: ends.remote,
        remote_shared: ends.shared,
        gpu,
        staging,
        fabric: match fabric {
            Some(f) => Ok(FabricFacts {
                description: f.describe(),
                hardware: f.is_hardware(),
                delivery_complete: f.delivery_complete,
                gpu_staged: f.gpu_staged_why(),
            }),
            None => Err(format!(
                "not open on this agent (it opens where {}=fabric or {} names a provider)",
                path_choice::TRANSPORT_ENV,
                fabric::PROVIDER_ENV
            )),
        },
    };
    path_choice::choose(policy, &facts)
}
