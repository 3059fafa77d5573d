//! The same-host notification path: the [`outbox`](crate::outbox) ring in a shared
//! segment, with a doorbell on the control connection.
//!
//! A notification over TCP costs a trip through the kernel on both sides, most of its
//! latency when the target is already polling. So a sender keeps, for each same-host
//! peer it notifies, a ring in a segment of its own that the peer maps (the
//! [`Frame::Outbox`] handshake); a polling target finds new notifications there with a
//! few loads. A target that sleeps instead (its connection thread in `poll`, or the
//! application in `wait_notifs`) would not notice, so the sender also sends a tiny
//! [`Frame::Wake`] whenever the ring it wrote to had been drained empty, i.e. when the
//! target may have gone to sleep; the target's connection thread then drains the ring.
//! Everything sent over TCP before the handshake is delivered first: the target starts
//! reading the ring only once it has read up to the `Outbox` frame.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::memory::SharedSegment;
use crate::notify::{NotifQueue, Notification};
use crate::transport::shm::Mapping;
use freight_proto::error::{Error, Result};
use freight_proto::frame::{Frame, MAX_NOTIF};
use freight_proto::metadata::HostIdentity;
use freight_proto::notif_ring::{Consumer, Producer, HEADER};

/// Bytes of records in an outbox: thousands of notifications, while the target's
/// connection thread drains it on every wake-up. Larger messages go in pieces.
pub const CAPACITY: usize = 1 << 20;

/// Polling for room in a full ring before sleeping (on hosts where polling pays).
const SPIN: Duration = Duration::from_micros(50);
/// The longest sleep between looks at a full ring.
const MAX_NAP: Duration = Duration::from_millis(1);

/// The sender's side: a ring in a segment of this process, for one peer.
pub struct Outbox {
    // The producer points into the segment: dropped first.
    ring: Producer,
    segment: Arc<SharedSegment>,
}

impl Outbox {
    pub fn create() -> Result<Outbox> {
        let segment = SharedSegment::allocate(HEADER + CAPACITY)?;
        // SAFETY: the segment is ours, fresh, and outlives the producer (field order).
        let ring = unsafe { Producer::init(segment.as_ptr(), segment.len())? };
        Ok(Outbox { ring, segment })
    }

    /// The handshake that tells the peer where the ring is.
    pub fn announcement(&self, host: &HostIdentity) -> Frame {
        Frame::Outbox { host: host.clone(), fd: self.segment.fd(), len: self.segment.len() as u64 }
    }

    /// Puts `msg` in the ring and calls `wake` when the peer may be asleep. When the
    /// ring is full, waits for room up to `timeout`, failing early once `alive` does.
    pub fn send(
        &mut self,
        peer: &str,
        msg: &[u8],
        timeout: Duration,
        mut wake: impl FnMut() -> Result<()>,
        alive: impl Fn() -> Result<()>,
    ) -> Result<()> {
        let mut sent = 0;
        let mut deadline = None;
        let mut nap = Duration::from_micros(10);
        loop {
            let w = self.ring.write(msg, &mut sent);
            // Before any wait: a sleeping peer frees no room.
            if w.wake {
                wake()?;
            }
            if w.done {
                return Ok(());
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            if freight_host::poll::briefly(SPIN, || self.ring.ready(msg, sent).then_some(())).is_some() {
                continue;
            }
            alive()?;
            if Instant::now() >= deadline {
                tracing::warn!(%peer, bytes = msg.len(), ?timeout, "the peer's notification ring stayed full");
                return Err(Error::Timeout(format!(
                    "peer '{peer}' took no notifications for {timeout:?}: its notification ring stayed full"
                )));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(MAX_NAP);
        }
    }
}

/// The receiver's side: a peer's outbox, mapped here.
pub struct Doorbell {
    from: String,
    /// Whoever drains holds this, so that each message enters the queue once, in order.
    ring: Mutex<Consumer>,
    /// Reported already (a corrupt ring stays corrupt, and every drain says so).
    broken: AtomicBool,
    // The consumer points into the mapping: dropped after it (field order).
    mapping: Mapping,
}

impl Doorbell {
    /// Maps the outbox that `from` announced, after checking that it comes from this
    /// host (`local`) and is a ring.
    pub fn attach(from: &str, local: &HostIdentity, host: &HostIdentity, fd: i32, len: u64) -> Result<Doorbell> {
        if !local.same_host(host) {
            return Err(Error::TransportUnavailable(format!(
                "the outbox of '{from}' is on host '{}', not this one",
                host.hostname
            )));
        }
        if len > (HEADER + CAPACITY) as u64 * 64 {
            return Err(Error::Protocol(format!("an outbox of {len} bytes")));
        }
        // The descriptor must be a memfd: a number that names another file now (the
        // sender closed it) must not be mapped and written to.
        let path = format!("/proc/{}/fd/{fd}", host.pid);
        let target = std::fs::read_link(&path).map_err(|e| Error::TransportUnavailable(format!("{path}: {e}")))?;
        if !target.to_string_lossy().starts_with("/memfd:") {
            return Err(Error::TransportUnavailable(format!("{path} is {}, not shared memory", target.display())));
        }
        let mapping = Mapping::open_fd(host.pid, fd, len)?;
        // SAFETY: the mapping is `len` bytes, page-aligned, and outlives the consumer
        // (field order); the sender writes only the producer's side.
        let ring = unsafe { Consumer::attach(mapping.as_ptr(), mapping.len(), MAX_NOTIF)? };
        Ok(Doorbell { from: from.to_string(), ring: Mutex::new(ring), broken: AtomicBool::new(false), mapping })
    }

    /// Tells the sender whether a thread of this agent is asleep waiting for
    /// notifications (then it rings when it writes), or none is (then the application
    /// polls, or looks when it next asks: no need to ring).
    pub fn set_asleep(&self, asleep: bool) {
        self.ring.lock().set_asleep(asleep);
    }

    /// Moves every complete message into `queue`, waiting for a concurrent drain.
    pub fn drain(&self, queue: &NotifQueue) -> Result<usize> {
        self.drain_locked(&mut self.ring.lock(), queue)
    }

    /// As [`Doorbell::drain`], but leaves the ring to a drain already running: that one
    /// looks again after it releases the ring, and the sender rings if it does not.
    pub fn try_drain(&self, queue: &NotifQueue) -> Result<usize> {
        match self.ring.try_lock() {
            Some(mut ring) => self.drain_locked(&mut ring, queue),
            None => Ok(0),
        }
    }

    /// Drains the ring, then queues `msg`, under one lock: whatever the sender wrote to
    /// the ring before it sent `msg` another way (on a data stream) comes out first.
    pub fn drain_then(&self, queue: &NotifQueue, msg: Vec<u8>) -> Result<()> {
        let mut ring = self.ring.lock();
        self.drain_locked(&mut ring, queue)?;
        queue.push(Notification { from: self.from.clone(), msg });
        Ok(())
    }

    fn drain_locked(&self, ring: &mut Consumer, queue: &NotifQueue) -> Result<usize> {
        let mut taken = Vec::new();
        let drained = ring.drain(|msg| taken.push(msg)).and_then(|n| {
            // Read from pages that faulted, the messages are zeros, not the sender's.
            match self.mapping.faulted() {
                false => Ok(n),
                true => Err(Error::Protocol("the memory of the sender's outbox faulted (its file shrank?)".into())),
            }
        });
        if drained.is_ok() {
            for msg in taken {
                queue.push(Notification { from: self.from.clone(), msg });
            }
        }
        drained.inspect_err(|e| {
            if !self.broken.swap(true, Ordering::Relaxed) {
                tracing::error!(from = %self.from, error = %e, "the sender's notification outbox is corrupt; dropping the connection");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outbox_and_doorbell() -> (Outbox, Doorbell) {
        let out = Outbox::create().unwrap();
        let here = freight_host::identity();
        let Frame::Outbox { host, fd, len } = out.announcement(&here) else { unreachable!() };
        let bell = Doorbell::attach("sender", &here, &host, fd, len).unwrap();
        (out, bell)
    }

    #[test]
    fn notifications_cross_the_mapping_and_ring_when_drained() {
        let (mut out, bell) = outbox_and_doorbell();
        let q = NotifQueue::default();
        let rings = std::cell::Cell::new(0);
        let ring = || {
            rings.set(rings.get() + 1);
            Ok(())
        };
        for i in 0..3u8 {
            out.send("peer", &[i; 10], Duration::from_secs(1), ring, || Ok(())).unwrap();
        }
        assert_eq!(rings.get(), 1, "only the first found the ring empty");
        assert_eq!(bell.drain(&q).unwrap(), 3);
        let got = q.drain();
        assert!(got.iter().all(|n| n.from == "sender"));
        assert_eq!(got.iter().map(|n| n.msg[0]).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn the_largest_notification_passes_through_a_smaller_ring() {
        let (mut out, bell) = outbox_and_doorbell();
        let q = NotifQueue::default();
        let msg: Vec<u8> = (0..MAX_NOTIF).map(|i| (i % 251) as u8).collect();
        let (ring, wakes) = crossbeam_channel::unbounded::<()>();
        std::thread::scope(|s| {
            // The target's connection thread, reduced to its part: drain on each wake-up.
            s.spawn(|| {
                while let Ok(()) = wakes.recv() {
                    bell.drain(&q).unwrap();
                }
            });
            out.send(
                "peer",
                &msg,
                Duration::from_secs(20),
                || ring.send(()).map_err(|e| Error::Io(e.to_string())),
                || Ok(()),
            )
            .unwrap();
            drop(ring);
        });
        bell.drain(&q).unwrap();
        let got = q.drain();
        assert_eq!(got.len(), 1);
        assert!(got[0].msg == msg);
    }

    #[test]
    fn a_full_ring_times_out_naming_the_peer_or_fails_when_the_peer_dies() {
        let (mut out, _bell) = outbox_and_doorbell();
        let big = vec![0u8; CAPACITY / 2];
        let ok = || Ok(());
        out.send("peer", &big, Duration::from_secs(1), ok, ok).unwrap();
        let start = Instant::now();
        let e = out.send("stuck-peer", &big, Duration::from_millis(100), ok, ok).unwrap_err();
        assert!(matches!(&e, Error::Timeout(m) if m.contains("stuck-peer")), "{e}");
        assert!(start.elapsed() >= Duration::from_millis(100) && start.elapsed() < Duration::from_secs(5));
        let dead = || Err(Error::PeerDisconnected { peer: "p".into(), reason: "gone".into() });
        let e = out.send("peer", &big, Duration::from_secs(30), ok, dead).unwrap_err();
        assert!(matches!(e, Error::PeerDisconnected { .. }));
    }

    #[test]
    fn outboxes_from_elsewhere_or_not_memfds_are_refused() {
        let out = Outbox::create().unwrap();
        let here = freight_host::identity();
        let Frame::Outbox { host, fd, len } = out.announcement(&here) else { unreachable!() };
        let other = HostIdentity { boot_id: "another-kernel".into(), ..host.clone() };
        assert!(Doorbell::attach("s", &here, &other, fd, len).is_err());
        assert!(Doorbell::attach("s", &here, &host, 0, len).is_err(), "stdin is no memfd");
        assert!(Doorbell::attach("s", &here, &host, 1 << 20, len).is_err(), "no such descriptor");
        assert!(Doorbell::attach("s", &here, &host, fd, len + 4096).is_err(), "longer than the file");
        assert!(Doorbell::attach("s", &here, &host, fd, 64).is_err(), "too short for a ring");
        assert!(Doorbell::attach("s", &here, &host, fd, u64::MAX).is_err());
        let plain = SharedSegment::allocate(HEADER + CAPACITY).unwrap();
        let e = Doorbell::attach("s", &here, &host, plain.fd(), plain.len() as u64).err().unwrap();
        assert!(e.to_string().contains("magic"), "{e}");
    }
}
