//! The agent: one per process (or per engine instance). It owns its memory registry, its
//! transports, its peers and its notification queue.
//!
//! Threading contract: every method takes `&self` and may be called from any thread at
//! any time. Requests may be posted, polled and waited on from any thread; a request's
//! `post` fails while that request is still pending. Background work runs on the
//! agent's own threads, which block on sockets and queues and use no CPU while idle.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::memory::{Registry, SharedSegment};
use crate::net::{self, Introduction};
use crate::notify::{NotifQueue, Notification, Waker};
use crate::peer::{ConnectionStats, DialContext, Peer};
use crate::server::{self, Server};
use crate::tracker::Tracker;
use crate::transport::cuda::{self as gpu, CudaConfig};
use crate::transport::fabric::{self, Fabric, FabricConfig};
use crate::transport::pool::CopyPool;
use crate::transport::shm::ShmConfig;
use crate::transport::staged;
use crate::transport::tcp::TcpConfig;
use freight_cuda::completion::Completions;
use freight_proto::desc::DescList;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::frame::{self, Frame};
use freight_proto::metadata::{AgentMetadata, HostIdentity};
use freight_proto::op::OpKind;
use freight_proto::path_choice::{self, PathFacts, PathPolicy, TransferPath, TransportKind};
use freight_proto::plan::{Plan, PreparedList};
use freight_proto::region::{Access, MemKind};

mod request;
pub use request::Request;

/// Everything an agent can be told at creation.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Address of the agent's listener (peers connect here). Port 0 picks a free port.
    pub listen: String,
    /// Addresses to advertise instead of the bound ones (behind NAT, several NICs).
    pub advertise: Vec<String>,
    /// Transports this agent may use and serve.
    pub transports: Vec<TransportKind>,
    /// When set, every transfer must use this transport or fail.
    pub require: Option<TransportKind>,
    pub tcp: TcpConfig,
    pub shm: ShmConfig,
    pub cuda: CudaConfig,
    pub fabric: FabricConfig,
    /// A peer that does not answer for this long is declared dead.
    pub peer_timeout: Duration,
    /// Bound on connecting and on each handshake.
    pub connect_timeout: Duration,
    /// When set, every connection to this agent must present this token: metadata
    /// requests, control, data and fabric connections alike (compared in constant
    /// time). Unset, anyone who can reach the listener may ask for the metadata, whose
    /// secret opens every other connection: see docs/engine.md, "Security model".
    pub token: Option<Vec<u8>>,
    /// Whether the listener answers metadata requests ([`Agent::connect`]). Off for an
    /// agent whose metadata travels another way only, as the KV server's and clients'
    /// do (over their authenticated control plane): then nothing on the listener hands
    /// out the secret, token or no token.
    pub serve_metadata: bool,
}

/// The longest access token (it travels in every hello).
pub const MAX_TOKEN: usize = 4096;

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: "127.0.0.1:0".into(),
            advertise: Vec::new(),
            transports: TransportKind::ALL.to_vec(),
            require: None,
            tcp: TcpConfig::default(),
            shm: ShmConfig::default(),
            cuda: CudaConfig::default(),
            fabric: FabricConfig::default(),
            peer_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            token: None,
            serve_metadata: true,
        }
    }
}

impl AgentConfig {
    fn validate(&self) -> Result<()> {
        if let Some(t) = self.require {
            if !self.transports.contains(&t) {
                return Err(invalid(format!("required transport {t} is not among the enabled transports")));
            }
        }
        if self.tcp.streams == 0 || self.tcp.window == 0 || self.tcp.chunk_size == 0 {
            return Err(invalid("tcp streams, window and chunk size must be positive"));
        }
        if matches!(&self.tcp.pin, freight_host::nic::Pinning::Cores(cores) if cores.is_empty()) {
            return Err(invalid("tcp pinning to cores needs at least one core"));
        }
        if self.tcp.chunk_size > frame::MAX_PAYLOAD {
            return Err(invalid(format!("tcp chunk size must be at most {} bytes", frame::MAX_PAYLOAD)));
        }
        if self.shm.threads == 0 {
            return Err(invalid("shm copy threads must be at least 1"));
        }
        if self.peer_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(invalid("timeouts must be positive"));
        }
        match self.token.as_deref() {
            // A peer that presents none presents the empty token: it would match.
            Some([]) => return Err(invalid("an empty token lets every peer in: give a non-empty one, or none")),
            Some(t) if t.len() > MAX_TOKEN => {
                return Err(invalid(format!("the token is {} bytes; at most {MAX_TOKEN} are allowed", t.len())))
            }
            _ => {}
        }
        self.fabric.validate()?;
        self.cuda.validate()
    }
}

/// The configuration's transport policy, with `FREIGHT_TRANSPORT` applied (logged, so
/// that a run's logs say which transport was asked for and by whom).
fn transport_policy(agent: &str, config: &AgentConfig) -> Result<PathPolicy> {
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
fn open_fabric(agent: &str, config: &AgentConfig, policy: &PathPolicy) -> Result<Option<Arc<Fabric>>> {
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

pub struct AgentInner {
    pub(crate) name: String,
    pub(crate) id: u64,
    pub(crate) secret: [u8; 16],
    pub(crate) host: Arc<HostIdentity>,
    pub(crate) config: AgentConfig,
    /// Which transports paths may take: the configuration's, or `FREIGHT_TRANSPORT`'s.
    policy: PathPolicy,
    pub(crate) registry: Registry,
    peers: RwLock<HashMap<String, Arc<Peer>>>,
    pub(crate) notifs: Arc<NotifQueue>,
    pub(crate) server: Server,
    copy_pool: OnceLock<CopyPool>,
    completions: OnceLock<Completions>,
    /// The fabric transport, where it was opened (see [`open_fabric`]).
    pub(crate) fabric: Option<Arc<Fabric>>,
    closed: AtomicBool,
}

/// See the module documentation for the threading contract.
pub struct Agent {
    inner: Arc<AgentInner>,
}

impl Agent {
    pub fn new(name: &str, config: AgentConfig) -> Result<Agent> {
        if name.is_empty() || name.len() > 256 || name.chars().any(|c| c.is_control() || c == '/') {
            return Err(invalid("agent name must be 1..256 printable characters without '/'"));
        }
        config.validate()?;
        let policy = transport_policy(name, &config)?;
        let fabric = open_fabric(name, &config, &policy)?;
        let inner = Arc::new(AgentInner {
            name: name.to_string(),
            id: rand::random::<u64>() | 1,
            secret: rand::random(),
            host: Arc::new(freight_host::identity()),
            config,
            policy,
            registry: Registry::new(),
            peers: RwLock::new(HashMap::new()),
            notifs: Arc::default(),
            server: Server::default(),
            copy_pool: OnceLock::new(),
            completions: OnceLock::new(),
            fabric,
            closed: AtomicBool::new(false),
        });
        server::listen(&inner, &inner.config.listen.clone())?;
        Ok(Agent { inner })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Who host memory pinned for region `key` belongs to (see [`freight_cuda::pinned`]):
    /// released when the region is deregistered or the agent goes away.
    pub fn pin_owner(&self, key: u64) -> freight_cuda::pinned::Owner {
        freight_cuda::pinned::Owner::Region { agent: self.inner.id, key }
    }

    pub fn config(&self) -> &AgentConfig {
        &self.inner.config
    }

    /// Listens on one more address (for example a well-known port for metadata).
    pub fn listen(&self, addr: &str) -> Result<SocketAddr> {
        self.inner.check_open()?;
        server::listen(&self.inner, addr)
    }

    /// Addresses peers are told to use.
    pub fn addresses(&self) -> Vec<String> {
        self.inner.advertised()
    }

    // -- memory ----------------------------------------------------------------------

    /// Registers memory. GPU memory is checked to be on GPU `dev` and exported to
    /// same-host peers where CUDA is present; without CUDA it is registered as given,
    /// and every transport refuses it with the reason.
    pub fn register(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<u64> {
        self.register_as(kind, addr, len, dev, Access::Shared)
    }

    /// Registers memory that peers may read but never write, and that this agent's own
    /// READs never land in: a buffer that must not change, or a read-only mapping (which
    /// a write would fault on). A WRITE into it is refused by the peer that would make
    /// it, and refused again here by the transports that serve remote accesses (tcp, the
    /// fabric's landing buffers and its memory registrations); shm and cuda peers write
    /// through their own mappings, so for them the refusal rests on their freight.
    pub fn register_read_only(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<u64> {
        self.register_as(kind, addr, len, dev, Access::ReadOnly)
    }

    fn register_as(&self, kind: MemKind, addr: u64, len: u64, dev: u64, access: Access) -> Result<u64> {
        self.inner.check_open()?;
        let export = if kind == MemKind::Vram { gpu::export_region(addr, len, dev)? } else { None };
        let key = self.inner.registry.register_gpu(kind, addr, len, dev, export, access)?;
        self.register_gpu_with_fabric(key, false);
        Ok(key)
    }

    /// Registers GPU memory with the fabric's provider now, where it offers `FI_HMEM`:
    /// the cost is paid here rather than by the first transfer, and `path_to` knows
    /// from here on whether it worked (else the rails stage GPU memory, as they do for
    /// a provider without `FI_HMEM`).
    fn register_gpu_with_fabric(&self, key: u64, private: bool) {
        let Some(fabric) = self.inner.fabric.as_ref().filter(|f| f.gpu_direct()) else { return };
        if let Some(region) = self.inner.registry.get(key).filter(|r| r.info.kind == MemKind::Vram) {
            fabric.register_gpu(&region.info, private);
        }
    }

    /// Registers private memory: like [`Agent::register`], but no peer may ever target
    /// it. It is left out of this agent's metadata (peers never learn its key, address,
    /// shared segment or IPC handle; private GPU memory is checked but not exported), and
    /// a remote access that names its key anyway is refused exactly as one naming a key
    /// that does not exist, so that a peer cannot probe for it. It serves as the local
    /// side of this agent's own transfers on every transport, exactly like a normal
    /// region, and [`Agent::deregister`] releases it as usual.
    ///
    /// Made for memory such as a server's pool: the server writes values from it into
    /// clients' buffers and reads clients' buffers into it, but clients must not touch it.
    ///
    /// This is a protocol guarantee, not an OS sandbox: on one host, processes of the
    /// same user can still open shared memory by its OS name, and a CUDA IPC handle names
    /// a whole allocation. Give a private region a segment ([`Agent::alloc`]) or GPU
    /// allocation of its own, shared with no public region.
    pub fn register_private(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<u64> {
        self.inner.check_open()?;
        if kind == MemKind::Vram {
            gpu::check_region(addr, len, dev)?;
        }
        let key = self.inner.registry.register_private(kind, addr, len, dev)?;
        self.register_gpu_with_fabric(key, true);
        Ok(key)
    }

    /// Deregisters a region; fails with `RegionBusy` while a transfer uses it. Peers that
    /// may map it (shared segments, GPU memory) are told to forget it; private regions,
    /// which no peer knows, are not announced.
    pub fn deregister(&self, key: u64) -> Result<()> {
        let info = self.inner.registry.get(key).map(|r| (r.info.clone(), r.is_private()));
        self.inner.registry.deregister(key)?;
        // Peers' one-sided accesses fail from here on.
        let fabric_keys = self.inner.fabric.as_ref().is_some_and(|f| f.forget(key));
        if let Some((info, private)) = info {
            if !private && (info.shared.is_some() || info.gpu.is_some() || fabric_keys) {
                self.inner.server.broadcast(&Frame::Revoke { region: key });
            }
            if info.kind == MemKind::Dram && freight_cuda::pinned::any() {
                freight_cuda::pinned::release(self.pin_owner(key));
            }
        }
        Ok(())
    }

    pub fn registered_regions(&self) -> usize {
        self.inner.registry.len()
    }

    /// Allocates host memory that same-host peers can reach through shm.
    pub fn alloc(&self, len: usize) -> Result<Arc<SharedSegment>> {
        SharedSegment::allocate(len)
    }

    /// Makes host memory this process already has reachable through shm, in place
    /// (see [`SharedSegment::share_in_place`]); register it afterwards. The segment
    /// lasts as long as the returned handle or a region registered in it.
    pub fn share_in_place(&self, addr: u64, len: u64) -> Result<Arc<SharedSegment>> {
        SharedSegment::share_in_place(addr, len)
    }

    // -- metadata and peers ----------------------------------------------------------

    /// This agent's metadata, for peers: its addresses and its public regions (private
    /// regions are never listed).
    pub fn metadata(&self) -> Vec<u8> {
        self.inner.metadata_bytes()
    }

    /// Adds a peer from its metadata; returns its name. Metadata of a peer already known
    /// and connected refreshes its regions in place; metadata of a restarted peer (a new
    /// agent id) or of one whose connection broke replaces it.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<String> {
        self.add_peer_with_token(metadata, None)
    }

    /// [`Agent::add_peer`] for a peer that requires an access token (its
    /// `AgentConfig::token`): every connection to it presents `token`. Metadata of a
    /// known peer given with a token replaces the token it had.
    pub fn add_peer_with_token(&self, metadata: &[u8], token: Option<&[u8]>) -> Result<String> {
        self.inner.check_open()?;
        let md = AgentMetadata::decode(metadata)?;
        let name = md.name.clone();
        // The same live agent again (a refresh): take its new regions and keep the
        // connections, so that transfers in flight to it carry on. Checked outside the
        // peers' lock: the check waits while a connection to that peer is being dialled,
        // and every other peer's lookup would wait behind it.
        let known = self.inner.peers.read().get(&name).cloned();
        if let Some(known) = known {
            if known.md.agent_id == md.agent_id && known.check_alive().is_ok() {
                known.replace_regions(&md.regions)?;
                if let Some(t) = token {
                    known.set_token(t);
                }
                tracing::debug!(agent = %self.inner.name, peer = %name, regions = md.regions.len(), "refreshed peer");
                return Ok(name);
            }
        }
        let same_host = self.inner.host.same_host(&md.host);
        let peer = Arc::new(Peer::new(md, same_host, token));
        let old = self.inner.peers.write().insert(name.clone(), peer);
        if let Some(old) = old {
            old.shutdown("replaced by new metadata");
        }
        tracing::info!(agent = %self.inner.name, peer = %name, same_host, "added peer");
        Ok(name)
    }

    /// Removes `name` as a peer, if it is one, and hangs up every connection it opened
    /// to this agent: it learns at once that it was dropped (its notifications and
    /// requests to this agent fail, and [`Agent::check_peer`] says so), instead of
    /// talking on to an agent that no longer answers it.
    pub fn disconnect_peer(&self, name: &str) {
        let removed = self.remove_peer(name).is_ok();
        let hung_up = self.inner.server.hang_up(name);
        tracing::info!(agent = %self.inner.name, peer = %name, removed, hung_up, "disconnected peer");
    }

    pub fn remove_peer(&self, name: &str) -> Result<()> {
        self.inner.check_open()?;
        let peer = self.inner.peers.write().remove(name).ok_or_else(|| Error::UnknownPeer(name.into()))?;
        peer.shutdown("removed");
        tracing::info!(agent = %self.inner.name, peer = %name, "removed peer");
        Ok(())
    }

    /// Fails with `PeerDisconnected` when a connection to `peer` broke or it was removed
    /// (a cheap check for code that waits on a peer, such as a stream's receiver).
    pub fn check_peer(&self, peer: &str) -> Result<()> {
        self.inner.peer(peer)?.check_alive()
    }

    /// The connections this agent made to `peer` since it was added: how many, the
    /// handshakes they took and how long setting them up took.
    pub fn connection_stats(&self, peer: &str) -> Result<ConnectionStats> {
        Ok(self.inner.peer(peer)?.connection_stats())
    }

    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.peers.read().keys().cloned().collect();
        v.sort();
        v
    }

    /// Fetches a peer's metadata from its listener at `addr` and adds it; `token` is
    /// the peer's access token, where it has one, and is presented on every
    /// connection to it from then on.
    pub fn connect(&self, addr: &str, token: Option<&[u8]>) -> Result<String> {
        self.inner.check_open()?;
        let bytes = net::fetch_metadata(addr, token.unwrap_or_default(), self.inner.config.connect_timeout)?;
        self.add_peer_with_token(&bytes, token)
    }

    /// Re-reads a known peer's metadata from its listener (to see regions it added),
    /// with `token`, or else the token it was added with.
    pub fn refresh_peer(&self, name: &str, token: Option<&[u8]>) -> Result<()> {
        let peer = self.inner.peer(name)?;
        let known = peer.token();
        let token = token.or((!known.is_empty()).then_some(&known[..]));
        let mut last = Error::TransportUnavailable(format!("peer '{name}' advertises no address"));
        for a in &peer.md.addresses {
            match self.connect(a, token) {
                Ok(_) => return Ok(()),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Which transport serves transfers to `peer`, and why: between GPU memory where
    /// this agent or the peer registered some, else between host memory.
    pub fn path_to(&self, peer: &str) -> Result<TransferPath> {
        let peer = self.inner.peer(peer)?;
        // This agent's end may be private memory: look at every local region.
        let local = self.inner.registry.local_regions();
        let local_gpu = local.iter().find(|r| r.kind == MemKind::Vram).cloned();
        let remote_gpu = peer.regions.read().iter().find(|r| r.kind == MemKind::Vram).cloned();
        let kind = |r: &Option<_>| if r.is_some() { MemKind::Vram } else { MemKind::Dram };
        let (local_kind, remote_kind) = (kind(&local_gpu), kind(&remote_gpu));
        let shared = {
            let shared_region = peer.regions.read().iter().find(|r| r.shared.is_some()).cloned();
            match shared_region {
                None => Err("the peer has no memory in shared segments".to_string()),
                Some(r) if peer.same_host => peer.shm.probe(&r).map_err(|e| e.to_string()),
                Some(_) => Ok(()),
            }
        };
        // Where one side has no GPU memory, its host memory is the other end.
        let local_end = local_gpu.or_else(|| local.into_iter().next());
        let remote_end = remote_gpu.or_else(|| peer.regions.read().iter().find(|r| r.shared.is_some()).cloned());
        let gpu = gpu::path_facts(local_end.as_ref(), remote_end.as_ref(), peer.same_host);
        let staging = staged::path_facts(local_end.as_ref(), remote_end.as_ref());
        self.inner.choose_path(&peer, local_kind, remote_kind, shared, gpu, staging)
    }

    /// Opens now the connections that transfers to `peer` take (on the path
    /// [`Agent::path_to`] chooses), which are otherwise opened by the first transfer:
    /// a server that moves every client's data from one thread opens each client's
    /// where waiting for it holds up no other client. Returns the path.
    pub fn open_path(&self, peer: &str) -> Result<TransferPath> {
        let path = self.path_to(peer)?;
        let peer = self.inner.peer(peer)?;
        let ctx = self.inner.dial_context();
        match path.transport {
            // Mapping transports need the control link: revocations arrive on it.
            TransportKind::Shm | TransportKind::Cuda => drop(peer.control(&ctx)?),
            TransportKind::Tcp => drop(peer.tcp(&ctx, &self.inner.config.tcp, None)?),
            TransportKind::Fabric => drop(peer.fabric(&ctx, self.inner.fabric()?)?),
        }
        Ok(path)
    }

    // -- descriptors and requests ----------------------------------------------------

    pub fn prepare_local(&self, list: &DescList) -> Result<PreparedList> {
        self.inner.registry.prepare(list)
    }

    pub fn prepare_remote(&self, peer: &str, list: &DescList) -> Result<RemoteList> {
        let peer = self.inner.peer(peer)?;
        let prepared = PreparedList::remote(list, &peer.regions.read())?;
        Ok(RemoteList { peer, list: prepared })
    }

    /// Builds a reusable request from prepared lists and optional index selections.
    pub fn make_request(
        &self,
        op: OpKind,
        local: &PreparedList,
        local_idx: Option<&[u64]>,
        remote: &RemoteList,
        remote_idx: Option<&[u64]>,
        notif: Option<Vec<u8>>,
    ) -> Result<Request> {
        self.inner.check_open()?;
        if notif.as_ref().is_some_and(|m| m.len() > frame::MAX_NOTIF) {
            return Err(invalid(format!("notification larger than {} bytes", frame::MAX_NOTIF)));
        }
        let started = Instant::now();
        let plan = Plan::build(local, local_idx, &remote.list, remote_idx)?;
        let planned = started.elapsed();
        let peer = remote.peer.clone();
        // Nothing is written into read-only memory: ours for a READ, the peer's for a
        // WRITE (which its transports would refuse too, where they serve it).
        if op == OpKind::Read {
            plan.local_regions.iter().try_for_each(|&k| match self.inner.registry.get(k) {
                Some(r) => r.info.check_writable(),
                None => Ok(()),
            })?;
        }
        // One pass over the peer's regions for both that and whether all are in shared
        // segments this host can map (which decides shm).
        let shared = {
            let regions = peer.regions.read();
            let mut shared = Ok(());
            for &k in &plan.remote_regions {
                let why = match regions.get(k) {
                    Some(r) if op == OpKind::Write && r.read_only => {
                        return Err(Error::RemoteRejected {
                            peer: peer.name.clone(),
                            reason: format!("region {k} is registered read-only by its owner: it cannot be written"),
                        })
                    }
                    _ if shared.is_err() => None,
                    Some(r) if r.shared.is_none() => Some(format!(
                        "remote region {k} is not in a shared segment (the peer must allocate it with Agent.alloc)"
                    )),
                    Some(r) if peer.same_host => peer.shm.probe(r).err().map(|e| e.to_string()),
                    Some(_) => None,
                    None => Some(format!("remote region {k} was revoked")),
                };
                if let Some(why) = why {
                    shared = Err(why);
                }
            }
            shared
        };
        let (gpu, staging) = if local.kind() == MemKind::Vram || remote.list.kind() == MemKind::Vram {
            let local_region =
                local.regions().first().and_then(|&k| self.inner.registry.get(k)).map(|r| r.info.clone());
            let remote_region = remote.list.regions().first().and_then(|&k| peer.regions.read().get(k).cloned());
            (
                gpu::path_facts(local_region.as_ref(), remote_region.as_ref(), peer.same_host),
                staged::path_facts(local_region.as_ref(), remote_region.as_ref()),
            )
        } else {
            (Err("no GPU memory on either side".into()), Ok(()))
        };
        let path = self.inner.choose_path(&peer, local.kind(), remote.list.kind(), shared, gpu, staging)?;
        let checked = started.elapsed();
        let request = Request {
            agent: self.inner.clone(),
            peer,
            op,
            plan: Arc::new(plan),
            notif,
            path,
            tracker: Arc::new(Tracker::new()),
            program: OnceLock::new(),
        };
        if request.path.transport == TransportKind::Cuda {
            // Compile now (map, pin, upload the work table): posting is then one launch.
            request.program(&request.agent.dial_context())?;
        }
        tracing::debug!(
            peer = %request.peer.name,
            transport = %request.path.transport,
            reason = %request.path.reason,
            ops = request.plan.ops.len(),
            bytes = request.plan.bytes,
            plan_us = planned.as_micros() as u64,
            checks_us = (checked - planned).as_micros() as u64,
            total_us = started.elapsed().as_micros() as u64,
            "request made"
        );
        Ok(request)
    }

    /// One-shot form: prepares both lists, builds the request and posts it.
    pub fn transfer(
        &self,
        op: OpKind,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Vec<u8>>,
    ) -> Result<Request> {
        let l = self.prepare_local(local)?;
        let r = self.prepare_remote(peer, remote)?;
        let req = self.make_request(op, &l, None, &r, None, notif)?;
        req.post()?;
        Ok(req)
    }

    // -- notifications ---------------------------------------------------------------

    /// Sends a standalone notification (ordered with the peer's other notifications).
    /// Fails with `Timeout` when a same-host peer leaves its notification ring full for
    /// the peer timeout (the peer does not run).
    pub fn notify(&self, peer: &str, msg: Vec<u8>) -> Result<()> {
        if msg.len() > frame::MAX_NOTIF {
            return Err(invalid(format!("notification larger than {} bytes", frame::MAX_NOTIF)));
        }
        let peer = self.inner.peer(peer)?;
        peer.control(&self.inner.dial_context())?.notify(msg)
    }

    /// Notifications received so far, oldest first (non-blocking).
    pub fn get_notifs(&self) -> Vec<Notification> {
        // Pull what the kernel already holds: a polling caller need not wait for the
        // connection thread to wake up (see `crate::inbox`).
        self.inner.server.inboxes.pump(&self.inner.notifs);
        self.inner.notifs.drain()
    }

    /// Returns notifications taken with [`Agent::get_notifs`] or [`Agent::wait_notifs`]
    /// that the taker does not handle (a component that stops owning the queue): they
    /// come first in line again, in their order.
    pub fn give_back_notifs(&self, notifs: Vec<Notification>) {
        self.inner.notifs.give_back(notifs);
    }

    /// Waits up to `timeout` for at least one notification.
    pub fn wait_notifs(&self, timeout: Duration) -> Vec<Notification> {
        let inboxes = &self.inner.server.inboxes;
        inboxes.pump(&self.inner.notifs);
        let ready = self.inner.notifs.drain();
        if !ready.is_empty() {
            return ready;
        }
        // Senders ring only while someone sleeps here: say so, then look once more.
        inboxes.sleeping(true);
        inboxes.pump(&self.inner.notifs);
        let got = self.inner.notifs.wait(timeout);
        inboxes.sleeping(false);
        got
    }

    /// A handle that ends a `wait_notifs` early (see [`Waker`]), e.g. from a request's
    /// [`Request::on_settled`] hook, so that one thread can wait for notifications and
    /// for its own transfers at once.
    pub fn waker(&self) -> Waker {
        Waker(self.inner.notifs.clone())
    }

    /// Stops listening and closes every connection. In-flight requests fail.
    pub fn close(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.server.shutdown();
        // Out of the table first: shutting a peer down may wait, and lookups must not.
        let peers: Vec<_> = self.inner.peers.write().drain().collect();
        for (_, p) in peers {
            p.shutdown("the local agent closed");
        }
        tracing::info!(agent = %self.inner.name, "closed");
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.close();
    }
}

impl Drop for AgentInner {
    /// Once no request is left (each holds the agent), the host memory it pinned is
    /// unpinned, also where the application never deregistered it.
    fn drop(&mut self) {
        if freight_cuda::pinned::any() {
            freight_cuda::pinned::release_agent(self.id);
        }
    }
}

impl AgentInner {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            return Err(Error::InvalidState(format!("agent '{}' is closed", self.name)));
        }
        Ok(())
    }

    /// A closed agent's peers are gone: that is no fault of the name asked for.
    fn peer(&self, name: &str) -> Result<Arc<Peer>> {
        self.check_open()?;
        self.peers.read().get(name).cloned().ok_or_else(|| Error::UnknownPeer(name.into()))
    }

    fn dial_context(&self) -> DialContext {
        DialContext {
            intro: Introduction {
                from_name: self.name.clone(),
                from_id: self.id,
                target_id: 0,
                secret: Vec::new(),
                token: Vec::new(),
            },
            timeout: self.config.connect_timeout,
            peer_timeout: self.config.peer_timeout,
            host: self.host.clone(),
        }
    }

    fn choose_path(
        &self,
        peer: &Peer,
        local: MemKind,
        remote: MemKind,
        shared: std::result::Result<(), String>,
        gpu: std::result::Result<String, String>,
        staging: std::result::Result<(), String>,
    ) -> Result<TransferPath> {
        let facts = PathFacts {
            same_host: peer.same_host,
            peer_transports: peer.md.transports.clone(),
            local_kind: local,
            remote_kind: remote,
            remote_shared: shared,
            gpu,
            staging,
            fabric: match &self.fabric {
                Some(f) => Ok(path_choice::FabricFacts {
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
        path_choice::choose(&self.policy, &facts)
    }

    pub(crate) fn advertised(&self) -> Vec<String> {
        if !self.config.advertise.is_empty() {
            return self.config.advertise.clone();
        }
        let mut out = Vec::new();
        for a in self.server.addresses() {
            if a.ip().is_unspecified() {
                for ip in local_ips() {
                    out.push(SocketAddr::new(ip, a.port()).to_string());
                }
            } else {
                out.push(a.to_string());
            }
        }
        out
    }

    /// What peers are told: public regions only (see [`Agent::register_private`]).
    pub(crate) fn metadata_bytes(&self) -> Vec<u8> {
        let (_, regions) = self.registry.snapshot();
        AgentMetadata {
            name: self.name.clone(),
            agent_id: self.id,
            secret: self.secret,
            host: (*self.host).clone(),
            addresses: self.advertised(),
            transports: self
                .config
                .transports
                .iter()
                .filter(|&&t| t != TransportKind::Fabric || self.fabric.is_some())
                .map(|t| t.as_str().to_string())
                .collect(),
            regions,
        }
        .encode()
    }

    fn completions(&self) -> Result<&Completions> {
        if let Some(c) = self.completions.get() {
            return Ok(c);
        }
        let c = Completions::start(&self.name, self.config.cuda.completion)?;
        Ok(self.completions.get_or_init(|| c))
    }

    fn fabric(&self) -> Result<&Arc<Fabric>> {
        self.fabric.as_ref().ok_or_else(|| Error::TransportUnavailable("fabric is not open on this agent".into()))
    }

    fn copy_pool(&self) -> Result<&CopyPool> {
        if let Some(p) = self.copy_pool.get() {
            return Ok(p);
        }
        let pool = CopyPool::new(self.config.shm.threads)?;
        Ok(self.copy_pool.get_or_init(|| pool))
    }
}

/// The host's IPv4 addresses, non-loopback first (for listeners bound to 0.0.0.0).
fn local_ips() -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = freight_host::nic::local_nics().into_iter().map(|n| IpAddr::V4(n.addr)).collect();
    ips.sort_by_key(|ip| ip.is_loopback());
    ips.dedup();
    if ips.is_empty() {
        ips.push(IpAddr::from([127, 0, 0, 1]));
    }
    ips
}

/// A descriptor list prepared against a peer's memory.
#[derive(Clone)]
pub struct RemoteList {
    peer: Arc<Peer>,
    pub list: PreparedList,
}

impl std::fmt::Debug for RemoteList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteList").field("peer", &self.peer.name).field("list", &self.list).finish()
    }
}

impl RemoteList {
    pub fn peer(&self) -> &str {
        &self.peer.name
    }
}
