//! The fabric transport: one-sided RDMA reads and writes through libfabric's reliable
//! datagram endpoints, over one or more rails (domains: NICs, or provider instances).
//!
//! libfabric is loaded at run time ([`ffi`]): without it the transport is simply not
//! available. An agent opens it when it is required (`FREIGHT_TRANSPORT=fabric`) or a
//! provider is named (`FREIGHT_FABRIC_PROVIDER`, [`FabricConfig::provider`]), and then
//! advertises `fabric` to its peers.
//!
//! A peer connection starts with an exchange over the peer's listener ([`link`]): the
//! target's endpoint addresses, one per rail, and later the keys of the regions the
//! initiator names. The target registers a region with its domains the first time a
//! peer asks for it (the registration cache) and drops the registrations when the region
//! is deregistered. After that the target's CPU takes no part: each transfer is cut into
//! operations of at most `chunk_size` bytes, dealt to the rails in turn, and each rail's
//! thread posts them and reaps their completions ([`progress`]). Writes complete only
//! once delivered (`FI_DELIVERY_COMPLETE`), so a notification sent after them finds the
//! data in place.
//!
//! Memory the provider cannot register is staged. Local GPU memory passes through the
//! rail's own pinned buffers ([`rail_staging`]); the peer's GPU memory through landing
//! buffers the peer lends and copies in and out of when told to
//! ([`freight_proto::fabric::pipeline`], [`relay`], [`dock`]).

mod dock;
pub mod ffi;
pub mod link;
pub mod progress;
pub mod rail;
mod rail_staging;
pub mod relay;

use std::sync::Arc;

use crate::tracker::{Finisher, Tracker};
use crate::transport::gpu_bounce;
use ffi::Lib;
use freight_cuda::driver::Device;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::frame::Seg;
use freight_proto::op::OpKind;
use freight_proto::plan::{chunk_ops, Plan};
use freight_proto::region::{MemKind, RegionInfo};
use progress::{Done, Work, Worker};
use rail::{DomainInfo, InfoList, Rail, Wants};
use relay::{Job, Part};

pub use link::{serve_fabric, FabricLink};

/// Names the libfabric provider, and so opens the fabric transport.
pub const PROVIDER_ENV: &str = "FREIGHT_FABRIC_PROVIDER";
/// Comma-separated domains to use as rails (for the tcp provider: interface names).
pub const DOMAINS_ENV: &str = "FREIGHT_FABRIC_DOMAINS";
/// `0` (or `off`, `false`) stages GPU memory even where the provider offers `FI_HMEM`.
pub const GPU_DIRECT_ENV: &str = "FREIGHT_FABRIC_GPU_DIRECT";

/// Tunables of the fabric transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricConfig {
    /// The libfabric provider ("efa", "verbs", "tcp", "shm"...); `None`: the first that
    /// offers what freight needs. Naming one opens the transport.
    pub provider: Option<String>,
    /// The domains to use, one rail each (a name may repeat: several endpoints on one
    /// NIC). Empty: the provider's first domain. Peers pair their rails in order.
    pub domains: Vec<String>,
    /// Largest single operation; larger copies are split and spread over the rails.
    pub chunk_size: u64,
    /// Stage the peer's host memory through its landing buffers too, as GPU memory the
    /// peer cannot register is: to test that path without GPUs, and to measure what it
    /// costs.
    pub stage_remote_host: bool,
    /// Register GPU memory with the provider where it offers `FI_HMEM` (else it is
    /// staged). Off: staged always, to compare the two, or where a provider's own GPU
    /// path is slower than staging.
    pub gpu_direct: bool,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            provider: None,
            domains: Vec::new(),
            chunk_size: 4 << 20,
            stage_remote_host: false,
            gpu_direct: true,
        }
    }
}

impl FabricConfig {
    /// The configuration with [`PROVIDER_ENV`], [`DOMAINS_ENV`] and [`GPU_DIRECT_ENV`]
    /// applied, as `env` reads them.
    pub fn with_env(&self, env: impl Fn(&str) -> Option<String>) -> Result<FabricConfig> {
        let mut cfg = self.clone();
        let set = |name| env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        if let Some(p) = set(PROVIDER_ENV) {
            cfg.provider = Some(p);
        }
        if let Some(d) = set(DOMAINS_ENV) {
            cfg.domains = d.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        }
        if let Some(v) = set(GPU_DIRECT_ENV) {
            cfg.gpu_direct = match v.to_ascii_lowercase().as_str() {
                "1" | "on" | "true" | "yes" => true,
                "0" | "off" | "false" | "no" => false,
                _ => return Err(invalid(format!("{GPU_DIRECT_ENV}='{v}': expected 1 or 0 (on/off, true/false)"))),
            };
        }
        Ok(cfg)
    }
}

/// Providers that move bytes through the kernel's sockets or memory copies: freight's
/// own tcp and shm transports do that at least as fast, so these are used only when
/// asked for by name. Any other provider drives RDMA hardware.
const SOFTWARE_PROVIDERS: [&str; 5] = ["tcp", "sockets", "udp", "shm", "net"];

/// The domains of `provider` again, asked to reach GPU memory too (`FI_HMEM`), where
/// it offers all of `names` so; else `list` as it is. Asked only of the provider
/// already chosen, so that asking never changes which provider serves.
fn with_gpu_memory(
    lib: &'static Lib,
    list: InfoList,
    provider: &str,
    names: &[String],
    delivery_complete: bool,
) -> InfoList {
    let wants = Wants { delivery_complete, gpu_memory: true };
    let offers_all = |gpu: &InfoList| {
        let domains = gpu.domains();
        names.iter().all(|n| domains.iter().any(|d| &d.domain == n))
    };
    match InfoList::discover(lib, Some(provider), wants) {
        Ok(gpu) if offers_all(&gpu) => {
            tracing::debug!(%provider, "the provider offers FI_HMEM: GPU memory is registered with it");
            gpu
        }
        Ok(_) => list,
        Err(e) => {
            tracing::debug!(%provider, error = %e, "GPU memory is staged");
            list
        }
    }
}

/// An agent's open fabric transport: its rails and their threads.
pub struct Fabric {
    /// The provider as libfabric names it ("tcp;ofi_rxm").
    pub provider: String,
    workers: Vec<Worker>,
    chunk_size: u64,
    /// Whether writes complete only once delivered (else notifications could overtake,
    /// and the peer's docks could not be landed).
    pub delivery_complete: bool,
    stage_remote_host: bool,
}

impl Fabric {
    /// Opens the transport as `cfg` says (checked by `AgentConfig::validate`).
    pub fn open(cfg: &FabricConfig) -> Result<Fabric> {
        debug_assert!(cfg.chunk_size > 0, "a fabric chunk size of 0 passed the configuration's check");
        let lib = Lib::get().map_err(|e| Error::TransportUnavailable(format!("fabric: {e}")))?;
        let provider = cfg.provider.as_deref();
        let wants = |delivery_complete| Wants { delivery_complete, gpu_memory: false };
        let (list, delivery_complete) = match InfoList::discover(lib, provider, wants(true)) {
            Ok(list) => (list, true),
            Err(first) => match InfoList::discover(lib, provider, wants(false)) {
                Ok(list) => {
                    tracing::warn!(error = %first, "the provider cannot complete writes on delivery; notifications wait for transmit completion only");
                    (list, false)
                }
                Err(_) => return Err(first),
            },
        };
        let first = list
            .domains()
            .first()
            .cloned()
            .ok_or_else(|| Error::TransportUnavailable("fabric: the provider offers no domain".into()))?;
        let names = if cfg.domains.is_empty() { vec![first.domain.clone()] } else { cfg.domains.clone() };
        let list =
            if cfg.gpu_direct { with_gpu_memory(lib, list, &first.provider, &names, delivery_complete) } else { list };
        let mut workers = Vec::with_capacity(names.len());
        for (i, name) in names.iter().enumerate() {
            let rail = Arc::new(Rail::open(&list, name)?);
            if !cfg.gpu_direct {
                // Never asked of the provider; this also holds should it offer it unasked.
                rail.stage_gpu_memory(format!(
                    "registering it is turned off: {GPU_DIRECT_ENV}=0 or fabric_gpu_direct=False"
                ));
            }
            workers.push(Worker::start(rail, i, cfg.chunk_size)?);
        }
        let provider = workers[0].rail.info.provider.clone();
        // Peers address every rail the same way (one provider, one addressing, one
        // address format): rails that differ would have their operations misread.
        if let Some(odd) = workers.iter().find(|w| {
            w.rail.info.provider != provider
                || w.rail.virt_addr != workers[0].rail.virt_addr
                || w.rail.addr_format != workers[0].rail.addr_format
                || w.rail.check_peer_address(&workers[0].rail.address).is_err()
        }) {
            return Err(Error::InvalidArgument(format!(
                "fabric: domain '{}' ({}) differs from domain '{}' ({}) in its provider, addressing or address format: \
                 every rail must be alike (name the provider, or domains of one kind)",
                odd.rail.info.domain, odd.rail.info.provider, workers[0].rail.info.domain, provider
            )));
        }
        let max_msg = workers.iter().map(|w| w.rail.max_msg).min().unwrap_or(0).max(1);
        let fabric = Fabric {
            provider,
            workers,
            chunk_size: cfg.chunk_size.min(max_msg),
            delivery_complete,
            stage_remote_host: cfg.stage_remote_host,
        };
        tracing::info!(transport = %fabric.describe(), chunk_size = fabric.chunk_size, lib = %lib.version_text(), "fabric transport open");
        Ok(fabric)
    }

    /// "provider tcp;ofi_rxm, 2 rails (lo, eth0)", for path reasons and logs.
    pub fn describe(&self) -> String {
        let names: Vec<&str> = self.workers.iter().map(|w| w.rail.info.domain.as_str()).collect();
        let rails = if names.len() == 1 { "1 rail".to_string() } else { format!("{} rails", names.len()) };
        format!("provider {}, {rails} ({})", self.provider, names.join(", "))
    }

    /// Whether the provider drives RDMA hardware (see [`SOFTWARE_PROVIDERS`]).
    pub fn is_hardware(&self) -> bool {
        let core = self.provider.split(';').next().unwrap_or_default();
        !SOFTWARE_PROVIDERS.contains(&core)
    }

    pub fn rails(&self) -> usize {
        self.workers.len()
    }

    /// The endpoint address of each rail, for peers.
    pub fn addresses(&self) -> Vec<Vec<u8>> {
        self.workers.iter().map(|w| w.rail.address.clone()).collect()
    }

    /// Whether peers address our memory by virtual address (else by offset into the
    /// region), the same on every rail.
    pub fn virt_addr(&self) -> bool {
        self.workers.iter().all(|w| w.rail.virt_addr)
    }

    /// Registers a region with every rail (cached): its keys, one per rail.
    pub fn keys(&self, region: &RegionInfo) -> Result<Vec<u64>> {
        self.workers.iter().map(|w| w.rail.registration(region, false).map(|m| m.key)).collect()
    }

    /// [`Fabric::keys`] of a GPU region, or `None` where some rail must stage GPU
    /// memory (then peers reach it through the docks).
    pub fn gpu_keys(&self, region: &RegionInfo) -> Option<Vec<u64>> {
        self.workers.iter().map(|w| w.rail.gpu_registration(region, false).map(|m| m.key)).collect()
    }

    /// Registers a GPU region with every rail ahead of its first use, where they
    /// register GPU memory (see [`Rail::gpu_registration`]; a failure turns them to
    /// staging).
    pub fn register_gpu(&self, region: &RegionInfo, private: bool) {
        for w in &self.workers {
            w.rail.gpu_registration(region, private);
        }
    }

    /// Whether GPU memory is registered with every rail rather than staged
    /// (`FI_HMEM`; until a registration fails, see [`Rail::gpu_registration`]).
    pub fn gpu_direct(&self) -> bool {
        self.workers.iter().all(|w| w.rail.gpu_direct())
    }

    /// Why GPU memory here is staged, where it is (for `path_to`).
    pub fn gpu_staged_why(&self) -> Option<String> {
        self.workers.iter().find_map(|w| w.rail.gpu_staged_why())
    }

    /// Drops a region's registrations; whether it had any.
    pub fn forget(&self, key: u64) -> bool {
        self.workers.iter().fold(false, |had, w| w.rail.forget(key) | had)
    }

    /// Fails every operation to a peer that died (`routes`: its handle on each rail).
    pub fn abandon(&self, routes: &[(u64, usize)], reason: &str) {
        for (worker, &(dest, _)) in self.workers.iter().zip(routes) {
            worker.abandon(dest, reason.to_string());
        }
    }

    /// Resolves a request's copies into operations, dealt to the rails in turn.
    /// `local` and `remote` describe the regions the copies name (`local` also says
    /// whether the region is private: no peer may reach it). Operations on the
    /// peer's GPU memory go through its docks (the relay is opened on first need).
    pub fn compile(
        self: &Arc<Self>,
        link: &Arc<FabricLink>,
        plan: &Plan,
        op: OpKind,
        local: impl Fn(u64) -> Option<(RegionInfo, bool)>,
        remote: impl Fn(u64) -> Option<RegionInfo>,
    ) -> Result<FabricProgram> {
        let read = op == OpKind::Read;
        let mut direct: Vec<Vec<Planned>> = vec![Vec::new(); self.workers.len()];
        let mut docked: Vec<Part> = Vec::new();
        // The peer's keys for the regions named, where it registered them (GPU memory
        // it must stage has none: it goes through its docks, as all memory does when
        // `stage_remote_host` says so).
        let mut reached = plan.remote_regions.clone();
        reached.retain(|&k| remote(k).is_some());
        let keys = if reached.is_empty() || self.stage_remote_host { Default::default() } else { link.keys(&reached)? };
        for (i, chunk) in chunk_ops(plan.copies(), self.chunk_size, 1).into_iter().enumerate() {
            let o = chunk.segs[0];
            let rail = i % self.workers.len();
            let (lr, private) = local(o.local_region).ok_or(Error::UnknownRegion(o.local_region))?;
            let rr = remote(o.remote_region).ok_or_else(|| Error::RemoteRejected {
                peer: link.peer().to_string(),
                reason: format!("region {} was deregistered by its owner", o.remote_region),
            })?;
            // Host memory is registered as it is, GPU memory too where the provider
            // can (FI_HMEM); else it passes through the rail's staging buffers.
            let here = &self.workers[rail].rail;
            let (gpu, desc) = match lr.kind {
                MemKind::Vram => match here.gpu_registration(&lr, private) {
                    Some(mr) => (None, mr.desc as usize),
                    None => (Some(gpu_bounce::gpu_of(&lr)?), 0),
                },
                _ => (None, here.registration(&lr, private)?.desc as usize),
            };
            let Some(Some(peer_keys)) = keys.get(&o.remote_region) else {
                let seg = Seg { region: o.remote_region, addr: o.remote_addr, len: o.len };
                let part = Part { read, local: o.local_addr, len: o.len, gpu, desc, rail, seg };
                docked.extend(part.split(relay::dock_size(self.chunk_size)));
                continue;
            };
            let (dest, remote_rail) = link.route(rail);
            direct[rail].push(Planned {
                local: o.local_addr,
                len: o.len,
                gpu,
                desc,
                dest,
                remote: if link.virt_addr() { o.remote_addr } else { o.remote_addr - rr.addr },
                key: peer_keys[remote_rail],
            });
        }
        // Opened now, so that a peer that cannot lend docks fails the request's making.
        if !docked.is_empty() {
            link.relay(self)?;
        }
        Ok(FabricProgram { read, direct, docked, link: link.clone(), peer: link.peer().into() })
    }

    /// Starts a compiled request.
    pub fn execute(
        self: &Arc<Self>,
        program: &FabricProgram,
        tracker: &Arc<Tracker>,
        finisher: Finisher,
    ) -> Result<()> {
        // The relay of this post (a new one if the last closed), before anything starts.
        let relay = (!program.docked.is_empty()).then(|| program.link.relay(self)).transpose()?;
        let parts: usize = program.direct.iter().map(Vec::len).sum::<usize>() + program.docked.len();
        tracker.begin(parts as u64, finisher)?;
        for (worker, planned) in self.workers.iter().zip(&program.direct) {
            if planned.is_empty() {
                continue;
            }
            let batch = planned
                .iter()
                .map(|p| Work {
                    read: program.read,
                    local: p.local,
                    len: p.len,
                    desc: p.desc,
                    dest: p.dest,
                    remote: p.remote,
                    key: p.key,
                    done: Done::Request(tracker.clone()),
                    peer: program.peer.clone(),
                    gpu: p.gpu,
                })
                .collect();
            worker.submit(batch);
        }
        if let Some(relay) = &relay {
            relay.submit(program.docked.iter().map(|&part| Job { part, tracker: tracker.clone() }).collect());
        }
        // The peer found dead while these were handed over: the rails may have obeyed
        // its one abandon before they got them, and would then wait on the provider for
        // ever. Abandoning again fails what is left; what was failed stays failed.
        if let Some(reason) = program.link.dead_reason() {
            self.abandon(program.link.routes(), &reason);
        }
        Ok(())
    }
}

/// One operation of a compiled request (see [`Work`]).
#[derive(Clone, Copy)]
struct Planned {
    local: u64,
    len: u64,
    gpu: Option<&'static Device>,
    desc: usize,
    dest: u64,
    remote: u64,
    key: u64,
}

/// A request resolved for the fabric: posting it only hands operations to the rails,
/// and the parts that go through the peer's docks to its relay.
pub struct FabricProgram {
    read: bool,
    direct: Vec<Vec<Planned>>,
    docked: Vec<Part>,
    /// The link to the peer: its relay carries `docked` (resolved at each post: relays
    /// close), and its watcher says when the peer died.
    link: Arc<FabricLink>,
    peer: Arc<str>,
}

/// libfabric's version where it can be loaded, else why not.
pub fn available() -> std::result::Result<String, String> {
    Lib::get().map(Lib::version_text)
}

/// What `freight doctor` reports of libfabric (see [`discover_domains`]).
pub struct Discovered {
    /// The name it was loaded by ("libfabric.so.1").
    pub library: String,
    /// "1.17".
    pub version: String,
    /// The domains its providers offer for freight's use (reliable datagram endpoints
    /// with one-sided reads and writes; none where it offers nothing suitable).
    pub domains: Vec<DomainInfo>,
    /// Those that also offer GPU memory (`FI_HMEM`).
    pub gpu_memory_domains: Vec<DomainInfo>,
}

/// What libfabric offers here, or why it cannot be loaded.
pub fn discover_domains() -> std::result::Result<Discovered, String> {
    let lib = Lib::get()?;
    let found = |gpu_memory| {
        let wants = Wants { delivery_complete: false, gpu_memory };
        InfoList::discover(lib, None, wants).map(|l| l.domains()).unwrap_or_default()
    };
    Ok(Discovered {
        library: lib.name.clone(),
        version: lib.version_text(),
        domains: found(false),
        gpu_memory_domains: found(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| map.get(name).cloned()
    }

    /// The environment names the provider and domains, and may turn FI_HMEM off; blank
    /// values leave the configuration alone, and a value that means neither on nor off
    /// is refused by name.
    #[test]
    fn the_environment_overrides_the_configuration() {
        let base = FabricConfig::default();
        assert_eq!(base.with_env(env_of(&[])).unwrap(), base);
        let cfg = base
            .with_env(env_of(&[(PROVIDER_ENV, " efa "), (DOMAINS_ENV, "a, b,,c"), (GPU_DIRECT_ENV, "Off")]))
            .unwrap();
        assert_eq!(cfg.provider.as_deref(), Some("efa"));
        assert_eq!(cfg.domains, ["a", "b", "c"]);
        assert!(!cfg.gpu_direct);
        let back = cfg.with_env(env_of(&[(PROVIDER_ENV, "  "), (GPU_DIRECT_ENV, "1")])).unwrap();
        assert_eq!(back.provider.as_deref(), Some("efa"));
        assert!(back.gpu_direct);
        let e = base.with_env(env_of(&[(GPU_DIRECT_ENV, "maybe")])).unwrap_err();
        assert!(e.to_string().contains("FREIGHT_FABRIC_GPU_DIRECT='maybe'"), "{e}");
    }

    /// The rails register GPU memory exactly where the provider offers FI_HMEM (Debian's
    /// shm provider does) and the configuration does not turn it off.
    #[test]
    fn gpu_memory_is_registered_where_offered_unless_turned_off() {
        let Ok(lib) = Lib::get() else {
            eprintln!("SKIPPED: libfabric is not installed");
            return;
        };
        let wants = Wants { delivery_complete: true, gpu_memory: true };
        let offered = InfoList::discover(lib, Some("shm"), wants).is_ok();
        for gpu_direct in [true, false] {
            let cfg = FabricConfig { provider: Some("shm".into()), gpu_direct, ..FabricConfig::default() };
            let Ok(fabric) = Fabric::open(&cfg) else {
                eprintln!("SKIPPED: libfabric's shm provider is not available");
                return;
            };
            assert_eq!(fabric.gpu_direct(), offered && gpu_direct, "offered: {offered}, configured: {gpu_direct}");
            let why = fabric.gpu_staged_why();
            assert_eq!(why.is_none(), fabric.gpu_direct(), "{why:?}");
            if !gpu_direct {
                assert!(why.unwrap().contains("turned off"));
            } else if !offered {
                assert!(why.unwrap().contains("offers no FI_HMEM"));
            }
        }
    }
}
