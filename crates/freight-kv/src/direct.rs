//! The direct connection: how a client that the server reaches over tcp sends its
//! GETs and PUTs, and takes its values, on one socket of its own to the server.
//!
//! Over tcp, a request that travels as an engine notification and a value that travels
//! as an engine transfer each pass through the engines' sending and receiving threads:
//! a small value paid for four thread wake-ups on top of the socket's own, and at 4 KiB
//! that made the server a third as fast as Redis. On the direct connection the client's
//! own thread writes the request and reads the answer, and the server answers on a
//! thread of that connection: a GET is one write and one read on each side, as for any
//! key-value server. Values still cross once: the server sends them from the pool
//! (large ones without a copy, see [`freight_core::transport::zerocopy`]) and the
//! client reads them into its receive buffer; a PUT's value goes from the client's
//! buffer into the slot the server reserved for it. Clients on the server's host keep
//! using shared memory through the engine, which copies less still.
//!
//! The server offers the connection in its hello answer (`HelloReply.direct_addresses`)
//! to a client it reaches over tcp, and only to a session: the client opens it with
//! [`Open`], its session's id and secret, which the server checks before it reads
//! anything else; a session's end closes its direct connections. Then, in turns:
//!
//! ```text
//!  client -> server   u32 LE length, a wire::Request of that many bytes
//!                     PUT: each item's value bytes (its buffer's length), in order
//!  server -> client   u32 LE length, a wire::Reply of that many bytes
//!                     GET: each found value's bytes (Outcome::Found's length), in order
//! ```
//!
//! A request and a reply each fit [`MAX_NOTIF`] as on the engine path (the same
//! batches). The items' buffers still name the client's receive buffer: a GET's value
//! belongs where the engine would have written it (the client reads it there), a PUT's
//! value is read from there; the server never addresses that memory.

use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use freight_core::{interrupt, Error, Result};
use freight_proto::frame::MAX_NOTIF;

use crate::wire::{Reply, SessionToken, VERSION};

/// The first bytes a client sends on a direct connection.
pub const OPEN_MAGIC: [u8; 4] = *b"fkvd";

/// The opening of a direct connection: the session it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    pub client_id: u64,
    pub session_token: SessionToken,
}

/// [`Open`]'s size on the wire: magic, version, id, token.
pub const OPEN_LEN: usize = OPEN_MAGIC.len() + 1 + 8 + 16;

/// The server's answer to an [`Open`]: this byte, then (when refused) a u16 LE length
/// and that many bytes of UTF-8 saying why.
pub const ACCEPTED: u8 = 0;
pub const REFUSED: u8 = 1;

impl Open {
    pub fn encode(&self) -> [u8; OPEN_LEN] {
        let mut out = [0u8; OPEN_LEN];
        out[..4].copy_from_slice(&OPEN_MAGIC);
        out[4] = VERSION;
        out[5..13].copy_from_slice(&self.client_id.to_le_bytes());
        out[13..].copy_from_slice(&self.session_token);
        out
    }

    /// The session an opening names, or why it is none.
    pub fn decode(bytes: &[u8; OPEN_LEN]) -> Result<Open, String> {
        if bytes[..4] != OPEN_MAGIC {
            return Err("not a freight KV direct connection".into());
        }
        if bytes[4] != VERSION {
            return Err(format!(
                "the client speaks KV data-plane protocol version {} and this server version {VERSION}",
                bytes[4]
            ));
        }
        let client_id = u64::from_le_bytes(bytes[5..13].try_into().expect("8 bytes"));
        let session_token = bytes[13..].try_into().expect("16 bytes");
        Ok(Open { client_id, session_token })
    }
}

/// A message's length prefix.
pub fn length_prefix(len: usize) -> [u8; 4] {
    debug_assert!(len <= MAX_NOTIF);
    (len as u32).to_le_bytes()
}

/// The length a prefix declares, refused past [`MAX_NOTIF`] before anything is
/// allocated for it.
pub fn declared_len(prefix: [u8; 4]) -> Result<usize, String> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len == 0 || len > MAX_NOTIF {
        return Err(format!("a message of {len} bytes (1 to {MAX_NOTIF})"));
    }
    Ok(len)
}

/// A client's end of a direct connection.
pub(crate) struct Link {
    /// Written to; read through `reader`, so that a reply and a small value take one
    /// system call.
    sock: TcpStream,
    reader: io::BufReader<TcpStream>,
    peer: String,
}

/// What one read of a client's connection may take in: a reply and a small value.
/// Larger values are read straight into the receive buffer; a buffer as large as they
/// are would take them in first and copy them again, undoing the one-copy send.
const READ_BUFFER: usize = 8 << 10;

impl Link {
    /// Connects to the first of `addresses` that answers and opens the connection for
    /// a session; writes wait at most `write_timeout`.
    pub(crate) fn open(addresses: &[String], open: &Open, deadline: Instant, write_timeout: Duration) -> Result<Link> {
        let mut last = Error::InvalidArgument("the server offered no address for direct connections".into());
        for peer in addresses {
            match Self::open_one(peer, open, deadline, write_timeout) {
                Ok(link) => return Ok(link),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn open_one(peer: &str, open: &Open, deadline: Instant, write_timeout: Duration) -> Result<Link> {
        let addr: SocketAddr = peer
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Protocol(format!("the server offered {peer:?} for direct connections")))?;
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let sock = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5)))
            .map_err(|e| Error::Io(format!("cannot open a direct connection to the KV server at {peer}: {e}")))?;
        sock.set_nodelay(true)?;
        // Reads wake up this often to look at the deadline and the interrupt check.
        sock.set_read_timeout(Some(interrupt::SLICE))?;
        sock.set_write_timeout(Some(write_timeout.max(Duration::from_millis(1))))?;
        let reader = io::BufReader::with_capacity(READ_BUFFER, sock.try_clone()?);
        let mut link = Link { sock, reader, peer: peer.to_string() };
        link.write(&mut [IoSlice::new(&open.encode())])?;
        let mut answer = [0u8; 1];
        link.read(&mut answer, deadline)?;
        if answer[0] != ACCEPTED {
            let mut len = [0u8; 2];
            link.read(&mut len, deadline)?;
            let mut why = vec![0u8; u16::from_le_bytes(len) as usize];
            link.read(&mut why, deadline)?;
            return Err(Error::Auth(format!(
                "the KV server at {peer} refused a direct connection: {}",
                String::from_utf8_lossy(&why)
            )));
        }
        Ok(link)
    }

    /// Writes a request: its length, its bytes, and (a PUT) the values that follow.
    pub(crate) fn send(&mut self, request: &[u8], values: &[&[u8]]) -> Result<()> {
        let prefix = length_prefix(request.len());
        let mut slices = Vec::with_capacity(2 + values.len());
        slices.push(IoSlice::new(&prefix));
        slices.push(IoSlice::new(request));
        slices.extend(values.iter().map(|v| IoSlice::new(v)));
        self.write(&mut slices)
    }

    /// Reads a reply (its values, if any, follow: [`Link::read`] them).
    pub(crate) fn receive(&mut self, deadline: Instant) -> Result<Reply> {
        let mut prefix = [0u8; 4];
        self.read(&mut prefix, deadline)?;
        let len = declared_len(prefix).map_err(|e| Error::Protocol(format!("the KV server sent {e}")))?;
        let mut body = vec![0u8; len];
        self.read(&mut body, deadline)?;
        match Reply::decode(&body) {
            Some(reply) => reply,
            None => Err(Error::Protocol("the KV server sent something that is no KV reply".into())),
        }
    }

    fn write(&mut self, slices: &mut [IoSlice<'_>]) -> Result<()> {
        freight_core::frame_io::write_all_vectored(&mut self.sock, slices).map_err(|e| self.failed(e))
    }

    /// Fills `into`, by `deadline`, looking at the interrupt check in between.
    pub(crate) fn read(&mut self, into: &mut [u8], deadline: Instant) -> Result<()> {
        let mut got = 0;
        while got < into.len() {
            // A large value, once what was read ahead is used: straight from the socket,
            // in as few wake-ups as its arrival allows.
            let whole = self.reader.buffer().is_empty() && into.len() - got >= READ_BUFFER;
            let read = if whole { recv_all(&self.sock, &mut into[got..]) } else { self.reader.read(&mut into[got..]) };
            match read {
                Ok(0) => {
                    return Err(Error::PeerDisconnected {
                        peer: self.peer.clone(),
                        reason: "the KV server closed the direct connection".into(),
                    })
                }
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout(format!("no answer from the KV server at {}", self.peer)));
                    }
                    interrupt::check()?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed(e)),
            }
        }
        Ok(())
    }

    fn failed(&self, e: io::Error) -> Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                Error::Timeout(format!("the KV server at {} takes no more bytes", self.peer))
            }
            _ => Error::PeerDisconnected { peer: self.peer.clone(), reason: format!("direct connection: {e}") },
        }
    }
}

/// One `recv` that waits for all of `into` (`MSG_WAITALL`): a value that arrives in
/// pieces wakes the reader once, not once per piece. It still returns early on the
/// socket's read timeout, a signal or the stream's end, with what it has.
fn recv_all(sock: &TcpStream, into: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `into` is writable for its length; the descriptor is the caller's socket.
    let n = unsafe { libc::recv(sock.as_raw_fd(), into.as_mut_ptr().cast(), into.len(), libc::MSG_WAITALL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_opening_names_its_session_and_is_read_back() {
        let open = Open { client_id: 7, session_token: [9; 16] };
        assert_eq!(Open::decode(&open.encode()), Ok(open));
    }

    #[test]
    fn another_protocol_or_version_is_refused_by_name() {
        let mut bytes = Open { client_id: 1, session_token: [0; 16] }.encode();
        bytes[4] = VERSION + 1;
        assert!(Open::decode(&bytes).unwrap_err().contains("version"));
        bytes[0] = b'G';
        assert!(Open::decode(&bytes).unwrap_err().contains("not a freight KV"));
    }

    #[test]
    fn lengths_past_the_limit_or_empty_are_refused() {
        assert_eq!(declared_len(length_prefix(MAX_NOTIF)), Ok(MAX_NOTIF));
        assert!(declared_len((MAX_NOTIF as u32 + 1).to_le_bytes()).is_err());
        assert!(declared_len([0; 4]).is_err());
        assert!(declared_len([0xff; 4]).is_err());
    }

    proptest! {
        #[test]
        fn any_opening_bytes_decode_or_are_refused_without_panicking(bytes in proptest::array::uniform29(any::<u8>())) {
            if let Ok(open) = Open::decode(&bytes) {
                prop_assert_eq!(open.encode(), bytes);
            }
        }
    }
}
