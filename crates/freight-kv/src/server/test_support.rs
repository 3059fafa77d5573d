//! What the server's unit tests share: a server on a free loopback port, agents that
//! stand in for clients.

use freight_core::{Agent, AgentConfig, Result};

use super::{Server, ServerConfig};

/// A server on a free loopback port with 1 MiB of memory.
pub(crate) fn test_server() -> Server {
    Server::start(test_config()).unwrap()
}

pub(crate) fn test_config() -> ServerConfig {
    ServerConfig { listen: "127.0.0.1:0".into(), memory_bytes: 1 << 20, ..Default::default() }
}

/// An engine agent standing in for a client.
pub(crate) fn agent(name: &str) -> Agent {
    Agent::new(name, AgentConfig::default()).unwrap()
}

/// The agent token these tests' hellos name: their agents require none, and an agent
/// without a token ignores the one presented.
pub(crate) const UNCHECKED: &[u8] = b"unchecked";

/// `client` takes the server's agent as a peer, with the token that agent requires (a
/// client learns it in its hello).
pub(crate) fn dial_server(client: &Agent, s: &Server) -> Result<String> {
    client.add_peer_with_token(&s.shared.agent.metadata(), s.shared.agent.config().token.as_deref())
}

/// How many sessions the server has.
pub(crate) fn sessions(s: &Server) -> usize {
    s.shared.clients.lock().len()
}
