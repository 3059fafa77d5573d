//! The listener's sockets and the connections it took: what shutting the agent down
//! closes, which peer opened which connection, the control connections revocations go
//! out on, and the limits on connections still awaiting their hello.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::inbox::{ControlWriter, Inboxes};
use crate::memory::Registry;
use freight_proto::error::Result;
use freight_proto::frame::{self, Frame};

/// An inbound connection, and the agent that opened it once its hello is taken.
type Inbound = (TcpStream, Option<String>);

/// Listening sockets and live inbound connections, so that shutdown can close them.
pub struct Server {
    pub(super) listeners: Mutex<Vec<(SocketAddr, TcpListener)>>,
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
    pub(super) handshakes: Arc<AtomicUsize>,
    /// Warnings about refused connections, at most one a second: a stranger hammering
    /// the listener must not flood the log (nor block on a log nobody drains).
    pub(super) refusals: Throttle,
}

/// Lets an event be logged at most once per [`Throttle::EVERY`], counting those it
/// held back in between, so that the next line can say how many there were.
pub(super) struct Throttle {
    start: Instant,
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
    pub(super) fn let_through(&self, now: Instant) -> Option<u64> {
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
pub(super) struct Handshake(Arc<AtomicUsize>);

impl Handshake {
    pub(super) fn begin(count: &Arc<AtomicUsize>) -> Option<Handshake> {
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
    pub(super) fn admit(&self, stream: &TcpStream) -> Option<u64> {
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
    pub(super) fn name(&self, id: u64, from: &str) {
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
    pub(super) fn take_up_control(
        &self,
        id: u64,
        peer: &str,
        writer: &ControlWriter,
        registry: &Registry,
    ) -> Result<()> {
        let mut controls = self.controls.lock();
        let live = Frame::LiveRegions { regions: registry.public_keys() };
        std::io::Write::write_all(&mut *writer.lock(), &frame::encode(&live))?;
        controls.insert(id, (peer.to_string(), writer.clone()));
        Ok(())
    }

    /// Forgets a connection that ended.
    pub(super) fn forget(&self, id: u64) {
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
