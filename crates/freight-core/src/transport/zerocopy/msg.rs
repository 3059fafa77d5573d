//! `MSG_ZEROCOPY`: the kernel pins the payload's pages and the NIC reads them itself;
//! completions come back on the socket's error queue.

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

// From <linux/socket.h> and <linux/errqueue.h>; not (yet) exported by the libc crate.
const SO_ZEROCOPY: libc::c_int = 60;
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

pub fn set_zerocopy(sock: &TcpStream) -> io::Result<()> {
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

pub fn send_zerocopy(sock: &TcpStream, slices: &[IoSlice<'_>]) -> io::Result<usize> {
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
pub fn next_completion(sock: &TcpStream) -> io::Result<Option<bool>> {
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
