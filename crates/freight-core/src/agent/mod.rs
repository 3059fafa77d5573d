//! The agent: one per process (or per engine instance). It owns its memory registry, its
//! transports, its peers and its notification queue.
//!
//! Threading contract: every method takes `&self` and may be called from any thread at
//! any time. Requests may be posted, polled and waited on from any thread; a request's
//! `post` fails while that request is still pending. Background work runs on the
//! agent's own threads, which block on sockets and queues and use no CPU while idle.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::config::AgentConfig;
use crate::memory::SharedSegment;
use crate::net::{self, Introduction};
use crate::notify::{Notification, Waker};
use crate::peer::{ConnectionStats, DialContext, Peer};
use crate::server::{self, Served};
use crate::tracker::Tracker;
use crate::transport::cuda as gpu;
use crate::transport::fabric::Fabric;
use crate::transport::pool::CopyPool;
use freight_cuda::completion::Completions;
use freight_proto::desc::DescList;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::frame::{self, Frame};
use freight_proto::metadata::AgentMetadata;
use freight_proto::op::OpKind;
use freight_proto::path_choice::{PathPolicy, TransferPath, TransportKind};
use freight_proto::plan::{Plan, PreparedList};
use freight_proto::region::{Access, MemKind};

mod policy;
mod request;
pub use request::Request;

/// The agent behind its handles (an [`Agent`], its requests).
pub struct AgentInner {
    /// What the agent serves its peers; the listener's threads hold it too.
    pub(crate) served: Arc<Served>,
    /// Which transports paths may take: the configuration's, or `FREIGHT_TRANSPORT`'s.
    policy: PathPolicy,
    peers: RwLock<HashMap<String, Arc<Peer>>>,
    copy_pool: OnceLock<CopyPool>,
    completions: OnceLock<Completions>,
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
        let policy = policy::transport_policy(name, &config)?;
        let fabric = policy::open_fabric(name, &config, &policy)?;
        let served = Arc::new(Served::new(name, freight_host::identity(), config, fabric));
        server::listen(&served, &served.config.listen)?;
        let inner = Arc::new(AgentInner {
            served,
            policy,
            peers: RwLock::new(HashMap::new()),
            copy_pool: OnceLock::new(),
            completions: OnceLock::new(),
        });
        Ok(Agent { inner })
    }

    /// Whether [`Agent::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.inner.served.is_closed()
    }

    pub fn name(&self) -> &str {
        &self.inner.served.name
    }

    /// Who host memory pinned for region `key` belongs to (see [`freight_cuda::pinned`]):
    /// released when the region is deregistered or the agent goes away.
    pub fn pin_owner(&self, key: u64) -> freight_cuda::pinned::Owner {
        freight_cuda::pinned::Owner::Region { agent: self.inner.served.id, key }
    }

    pub fn config(&self) -> &AgentConfig {
        &self.inner.served.config
    }

    /// Listens on one more address (for example a well-known port for metadata).
    pub fn listen(&self, addr: &str) -> Result<SocketAddr> {
        self.inner.check_open()?;
        server::listen(&self.inner.served, addr)
    }

    /// Addresses peers are told to use.
    pub fn addresses(&self) -> Vec<String> {
        self.inner.served.advertised()
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
        let key = self.inner.served.registry.register_gpu(kind, addr, len, dev, export, access)?;
        self.register_gpu_with_fabric(key, false);
        Ok(key)
    }

    /// Registers GPU memory with the fabric's provider now, where it offers `FI_HMEM`:
    /// the cost is paid here rather than by the first transfer, and `path_to` knows
    /// from here on whether it worked (else the rails stage GPU memory, as they do for
    /// a provider without `FI_HMEM`).
    fn register_gpu_with_fabric(&self, key: u64, private: bool) {
        let Some(fabric) = self.inner.served.fabric.as_ref().filter(|f| f.gpu_direct()) else { return };
        if let Some(region) = self.inner.served.registry.get(key).filter(|r| r.info.kind == MemKind::Vram) {
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
        let key = self.inner.served.registry.register_private(kind, addr, len, dev)?;
        self.register_gpu_with_fabric(key, true);
        Ok(key)
    }

    /// Deregisters a region; fails with `RegionBusy` while a transfer uses it. Peers that
    /// may map it (shared segments, GPU memory) are told to forget it; private regions,
    /// which no peer knows, are not announced.
    pub fn deregister(&self, key: u64) -> Result<()> {
        let info = self.inner.served.registry.get(key).map(|r| (r.info.clone(), r.is_private()));
        self.inner.served.registry.deregister(key)?;
        // Peers' one-sided accesses fail from here on.
        let fabric_keys = self.inner.served.fabric.as_ref().is_some_and(|f| f.forget(key));
        if let Some((info, private)) = info {
            if !private && (info.shared.is_some() || info.gpu.is_some() || fabric_keys) {
                self.inner.served.server.broadcast(&Frame::Revoke { region: key });
            }
            if info.kind == MemKind::Dram && freight_cuda::pinned::any() {
                freight_cuda::pinned::release(self.pin_owner(key));
            }
        }
        Ok(())
    }

    pub fn registered_regions(&self) -> usize {
        self.inner.served.registry.len()
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
        self.inner.served.metadata_bytes()
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
                tracing::debug!(agent = %self.inner.served.name, peer = %name, regions = md.regions.len(), "refreshed peer");
                return Ok(name);
            }
        }
        let same_host = self.inner.served.host.same_host(&md.host);
        let peer = Arc::new(Peer::new(md, same_host, token));
        let old = self.inner.peers.write().insert(name.clone(), peer);
        if let Some(old) = old {
            old.shutdown("replaced by new metadata");
        }
        tracing::info!(agent = %self.inner.served.name, peer = %name, same_host, "added peer");
        Ok(name)
    }

    /// Removes `name` as a peer, if it is one, and hangs up every connection it opened
    /// to this agent: it learns at once that it was dropped (its notifications and
    /// requests to this agent fail, and [`Agent::check_peer`] says so), instead of
    /// talking on to an agent that no longer answers it.
    pub fn disconnect_peer(&self, name: &str) {
        let removed = self.remove_peer(name).is_ok();
        let hung_up = self.inner.served.server.hang_up(name);
        tracing::info!(agent = %self.inner.served.name, peer = %name, removed, hung_up, "disconnected peer");
    }

    pub fn remove_peer(&self, name: &str) -> Result<()> {
        self.inner.check_open()?;
        let peer = self.inner.peers.write().remove(name).ok_or_else(|| Error::UnknownPeer(name.into()))?;
        peer.shutdown("removed");
        tracing::info!(agent = %self.inner.served.name, peer = %name, "removed peer");
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
        let bytes = net::fetch_metadata(addr, token.unwrap_or_default(), self.inner.served.config.connect_timeout)?;
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
        let local = self.inner.served.registry.local_regions();
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
        let ends = policy::Ends {
            local: local_kind,
            remote: remote_kind,
            shared,
            local_region: local_end.as_ref(),
            remote_region: remote_end.as_ref(),
        };
        self.inner.choose_path(&peer, ends)
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
            TransportKind::Tcp => drop(peer.tcp(&ctx, &self.inner.served.config.tcp, None)?),
            TransportKind::Fabric => drop(peer.fabric(&ctx, self.inner.fabric()?)?),
        }
        Ok(path)
    }

    // -- descriptors and requests ----------------------------------------------------

    pub fn prepare_local(&self, list: &DescList) -> Result<PreparedList> {
        self.inner.served.registry.prepare(list)
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
            plan.local_regions.iter().try_for_each(|&k| match self.inner.served.registry.get(k) {
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
        // The first region of each side stands for its GPU (a request's memory on one
        // side is on one GPU, or the transport refuses it when compiling).
        let gpu_involved = local.kind() == MemKind::Vram || remote.list.kind() == MemKind::Vram;
        let local_region = local
            .regions()
            .first()
            .filter(|_| gpu_involved)
            .and_then(|&k| self.inner.served.registry.get(k))
            .map(|r| r.info.clone());
        let remote_region =
            remote.list.regions().first().filter(|_| gpu_involved).and_then(|&k| peer.regions.read().get(k).cloned());
        let ends = policy::Ends {
            local: local.kind(),
            remote: remote.list.kind(),
            shared,
            local_region: local_region.as_ref(),
            remote_region: remote_region.as_ref(),
        };
        let path = self.inner.choose_path(&peer, ends)?;
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
            copies = request.plan.copy_count(),
            runs = request.plan.runs().len(),
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
        self.inner.served.server.inboxes.pump(&self.inner.served.notifs);
        self.inner.served.notifs.drain()
    }

    /// Returns notifications taken with [`Agent::get_notifs`] or [`Agent::wait_notifs`]
    /// that the taker does not handle (a component that stops owning the queue): they
    /// come first in line again, in their order.
    pub fn give_back_notifs(&self, notifs: Vec<Notification>) {
        self.inner.served.notifs.give_back(notifs);
    }

    /// Waits up to `timeout` for at least one notification.
    pub fn wait_notifs(&self, timeout: Duration) -> Vec<Notification> {
        let inboxes = &self.inner.served.server.inboxes;
        inboxes.pump(&self.inner.served.notifs);
        let ready = self.inner.served.notifs.drain();
        if !ready.is_empty() {
            return ready;
        }
        // Senders ring only while someone sleeps here: say so, then look once more.
        inboxes.sleeping(true);
        inboxes.pump(&self.inner.served.notifs);
        let got = self.inner.served.notifs.wait(timeout);
        inboxes.sleeping(false);
        got
    }

    /// A handle that ends a `wait_notifs` early (see [`Waker`]), e.g. from a request's
    /// [`Request::on_settled`] hook, so that one thread can wait for notifications and
    /// for its own transfers at once.
    pub fn waker(&self) -> Waker {
        Waker(self.inner.served.notifs.clone())
    }

    /// Stops listening and closes every connection. In-flight requests fail.
    pub fn close(&self) {
        if !self.inner.served.close() {
            return;
        }
        self.inner.served.server.shutdown();
        // Out of the table first: shutting a peer down may wait, and lookups must not.
        let peers: Vec<_> = self.inner.peers.write().drain().collect();
        for (_, p) in peers {
            p.shutdown("the local agent closed");
        }
        tracing::info!(agent = %self.inner.served.name, "closed");
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
            freight_cuda::pinned::release_agent(self.served.id);
        }
    }
}

impl AgentInner {
    fn check_open(&self) -> Result<()> {
        if self.served.is_closed() {
            return Err(Error::InvalidState(format!("agent '{}' is closed", self.served.name)));
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
                from_name: self.served.name.clone(),
                from_id: self.served.id,
                target_id: 0,
                secret: Vec::new(),
                token: Vec::new(),
            },
            timeout: self.served.config.connect_timeout,
            peer_timeout: self.served.config.peer_timeout,
            host: self.served.host.clone(),
        }
    }

    fn choose_path(&self, peer: &Peer, ends: policy::Ends<'_>) -> Result<TransferPath> {
        policy::choose(&self.policy, self.served.fabric.as_deref(), peer, ends)
    }

    fn completions(&self) -> Result<&Completions> {
        if let Some(c) = self.completions.get() {
            return Ok(c);
        }
        let c = Completions::start(&self.served.name, self.served.config.cuda.completion)?;
        Ok(self.completions.get_or_init(|| c))
    }

    fn fabric(&self) -> Result<&Arc<Fabric>> {
        self.served
            .fabric
            .as_ref()
            .ok_or_else(|| Error::TransportUnavailable("fabric is not open on this agent".into()))
    }

    fn copy_pool(&self) -> Result<&CopyPool> {
        if let Some(p) = self.copy_pool.get() {
            return Ok(p);
        }
        let pool = CopyPool::new(self.served.config.shm.threads)?;
        Ok(self.copy_pool.get_or_init(|| pool))
    }
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
