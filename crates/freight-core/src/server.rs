//! The agent's listener: accepts control, data and metadata connections from peers,
//! authenticates them, and serves each on its own thread (blocking I/O, no polling).

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::Instant;

use parking_lot::Mutex;

use crate::agent::AgentInner;
use crate::frame_io;
use crate::inbox::{ControlWriter, Inbox, Inboxes};
use crate::memory::Registry;
use crate::net::tune;
use crate::transport::fabric::serve_fabric;
use crate::transport::tcp::serve_data_stream;
use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Frame, Role};
use freight_proto::hello::{self, Gate, Verdict};

/// An inbound connection, and the agent that opened it once its hello is taken.
type Inbound = (TcpStream, Option<String>);

/// Listening sockets and live inbound connections, so that shutdown can close them.
pub struct Server {
    listeners: Mutex<Vec<(SocketAddr, TcpListener)>>,
    /// Live inbound connections by id (removed when they end), with the name of the
    /// agent that opened each once its hello is taken; `None` once shut down, so that a
    /// connection accepted as the agent closes is refused, not missed.
    inbound: Mutex<Option<HashMap<u64, Inbound>>>,
    /// Control connections from peers: revocations are sent back on them (each writer
    /// is locked for a whole frame: its inbox answers on it too).
    controls: Mutex<HashMap<u64, (String, ControlWriter)>>,
    /// The same connections, as sources of notifications.
    pub(crate) inboxes: Inboxes,
    next_id: AtomicU64,
    /// Connections whose hello is still awaited.
    handshakes: Arc<AtomicUsize>,
    /// Warnings about refused connections, at most one a second: a stranger hammering
    /// the listener must not flood the log (nor block on a log nobody drains).
    refusals: Throttle,
}

/// Lets an event be logged at most once per [`Throttle::EVERY`], counting those it
/// held back in between, so that the next line can say how many there were.
struct Throttle {
    start: std::time::Instant,
    /// Milliseconds after `start` of the last event let through (`u64::MAX`: none yet).
    last: AtomicU64,
    held_back: AtomicU64,
}

impl Throttle {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(1);

    fn new() -> Throttle {
        Throttle { start: Instant::now(), last: AtomicU64::new(u64::MAX), held_back: AtomicU64::new(0) }
    }

    /// `Some(n)`: log this event, and say that `n` events like it were held back since
    /// the last one logged; `None`: hold this one back.
    fn let_through(&self, now: std::time::Instant) -> Option<u64> {
        let at = now.saturating_duration_since(self.start).as_millis() as u64;
        let last = self.last.load(Ordering::Relaxed);
        let due = last == u64::MAX || at.saturating_sub(last) >= Self::EVERY.as_millis() as u64;
        if due && self.last.compare_exchange(last, at, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            return Some(self.held_back.swap(0, Ordering::AcqRel));
        }
        self.held_back.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// Most connections that may be awaiting their hello at once. Beyond that a new
/// connection is dropped at once: clients that connect and never finish a hello cannot
/// take every thread and descriptor of the agent (each gives up after the connect
/// timeout). Peers finish their hellos in a round trip, so they never come near it.
pub const MAX_HANDSHAKES: usize = 256;

/// One connection's place among those awaiting a hello, given back when dropped.
struct Handshake(Arc<AtomicUsize>);

impl Handshake {
    fn begin(count: &Arc<AtomicUsize>) -> Option<Handshake> {
        if count.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
            count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Handshake(count.clone()))
    }
}

impl Drop for Handshake {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Server {
    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.listeners.lock().iter().map(|(a, _)| *a).collect()
    }

    /// Tells every connected peer that a region is gone. The connections are listed
    /// under the lock and written to after it, so that a peer slow to read holds up no
    /// other connection's set-up or end. A peer that cannot be told has its connection
    /// shut: it must not go on trusting a control link that misses revocations.
    pub fn broadcast(&self, frame: &Frame) {
        let bytes = frame::encode(frame);
        let controls: Vec<(u64, String, ControlWriter)> =
            self.controls.lock().iter().map(|(&id, (peer, w))| (id, peer.clone(), w.clone())).collect();
        for (id, peer, writer) in controls {
            let mut stream = writer.lock();
            if let Err(e) = std::io::Write::write_all(&mut *stream, &bytes) {
                tracing::warn!(%peer, error = %e, "a peer could not be told of a revocation; shut its control connection");
                let _ = stream.shutdown(Shutdown::Both);
                drop(stream);
                self.controls.lock().remove(&id);
            }
        }
    }

    pub fn shutdown(&self) {
        for (_, l) in self.listeners.lock().drain(..) {
            // SAFETY: shutting down our own listening socket wakes its accept() call.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        // Under the lock `admit` records connections under: none is recorded after this.
        for (_, (s, _)) in self.inbound.lock().take().into_iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.controls.lock().clear();
    }

    /// Records an accepted connection, so that shutdown closes it; its id. `None`: the
    /// server is shut down (or out of descriptors), and the connection is shut at once.
    /// Checking and recording under one lock is what makes a connection accepted while
    /// the agent closes either closed by `shutdown` or refused here, never served.
    fn admit(&self, stream: &TcpStream) -> Option<u64> {
        let clone = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                // A connection `shutdown` could not reach must not be served.
                tracing::warn!(error = %e, "cannot keep track of an inbound connection; dropping it");
                let _ = stream.shutdown(Shutdown::Both);
                return None;
            }
        };
        let mut inbound = self.inbound.lock();
        let Some(open) = inbound.as_mut() else {
            drop(inbound);
            let _ = stream.shutdown(Shutdown::Both);
            return None;
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        open.insert(id, (clone, None));
        Some(id)
    }

    /// Notes which agent opened connection `id` (as its accepted hello says).
    fn name(&self, id: u64, from: &str) {
        if let Some((_, name)) = self.inbound.lock().as_mut().and_then(|open| open.get_mut(&id)) {
            *name = Some(from.to_string());
        }
    }

    /// Shuts every connection that agent `from` opened to this one; how many.
    pub fn hang_up(&self, from: &str) -> usize {
        let mut hung_up = 0;
        for (s, _) in
            self.inbound.lock().iter().flat_map(|open| open.values()).filter(|(_, n)| n.as_deref() == Some(from))
        {
            let _ = s.shutdown(Shutdown::Both);
            hung_up += 1;
        }
        hung_up
    }

    /// Takes up a peer's control connection: sends it the keys of the regions that are
    /// live now, then records it for revocations. Both under the lock `broadcast` lists
    /// connections under, so a region deregistered meanwhile is either missing from the
    /// list or revoked on the connection after it: a peer that read metadata before the
    /// revocation (and opened this connection after it) learns of it either way. (The
    /// list is written under the lock: a new connection's first write, bounded by the
    /// peer timeout, is the one wait that may hold up a broadcast.)
    fn take_up_control(&self, id: u64, peer: &str, writer: &ControlWriter, registry: &Registry) -> Result<()> {
        let mut controls = self.controls.lock();
        let live = Frame::LiveRegions { regions: registry.public_keys() };
        std::io::Write::write_all(&mut *writer.lock(), &frame::encode(&live))?;
        controls.insert(id, (peer.to_string(), writer.clone()));
        Ok(())
    }

    /// Forgets a connection that ended.
    fn forget(&self, id: u64) {
        if let Some(open) = self.inbound.lock().as_mut() {
            open.remove(&id);
        }
        self.controls.lock().remove(&id);
    }
}

impl Default for Server {
    fn default() -> Self {
        Server {
            listeners: Mutex::default(),
            inbound: Mutex::new(Some(HashMap::new())),
            controls: Mutex::default(),
            inboxes: Inboxes::default(),
            next_id: AtomicU64::default(),
            handshakes: Arc::default(),
            refusals: Throttle::new(),
        }
    }
}

/// Binds `addr` and serves it until the agent shuts down.
pub fn listen(agent: &Arc<AgentInner>, addr: &str) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr).map_err(|e| Error::Io(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener.local_addr()?;
    warn_if_exposed(&agent.name, bound, &agent.config);
    let accept = listener.try_clone()?;
    agent.server.listeners.lock().push((bound, listener));
    let weak = Arc::downgrade(agent);
    thread::Builder::new().name("freight-accept".into()).spawn(move || accept_loop(accept, weak))?;
    tracing::info!(agent = %agent.name, %bound, "listening");
    Ok(bound)
}

/// A listener that other hosts can reach and no token guards is worth a warning: who
/// may connect, and what they get.
fn warn_if_exposed(agent: &str, bound: SocketAddr, config: &crate::agent::AgentConfig) {
    if bound.ip().is_loopback() || config.token.is_some() {
        return;
    }
    if config.serve_metadata {
        tracing::warn!(
            agent,
            %bound,
            "listening beyond loopback without a token: anyone who reaches this address can ask for this \
             agent's metadata, whose secret lets them read and write every region it registers \
             (give it a token: AgentConfig.token; or listen on loopback)"
        );
    } else {
        tracing::warn!(
            agent,
            %bound,
            "listening beyond loopback without a token: connections are guarded by the secret alone, which \
             crosses the network in the clear (give it a token: AgentConfig.token)"
        );
    }
}

fn accept_loop(listener: TcpListener, agent: Weak<AgentInner>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if agent.upgrade().is_none_or(|a| a.is_closed()) {
                    tracing::debug!(error = %e, "listener closed");
                    return;
                }
                // Out of descriptors or memory, a connection reset before it was taken:
                // the agent must stay reachable once that passes.
                tracing::warn!(error = %e, "accepting a connection failed; trying again");
                thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let Some(a) = agent.upgrade() else { return };
        if a.is_closed() {
            return;
        }
        let Some(handshake) = Handshake::begin(&a.server.handshakes) else {
            if let Some(held_back) = a.server.refusals.let_through(Instant::now()) {
                tracing::warn!(
                    most = MAX_HANDSHAKES,
                    held_back,
                    "too many connections awaiting their hello; dropped a new one"
                );
            }
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        };
        // The agent may close between the check above and here: `admit` then refuses.
        let Some(id) = a.server.admit(&stream) else {
            if a.is_closed() {
                return;
            }
            continue;
        };
        let weak = agent.clone();
        let spawned = thread::Builder::new().name("freight-conn".into()).spawn(move || {
            if let Err(e) = serve_connection(stream, &weak, id, handshake) {
                tracing::debug!(error = %e, "inbound connection ended");
            }
            if let Some(a) = weak.upgrade() {
                a.server.forget(id);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to serve an inbound connection; dropping it");
            a.server.forget(id);
        }
    }
}

/// The agent, while it serves; an error once it closed (or went away).
fn serving(agent: &Weak<AgentInner>) -> Result<Arc<AgentInner>> {
    agent.upgrade().filter(|a| !a.is_closed()).ok_or_else(|| Error::Io("agent closed".into()))
}

fn serve_connection(mut stream: TcpStream, agent: &Weak<AgentInner>, id: u64, handshake: Handshake) -> Result<()> {
    let (timeout, peer_timeout, token, serve_metadata, secret, my_id) = {
        let a = serving(agent)?;
        let c = &a.config;
        (c.connect_timeout, c.peer_timeout, c.token.clone(), c.serve_metadata, a.secret, a.id)
    };
    tune(&stream, peer_timeout)?;
    // Unauthenticated so far: a bounded hello that must arrive whole within the connect
    // timeout (not merely byte by byte), and answers that cannot block for ever.
    stream.set_write_timeout(Some(peer_timeout))?;
    let first = frame_io::read_frame_within(&mut Deadline::after(&stream, timeout), frame::MAX_HELLO)?;
    drop(handshake);
    let said = match &first {
        Some(Frame::Hello { from_name, role, .. }) => Some((from_name.clone(), *role)),
        _ => None,
    };
    let gate = Gate { agent_id: my_id, secret: &secret, token: token.as_deref(), serve_metadata };
    let verdict = hello::judge(&gate, first);
    let (role, from_name) = match &verdict {
        Verdict::Admit { role, from } => (*role, from.clone()),
        Verdict::Metadata => {
            let bytes = serving(agent)?.metadata_bytes();
            return frame_io::write_frame(&mut stream, &hello::answer(&gate, &verdict, || bytes), &[]);
        }
        Verdict::Refuse { reason, unauthenticated } => {
            if *unauthenticated {
                // Logged, at most once a second: whoever fails to authenticate.
                if let Some(held_back) = agent.upgrade().and_then(|a| a.server.refusals.let_through(Instant::now())) {
                    let (from_name, role) = said.unzip();
                    let from = stream.peer_addr().ok();
                    tracing::warn!(?from_name, ?from, ?role, held_back, "refused a connection: {reason}");
                }
            }
            return refuse(&mut stream, reason);
        }
    };
    match serving(agent) {
        Ok(a) => a.server.name(id, &from_name),
        Err(_) => return refuse(&mut stream, "the agent is closed"),
    }
    frame_io::write_frame(&mut stream, &hello::answer(&gate, &verdict, Vec::new), &[])?;
    stream.set_read_timeout(None)?;
    match role {
        Role::Control => serve_control(stream, agent, &from_name, id),
        Role::Data { index } => {
            let a = serving(agent)?;
            freight_host::nic::pin_stream_thread(&a.config.tcp.pin, index as usize, stream.local_addr().ok(), None);
            let deliver = |msg| a.server.inboxes.try_deliver_after(&from_name, msg, &a.notifs);
            // Idle between messages without a deadline; within one, `peer_timeout`.
            let open = || !a.is_closed();
            serve_data_stream(stream, &a.registry, &a.config.tcp, &from_name, peer_timeout, open, deliver)
        }
        Role::Fabric => {
            let a = serving(agent)?;
            serve_fabric(stream, &a.registry, a.fabric.as_deref(), &from_name)
        }
        Role::Metadata => unreachable!("a metadata request is answered above, never admitted"),
    }
}

/// Reads from a socket until a deadline: each read waits only for the time left.
struct Deadline<'a> {
    stream: &'a TcpStream,
    at: std::time::Instant,
}

impl<'a> Deadline<'a> {
    fn after(stream: &'a TcpStream, timeout: std::time::Duration) -> Deadline<'a> {
        Deadline { stream, at: crate::interrupt::deadline_after(timeout) }
    }
}

impl std::io::Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the hello did not arrive in time"));
        }
        self.stream.set_read_timeout(Some(left))?;
        std::io::Read::read(&mut self.stream, buf)
    }
}

fn refuse(stream: &mut TcpStream, reason: &str) -> Result<()> {
    frame_io::write_frame(stream, &Frame::Refused { reason: reason.into() }, &[])?;
    Err(Error::Auth(reason.into()))
}

/// Delivers notifications in the order they arrive on this (ordered) connection.
fn serve_control(stream: TcpStream, agent: &Weak<AgentInner>, from: &str, id: u64) -> Result<()> {
    let writer = Arc::new(Mutex::new(stream.try_clone()?));
    let host = match agent.upgrade().filter(|a| !a.is_closed()) {
        Some(a) => {
            a.server.take_up_control(id, from, &writer, &a.registry)?;
            a.host.clone()
        }
        None => return Ok(()),
    };
    let inbox = Arc::new(Inbox::new(from, stream, writer, host));
    let result = read_notifications(&inbox, agent);
    if let Some(a) = agent.upgrade() {
        a.server.inboxes.remove(&inbox);
    }
    result
}

/// Sleeps until bytes arrive, then reads them (unless an application thread polling for
/// notifications got there first), until the peer closes the connection.
fn read_notifications(inbox: &Arc<Inbox>, agent: &Weak<AgentInner>) -> Result<()> {
    match agent.upgrade().filter(|a| !a.is_closed()) {
        Some(a) => a.server.inboxes.add(inbox.clone()),
        None => return Ok(()),
    }
    let fd = inbox.fd();
    loop {
        crate::inbox::wait_readable(fd)?;
        let Some(a) = agent.upgrade() else { return Ok(()) };
        if !inbox.pump(&a.notifs)? {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::time::Duration;

    /// A connected pair: the peer's end, and the end `accept` returned.
    fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (peer, listener.accept().unwrap().0)
    }

    /// The end of the stream (or a reset), not a timeout: the listener let it go.
    fn closed_by_server(peer: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        match peer.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }

    /// The accept thread checks that the agent is open, then the agent closes and drains
    /// its connections, then the accept thread records the new one: that connection must
    /// be refused and shut, not served into a closed agent's memory. Here the steps run
    /// in that order on one thread; a connection recorded before the close is shut by it.
    #[test]
    fn a_connection_accepted_as_the_agent_closes_is_shut_not_served() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = Server::default();
        let (mut before, accepted) = pair(&listener);
        let id = server.admit(&accepted).expect("admitted while open");
        let (mut during, late) = pair(&listener);
        server.shutdown();
        assert_eq!(server.admit(&late), None, "recorded after the shutdown drained");
        assert!(closed_by_server(&mut during), "the late connection is shut at once");
        assert!(closed_by_server(&mut before), "shutdown shuts what was recorded before it");
        // Ending connections after the shutdown finds nothing to forget, and no table.
        server.forget(id);
        assert!(server.inbound.lock().is_none());
    }

    #[test]
    fn a_peer_too_slow_to_be_told_of_a_revocation_loses_its_control_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = Server::default();
        let (mut peer, accepted) = pair(&listener);
        accepted.set_write_timeout(Some(Duration::from_millis(50))).unwrap();
        server.controls.lock().insert(1, ("slow".into(), Arc::new(Mutex::new(accepted))));
        // The peer reads nothing: its socket fills, and a write times out.
        let big = Frame::LiveRegions { regions: vec![7; 1 << 20] };
        for _ in 0..100 {
            if server.controls.lock().is_empty() {
                break;
            }
            server.broadcast(&big);
        }
        assert!(server.controls.lock().is_empty(), "the slow peer is no longer told of revocations");
        // ...and its end sees the connection end, instead of a link that went quiet.
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).expect("the connection was shut, not left open");
    }

    #[test]
    fn handshakes_beyond_the_most_are_turned_away_until_one_ends() {
        let count = Arc::new(AtomicUsize::new(0));
        let mut held: Vec<Handshake> = (0..MAX_HANDSHAKES).map(|_| Handshake::begin(&count).unwrap()).collect();
        assert!(Handshake::begin(&count).is_none());
        assert_eq!(count.load(Ordering::Acquire), MAX_HANDSHAKES, "a refusal takes no place");
        held.pop();
        assert!(Handshake::begin(&count).is_some());
        drop(held);
        assert_eq!(count.load(Ordering::Acquire), 0);
    }

    #[test]
    fn refusals_are_logged_once_a_second_with_a_count_of_the_rest() {
        let t = Throttle::new();
        let at = |ms: u64| t.start + Duration::from_millis(ms);
        assert_eq!(t.let_through(at(0)), Some(0), "the first one is logged");
        assert_eq!(t.let_through(at(10)), None);
        assert_eq!(t.let_through(at(999)), None);
        assert_eq!(t.let_through(at(1000)), Some(2), "a second later, with the two held back");
        assert_eq!(t.let_through(at(1500)), None);
        assert_eq!(t.let_through(at(5000)), Some(1));
    }

    #[test]
    fn connections_are_forgotten_when_they_end() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = Server::default();
        let (_peer, accepted) = pair(&listener);
        let id = server.admit(&accepted).unwrap();
        assert_eq!(server.inbound.lock().as_ref().map(HashMap::len), Some(1));
        server.forget(id);
        assert_eq!(server.inbound.lock().as_ref().map(HashMap::len), Some(0));
    }
}
