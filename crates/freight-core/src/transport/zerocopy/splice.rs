//! Splicing: payload pages go into a pipe by reference (`vmsplice`) and from the pipe
//! into the socket (`splice`), so the sender copies nothing. Where the receiver is on
//! this host (loopback, a veth pair into another network namespace) the kernel hands
//! those same pages to the receiving socket, and the receiver's read is the only copy
//! end to end, where `MSG_ZEROCOPY` would be copied at delivery.
//!
//! The kernel reads the pages when the receiver does, not when `splice` returns: the
//! caller keeps them untouched until the peer has answered for the message, which is
//! what a tcp chunk waits for anyway (see the module above).

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::retrying;

/// The pipe's capacity we ask for: a 1 MiB chunk in one `vmsplice`/`splice` pair. The
/// kernel's default limit for unprivileged users (`fs.pipe-max-size`) is 1 MiB.
const PIPE_BYTES: libc::c_int = 1 << 20;

/// A pipe that carries one socket's payloads.
pub struct SplicePipe {
    read: OwnedFd,
    write: OwnedFd,
}

/// Splicing stopped partway: `sent` bytes reached the socket, the rest must go another
/// way (plain sends, which also tell a dead connection from a refused splice).
#[derive(Debug)]
pub struct Stopped {
    pub sent: usize,
    pub error: io::Error,
}

impl SplicePipe {
    pub fn new() -> io::Result<SplicePipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: fds has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned by nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A smaller pipe (a lower system limit) still works, with more calls per chunk.
        // SAFETY: F_SETPIPE_SZ on a pipe we own, with an int argument.
        unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES) };
        Ok(SplicePipe { read, write })
    }

    /// Sends all of `payload` into `sock`. After an error the pipe may still hold pages
    /// and must be dropped.
    pub fn send(&mut self, sock: &TcpStream, payload: &[IoSlice<'_>]) -> Result<(), Stopped> {
        let total: usize = payload.iter().map(|s| s.len()).sum();
        let mut slices = payload.to_vec();
        let mut rest = &mut slices[..];
        IoSlice::advance_slices(&mut rest, 0);
        let mut sent = 0;
        while !rest.is_empty() {
            let batch = retrying(|| {
                // SAFETY: the iovecs point into memory the caller keeps mapped until the
                // peer has answered; IoSlice is ABI-compatible with iovec.
                unsafe {
                    libc::vmsplice(
                        self.write.as_raw_fd(),
                        rest.as_ptr().cast::<libc::iovec>(),
                        rest.len().min(libc::UIO_MAXIOV as usize),
                        0,
                    )
                }
            })
            .map_err(|error| Stopped { sent, error })?;
            IoSlice::advance_slices(&mut rest, batch);
            let mut left = batch;
            while left > 0 {
                let more = if sent + left < total { libc::SPLICE_F_MORE } else { 0 };
                let n = retrying(|| {
                    // SAFETY: moves bytes between two descriptors we hold; no user memory.
                    unsafe {
                        libc::splice(
                            self.read.as_raw_fd(),
                            std::ptr::null_mut(),
                            sock.as_raw_fd(),
                            std::ptr::null_mut(),
                            left,
                            more,
                        )
                    }
                })
                .map_err(|error| Stopped { sent, error })?;
                if n == 0 {
                    let error = io::Error::new(io::ErrorKind::WriteZero, "connection closed while writing");
                    return Err(Stopped { sent, error });
                }
                left -= n;
                sent += n;
            }
        }
        Ok(())
    }
}
