//! Zero-copy sends: large payloads leave registered memory without a copy into socket
//! buffers, in one of two ways.
//!
//! - Towards other hosts, `MSG_ZEROCOPY` ([`msg`]): the NIC reads the pages itself.
//! - Within this host (loopback, or a veth pair into another network namespace), where
//!   the kernel would copy a `MSG_ZEROCOPY` payload at delivery, splicing ([`splice`]):
//!   the receiving socket gets the sender's pages and its read is the only copy.
//!
//! Either way the kernel keeps referencing the pages after the call returns. freight
//! needs no per-send bookkeeping for an initiator's WRITE: its request completes only
//! when the peer has answered for the chunk, which means the peer has read every byte,
//! so the pages are not reused while the kernel could still need them. A target's READ
//! answer is not answered for: its region may be deregistered once the send returns,
//! while the kernel still holds pages that the initiator has not read yet. The kernel
//! keeps those pages alive (nothing unmapped is ever read), but bytes the application
//! writes into them meanwhile reach that READ; an application that reuses memory a peer
//! is reading has raced with the peer in any case. `MSG_ZEROCOPY` completions are
//! drained only so that they do not exhaust the socket's option memory, and to notice
//! when the kernel silently copied anyway (a peer in another namespace of this host, a
//! device without scatter-gather): the socket then splices instead.

mod msg;
mod splice;

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use splice::SplicePipe;

/// Payloads smaller than this are copied: pinning pages and handling the notification
/// costs more than copying a few tens of KiB (the kernel's own guidance says ~10 KiB).
pub const MIN_BYTES: usize = 64 << 10;

/// How a socket sends payloads of [`MIN_BYTES`] and more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendMode {
    Copy,
    MsgZeroCopy,
    Splice,
}

enum Sender {
    Copy,
    MsgZeroCopy,
    Splice(SplicePipe),
}

/// Sends through one socket, without copying large payloads where the kernel allows.
pub struct ZeroCopySocket {
    sender: Sender,
}

/// Whether `sock` leads to this host: loopback, or one of our own addresses.
fn within_host(sock: &TcpStream) -> bool {
    match (sock.peer_addr(), sock.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

/// A splicing sender, or plain sends where the system refuses a pipe.
fn splicing() -> Sender {
    match SplicePipe::new() {
        Ok(pipe) => Sender::Splice(pipe),
        Err(e) => {
            tracing::debug!(error = %e, "no pipe for splicing; using plain sends");
            Sender::Copy
        }
    }
}

impl ZeroCopySocket {
    /// Picks the way for `sock` (`wanted` false: always plain sends).
    pub fn new(sock: &TcpStream, wanted: bool) -> ZeroCopySocket {
        let sender = if !wanted {
            Sender::Copy
        } else if within_host(sock) {
            splicing()
        } else if msg::set_zerocopy(sock).is_ok() {
            Sender::MsgZeroCopy
        } else {
            splicing()
        };
        ZeroCopySocket { sender }
    }

    pub fn mode(&self) -> SendMode {
        match self.sender {
            Sender::Copy => SendMode::Copy,
            Sender::MsgZeroCopy => SendMode::MsgZeroCopy,
            Sender::Splice(_) => SendMode::Splice,
        }
    }

    /// Writes a message header and its payload. The payload goes without a copy when it
    /// is large enough; the caller keeps it untouched until the peer has answered for it.
    pub fn write_all(&mut self, sock: &mut TcpStream, header: &[u8], payload: &[IoSlice<'_>]) -> io::Result<()> {
        let bytes: usize = payload.iter().map(|s| s.len()).sum();
        if matches!(self.sender, Sender::Copy) || bytes < MIN_BYTES {
            let mut slices = Vec::with_capacity(payload.len() + 1);
            slices.push(IoSlice::new(header));
            slices.extend_from_slice(payload);
            return crate::frame_io::write_all_vectored(sock, &mut slices);
        }
        match &mut self.sender {
            Sender::Splice(pipe) => {
                // The header waits in the socket for the payload's first pages.
                send_more(sock, header)?;
                match pipe.send(sock, payload) {
                    Ok(()) => Ok(()),
                    Err(stopped) => {
                        // A refused splice, or a dead connection: plain sends tell which.
                        tracing::debug!(error = %stopped.error, "splicing stopped; using plain sends on this stream");
                        self.sender = Sender::Copy;
                        let mut slices = payload.to_vec();
                        let mut rest = &mut slices[..];
                        IoSlice::advance_slices(&mut rest, stopped.sent);
                        crate::frame_io::write_all_vectored(sock, rest)
                    }
                }
            }
            _ => self.send_msg_zerocopy(sock, header, payload),
        }
    }

    fn send_msg_zerocopy(&mut self, sock: &mut TcpStream, header: &[u8], payload: &[IoSlice<'_>]) -> io::Result<()> {
        crate::frame_io::write_all_vectored(sock, &mut [IoSlice::new(header)])?;
        let mut slices = payload.to_vec();
        let mut rest = &mut slices[..];
        IoSlice::advance_slices(&mut rest, 0);
        while !rest.is_empty() {
            match msg::send_zerocopy(sock, rest) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while writing")),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Out of option memory for pinned pages: collect what has completed,
                // then carry on; a plain send of this piece always works.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    self.drain(sock);
                    return crate::frame_io::write_all_vectored(sock, rest);
                }
                Err(e) => return Err(e),
            }
        }
        self.drain(sock);
        Ok(())
    }

    /// Reads every pending `MSG_ZEROCOPY` completion without blocking; splices instead
    /// when the kernel reports that it copied. Returns how many it read.
    fn drain(&mut self, sock: &TcpStream) -> usize {
        let (mut read, mut copied) = (0, false);
        loop {
            match msg::next_completion(sock) {
                Ok(Some(c)) => {
                    read += 1;
                    copied |= c;
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "reading zero-copy completions failed; using plain sends");
                    self.sender = Sender::Copy;
                    return read;
                }
            }
        }
        if copied && matches!(self.sender, Sender::MsgZeroCopy) {
            tracing::debug!("the kernel copied a zero-copy send (a peer on this host); splicing instead");
            self.sender = splicing();
        }
        read
    }

    /// Sleeps until bytes, the end of the stream or an error can be read from `sock`.
    /// The kernel's completion reports for `MSG_ZEROCOPY` sends wake `poll` too (as
    /// `POLLERR`, asked for or not) until they are read: they are read here, and the
    /// wait goes on. Otherwise the last send's report, which comes a round trip after
    /// it, would pass for a message and the read that follows would time out.
    pub fn wait_readable(&mut self, sock: &TcpStream) -> io::Result<()> {
        loop {
            let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let readable = pfd.revents & (libc::POLLIN | libc::POLLHUP) != 0;
            // Nothing on the error queue: a real error, which the read reports.
            if readable || pfd.revents & libc::POLLERR == 0 || self.drain(sock) == 0 {
                return Ok(());
            }
        }
    }
}

/// Sends `bytes` with `MSG_MORE`: held back until what follows fills a segment.
fn send_more(sock: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: a valid socket and a live buffer of the given length.
        let n = retrying(|| unsafe {
            libc::send(sock.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), libc::MSG_MORE | libc::MSG_NOSIGNAL)
        })?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while writing"));
        }
        bytes = &bytes[n..];
    }
    Ok(())
}

/// Runs a system call until it is not interrupted; its count, or the error.
pub(super) fn retrying(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    /// Sends `rounds` messages of `parts` through `zc`, reads them back on the other end
    /// and checks every byte.
    fn send_and_check(zc: &mut ZeroCopySocket, client: &mut TcpStream, server: TcpStream, parts: &[Vec<u8>]) {
        const ROUNDS: usize = 3;
        let message: Vec<u8> = b"HEAD".iter().copied().chain(parts.iter().flatten().copied()).collect();
        let expected = message.clone();
        let reader = std::thread::spawn(move || {
            let mut server = server;
            let mut got = vec![0u8; expected.len() * ROUNDS];
            server.read_exact(&mut got).unwrap();
            got
        });
        for _ in 0..ROUNDS {
            let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
            zc.write_all(client, b"HEAD", &slices).unwrap();
        }
        let got = reader.join().unwrap();
        for (i, round) in got.chunks(message.len()).enumerate() {
            assert!(round == &message[..], "message {i} arrived damaged");
        }
    }

    /// Odd sizes at odd offsets, more bytes in all than one pipe holds.
    fn ragged_parts() -> Vec<Vec<u8>> {
        (0..9u8)
            .map(|i| (0..(300 << 10) + 4093 * i as usize).map(|b| (b as u8).wrapping_mul(31) ^ i).collect())
            .collect()
    }

    #[test]
    fn within_the_host_payloads_are_spliced_and_arrive_whole() {
        let (mut client, server) = pair();
        let mut zc = ZeroCopySocket::new(&client, true);
        assert_eq!(zc.mode(), SendMode::Splice);
        let parts = ragged_parts();
        // Slices that start inside a page.
        let unaligned: Vec<Vec<u8>> = parts.iter().map(|p| p[1..].to_vec()).collect();
        send_and_check(&mut zc, &mut client, server, &unaligned);
        assert_eq!(zc.mode(), SendMode::Splice, "splicing gave up on loopback");
    }

    #[test]
    fn a_copying_kernel_turns_msg_zerocopy_into_splicing() {
        let (mut client, server) = pair();
        msg::set_zerocopy(&client).expect("this kernel refused SO_ZEROCOPY");
        let mut zc = ZeroCopySocket { sender: Sender::MsgZeroCopy };
        send_and_check(&mut zc, &mut client, server, &ragged_parts());
        // Loopback delivers MSG_ZEROCOPY payloads by copying, and says so on the error
        // queue: the socket must have noticed and moved to splicing.
        zc.drain(&client);
        assert_eq!(zc.mode(), SendMode::Splice, "the copied-completion on loopback went unnoticed");
    }

    #[test]
    fn completion_reports_do_not_pass_for_a_message() {
        let (mut client, mut server) = pair();
        msg::set_zerocopy(&client).expect("this kernel refused SO_ZEROCOPY");
        let mut zc = ZeroCopySocket { sender: Sender::MsgZeroCopy };
        let payload = vec![3u8; 1 << 20];
        let mut sent = payload.clone();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 4 + sent.len()];
            server.read_exact(&mut got).unwrap();
            // Once the sender is idle and its last report is queued, answer.
            std::thread::sleep(std::time::Duration::from_millis(300));
            server.write_all(b"next").unwrap();
            sent.splice(0..0, *b"HEAD");
            assert!(got == sent);
            server
        });
        // Written without draining afterwards: the reports stay queued, as after the last
        // send of a busy stream.
        crate::frame_io::write_all_vectored(&mut client, &mut [IoSlice::new(b"HEAD")]).unwrap();
        let mut rest = [IoSlice::new(&payload)];
        let mut rest = &mut rest[..];
        while !rest.is_empty() {
            let n = msg::send_zerocopy(&client, rest).unwrap();
            IoSlice::advance_slices(&mut rest, n);
        }
        let started = std::time::Instant::now();
        zc.wait_readable(&client).unwrap();
        assert!(started.elapsed() >= std::time::Duration::from_millis(200), "woke for a completion report");
        let mut next = [0u8; 4];
        client.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"next");
        let _server = reader.join().unwrap();
    }

    #[test]
    fn small_payloads_and_unwanted_zero_copy_use_plain_sends() {
        let (mut client, server) = pair();
        let mut plain = ZeroCopySocket::new(&client, false);
        assert_eq!(plain.mode(), SendMode::Copy);
        send_and_check(&mut plain, &mut client, server, &[vec![7u8; 100], vec![9u8; 200 << 10]]);
        let (mut client, server) = pair();
        let mut zc = ZeroCopySocket::new(&client, true);
        send_and_check(&mut zc, &mut client, server, &[vec![5u8; 1000]]);
    }

    #[test]
    fn a_closed_peer_fails_a_spliced_send_instead_of_hanging() {
        let (mut client, server) = pair();
        let mut zc = ZeroCopySocket::new(&client, true);
        drop(server);
        let payload = vec![1u8; 4 << 20];
        // The first send may still land in the socket buffer; the reset then fails one.
        let failed = (0..20).any(|_| zc.write_all(&mut client, b"HEAD", &[IoSlice::new(&payload)]).is_err());
        assert!(failed, "sends into a closed connection kept succeeding");
    }
}
