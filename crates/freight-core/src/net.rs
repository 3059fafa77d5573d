//! Opening authenticated connections to a peer's listener.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};

use crate::frame_io;
use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Role};
use freight_proto::hello;
pub use freight_proto::hello::Introduction;

/// The order in which data stream `index` tries the peer's addresses. Streams bound to
/// a local address (one per NIC) try first the peer address that shares the longest
/// prefix with it, the one on the same link when each NIC has a subnet of its own; the
/// others spread over the peer's addresses in turn.
pub fn dial_order(addrs: &[String], index: usize, bind: Option<IpAddr>) -> Vec<String> {
    let mut order = addrs.to_vec();
    let n = order.len();
    if n > 0 {
        order.rotate_left(index % n);
    }
    if let Some(local) = bind {
        let shared = |a: &String| a.parse::<SocketAddr>().ok().map_or(0, |peer| common_prefix_bits(local, peer.ip()));
        // Stable: among equally close addresses the rotation above still spreads streams.
        order.sort_by_key(|a| std::cmp::Reverse(shared(a)));
    }
    order
}

fn common_prefix_bits(a: IpAddr, b: IpAddr) -> u32 {
    match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a) ^ u32::from(b)).leading_zeros(),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a) ^ u128::from(b)).leading_zeros(),
        _ => 0,
    }
}

/// Connects to the first reachable address, introduces itself, and waits for a welcome
/// (each within `timeout`); `peer_timeout` sets how soon a silent peer is noticed ([`tune`]).
pub fn dial(
    addrs: &[String],
    bind: Option<IpAddr>,
    role: Role,
    intro: &Introduction,
    timeout: Duration,
    peer_timeout: Duration,
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
        match dial_one(addr, bind, role, intro, timeout, peer_timeout) {
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
    peer_timeout: Duration,
) -> Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if let Some(ip) = bind {
        socket
            .bind(&SocketAddr::new(ip, 0).into())
            .map_err(|e| Error::Io(format!("cannot bind local address {ip}: {e}")))?;
    }
    socket.connect_timeout(&addr.into(), timeout).map_err(|e| Error::Io(format!("cannot connect to {addr}: {e}")))?;
    let mut stream: TcpStream = socket.into();
    tune(&stream, peer_timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.write_all(&frame::encode(&intro.hello(role)))?;
    let answer = match frame_io::read_frame(&mut stream) {
        Err(Error::Timeout(_)) => {
            return Err(Error::Timeout(format!("{addr} did not answer the handshake within {timeout:?}")))
        }
        answer => answer?,
    };
    hello::dialler_reads(role, answer, &addr.to_string())?;
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
    stream.write_all(&frame::encode(&Introduction::for_metadata(token).hello(Role::Metadata)))?;
    let bytes = hello::dialler_reads(Role::Metadata, frame_io::read_frame(&mut stream)?, addr)?;
    Ok(bytes.expect("a metadata request's answer is the metadata"))
}

/// Probes of a silent connection before it is given up.
const KEEPALIVE_PROBES: u32 = 3;

/// Small messages must not wait for Nagle; keepalive notices peers that vanish silently.
/// An idle connection to a host that went away without closing it (powered off, cut
/// off the network) is probed after `peer_timeout` of silence, then every fifth of that,
/// and fails after [`KEEPALIVE_PROBES`] unanswered probes: within about 1.6 peer
/// timeouts rather than the system's two hours and more. What waits on such a
/// connection (a fabric exchange's watcher, a control link) then hears of it.
pub fn tune(stream: &TcpStream, peer_timeout: Duration) -> Result<()> {
    stream.set_nodelay(true)?;
    // Linux takes at most 32767 s.
    let idle = peer_timeout.clamp(Duration::from_secs(1), Duration::from_secs(32767));
    let keepalive = TcpKeepalive::new()
        .with_time(idle)
        .with_interval((idle / 5).max(Duration::from_secs(1)))
        .with_retries(KEEPALIVE_PROBES);
    SockRef::from(stream).set_tcp_keepalive(&keepalive)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_peer_is_probed_after_the_peer_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        tune(&stream, Duration::from_secs(10)).unwrap();
        let s = SockRef::from(&stream);
        assert!(s.keepalive().unwrap() && s.tcp_nodelay().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(10));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(2));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
        // A peer timeout past what the system takes is clamped, not refused.
        tune(&stream, Duration::from_secs(1 << 40)).unwrap();
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(32767));
    }

    #[test]
    fn streams_bound_to_a_nic_dial_the_peer_address_on_its_link() {
        let peer: Vec<String> = ["10.77.1.2:7000", "10.77.0.2:7000", "10.77.2.2:7000"].map(String::from).to_vec();
        for (i, local) in ["10.77.0.1", "10.77.1.1", "10.77.2.1", "10.77.0.1"].iter().enumerate() {
            let order = dial_order(&peer, i, Some(local.parse().unwrap()));
            let want = format!("{}2:7000", &local[..local.len() - 1]);
            assert_eq!(order[0], want, "stream {i} bound to {local}: {order:?}");
            assert_eq!(order.len(), 3);
        }
        // Unbound streams take the peer's addresses in turn.
        let firsts: Vec<String> = (0..3).map(|i| dial_order(&peer, i, None).remove(0)).collect();
        assert_eq!(firsts, peer);
        assert!(dial_order(&[], 1, None).is_empty());
    }
}
