//! Where a data plane's engine listens, and whom it lets in.
//!
//! Where: the server moves every value with one-sided transfers, so its agent dials
//! the client's and the client's dials the server's: an agent left on the default
//! loopback listener is unreachable for a peer on another host. An agent that talks to
//! (or is reached through) a non-loopback address listens on every interface instead,
//! unless its configuration chose a listener (one equal to the default counts as not
//! chosen).
//!
//! Whom: the two sides hand each other their agents' metadata over the control plane
//! (in `Hello`), which authenticates with the server's token where it has one. So the
//! agents never answer metadata requests on their listeners (which anyone who reaches
//! them could make, and whose answer holds the secret that opens every connection).
//! Each agent also requires a token of its own on every connection, a random one that
//! only the other side learns, in that same `Hello`: a process that reaches a client's
//! listener gets nothing from it, whether or not the server has a token, and neither
//! does another client of the same server.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use freight_core::AgentConfig;

/// Every interface, any port.
const EVERYWHERE: &str = "0.0.0.0:0";

/// The configuration of a data plane's agent: `engine` with a listener that peers on
/// other hosts can reach where they may come, no metadata on its listener, and a fresh
/// random token (see [`agent_token`]) required on every connection, in place of any
/// token the engine's configuration had.
pub fn data_plane(engine: AgentConfig, other_hosts: bool) -> AgentConfig {
    AgentConfig { serve_metadata: false, token: Some(agent_token()), ..open_to_other_hosts(engine, other_hosts) }
}

/// A random token for one data-plane agent: 32 random bytes, as hex (printable, so
/// that it reads plainly in a debugger and travels in any field).
fn agent_token() -> Vec<u8> {
    rand::random::<[u8; 32]>().iter().map(|b| format!("{b:02x}")).collect::<String>().into_bytes()
}

/// `engine` with a listener that peers on other hosts can reach, where they may come.
fn open_to_other_hosts(mut engine: AgentConfig, other_hosts: bool) -> AgentConfig {
    let chosen = engine.listen != AgentConfig::default().listen;
    if other_hosts && !chosen {
        engine.listen = EVERYWHERE.into();
    }
    engine
}

/// Whether a peer at `host` may be on another host (a name that does not resolve may).
pub fn beyond_loopback(host: Option<IpAddr>) -> bool {
    !matches!(host, Some(ip) if ip.is_loopback())
}

/// The address a control-plane URL ("http://10.0.0.2:50051") names, if it resolves.
pub fn url_host(url: &str) -> Option<IpAddr> {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest).split('/').next()?;
    if let Ok(a) = authority.parse::<SocketAddr>() {
        return Some(a.ip());
    }
    authority.to_socket_addrs().ok()?.next().map(|a| a.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_default_listener_facing_another_host_opens_up() {
        let default = AgentConfig::default();
        let remote = url_host("http://10.0.0.2:50051");
        assert_eq!(remote, Some("10.0.0.2".parse().unwrap()));
        assert!(beyond_loopback(remote));
        assert!(!beyond_loopback(url_host("http://[::1]:50051")));
        assert!(!beyond_loopback(url_host("https://localhost:50051/")));
        assert!(beyond_loopback(None));
        assert_eq!(open_to_other_hosts(default.clone(), true).listen, EVERYWHERE);
        assert_eq!(open_to_other_hosts(default.clone(), false).listen, default.listen);
        let chosen = AgentConfig { listen: "10.0.0.1:7000".into(), ..AgentConfig::default() };
        assert_eq!(open_to_other_hosts(chosen, true).listen, "10.0.0.1:7000");
    }

    #[test]
    fn a_data_plane_agent_serves_no_metadata_and_requires_a_token_of_its_own() {
        let own = AgentConfig { token: Some(b"engine's own".to_vec()), ..AgentConfig::default() };
        let first = data_plane(own.clone(), false);
        let second = data_plane(own, true);
        for plane in [&first, &second] {
            assert!(!plane.serve_metadata);
            let token = plane.token.as_deref().expect("a data-plane agent has a token");
            assert_eq!(token.len(), 64);
            assert!(token.iter().all(u8::is_ascii_hexdigit), "{token:?}");
        }
        assert_ne!(first.token, second.token, "each agent has a token of its own");
        assert_eq!(second.listen, EVERYWHERE);
    }
}
