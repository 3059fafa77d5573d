//! Zero-copy sends (Linux `MSG_ZEROCOPY`): the kernel transmits large payloads straight
//! from registered memory instead of copying them into socket buffers first.
//!
//! The kernel keeps referencing the pages until the data is acknowledged and reports
//! that on the socket's error queue. freight needs no per-send bookkeeping for that: a
//! request completes only when the peer has answered for the chunk, which means the peer
//! has read every byte, so the pages are never reused while the kernel could still need
//! to resend them. The notifications are drained only so that they do not exhaust the
//! socket's option memory, and to notice when the kernel silently copied anyway (it
//! does on loopback and on devices without scatter-gather): then zero-copy costs more
//! than it saves, and the socket goes back to ordinary sends.

use std::io::{self, IoSlice};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;

/// Payloads smaller than this are copied: pinning pages and handling the notification
/// costs more than copying a few tens of KiB (the kernel's own guidance says ~10 KiB).
pub const MIN_BYTES: usize = 64 << 10;

// From <linux/socket.h> and <linux/errqueue.h>; not (yet) exported by the libc crate.
const SO_ZEROCOPY: libc::c_int = 60;
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// Whether zero-copy can pay off towards `peer`: on loopback the kernel copies at
/// delivery, so it only adds work.
pub fn worthwhile(peer: SocketAddr) -> bool {
    !peer.ip().is_loopback()
}

/// Sends through one socket, with `MSG_ZEROCOPY` while it helps.
pub struct ZeroCopySocket {
    enabled: bool,
}

impl ZeroCopySocket {
    /// Asks the kernel for zero-copy on `sock`; where it refuses (old kernel, not TCP)
    /// every send is an ordinary one.
    pub fn new(sock: &TcpStream, wanted: bool) -> ZeroCopySocket {
        let enabled = wanted && set_zerocopy(sock).is_ok();
        ZeroCopySocket { enabled }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Writes a message header and its payload. The payload goes zero-copy when it is
    /// large enough; the caller keeps it untouched until the peer has answered for it.
    pub fn write_all(&mut self, sock: &mut TcpStream, header: &[u8], payload: &[IoSlice<'_>]) -> io::Result<()> {
        let bytes: usize = payload.iter().map(|s| s.len()).sum();
        if !self.enabled || bytes < MIN_BYTES {
            let mut slices = Vec::with_capacity(payload.len() + 1);
            slices.push(IoSlice::new(header));
            slices.extend_from_slice(payload);
            return crate::wire::write_all_vectored(sock, &mut slices);
        }
        crate::wire::write_all_vectored(sock, &mut [IoSlice::new(header)])?;
        let mut slices = payload.to_vec();
        let mut rest = &mut slices[..];
        IoSlice::advance_slices(&mut rest, 0);
        while !rest.is_empty() {
            match send_zerocopy(sock, rest) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while writing")),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Out of option memory for pinned pages: collect what has completed,
                // then carry on; a plain send of this piece always works.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    self.drain(sock);
                    return crate::wire::write_all_vectored(sock, rest);
                }
                Err(e) => return Err(e),
            }
        }
        self.drain(sock);
        Ok(())
    }

    /// Reads every pending completion without blocking; turns zero-copy off for this
    /// socket when the kernel reports that it copied.
    fn drain(&mut self, sock: &TcpStream) {
        loop {
            match next_completion(sock) {
                Ok(Some(copied)) if copied => {
                    tracing::debug!("the kernel copied a zero-copy send; using plain sends on this stream");
                    self.enabled = false;
                }
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "reading zero-copy completions failed; using plain sends");
                    self.enabled = false;
                    return;
                }
            }
        }
    }
}

fn set_zerocopy(sock: &TcpStream) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: a valid socket descriptor and a c_int option value of the right size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ZEROCOPY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn send_zerocopy(sock: &TcpStream, slices: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; all-zero is its valid empty state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec (std guarantees it on Unix).
    msg.msg_iov = slices.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = slices.len().min(libc::UIO_MAXIOV as usize) as _;
    // SAFETY: the iovecs point into memory the caller keeps alive and registered.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_ZEROCOPY | libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One completion from the error queue: `Some(copied)`, or `None` when none is pending.
fn next_completion(sock: &TcpStream) -> io::Result<Option<bool>> {
    let mut control = [0u64; 16];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at a control buffer that outlives the call; no data iovecs.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            io::ErrorKind::Interrupted => next_completion(sock),
            _ => Err(e),
        };
    }
    let mut copied = false;
    // SAFETY: the kernel filled msg_control with well-formed cmsgs, walked with its macros.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let is_recverr = ((*cmsg).cmsg_level == libc::SOL_IP && (*cmsg).cmsg_type == libc::IP_RECVERR)
                || ((*cmsg).cmsg_level == libc::SOL_IPV6 && (*cmsg).cmsg_type == libc::IPV6_RECVERR);
            if is_recverr {
                let err = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::sock_extended_err);
                if err.ee_origin == SO_EE_ORIGIN_ZEROCOPY && err.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                    copied = true;
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(Some(copied))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    #[test]
    fn loopback_is_not_worth_it_and_other_hosts_are() {
        assert!(!worthwhile("127.0.0.1:7000".parse().unwrap()));
        assert!(!worthwhile("[::1]:7000".parse().unwrap()));
        assert!(worthwhile("10.1.2.3:7000".parse().unwrap()));
    }

    #[test]
    fn zero_copy_sends_arrive_whole_and_a_copying_kernel_turns_them_off() {
        let (mut client, mut server) = pair();
        let mut zc = ZeroCopySocket::new(&client, true);
        assert!(zc.enabled(), "this kernel refused SO_ZEROCOPY");
        let parts: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 300 << 10]).collect();
        let expected: Vec<u8> = b"HEAD".iter().copied().chain(parts.iter().flatten().copied()).collect();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; expected.len() * 3];
            server.read_exact(&mut got).unwrap();
            (got, expected)
        });
        for _ in 0..3 {
            let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
            zc.write_all(&mut client, b"HEAD", &slices).unwrap();
        }
        let (got, expected) = reader.join().unwrap();
        // Loopback delivers by copying, and says so on the error queue: the socket
        // must have noticed and gone back to plain sends.
        zc.drain(&client);
        assert!(!zc.enabled(), "the copied-completion on loopback went unnoticed");
        for round in got.chunks(expected.len()) {
            assert_eq!(round, &expected[..]);
        }
    }

    #[test]
    fn small_payloads_and_disabled_sockets_use_plain_sends() {
        let (mut client, mut server) = pair();
        let mut plain = ZeroCopySocket::new(&client, false);
        assert!(!plain.enabled());
        plain.write_all(&mut client, b"h", &[IoSlice::new(&[7u8; 100])]).unwrap();
        let mut got = [0u8; 101];
        server.read_exact(&mut got).unwrap();
        assert_eq!(got[0], b'h');
        assert!(got[1..].iter().all(|&b| b == 7));
    }
}
