//! Incoming control connections, read by whoever gets there first.
//!
//! Each connection has a thread that sleeps until bytes arrive. Waking it costs tens of
//! microseconds, which would be most of a notification's latency when the application
//! is already polling for notifications. So the application's own calls
//! (`get_notifs`) also pull whatever the kernel has received, without blocking; the
//! connection's lock keeps frames whole and in order, so a sender's notifications still
//! arrive in the order it sent them.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::notify::{NotifQueue, Notification};
use crate::wire::{self, Frame};

/// One incoming control connection and the bytes received on it but not yet parsed.
pub struct Inbox {
    from: String,
    stream: TcpStream,
    pending: Vec<u8>,
}

impl Inbox {
    pub fn new(from: &str, stream: TcpStream) -> Inbox {
        Inbox { from: from.to_string(), stream, pending: Vec::new() }
    }

    /// Receives what has arrived without blocking and queues every complete
    /// notification. `Ok(false)` once the peer closed the connection.
    pub fn pump(&mut self, queue: &NotifQueue) -> Result<bool> {
        let mut open = true;
        let mut chunk = [0u8; 16 << 10];
        loop {
            // SAFETY: recv into a local buffer; MSG_DONTWAIT leaves the socket's own
            // (blocking) mode alone for the other users of this connection.
            let n = unsafe {
                libc::recv(self.stream.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len(), libc::MSG_DONTWAIT)
            };
            if n > 0 {
                self.pending.extend_from_slice(&chunk[..n as usize]);
                continue;
            }
            if n == 0 {
                open = false;
                break;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => break,
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e.into()),
            }
        }
        while let Some(frame) = wire::take_frame(&mut self.pending)? {
            let Frame::Notify { msg } = frame else {
                return Err(Error::Protocol(format!("unexpected message on a control connection: {frame:?}")));
            };
            queue.push(Notification { from: self.from.clone(), msg });
        }
        if !open && !self.pending.is_empty() {
            return Err(Error::Io("connection closed inside a frame".into()));
        }
        Ok(open)
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
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
    open: Mutex<Vec<Arc<Mutex<Inbox>>>>,
}

impl Inboxes {
    pub fn add(&self, inbox: Arc<Mutex<Inbox>>) {
        self.open.lock().push(inbox);
    }

    pub fn remove(&self, inbox: &Arc<Mutex<Inbox>>) {
        self.open.lock().retain(|i| !Arc::ptr_eq(i, inbox));
    }

    /// Pulls what has arrived on every connection nobody else is reading right now.
    /// Errors are left to the connection's own thread, which reads again and reports.
    pub fn pump(&self, queue: &NotifQueue) {
        let open: Vec<_> = self.open.lock().clone();
        for inbox in open {
            if let Some(mut i) = inbox.try_lock() {
                let _ = i.pump(queue);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    #[test]
    fn pumping_delivers_whole_frames_in_order_and_notices_the_end() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        let mut inbox = Inbox::new("peer", rx);
        let q = NotifQueue::default();
        assert!(inbox.pump(&q).unwrap(), "nothing sent yet: open, no frames");
        let mut bytes = Vec::new();
        for i in 0..3u8 {
            bytes.extend(wire::encode(&Frame::Notify { msg: vec![i; 100] }));
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
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        let mut inbox = Inbox::new("peer", rx);
        tx.write_all(&wire::encode(&Frame::Revoke { region: 1 })).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(matches!(inbox.pump(&NotifQueue::default()), Err(Error::Protocol(_))));
    }
}
