//! Which transport serves a peer and memory kind, and why: a pure decision over facts the
//! agent gathered, so every rule is tested without sockets.

use std::fmt;

use crate::error::{Error, Result};
use crate::region::MemKind;

/// The transports this build knows, in order of preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Same host, GPU memory on at least one side: copy kernels and copy engines.
    Cuda,
    /// Same host, host memory, through shared mappings.
    Shm,
    /// Any host, host memory, through libfabric's one-sided RDMA (see
    /// `freight_core::transport::fabric`).
    Fabric,
    /// Any host, host memory, through parallel TCP streams.
    Tcp,
}

impl TransportKind {
    pub const ALL: [TransportKind; 4] =
        [TransportKind::Cuda, TransportKind::Shm, TransportKind::Fabric, TransportKind::Tcp];

    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Cuda => "cuda",
            TransportKind::Shm => "shm",
            TransportKind::Fabric => "fabric",
            TransportKind::Tcp => "tcp",
        }
    }

    pub fn parse(s: &str) -> Result<TransportKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cuda" => Ok(TransportKind::Cuda),
            "shm" => Ok(TransportKind::Shm),
            "fabric" => Ok(TransportKind::Fabric),
            "tcp" => Ok(TransportKind::Tcp),
            other => {
                Err(Error::InvalidArgument(format!("unknown transport '{other}' (expected cuda, shm, fabric or tcp)")))
            }
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What this agent allows.
#[derive(Debug, Clone)]
pub struct PathPolicy {
    pub enabled: Vec<TransportKind>,
    pub require: Option<TransportKind>,
    /// Who asked for `require`, for reasons and errors: "configuration", or the
    /// environment variable and its value.
    pub required_by: String,
}

/// The environment variable that picks an agent's transport, overriding its
/// configuration: `cuda`, `shm`, `fabric`, `tcp`, or `auto` (the configuration decides).
pub const TRANSPORT_ENV: &str = "FREIGHT_TRANSPORT";

/// Applies a [`TRANSPORT_ENV`] value to a policy: the transport it names becomes the
/// required one. Returns whether it overrode a different configured requirement.
pub fn apply_transport_env(policy: &mut PathPolicy, value: Option<&str>) -> Result<bool> {
    let value = match value.map(str::trim) {
        None | Some("") => return Ok(false),
        Some(v) if v.eq_ignore_ascii_case("auto") => return Ok(false),
        Some(v) => v,
    };
    let t = TransportKind::parse(value).map_err(|_| {
        Error::InvalidArgument(format!(
            "{TRANSPORT_ENV}={value}: unknown transport (expected cuda, shm, fabric, tcp or auto)"
        ))
    })?;
    if !policy.enabled.contains(&t) {
        return Err(Error::InvalidArgument(format!(
            "{TRANSPORT_ENV}={value}, but this agent's configuration does not enable {t}"
        )));
    }
    let overrode = policy.require.is_some_and(|r| r != t);
    policy.require = Some(t);
    policy.required_by = format!("{TRANSPORT_ENV}={value}");
    Ok(overrode)
}

/// What is known about one path.
#[derive(Debug, Clone)]
pub struct PathFacts {
    pub same_host: bool,
    /// Transports the peer serves (from its metadata).
    pub peer_transports: Vec<String>,
    pub local_kind: MemKind,
    pub remote_kind: MemKind,
    /// `Err(why)` when some remote memory of the path is not in a shared segment.
    pub remote_shared: std::result::Result<(), String>,
    /// Whether the GPUs (and CUDA) can serve the path: how (`Ok`), or why not. Only
    /// asked where GPU memory is involved.
    pub gpu: std::result::Result<String, String>,
    /// Whether the GPU memory of the path can pass through host memory on both sides
    /// (for tcp), or why not.
    pub staging: std::result::Result<(), String>,
    /// This agent's open fabric transport, or why there is none.
    pub fabric: std::result::Result<FabricFacts, String>,
}

/// What the path decision needs to know about an open fabric transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricFacts {
    /// "provider tcp;ofi_rxm, 1 rail (lo)".
    pub description: String,
    /// Whether the provider drives RDMA hardware: only then is fabric chosen unasked.
    pub hardware: bool,
    /// Whether writes complete once delivered: staging into the peer's landing buffers
    /// (its GPU memory) needs it.
    pub delivery_complete: bool,
    /// Why this agent's GPU memory is staged through pinned host buffers, where it is;
    /// `None`: the provider registers it as it is (`FI_HMEM`).
    pub gpu_staged: Option<String>,
}

/// The chosen transport and the reason, as reported to users and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPath {
    pub transport: TransportKind,
    pub reason: String,
}

fn can_serve(t: TransportKind, policy: &PathPolicy, f: &PathFacts) -> std::result::Result<String, String> {
    if !policy.enabled.contains(&t) {
        return Err("disabled by configuration".into());
    }
    if !f.peer_transports.iter().any(|p| p == t.as_str()) {
        return Err("the peer does not serve it".into());
    }
    let gpu_involved = f.local_kind == MemKind::Vram || f.remote_kind == MemKind::Vram;
    if t == TransportKind::Cuda {
        if !gpu_involved {
            return Err("no GPU memory on either side (shm or tcp moves host memory)".into());
        }
        if f.local_kind == MemKind::File || f.remote_kind == MemKind::File {
            return Err("FILE memory has no transport in this build".into());
        }
        if !f.same_host {
            return Err("the peer is on another host".into());
        }
        if f.remote_kind == MemKind::Dram {
            f.remote_shared.clone().map_err(|why| format!("the peer's host memory cannot be mapped: {why}"))?;
        }
        return f.gpu.clone();
    }
    if t == TransportKind::Tcp {
        if f.local_kind == MemKind::File || f.remote_kind == MemKind::File {
            return Err("FILE memory has no transport in this build".into());
        }
        if gpu_involved {
            f.staging.clone()?;
        }
    } else if t == TransportKind::Fabric {
        for kind in [f.local_kind, f.remote_kind] {
            if !matches!(kind, MemKind::Dram | MemKind::Vram) {
                return Err(format!("moves host and GPU memory only, not {kind}"));
            }
        }
        if f.local_kind == MemKind::Vram {
            f.staging.clone()?;
        }
    } else {
        for kind in [f.local_kind, f.remote_kind] {
            if kind != MemKind::Dram {
                return Err(format!("moves host memory only, not {kind}"));
            }
        }
    }
    let staged = if gpu_involved { "; GPU memory staged through pinned host buffers" } else { "" };
    match t {
        TransportKind::Cuda => unreachable!("handled above"),
        TransportKind::Shm => {
            if !f.same_host {
                return Err("the peer is on another host (or another pid namespace)".into());
            }
            f.remote_shared.clone()?;
            Ok("same host, remote memory in shared segments: one memcpy, no syscalls".into())
        }
        TransportKind::Fabric => {
            let fabric = f.fabric.clone()?;
            if policy.require != Some(TransportKind::Fabric) && !fabric.hardware {
                return Err(format!(
                    "{} drives no RDMA hardware, so it is used only when required ({TRANSPORT_ENV}=fabric)",
                    fabric.description
                ));
            }
            let docks = if f.remote_kind == MemKind::Vram {
                if !fabric.delivery_complete {
                    return Err(format!(
                        "{} cannot complete writes on delivery, so the peer's GPU memory cannot be staged",
                        fabric.description
                    ));
                }
                "; the peer's GPU memory registered by its provider where it can (FI_HMEM), else staged in \
                 landing buffers it lends"
            } else {
                ""
            };
            let host = if f.same_host { "same host" } else { "peer on another host" };
            let here = match (f.local_kind, &fabric.gpu_staged) {
                (MemKind::Vram, None) => "; GPU memory here registered with the provider (FI_HMEM)".to_string(),
                (MemKind::Vram, Some(why)) => format!("; GPU memory here staged through pinned host buffers ({why})"),
                _ => String::new(),
            };
            Ok(format!("{host}, one-sided RDMA through libfabric, {}{here}{docks}", fabric.description))
        }
        TransportKind::Tcp => Ok(if f.same_host {
            format!("same host, but neither cuda nor shm can serve this path{staged}")
        } else {
            format!("peer on another host{staged}")
        }),
    }
}

/// Picks the most preferred transport that can serve the path.
pub fn choose(policy: &PathPolicy, facts: &PathFacts) -> Result<TransferPath> {
    if let Some(t) = policy.require {
        return can_serve(t, policy, facts)
            .map(|reason| TransferPath {
                transport: t,
                reason: format!("required by {}; {reason}", policy.required_by),
            })
            .map_err(|why| {
                Error::TransportUnavailable(format!(
                    "required transport {t} ({}) cannot serve this path: {why}",
                    policy.required_by
                ))
            });
    }
    let mut rejected = Vec::new();
    for t in TransportKind::ALL {
        match can_serve(t, policy, facts) {
            Ok(reason) => {
                let reason = if rejected.is_empty() { reason } else { format!("{reason} ({})", rejected.join("; ")) };
                return Ok(TransferPath { transport: t, reason });
            }
            Err(why) => rejected.push(format!("{t}: {why}")),
        }
    }
    Err(Error::TransportUnavailable(format!("no transport can serve this path: {}", rejected.join("; "))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> PathFacts {
        PathFacts {
            same_host: true,
            peer_transports: vec!["cuda".into(), "shm".into(), "tcp".into()],
            local_kind: MemKind::Dram,
            remote_kind: MemKind::Dram,
            remote_shared: Ok(()),
            gpu: Ok("same host, GPU 0 reaches GPU 1 over NVLink".into()),
            staging: Ok(()),
            fabric: Err("no fabric transport open".into()),
        }
    }
    fn policy() -> PathPolicy {
        PathPolicy { enabled: TransportKind::ALL.to_vec(), require: None, required_by: "configuration".into() }
    }

    #[test]
    fn prefers_shm_on_the_same_host() {
        assert_eq!(choose(&policy(), &facts()).unwrap().transport, TransportKind::Shm);
    }

    #[test]
    fn falls_back_to_tcp_and_says_why() {
        let f = PathFacts { same_host: false, ..facts() };
        let p = choose(&policy(), &f).unwrap();
        assert_eq!(p.transport, TransportKind::Tcp);
        assert!(p.reason.contains("another host"), "{}", p.reason);
        let f = PathFacts { remote_shared: Err("region 3 is not in a shared segment".into()), ..facts() };
        let p = choose(&policy(), &f).unwrap();
        assert_eq!(p.transport, TransportKind::Tcp);
        assert!(p.reason.contains("region 3"), "{}", p.reason);
    }

    #[test]
    fn the_environment_picks_the_transport_and_says_so() {
        let mut pol = policy();
        assert!(!apply_transport_env(&mut pol, None).unwrap());
        assert!(!apply_transport_env(&mut pol, Some(" auto ")).unwrap());
        assert_eq!(pol.require, None);
        assert!(!apply_transport_env(&mut pol, Some("TCP")).unwrap());
        let p = choose(&pol, &facts()).unwrap();
        assert_eq!(p.transport, TransportKind::Tcp);
        assert!(p.reason.starts_with("required by FREIGHT_TRANSPORT=TCP;"), "{}", p.reason);
        // Over a different configured choice, and named in the error when it cannot serve.
        let mut pol = PathPolicy { require: Some(TransportKind::Tcp), ..policy() };
        assert!(apply_transport_env(&mut pol, Some("shm")).unwrap());
        let e = choose(&pol, &PathFacts { same_host: false, ..facts() }).unwrap_err().to_string();
        assert!(e.contains("required transport shm (FREIGHT_TRANSPORT=shm)"), "{e}");
        let e = apply_transport_env(&mut policy(), Some("rdma")).unwrap_err().to_string();
        assert!(e.contains("FREIGHT_TRANSPORT=rdma: unknown transport"), "{e}");
        let mut tcp_only = PathPolicy { enabled: vec![TransportKind::Tcp], ..policy() };
        let e = apply_transport_env(&mut tcp_only, Some("shm")).unwrap_err().to_string();
        assert!(e.contains("does not enable shm"), "{e}");
    }

    #[test]
    fn a_required_transport_is_never_silently_replaced() {
        let pol = PathPolicy { require: Some(TransportKind::Shm), ..policy() };
        let f = PathFacts { same_host: false, ..facts() };
        let e = choose(&pol, &f).unwrap_err().to_string();
        assert!(e.contains("required transport shm"), "{e}");
        let pol = PathPolicy { require: Some(TransportKind::Tcp), ..policy() };
        assert_eq!(choose(&pol, &facts()).unwrap().transport, TransportKind::Tcp);
    }

    #[test]
    fn gpu_memory_takes_cuda_on_the_same_host_and_says_how() {
        let f = PathFacts { local_kind: MemKind::Vram, remote_kind: MemKind::Vram, ..facts() };
        let p = choose(&policy(), &f).unwrap();
        assert_eq!(p.transport, TransportKind::Cuda);
        assert!(p.reason.contains("NVLink"), "{}", p.reason);
        // Host memory the peer did not share: only tcp reaches it, staging the GPU side.
        let f = PathFacts { local_kind: MemKind::Vram, remote_shared: Err("no segment".into()), ..facts() };
        let p = choose(&policy(), &f).unwrap();
        assert_eq!(p.transport, TransportKind::Tcp);
        assert!(p.reason.contains("staged through pinned host buffers"), "{}", p.reason);
        let f = PathFacts { staging: Err("CUDA is not available here".into()), ..f };
        let e = choose(&policy(), &f).unwrap_err().to_string();
        assert!(e.contains("cannot be mapped") && e.contains("CUDA is not available here"), "{e}");
    }

    #[test]
    fn gpu_memory_on_another_host_goes_over_tcp_staged() {
        let f = PathFacts { same_host: false, local_kind: MemKind::Vram, remote_kind: MemKind::Vram, ..facts() };
        let p = choose(&policy(), &f).unwrap();
        assert_eq!(p.transport, TransportKind::Tcp);
        assert!(p.reason.contains("another host") && p.reason.contains("staged"), "{}", p.reason);
        let f = PathFacts { local_kind: MemKind::File, ..f };
        assert!(choose(&policy(), &f).unwrap_err().to_string().contains("FILE"));
    }

    #[test]
    fn requiring_cuda_without_peer_access_is_an_error() {
        let pol = PathPolicy { require: Some(TransportKind::Cuda), ..policy() };
        let f = PathFacts {
            local_kind: MemKind::Vram,
            remote_kind: MemKind::Vram,
            gpu: Err("GPU 0 cannot access GPU 1 directly (no peer access)".into()),
            ..facts()
        };
        let e = choose(&pol, &f).unwrap_err().to_string();
        assert!(e.contains("required transport cuda") && e.contains("no peer access"), "{e}");
        assert!(choose(&pol, &facts()).unwrap_err().to_string().contains("no GPU memory"));
    }

    #[test]
    fn gpu_memory_is_refused_with_a_reason() {
        let f = PathFacts {
            remote_kind: MemKind::Vram,
            gpu: Err("CUDA is not available".into()),
            staging: Err("the peer registered GPU memory without CUDA".into()),
            ..facts()
        };
        let e = choose(&policy(), &f).unwrap_err().to_string();
        assert!(e.contains("VRAM") && e.contains("CUDA is not available"), "{e}");
        assert!(e.contains("without CUDA"), "{e}");
        let pol = PathPolicy { enabled: vec![TransportKind::Shm], ..policy() };
        let f = PathFacts { same_host: false, ..facts() };
        assert!(choose(&pol, &f).is_err());
    }

    #[test]
    fn fabric_is_chosen_unasked_only_over_rdma_hardware() {
        let software = FabricFacts {
            description: "provider tcp;ofi_rxm, 1 rail (lo)".into(),
            hardware: false,
            delivery_complete: true,
            gpu_staged: Some("the provider offers no FI_HMEM".into()),
        };
        let remote = PathFacts { same_host: false, fabric: Ok(software.clone()), ..facts() };
        let remote = PathFacts { peer_transports: vec!["fabric".into(), "tcp".into()], ..remote };
        let p = choose(&policy(), &remote).unwrap();
        assert_eq!(p.transport, TransportKind::Tcp);
        assert!(p.reason.contains("drives no RDMA hardware"), "{}", p.reason);
        let pol = PathPolicy { require: Some(TransportKind::Fabric), ..policy() };
        let p = choose(&pol, &remote).unwrap();
        assert_eq!(p.transport, TransportKind::Fabric);
        assert!(p.reason.contains("one-sided RDMA") && p.reason.contains("tcp;ofi_rxm"), "{}", p.reason);
        let hardware = FabricFacts {
            description: "provider efa, 4 rails".into(),
            hardware: true,
            delivery_complete: true,
            gpu_staged: None,
        };
        let p = choose(&policy(), &PathFacts { fabric: Ok(hardware.clone()), ..remote.clone() }).unwrap();
        assert_eq!(p.transport, TransportKind::Fabric);
        // Local GPU memory is registered where the provider can, else staged; the peer's
        // is registered by the peer, or staged in its landing buffers where writes
        // complete on delivery; nothing without an open transport on both sides.
        let gpu = PathFacts { local_kind: MemKind::Vram, ..remote.clone() };
        let reason = choose(&pol, &gpu).unwrap().reason;
        assert!(
            reason.contains("here staged through pinned host buffers (the provider offers no FI_HMEM)"),
            "{reason}"
        );
        let direct = PathFacts { fabric: Ok(hardware), ..gpu.clone() };
        let reason = choose(&pol, &direct).unwrap().reason;
        assert!(
            reason.contains("here registered with the provider (FI_HMEM)") && !reason.contains("staged"),
            "{reason}"
        );
        let no_cuda = PathFacts { staging: Err("CUDA is not available".into()), ..gpu };
        assert!(choose(&pol, &no_cuda).unwrap_err().to_string().contains("CUDA is not available"));
        let remote_gpu = PathFacts { remote_kind: MemKind::Vram, ..remote.clone() };
        assert!(choose(&pol, &remote_gpu).unwrap().reason.contains("landing buffers"));
        let undelivered = FabricFacts { delivery_complete: false, ..software.clone() };
        let e = choose(&pol, &PathFacts { fabric: Ok(undelivered), ..remote_gpu }).unwrap_err().to_string();
        assert!(e.contains("cannot complete writes on delivery"), "{e}");
        let file = PathFacts { remote_kind: MemKind::File, ..remote.clone() };
        assert!(choose(&pol, &file).unwrap_err().to_string().contains("not FILE"));
        let closed = PathFacts { fabric: Err("libfabric is not installed".into()), ..remote.clone() };
        assert!(choose(&pol, &closed).unwrap_err().to_string().contains("not installed"));
        let e = choose(&pol, &PathFacts { fabric: Ok(software), ..facts() }).unwrap_err().to_string();
        assert!(e.contains("the peer does not serve it"), "{e}");
    }
}
