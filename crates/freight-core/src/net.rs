//! Opening authenticated connections to a peer's listener.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, Type};

use crate::error::{Error, Result};
use crate::wire::{self, Frame, Role, PROTOCOL_VERSION};

/// Who is calling and whom they expect to reach.
#[derive(Debug, Clone)]
pub struct Introduction {
    pub from_name: String,
    pub from_id: u64,
    pub target_id: u64,
    pub token: Vec<u8>,
}

/// Connects to the first reachable address, introduces itself, and waits for a welcome.
pub fn dial(
    addrs: &[String],
    bind: Option<IpAddr>,
    role: Role,
    intro: &Introduction,
    timeout: Duration,
) -> Result<TcpStream> {
    let mut last = Error::TransportUnavailable("the peer advertises no address".into());
    for a in addrs {
        let addr: SocketAddr = match a.parse() {
            Ok(x) => x,
            Err(_) => {
                last = Error::Metadata(format!("bad address '{a}'"));
                continue;
            }
        };
        match dial_one(addr, bind, role, intro, timeout) {
            Ok(s) => return Ok(s),
            // A refusal is an answer, not a reason to try elsewhere.
            Err(e @ (Error::Auth(_) | Error::Protocol(_))) => return Err(e),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn dial_one(
    addr: SocketAddr,
    bind: Option<IpAddr>,
    role: Role,
    intro: &Introduction,
    timeout: Duration,
) -> Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if let Some(ip) = bind {
        socket
            .bind(&SocketAddr::new(ip, 0).into())
            .map_err(|e| Error::Io(format!("cannot bind local address {ip}: {e}")))?;
    }
    socket.connect_timeout(&addr.into(), timeout).map_err(|e| Error::Io(format!("cannot connect to {addr}: {e}")))?;
    let mut stream: TcpStream = socket.into();
    tune(&stream)?;
    stream.set_read_timeout(Some(timeout))?;
    let hello = Frame::Hello {
        version: PROTOCOL_VERSION,
        role,
        from_name: intro.from_name.clone(),
        from_id: intro.from_id,
        target_id: intro.target_id,
        token: intro.token.clone(),
    };
    stream.write_all(&wire::encode(&hello))?;
    match wire::read_frame(&mut stream) {
        Ok(Some(Frame::Welcome { .. })) => {}
        Ok(Some(Frame::Refused { reason })) => {
            return Err(Error::Auth(format!("{addr} refused the connection: {reason}")))
        }
        Ok(Some(other)) => return Err(Error::Protocol(format!("expected a welcome, got {other:?}"))),
        Ok(None) => return Err(Error::Io(format!("{addr} closed the connection during the handshake"))),
        Err(Error::Timeout(_)) => {
            return Err(Error::Timeout(format!("{addr} did not answer the handshake within {timeout:?}")))
        }
        Err(e) => return Err(e),
    }
    stream.set_read_timeout(None)?;
    Ok(stream)
}

/// Asks the listener at `addr` for its agent's metadata (listener exchange).
pub fn fetch_metadata(addr: &str, token: &[u8], timeout: Duration) -> Result<Vec<u8>> {
    let sa: SocketAddr =
        addr.parse().map_err(|_| Error::InvalidArgument(format!("'{addr}' is not an ip:port address")))?;
    let mut stream =
        TcpStream::connect_timeout(&sa, timeout).map_err(|e| Error::Io(format!("cannot connect to {addr}: {e}")))?;
    stream.set_read_timeout(Some(timeout))?;
    let hello = Frame::Hello {
        version: PROTOCOL_VERSION,
        role: Role::Metadata,
        from_name: String::new(),
        from_id: 0,
        target_id: 0,
        token: token.to_vec(),
    };
    stream.write_all(&wire::encode(&hello))?;
    match wire::read_frame(&mut stream)? {
        Some(Frame::Metadata { bytes }) => Ok(bytes),
        Some(Frame::Refused { reason }) => Err(Error::Auth(format!("{addr} refused the metadata request: {reason}"))),
        Some(other) => Err(Error::Protocol(format!("expected metadata, got {other:?}"))),
        None => Err(Error::Io(format!("{addr} closed the connection without answering"))),
    }
}

/// Small messages must not wait for Nagle; keepalive notices peers that vanish silently.
pub fn tune(stream: &TcpStream) -> Result<()> {
    stream.set_nodelay(true)?;
    let s = SockRef::from(stream);
    s.set_keepalive(true)?;
    Ok(())
}

/// Constant-time comparison, so that a secret cannot be guessed byte by byte.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
