//! What an agent knows about one peer, and its connections to it (opened lazily).

use std::collections::HashSet;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::doorbell::Outbox;
use crate::frame_io;
use crate::net::{self, Introduction};
use crate::transport::cuda::CudaPeer;
use crate::transport::fabric::{Fabric, FabricLink};
use crate::transport::shm::ShmPeer;
use crate::transport::tcp::{Health, TcpConfig, TcpConn};
use freight_host::pci::PciPlace;
use freight_proto::error::{Error, Result};
use freight_proto::frame::{Frame, Role};
use freight_proto::metadata::{AgentMetadata, HostIdentity};
use freight_proto::region::RemoteRegions;

/// Connection settings a peer needs from its agent.
#[derive(Debug, Clone)]
pub struct DialContext {
    pub intro: Introduction,
    pub timeout: Duration,
    pub peer_timeout: Duration,
    /// This agent's host, for the peer to check an outbox against.
    pub host: Arc<HostIdentity>,
}

pub struct Peer {
    pub name: String,
    pub md: AgentMetadata,
    pub same_host: bool,
    pub regions: RwLock<RemoteRegions>,
    /// Regions the peer revoked (keys are never reused by an agent): metadata read
    /// before a revocation must not bring its region back. Locked inside `regions`.
    revoked: Mutex<HashSet<u64>>,
    pub shm: ShmPeer,
    pub cuda: CudaPeer,
    /// The access token this agent presents to the peer on every connection (empty:
    /// none), where the peer requires one (see `AgentConfig::token`); given with its
    /// metadata, and replaced when metadata comes again with another.
    token: RwLock<Vec<u8>>,
    /// The connections made so far. Held only to look at or swap them, never while one
    /// is dialled: checking the peer's health, or using a link it has, does not wait
    /// for a dial (which may take the connect timeout).
    links: Mutex<Links>,
    /// One dial of each kind of link at a time.
    dialing: Dialing,
    removed: AtomicBool,
    /// Connections made to this peer so far, and what they cost.
    /// Shared with the fabric link, which dials its relay connection itself.
    dials: Arc<Mutex<ConnectionStats>>,
}

/// The connections an agent made to one peer: how many, and how long setting them up
/// took (dialling, the hello/welcome handshake and, for tcp, starting the stream
/// threads). More than one control connection or tcp connection means the peer was
/// reconnected to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectionStats {
    /// Control connections dialled (notifications, revocations).
    pub control_connections: u64,
    /// tcp connections set up (each one `streams` data streams).
    pub tcp_connections: u64,
    /// Fabric connections set up: the exchange (then one-sided operations only), and
    /// the relay where the peer stages its GPU memory.
    pub fabric_connections: u64,
    /// Handshakes: one per control connection, data stream and fabric connection.
    pub handshakes: u64,
    /// Time spent setting connections up, all of them together, in microseconds.
    pub setup_us: u64,
    /// The same for the last connection set up.
    pub last_setup_us: u64,
}

/// The kinds of connection [`ConnectionStats`] counts.
#[derive(Debug, Clone, Copy)]
enum Dialled {
    Control,
    Tcp,
    Fabric,
}

impl ConnectionStats {
    fn record(&mut self, kind: Dialled, handshakes: u64, took: Duration) {
        let us = took.as_micros() as u64;
        match kind {
            Dialled::Control => self.control_connections += 1,
            Dialled::Tcp => self.tcp_connections += 1,
            Dialled::Fabric => self.fabric_connections += 1,
        }
        self.handshakes += handshakes;
        self.setup_us += us;
        self.last_setup_us = us;
    }
}

#[derive(Default)]
struct Dialing {
    control: Mutex<()>,
    tcp: Mutex<()>,
    fabric: Mutex<()>,
}

#[derive(Default)]
struct Links {
    control: Option<Arc<ControlLink>>,
    tcp: Option<Arc<TcpConn>>,
    fabric: Option<Arc<FabricLink>>,
}

fn disconnected(peer: &str, reason: impl Into<String>) -> Error {
    Error::PeerDisconnected { peer: peer.to_string(), reason: reason.into() }
}

/// The first frame of a control connection: the peer's live region keys.
fn read_live_regions(stream: &mut TcpStream, timeout: Duration) -> Result<HashSet<u64>> {
    stream.set_read_timeout(Some(timeout))?;
    let live = match frame_io::read_frame(stream) {
        Ok(Some(Frame::LiveRegions { regions })) => regions.into_iter().collect(),
        Ok(Some(other)) => return Err(Error::Protocol(format!("expected the live regions, got {other:?}"))),
        Ok(None) => return Err(Error::Io("the peer closed the control connection as it opened".into())),
        Err(Error::Timeout(_)) => {
            return Err(Error::Timeout(format!("the peer did not list its regions within {timeout:?}")))
        }
        Err(e) => return Err(e),
    };
    stream.set_read_timeout(None)?;
    Ok(live)
}

/// The error for a connection that broke (rather than one never made).
fn broken(peer: &str, reason: &str) -> Error {
    disconnected(peer, format!("{reason}; add the peer again to reconnect"))
}

/// The connection notifications travel on; its reader learns of revocations and of the
/// peer's death. To a same-host peer that accepts it, notifications go through an outbox
/// in shared memory instead, and this connection carries only wake-ups (see
/// [`crate::doorbell`]).
pub struct ControlLink {
    peer: String,
    writer: Mutex<TcpStream>,
    health: Arc<Health>,
    /// How notifications travel. Held for a whole notification: that keeps them in
    /// order and makes this process the ring's one producer.
    route: Mutex<Route>,
    /// The peer's answer to our outbox, posted by the link's reader.
    answer: Answer,
    same_host: bool,
    host: Arc<HostIdentity>,
    handshake_timeout: Duration,
    peer_timeout: Duration,
}

enum Route {
    /// Nothing sent yet: a same-host peer is offered an outbox with the first notification.
    Undecided,
    /// For good: another host, an outbox the peer refused, or a link that broke.
    Tcp,
    Ring(Outbox),
}

/// A reply awaited by one thread and delivered by another.
#[derive(Default)]
struct Answer {
    slot: Mutex<Option<std::result::Result<(), String>>>,
    cv: Condvar,
}

impl Answer {
    fn post(&self, answer: std::result::Result<(), String>) {
        self.slot.lock().get_or_insert(answer);
        self.cv.notify_all();
    }

    fn wait(&self, timeout: Duration) -> Option<std::result::Result<(), String>> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.slot.lock();
        while slot.is_none() {
            if self.cv.wait_until(&mut slot, deadline).timed_out() {
                break;
            }
        }
        slot.clone()
    }
}

impl ControlLink {
    pub fn send(&self, frame: &Frame) -> Result<()> {
        let mut w = self.writer.lock();
        frame_io::write_frame(&mut *w, frame, &[]).map_err(|e| {
            let reason = format!("write failed: {e}");
            self.health.kill(reason.clone());
            broken(&self.peer, &reason)
        })
    }

    fn check_alive(&self) -> Result<()> {
        match self.health.reason() {
            Some(reason) => Err(broken(&self.peer, &reason)),
            None => Ok(()),
        }
    }

    /// Sends a notification, after everything sent before it on this link.
    pub fn notify(&self, msg: Vec<u8>) -> Result<()> {
        self.check_alive()?;
        let mut route = self.route.lock();
        if matches!(*route, Route::Undecided) {
            *route = self.choose_route()?;
        }
        match &mut *route {
            Route::Ring(outbox) => {
                outbox.send(&self.peer, &msg, self.peer_timeout, || self.send(&Frame::Wake), || self.check_alive())
            }
            Route::Tcp | Route::Undecided => self.send(&Frame::Notify { msg }),
        }
    }

    /// Whether a notification may ride on the data it follows instead of travelling
    /// here: only once notifications go through an outbox, which the target drains
    /// before it queues one that came with data (see `Inboxes::deliver_after`). Over
    /// tcp nothing would keep it behind the notifications sent here before it. Never
    /// waits: while another thread is notifying (it may wait for room in the ring),
    /// the answer is no, and the notification takes the usual way.
    pub fn rides_on_data(&self) -> bool {
        self.route.try_lock().is_some_and(|route| matches!(*route, Route::Ring(_)))
    }

    /// Offers a same-host peer an outbox and waits for its answer: nothing goes into
    /// the ring before the peer reads it, so a refusal loses nothing. Fails only when
    /// the link itself does.
    fn choose_route(&self) -> Result<Route> {
        if !self.same_host {
            return Ok(Route::Tcp);
        }
        let outbox = match Outbox::create() {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(peer = %self.peer, error = %e, "cannot create a notification outbox; notifying this peer over tcp");
                return Ok(Route::Tcp);
            }
        };
        self.send(&outbox.announcement(&self.host))?;
        match self.answer.wait(self.handshake_timeout) {
            Some(Ok(())) => {
                tracing::debug!(peer = %self.peer, "notifying this peer through a shared-memory outbox");
                Ok(Route::Ring(outbox))
            }
            Some(Err(reason)) => {
                self.check_alive()?;
                tracing::warn!(peer = %self.peer, %reason, "the peer refused our notification outbox; notifying it over tcp");
                Ok(Route::Tcp)
            }
            None => {
                tracing::warn!(peer = %self.peer, timeout = ?self.handshake_timeout, "the peer did not answer our notification outbox; notifying it over tcp");
                Ok(Route::Tcp)
            }
        }
    }

    /// The link broke: frees the outbox, and wakes a notifier waiting for the handshake.
    fn retire(&self, reason: &str) {
        self.answer.post(Err(reason.to_string()));
        *self.route.lock() = Route::Tcp;
    }
}

impl Peer {
    pub fn new(md: AgentMetadata, same_host: bool, token: Option<&[u8]>) -> Peer {
        Peer {
            token: RwLock::new(token.unwrap_or_default().to_vec()),
            name: md.name.clone(),
            regions: RwLock::new(RemoteRegions::new(&md.regions)),
            revoked: Mutex::default(),
            shm: ShmPeer::new(&md.name, md.host.pid),
            cuda: CudaPeer::default(),
            md,
            same_host,
            links: Mutex::new(Links::default()),
            dialing: Dialing::default(),
            removed: AtomicBool::new(false),
            dials: Arc::default(),
        }
    }

    fn disconnected(&self, reason: impl Into<String>) -> Error {
        disconnected(&self.name, reason)
    }

    /// A dial that failed: refused for want of the right token or secret stays an
    /// authentication error (retrying cannot help, the credentials must change);
    /// anything else is a disconnection, described by `why`.
    fn dial_failed(&self, e: Error, why: impl FnOnce(&Error) -> String) -> Error {
        match e {
            Error::Auth(m) => Error::Auth(format!("peer '{}': {m}", self.name)),
            e => self.disconnected(why(&e)),
        }
    }

    pub fn connection_stats(&self) -> ConnectionStats {
        *self.dials.lock()
    }

    /// The connections, unless the peer was removed: checked under their lock, so that
    /// a connection dialled while it is removed is never kept (its thread would leak;
    /// see [`Peer::link`]).
    fn live_links(&self) -> Result<parking_lot::MutexGuard<'_, Links>> {
        let links = self.links.lock();
        if self.removed.load(Ordering::Acquire) {
            return Err(self.disconnected("the peer was removed or replaced; prepare against the new peer"));
        }
        Ok(links)
    }

    /// Fails when the peer was removed or a connection to it broke.
    pub fn check_alive(&self) -> Result<()> {
        if self.removed.load(Ordering::Acquire) {
            return Err(self.disconnected("the peer was removed or replaced; prepare against the new peer"));
        }
        let links = self.links.lock();
        let dead = links
            .control
            .as_ref()
            .and_then(|c| c.health.reason())
            .or_else(|| links.tcp.as_ref().and_then(|t| t.dead_reason()))
            .or_else(|| links.fabric.as_ref().and_then(|f| f.dead_reason()));
        match dead {
            Some(reason) => Err(broken(&self.name, &reason)),
            None => Ok(()),
        }
    }

    /// The link that `slot` picks out of the connections, made by `dial` on first use.
    /// Dials of one kind wait for each other (`lock`), and nothing waits for a dial
    /// under the connections' lock. A link dialled while the peer was removed is put
    /// down with `discard`, never kept.
    fn link<T: Clone>(
        &self,
        lock: &Mutex<()>,
        slot: impl Fn(&mut Links) -> &mut Option<T>,
        dial: impl FnOnce() -> Result<T>,
        discard: impl FnOnce(&T),
    ) -> Result<T> {
        self.check_alive()?;
        if let Some(l) = slot(&mut *self.live_links()?).clone() {
            return Ok(l);
        }
        let _one_dial = lock.lock();
        // Another thread may have dialled it while this one waited.
        if let Some(l) = slot(&mut *self.live_links()?).clone() {
            return Ok(l);
        }
        let link = dial()?;
        match self.live_links() {
            Ok(mut links) => {
                *slot(&mut links) = Some(link.clone());
                Ok(link)
            }
            Err(e) => {
                discard(&link);
                Err(e)
            }
        }
    }

    /// The control link, dialled on first use.
    pub fn control(self: &Arc<Self>, ctx: &DialContext) -> Result<Arc<ControlLink>> {
        self.link(
            &self.dialing.control,
            |l| &mut l.control,
            || self.dial_control(ctx),
            |c| c.health.close("the peer was removed"),
        )
    }

    fn dial_control(self: &Arc<Self>, ctx: &DialContext) -> Result<Arc<ControlLink>> {
        let intro = self.intro(ctx);
        let started = Instant::now();
        let stream = net::dial(&self.md.addresses, None, Role::Control, &intro, ctx.timeout, ctx.peer_timeout)
            .map_err(|e| self.dial_failed(e, |e| format!("cannot open control connection: {e}")))?;
        // A peer that stops reading fails a notification instead of blocking it (and
        // everything waiting for the writer) for ever.
        stream.set_write_timeout(Some(ctx.peer_timeout))?;
        let mut reader = stream.try_clone()?;
        // Before any request relies on this link for revocations: what the peer revoked
        // between our reading its metadata and its taking up the link.
        let live = read_live_regions(&mut reader, ctx.timeout).map_err(|e| self.disconnected(e.to_string()))?;
        let gone: Vec<u64> = self.regions.read().iter().map(|r| r.key).filter(|k| !live.contains(k)).collect();
        let fabric = self.links.lock().fabric.clone();
        self.forget_regions(&gone, fabric.as_deref());
        // Closing the link shuts the socket down through the health, never waiting for
        // a writer that holds the lock.
        let health = Arc::new(Health::default());
        health.watch(stream.try_clone()?);
        let link = Arc::new(ControlLink {
            peer: self.name.clone(),
            writer: Mutex::new(stream),
            health,
            route: Mutex::new(Route::Undecided),
            answer: Answer::default(),
            same_host: self.same_host,
            host: ctx.host.clone(),
            handshake_timeout: ctx.timeout,
            peer_timeout: ctx.peer_timeout,
        });
        let (peer, l) = (self.clone(), link.clone());
        thread::Builder::new().name("freight-ctl-rx".into()).spawn(move || peer.watch_control(reader, l))?;
        self.dials.lock().record(Dialled::Control, 1, started.elapsed());
        Ok(link)
    }

    /// Takes the regions of the peer's refreshed metadata, less those it revoked since:
    /// the metadata may be older than the revocation (read before it, or kept by the
    /// application). A live agent never reuses a key, so a region known already must come
    /// back exactly as it was: requests prepared against it trust its bounds and its
    /// place in shared memory. Metadata that changes one is refused whole.
    pub fn replace_regions(&self, regions: &[freight_proto::region::RegionInfo]) -> Result<()> {
        let mut known = self.regions.write();
        if let Some(r) = regions.iter().find(|r| known.get(r.key).is_some_and(|k| k != *r)) {
            return Err(Error::Metadata(format!(
                "peer '{}' sent region {} again with another range or location; its metadata is \
                 corrupt or not its own",
                self.name, r.key
            )));
        }
        let revoked = self.revoked.lock();
        let live: Vec<_> = regions.iter().filter(|r| !revoked.contains(&r.key)).cloned().collect();
        drop(revoked);
        *known = RemoteRegions::new(&live);
        self.close_unused_imports(&known);
        Ok(())
    }

    /// Drops regions the peer revoked, and what this agent holds for them: mappings and
    /// fabric keys. Metadata read before the revocation will not bring them back.
    fn forget_regions(&self, keys: &[u64], fabric: Option<&FabricLink>) {
        if keys.is_empty() {
            return;
        }
        tracing::debug!(peer = %self.name, regions = ?keys, "peer revoked regions");
        let mut regions = self.regions.write();
        self.revoked.lock().extend(keys);
        for &k in keys {
            regions.remove(k);
        }
        self.close_unused_imports(&regions);
        drop(regions);
        if let Some(f) = fabric {
            for &k in keys {
                f.forget(k);
            }
        }
    }

    /// Lets go of the peer's GPU allocations that no registered region lies in any more.
    fn close_unused_imports(&self, regions: &RemoteRegions) {
        let live: Vec<(u64, &[u8])> =
            regions.iter().filter_map(|r| r.gpu.as_ref().map(|g| (g.alloc_base, g.handle.as_slice()))).collect();
        self.cuda.imports.retain(|base, handle| live.contains(&(base, handle)));
        self.shm.forget_unused(regions.iter());
    }

    /// [`Peer::close_unused_imports`] for the regions known now: after a request opened
    /// mappings for regions copied earlier, some of which may have been revoked since.
    pub(crate) fn close_imports_of_revoked_regions(&self) {
        self.close_unused_imports(&self.regions.read());
    }

    /// The token presented to the peer (empty: none).
    pub fn token(&self) -> Vec<u8> {
        self.token.read().clone()
    }

    /// Presents `token` on the connections opened from now on.
    pub fn set_token(&self, token: &[u8]) {
        *self.token.write() = token.to_vec();
    }

    fn intro(&self, ctx: &DialContext) -> Introduction {
        Introduction {
            target_id: self.md.agent_id,
            secret: self.md.secret.to_vec(),
            token: self.token.read().clone(),
            ..ctx.intro.clone()
        }
    }

    /// Reads what the peer sends back on the control link until it closes.
    fn watch_control(self: Arc<Self>, mut reader: TcpStream, link: Arc<ControlLink>) {
        let health = &link.health;
        loop {
            match frame_io::read_frame(&mut reader) {
                Ok(Some(Frame::Revoke { region })) => {
                    let fabric = self.links.lock().fabric.clone();
                    self.forget_regions(&[region], fabric.as_deref());
                }
                Ok(Some(Frame::OutboxReply { error })) => link.answer.post(error.map_or(Ok(()), Err)),
                Ok(Some(other)) => {
                    health.kill(format!("protocol error: unexpected {other:?} on the control link"));
                    break;
                }
                Ok(None) => {
                    // An orderly close (the peer closed its agent or removed us): not a
                    // failure, though requests still in flight to it will fail.
                    tracing::info!(peer = %self.name, "the peer closed its control connection");
                    health.close("the peer closed the connection");
                    break;
                }
                Err(e) => {
                    health.kill(e.to_string());
                    break;
                }
            }
        }
        // The peer is gone: fail the data path too, so that nothing waits for it.
        let reason = health.reason().unwrap_or_default();
        if let Some(t) = self.links.lock().tcp.clone() {
            t.shutdown(&reason);
        }
        link.retire(&reason);
    }

    /// The tcp data streams, dialled on first use. `gpu` is where the GPU whose memory
    /// the first request moves sits on the PCI tree, if any: the NICs closest to it come
    /// first, and threads of NICs without a NUMA node go to the GPU's.
    pub fn tcp(&self, ctx: &DialContext, cfg: &TcpConfig, gpu: Option<PciPlace>) -> Result<Arc<TcpConn>> {
        self.link(
            &self.dialing.tcp,
            |l| &mut l.tcp,
            || self.dial_tcp(ctx, cfg, gpu),
            |t| t.shutdown("the peer was removed"),
        )
    }

    fn dial_tcp(&self, ctx: &DialContext, cfg: &TcpConfig, gpu: Option<PciPlace>) -> Result<Arc<TcpConn>> {
        let intro = self.intro(ctx);
        let started = Instant::now();
        let n = cfg.streams.max(1);
        let local_addrs = if cfg.local_addrs.is_empty() {
            freight_host::nic::towards(
                &freight_host::nic::local_nics(),
                &self.md.addresses,
                self.same_host,
                gpu.as_ref(),
            )
        } else {
            cfg.local_addrs.clone()
        };
        let mut sockets = Vec::with_capacity(n);
        for i in 0..n {
            let bind = (!local_addrs.is_empty()).then(|| local_addrs[i % local_addrs.len()]);
            let addrs = net::dial_order(&self.md.addresses, i, bind);
            let s = net::dial(&addrs, bind, Role::Data { index: i as u32 }, &intro, ctx.timeout, ctx.peer_timeout)
                .map_err(|e| self.dial_failed(e, |e| format!("cannot open data stream {i}: {e}")))?;
            sockets.push(s);
        }
        let health = Arc::new(Health::default());
        let gpu_node = gpu.and_then(|g| g.numa_node);
        let conn = Arc::new(TcpConn::start(&self.name, sockets, cfg, ctx.peer_timeout, health, gpu_node)?);
        let took = started.elapsed();
        self.dials.lock().record(Dialled::Tcp, n as u64, took);
        tracing::info!(peer = %self.name, streams = n, nics = ?local_addrs, near_gpu = ?gpu_node, chunk_size = cfg.chunk_size, window = cfg.window, setup_us = took.as_micros() as u64, "tcp connection up");
        Ok(conn)
    }

    /// The fabric exchange with the peer, set up on first use.
    pub fn fabric(&self, ctx: &DialContext, fabric: &Arc<Fabric>) -> Result<Arc<FabricLink>> {
        self.link(
            &self.dialing.fabric,
            |l| &mut l.fabric,
            || self.dial_fabric(ctx, fabric),
            |f| f.shutdown("the peer was removed"),
        )
    }

    fn dial_fabric(&self, ctx: &DialContext, fabric: &Arc<Fabric>) -> Result<Arc<FabricLink>> {
        let started = Instant::now();
        let stream = net::dial(&self.md.addresses, None, Role::Fabric, &self.intro(ctx), ctx.timeout, ctx.peer_timeout)
            .map_err(|e| self.dial_failed(e, |e| format!("cannot open the fabric exchange: {e}")))?;
        stream.set_read_timeout(Some(ctx.peer_timeout))?;
        let dial: crate::transport::fabric::link::Dial = {
            let (addresses, intro, timeout) = (self.md.addresses.clone(), self.intro(ctx), ctx.timeout);
            let peer_timeout = ctx.peer_timeout;
            let dials = self.dials.clone();
            Box::new(move || {
                let started = Instant::now();
                let stream = net::dial(&addresses, None, Role::Fabric, &intro, timeout, peer_timeout)?;
                dials.lock().record(Dialled::Fabric, 1, started.elapsed());
                // A peer that hangs must not hold the relay's opening (or a send to it)
                // forever: its answers and our sends are bounded.
                stream.set_read_timeout(Some(peer_timeout))?;
                stream.set_write_timeout(Some(peer_timeout))?;
                Ok(stream)
            })
        };
        let link = Arc::new(FabricLink::connect(stream, fabric, &self.name, dial)?);
        let took = started.elapsed();
        self.dials.lock().record(Dialled::Fabric, 1, took);
        tracing::info!(peer = %self.name, transport = %fabric.describe(), setup_us = took.as_micros() as u64, "fabric connection up");
        Ok(link)
    }

    /// Closes every connection; in-flight requests fail.
    pub fn shutdown(&self, reason: &str) {
        self.removed.store(true, Ordering::Release);
        let links = std::mem::take(&mut *self.links.lock());
        if let Some(c) = links.control {
            c.health.close(reason);
        }
        if let Some(t) = links.tcp {
            t.shutdown(reason);
        }
        if let Some(f) = links.fabric {
            f.shutdown(reason);
        }
    }
}
