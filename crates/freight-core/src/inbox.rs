//! Incoming control connections, read by whoever gets there first.
//!
//! Each connection has a thread that sleeps until bytes arrive. Waking it costs tens of
//! microseconds, which would be most of a notification's latency when the application
//! is already polling for notifications. So the application's own calls
//! (`get_notifs`) also pull whatever the kernel has received, without blocking; the
//! connection's lock keeps frames whole and in order, so a sender's notifications still
//! arrive in the order it sent them.
//!
//! A same-host sender may move its notifications to an outbox in shared memory (see
//! [`crate::doorbell`]). Polling calls read outboxes first, with a few loads and no
//! syscall; the connection's thread drains one when its sender rings.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::doorbell::Doorbell;
use crate::frame_io;
use crate::notify::{NotifQueue, Notification};
use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Frame, FrameBuf};
use freight_proto::metadata::HostIdentity;

/// The writing half of a control connection, locked for a whole frame.
pub type ControlWriter = Arc<Mutex<TcpStream>>;

/// One incoming control connection.
pub struct Inbox {
    from: String,
    /// The socket and the bytes received on it but not yet parsed.
    reader: Mutex<Reader>,
    /// The sender's outbox, once it announced one and it was mapped.
    doorbell: OnceLock<Doorbell>,
    /// Frames back to the sender; revocations are written under the same lock.
    writer: ControlWriter,
    /// This agent's host: outboxes from elsewhere are refused.
    host: Arc<HostIdentity>,
    fd: RawFd,
}

struct Reader {
    stream: TcpStream,
    /// At most one frame's start, once what came with it was handled.
    pending: FrameBuf,
}

impl Inbox {
    pub fn new(from: &str, stream: TcpStream, writer: ControlWriter, host: Arc<HostIdentity>) -> Inbox {
        Inbox {
            from: from.to_string(),
            fd: stream.as_raw_fd(),
            reader: Mutex::new(Reader { stream, pending: FrameBuf::new(frame::MAX_CONTROL_HEADER) }),
            doorbell: OnceLock::new(),
            writer,
            host,
        }
    }

    /// Receives what has arrived without blocking and queues every complete
    /// notification, from the socket and, when the sender rang, from its outbox.
    /// `Ok(false)` once the peer closed the connection.
    pub fn pump(&self, queue: &NotifQueue) -> Result<bool> {
        self.pump_locked(&mut self.reader.lock(), queue)
    }

    fn pump_locked(&self, r: &mut Reader, queue: &NotifQueue) -> Result<bool> {
        let received = self.receive(r, queue);
        // A sender that closes may have written records it did not ring for; one whose
        // connection broke (a reset, a bad frame) left its records intact in shared
        // memory, written before whatever went wrong: they are delivered either way.
        let drain = match &received {
            Ok((woken, open)) => *woken || !*open,
            Err(_) => true,
        };
        if let (true, Some(d)) = (drain, self.doorbell.get()) {
            let drained = d.drain(queue);
            if let Err(e) = &drained {
                if received.is_err() {
                    tracing::warn!(from = %self.from, error = %e, "the outbox of a broken connection could not be read");
                }
            }
            // The connection's own error says more than the outbox's.
            if received.is_ok() {
                drained?;
            }
        }
        let (_, open) = received?;
        if !open && !r.pending.is_empty() {
            return Err(Error::Io("connection closed inside a frame".into()));
        }
        Ok(open)
    }

    /// Takes in what the socket holds: whether the sender rang, and whether the
    /// connection is still open.
    fn receive(&self, r: &mut Reader, queue: &NotifQueue) -> Result<(bool, bool)> {
        // Frames left by an earlier pump that stopped at an error come first.
        let mut woken = self.handle_frames(&mut r.pending, queue)?;
        let mut chunk = [0u8; 16 << 10];
        loop {
            // SAFETY: recv into a local buffer; MSG_DONTWAIT leaves the socket's own
            // (blocking) mode alone for the other users of this connection.
            let n =
                unsafe { libc::recv(r.stream.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len(), libc::MSG_DONTWAIT) };
            if n > 0 {
                // Handled as they complete: what stays buffered is at most one frame.
                r.pending.extend(&chunk[..n as usize]);
                woken |= self.handle_frames(&mut r.pending, queue)?;
                continue;
            }
            if n == 0 {
                return Ok((woken, false));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => return Ok((woken, true)),
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e.into()),
            }
        }
    }

    /// Handles every complete frame in `pending`, in order. `Ok(true)`: the sender rang.
    fn handle_frames(&self, pending: &mut FrameBuf, queue: &NotifQueue) -> Result<bool> {
        let mut woken = false;
        while let Some(frame) = pending.take()? {
            match frame {
                Frame::Notify { msg } => queue.push(Notification { from: self.from.clone(), msg }),
                Frame::Outbox { host, fd, len } => self.accept_outbox(&host, fd, len)?,
                Frame::Wake if self.doorbell.get().is_some() => woken = true,
                other => return Err(Error::Protocol(format!("unexpected message on a control connection: {other:?}"))),
            }
        }
        Ok(woken)
    }

    /// Maps the sender's outbox, or refuses it (the sender then stays on tcp), and
    /// answers. Only a failure to answer ends the connection.
    fn accept_outbox(&self, host: &HostIdentity, fd: i32, len: u64) -> Result<()> {
        let outcome = match self.doorbell.get() {
            Some(_) => Err(Error::Protocol("a second outbox on one connection".into())),
            None => Doorbell::attach(&self.from, &self.host, host, fd, len),
        };
        let error = match outcome {
            Ok(d) => {
                // Set before answering: the sender writes to it only once answered.
                let _ = self.doorbell.set(d);
                tracing::debug!(from = %self.from, pid = host.pid, fd, len, "reading notifications from the sender's outbox");
                None
            }
            Err(e) => {
                tracing::error!(from = %self.from, pid = host.pid, fd, len, error = %e, "refused a notification outbox");
                Some(e.to_string())
            }
        };
        frame_io::write_frame(&mut *self.writer.lock(), &Frame::OutboxReply { error }, &[])
    }

    /// Drains the outbox, if there is one and no other thread is at it.
    fn poll_outbox(&self, queue: &NotifQueue) {
        if let Some(d) = self.doorbell.get() {
            if d.try_drain(queue).is_err() {
                // The connection's thread reports it once woken, and the connection ends.
                let _ = self.writer.lock().shutdown(Shutdown::Both);
            }
        }
    }

    /// Queues `msg` after what the outbox holds. A corrupt outbox loses what it held,
    /// so `msg` cannot come after it: it is not queued, and the error says so.
    fn deliver_after_outbox(&self, msg: Vec<u8>, queue: &NotifQueue) -> Result<()> {
        let d = self.doorbell.get().expect("an inbox with an outbox");
        d.drain_then(queue, msg).map_err(|e| {
            // As in `poll_outbox`: the connection's thread reports it, and the connection ends.
            let _ = self.writer.lock().shutdown(Shutdown::Both);
            Error::Protocol(format!(
                "the notification sent with this write was not delivered: the notifications \
                 before it in the sender's outbox were lost ({e})"
            ))
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd
    }
}

/// Sleeps until bytes (or the end of the stream) can be read from `fd`. Called without
/// the inbox's lock, so that polling applications can read meanwhile.
pub fn wait_readable(fd: RawFd) -> Result<()> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
        if rc >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e.into());
        }
    }
}

/// The agent's incoming control connections.
#[derive(Default)]
pub struct Inboxes {
    open: Mutex<Vec<Arc<Inbox>>>,
    /// Threads asleep in `Agent::wait_notifs`. While there are none, same-host senders
    /// need not ring after each notification: whoever asks next pulls it from the
    /// outbox (see [`Inboxes::sleeping`]).
    sleepers: Mutex<usize>,
}

impl Inboxes {
    pub fn add(&self, inbox: Arc<Inbox>) {
        self.open.lock().push(inbox);
    }

    pub fn remove(&self, inbox: &Arc<Inbox>) {
        self.open.lock().retain(|i| !Arc::ptr_eq(i, inbox));
    }

    /// Marks a thread going to sleep for notifications (`true`) or back from it. The
    /// first sleeper tells every sender's outbox to ring, the last one back tells them
    /// not to. An outbox attached meanwhile starts out ringing, which is always safe.
    /// After `sleeping(true)`, pump once more before sleeping: a notification written
    /// before the senders saw the change was not rung for.
    pub fn sleeping(&self, asleep: bool) {
        let mut sleepers = self.sleepers.lock();
        let before = *sleepers;
        *sleepers = if asleep { before + 1 } else { before.saturating_sub(1) };
        if (before == 0) != (*sleepers == 0) {
            for inbox in self.open.lock().iter() {
                if let Some(d) = inbox.doorbell.get() {
                    d.set_asleep(asleep);
                }
            }
        }
    }

    /// Queues a notification that came on a data stream with the payload it follows,
    /// after every notification its sender put in its outbox before sending it. (A
    /// sender lets notifications ride on data only while it notifies through an outbox;
    /// see `ControlLink::rides_on_data`.)
    ///
    /// An error means that it was not queued: the sender's outbox is corrupt (the
    /// notifications before it are lost, so it cannot follow them; the control
    /// connection is shut down). The write it came with must then be answered with the
    /// error, so that the initiator does not report a notification delivered.
    pub fn try_deliver_after(&self, from: &str, msg: Vec<u8>, queue: &NotifQueue) -> Result<()> {
        let inbox = self.open.lock().iter().find(|i| i.from == from && i.doorbell.get().is_some()).cloned();
        match inbox {
            Some(inbox) => inbox.deliver_after_outbox(msg, queue),
            None => {
                queue.push(Notification { from: from.to_string(), msg });
                Ok(())
            }
        }
    }

    /// Pulls what has arrived on every connection nobody else is reading right now:
    /// outboxes first (no syscall), then the sockets of senders without one (a sender
    /// with an outbox sends nothing else but wake-ups, which its thread handles).
    /// Errors are left to the connection's own thread, which reads again and reports.
    pub fn pump(&self, queue: &NotifQueue) {
        let open: Vec<_> = self.open.lock().clone();
        for inbox in &open {
            inbox.poll_outbox(queue);
        }
        for inbox in open.iter().filter(|i| i.doorbell.get().is_none()) {
            if let Some(mut r) = inbox.reader.try_lock() {
                let _ = inbox.pump_locked(&mut r, queue);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doorbell::Outbox;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Duration;

    /// An inbox on one end of a fresh connection, and the sender's end.
    fn connection() -> (Inbox, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        let writer = Arc::new(Mutex::new(rx.try_clone().unwrap()));
        (Inbox::new("peer", rx, writer, Arc::new(freight_host::identity())), tx)
    }

    /// A connection among an agent's inboxes, and an outbox (not announced yet) on the
    /// sending side.
    struct Watched {
        inbox: Arc<Inbox>,
        tx: TcpStream,
        inboxes: Inboxes,
        q: NotifQueue,
        out: Outbox,
    }

    fn watched_with_an_outbox() -> Watched {
        let (inbox, tx) = connection();
        let (inboxes, inbox) = (Inboxes::default(), Arc::new(inbox));
        inboxes.add(inbox.clone());
        Watched { inbox, tx, inboxes, q: NotifQueue::default(), out: Outbox::create().unwrap() }
    }

    /// Pumps until `n` notifications are queued (the bytes may take a moment).
    fn pump_until(inbox: &Inbox, q: &NotifQueue, n: usize) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        for _ in 0..500 {
            inbox.pump(q).unwrap();
            got.extend(q.drain().into_iter().map(|n| n.msg));
            if got.len() >= n {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        got
    }

    #[test]
    fn pumping_delivers_whole_frames_in_order_and_notices_the_end() {
        let (inbox, mut tx) = connection();
        let q = NotifQueue::default();
        assert!(inbox.pump(&q).unwrap(), "nothing sent yet: open, no frames");
        let mut bytes = Vec::new();
        for i in 0..3u8 {
            bytes.extend(frame::encode(&Frame::Notify { msg: vec![i; 100] }));
        }
        tx.write_all(&bytes[..150]).unwrap();
        wait_readable(inbox.fd()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(inbox.pump(&q).unwrap());
        assert_eq!(q.drain().len(), 1, "only the first frame is complete");
        tx.write_all(&bytes[150..]).unwrap();
        drop(tx);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!inbox.pump(&q).unwrap(), "the end of the stream is reported");
        let rest: Vec<u8> = q.drain().iter().map(|n| n.msg[0]).collect();
        assert_eq!(rest, vec![1, 2]);
    }

    #[test]
    fn a_stray_frame_is_a_protocol_error() {
        let (inbox, mut tx) = connection();
        tx.write_all(&frame::encode(&Frame::Revoke { region: 1 })).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(matches!(inbox.pump(&NotifQueue::default()), Err(Error::Protocol(_))));
    }

    #[test]
    fn a_wake_up_without_an_outbox_is_a_protocol_error() {
        let (inbox, mut tx) = connection();
        tx.write_all(&frame::encode(&Frame::Wake)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(matches!(inbox.pump(&NotifQueue::default()), Err(Error::Protocol(_))));
    }

    #[test]
    fn an_outbox_is_answered_and_read_after_what_came_before_it() {
        let Watched { inbox, mut tx, inboxes, q, mut out } = watched_with_an_outbox();
        tx.write_all(&frame::encode(&Frame::Notify { msg: b"tcp".to_vec() })).unwrap();
        tx.write_all(&frame::encode(&out.announcement(&freight_host::identity()))).unwrap();
        assert_eq!(pump_until(&inbox, &q, 1), vec![b"tcp".to_vec()]);
        let reply = frame_io::read_frame(&mut tx).unwrap().unwrap();
        assert_eq!(reply, Frame::OutboxReply { error: None });

        // A polling caller finds records without any wake-up...
        let mut woken = 0;
        let mut send = |out: &mut crate::doorbell::Outbox, msg: &[u8]| {
            let ring = || {
                woken += 1;
                Ok(())
            };
            out.send("p", msg, Duration::from_secs(1), ring, || Ok(())).unwrap();
        };
        send(&mut out, b"ring 1");
        inboxes.pump(&q);
        assert_eq!(
            q.drain().iter().map(|n| (n.from.as_str(), n.msg.as_slice())).collect::<Vec<_>>(),
            vec![("peer", &b"ring 1"[..])]
        );
        // ...and the connection's own pump drains on one.
        send(&mut out, b"ring 2");
        assert_eq!(woken, 2, "each record found the ring drained");
        tx.write_all(&frame::encode(&Frame::Wake)).unwrap();
        assert_eq!(pump_until(&inbox, &q, 1), vec![b"ring 2".to_vec()]);

        // Records written before the sender closes are delivered, rung for or not.
        out.send("p", b"last", Duration::from_secs(1), || Ok(()), || Ok(())).unwrap();
        drop(tx);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!inbox.pump(&q).unwrap());
        assert_eq!(q.drain()[0].msg, b"last");
    }

    #[test]
    fn records_in_the_outbox_survive_a_connection_that_breaks() {
        let Watched { inbox, mut tx, q, mut out, .. } = watched_with_an_outbox();
        tx.write_all(&frame::encode(&out.announcement(&freight_host::identity()))).unwrap();
        pump_until(&inbox, &q, 0);
        assert_eq!(frame_io::read_frame(&mut tx).unwrap().unwrap(), Frame::OutboxReply { error: None });
        // Not rung for (nobody sleeps on notifications), then the connection breaks.
        out.send("p", b"kept", Duration::from_secs(1), || Ok(()), || Ok(())).unwrap();
        tx.write_all(&frame::encode(&Frame::Revoke { region: 1 })).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(matches!(inbox.pump(&q), Err(Error::Protocol(_))));
        assert_eq!(q.drain().iter().map(|n| n.msg.clone()).collect::<Vec<_>>(), vec![b"kept".to_vec()]);
    }

    #[test]
    fn a_burst_of_notifications_is_taken_by_offset() {
        let (inbox, mut tx) = connection();
        let q = NotifQueue::default();
        let n = 100_000u32;
        let bytes: Vec<u8> =
            (0..n).flat_map(|i| frame::encode(&Frame::Notify { msg: i.to_le_bytes().to_vec() })).collect();
        let total = bytes.len() as u64;
        let sender = std::thread::spawn(move || tx.write_all(&bytes).map(|_| tx));
        let got = pump_until(&inbox, &q, n as usize);
        let expected: Vec<Vec<u8>> = (0..n).map(|i| i.to_le_bytes().to_vec()).collect();
        assert!(got == expected, "{} of {n} notifications, in order: {}", got.len(), got == expected);
        let r = inbox.reader.lock();
        assert!(r.pending.is_empty());
        // Parsed by offset: a drain per frame would have moved each byte once per frame
        // before it in the same read.
        assert!(r.pending.moved() <= total, "moved {} of {total} bytes", r.pending.moved());
        drop(sender.join().unwrap().unwrap());
    }

    /// Makes the sender's ring unreadable: a producer position no writer leaves.
    fn corrupt(out: &Outbox) {
        let Frame::Outbox { fd, len, .. } = out.announcement(&freight_host::identity()) else { unreachable!() };
        // SAFETY: a fresh shared mapping of the outbox's memfd, unmapped below.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            assert_ne!(p, libc::MAP_FAILED);
            (p as *mut u64).write_volatile(3);
            libc::munmap(p, len as usize);
        }
    }

    #[test]
    fn a_notification_riding_on_data_is_refused_not_lost_when_the_outbox_is_corrupt() {
        let Watched { inbox, mut tx, inboxes, q, mut out } = watched_with_an_outbox();
        tx.write_all(&frame::encode(&out.announcement(&freight_host::identity()))).unwrap();
        pump_until(&inbox, &q, 0);
        assert_eq!(frame_io::read_frame(&mut tx).unwrap().unwrap(), Frame::OutboxReply { error: None });

        // Riding on data, a notification comes after those in the outbox before it.
        out.send("p", b"first", Duration::from_secs(1), || Ok(()), || Ok(())).unwrap();
        inboxes.try_deliver_after("peer", b"rider".to_vec(), &q).unwrap();
        let msgs = |q: &NotifQueue| q.drain().into_iter().map(|n| n.msg).collect::<Vec<_>>();
        assert_eq!(msgs(&q), vec![b"first".to_vec(), b"rider".to_vec()]);

        // A corrupt outbox lost what came before it: it is refused, every time, and the
        // control connection ends.
        corrupt(&out);
        for _ in 0..2 {
            let e = inboxes.try_deliver_after("peer", b"lost".to_vec(), &q).unwrap_err();
            assert!(matches!(&e, Error::Protocol(m) if m.contains("not delivered")), "{e}");
            assert!(msgs(&q).is_empty());
        }
        tx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(matches!(frame_io::read_frame(&mut tx), Ok(None) | Err(Error::Io(_))), "the connection was shut down");

        // From a sender without an outbox, it is queued as it comes.
        inboxes.try_deliver_after("another", b"plain".to_vec(), &q).unwrap();
        assert_eq!(msgs(&q), vec![b"plain".to_vec()]);
    }

    #[test]
    fn a_bad_outbox_is_refused_and_the_connection_goes_on() {
        let (inbox, mut tx) = connection();
        let q = NotifQueue::default();
        let host = freight_host::identity();
        let bad = Frame::Outbox { host, fd: 1 << 20, len: 1 << 20 };
        tx.write_all(&frame::encode(&bad)).unwrap();
        tx.write_all(&frame::encode(&Frame::Notify { msg: b"still here".to_vec() })).unwrap();
        assert_eq!(pump_until(&inbox, &q, 1), vec![b"still here".to_vec()]);
        let Frame::OutboxReply { error: Some(reason) } = frame_io::read_frame(&mut tx).unwrap().unwrap() else {
            panic!("expected a refusal")
        };
        assert!(reason.contains("/proc/"), "{reason}");
    }
}
