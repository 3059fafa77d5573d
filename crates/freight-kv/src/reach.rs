//! Where a data plane's engine listens. The server moves every value with one-sided
//! transfers, so its agent dials the client's and the client's dials the server's: an
//! agent left on the default loopback listener is unreachable for a peer on another
//! host. An agent that talks to (or is reached through) a non-loopback address listens
//! on every interface instead, unless its configuration chose a listener (one equal to
//! the default counts as not chosen).

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use freight_core::AgentConfig;

/// Every interface, any port.
const EVERYWHERE: &str = "0.0.0.0:0";

/// `engine` with a listener that peers on other hosts can reach, where they may come.
pub fn open_to_other_hosts(mut engine: AgentConfig, other_hosts: bool) -> AgentConfig {
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
}
