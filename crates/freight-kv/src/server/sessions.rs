//! The server's clients: their sessions (opened by a hello on the control plane, ended
//! by a goodbye, by a sweep that finds their agent gone, or when they cannot be
//! answered), who sent a data-plane request, and [`Shared`], what the control plane and
//! the data-plane worker share.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use freight_core::{Agent, Error, Result};
use parking_lot::Mutex;

use crate::index::Index;
use crate::pool::Slot;
use crate::pool_memory::PoolMemory;
use crate::wire;

/// A client's session.
struct Session {
    /// Numbers sessions in the logs.
    id: u64,
    /// What Refresh and Goodbye must present: ids are sequential, so anyone could name
    /// another client's.
    token: [u8; 16],
    /// The client's agent instance: another agent of the same name is another client.
    agent_id: u64,
    /// The token the client's agent requires, as its hello named it.
    agent_token: Vec<u8>,
}

/// Clients that said hello, by their agent's name.
#[derive(Default)]
pub(crate) struct Clients {
    by_name: HashMap<String, Session>,
    next_id: u64,
}

impl Clients {
    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }

    fn add(&mut self, name: String, agent_id: u64, agent_token: Vec<u8>) -> (u64, [u8; 16]) {
        self.next_id += 1;
        let token = rand::random();
        self.by_name.insert(name, Session { id: self.next_id, token, agent_id, agent_token });
        (self.next_id, token)
    }

    /// Whose session a data-plane request of `name`'s agent with `token` belongs to.
    pub(crate) fn sender(&self, name: &str, token: &wire::SessionToken) -> Sender {
        match self.by_name.get(name) {
            None => Sender::NoSession,
            Some(s) if freight_core::same_secret(&s.token, token) => Sender::Session(s.id),
            Some(_) => Sender::Impostor,
        }
    }

    /// The name of the session with this id and token.
    pub(crate) fn find(&self, id: u64, token: &[u8]) -> Option<String> {
        self.by_name
            .iter()
            .find(|(_, s)| s.id == id && freight_core::same_secret(&s.token, token))
            .map(|(name, _)| name.clone())
    }
}

/// Who sent a data-plane request, as its token shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sender {
    /// The agent it names has no session: it never said hello, or its session ended.
    NoSession,
    /// Not the session's token: another agent, under that session's agent's name.
    Impostor,
    /// The session with this id.
    Session(u64),
}

/// A session that [`Shared::hello`] opened.
pub(crate) struct Opened {
    pub(crate) id: u64,
    pub(crate) token: [u8; 16],
    pub(crate) agent: String,
    /// The transport the server's agent reaches the client's by: a client reached over
    /// tcp is offered direct connections.
    pub(crate) transport: freight_core::TransportKind,
}

/// What the control plane and the worker share.
pub(crate) struct Shared {
    pub(crate) agent: Arc<Agent>,
    pub(super) pool: PoolMemory,
    pub(crate) index: Mutex<Index>,
    pub(crate) clients: Mutex<Clients>,
    pub(super) started: Instant,
    pub(super) stop: AtomicBool,
    /// The direct connections open, by session.
    pub(crate) direct: super::direct::Connections,
    /// Where clients reach direct connections (none: not offered).
    pub(crate) direct_addresses: Vec<String>,
}

impl Shared {
    pub(crate) fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    pub(crate) fn pool_bytes(&self) -> u64 {
        self.pool.len() as u64
    }

    /// Opens a session for the agent whose metadata this is, and connects to it with
    /// the token it requires. Blocks for as long as connecting takes (the engine's
    /// connect timeout at most).
    pub(crate) fn hello(&self, metadata: &[u8], agent_token: &[u8]) -> Result<Opened> {
        let md = freight_proto::metadata::AgentMetadata::decode(metadata)?;
        if agent_token.is_empty() {
            return Err(Error::InvalidArgument(
                "the client's hello names no token for its agent (a client older than this server, whose \
                 data-plane agents each require one): use the same freight release on both sides"
                    .into(),
            ));
        }
        let name = md.name;
        let (id, token) = {
            // Peers change only under this lock, so that a sweep of dead clients cannot
            // remove the peer that this session is about to take (see
            // `drop_dead_clients`).
            let mut clients = self.clients.lock();
            if let Some(live) = clients.by_name.get(&name) {
                if live.agent_id != md.agent_id && self.agent.check_peer(&name).is_ok() {
                    return Err(Error::InvalidArgument(format!(
                        "agent {name} already has a live session with this server, as another instance of that \
                         name: each client's agent needs a name of its own"
                    )));
                }
            }
            self.agent.add_peer_with_token(metadata, Some(agent_token))?;
            if let Some(old) = clients.by_name.get(&name) {
                self.direct.close_session(old.id);
            }
            // The same agent saying hello again (a reconnect): its old session ends. Its
            // reservations stay with the transfers that fill them: the worker commits or
            // aborts each when its transfer settles (freeing one sooner could let another
            // value take the slot while the old copy still writes into it).
            clients.add(name.clone(), md.agent_id, agent_token.to_vec())
        };
        // Connected here rather than by the data-plane worker at its first reply or
        // transfer, which would hold up every other client meanwhile; a client the
        // server cannot reach learns it now instead of at its first request's timeout.
        let connected = self.agent.notify(&name, wire::WELCOME.to_vec()).and_then(|()| self.agent.open_path(&name));
        let path = match connected {
            Ok(path) => path,
            Err(e) => {
                self.end_session(&name, id, "unreachable");
                return Err(Error::PeerDisconnected {
                    peer: name,
                    reason: format!(
                        "the KV server cannot reach this client's engine agent at {}: {e}",
                        md.addresses.join(", ")
                    ),
                });
            }
        };
        tracing::info!(client = id, agent = %name, transport = ?path.transport, "client connected");
        Ok(Opened { id, token, agent: name, transport: path.transport })
    }

    /// Takes a client's new metadata (it registered more memory).
    pub(crate) fn refresh(&self, client: u64, token: &[u8], metadata: &[u8]) -> Result<()> {
        let md = freight_proto::metadata::AgentMetadata::decode(metadata)?;
        let clients = self.clients.lock();
        // The session first: metadata of an agent without one is not taken as a peer.
        let owner = clients.find(client, token);
        let session = clients.by_name.get(&md.name).filter(|s| s.agent_id == md.agent_id);
        match session {
            Some(session) if owner.as_deref() == Some(md.name.as_str()) => {
                self.agent.add_peer_with_token(metadata, Some(&session.agent_token)).map(|_| ())
            }
            _ => Err(Error::InvalidArgument(format!(
                "client {client} has no session with this server for agent {} and this token",
                md.name
            ))),
        }
    }

    /// Ends the session with this id and token (nothing happens if there is none).
    pub(crate) fn goodbye(&self, client: u64, token: &[u8]) {
        let name = self.clients.lock().find(client, token);
        match name {
            Some(name) => self.end_session(&name, client, "said goodbye"),
            None => tracing::debug!(client, "a goodbye for no session of this id and token"),
        }
    }

    /// Ends the session of `name`'s agent, whichever it is (tests).
    #[cfg(test)]
    pub(crate) fn end_session_of(&self, name: &str, why: &str) {
        let id = self.clients.lock().by_name.get(name).map(|s| s.id);
        if let Some(id) = id {
            self.end_session(name, id, why);
        }
    }

    /// Ends session `id` of `name`'s agent, unless another has replaced it. Its PUTs
    /// still in flight end with their transfers (see `hello`).
    pub(crate) fn end_session(&self, name: &str, id: u64, why: &str) {
        let mut clients = self.clients.lock();
        if clients.by_name.get(name).is_some_and(|s| s.id == id) {
            clients.by_name.remove(name);
            // Its connections to this server go too: the client learns now that it
            // needs a new session, instead of when a request goes unanswered.
            self.agent.disconnect_peer(name);
            self.direct.close_session(id);
            tracing::info!(client = id, agent = %name, why, "client gone");
        }
    }

    /// Drops clients whose agent stopped answering.
    pub(super) fn drop_dead_clients(&self) {
        let dead = self.dead_sessions();
        self.drop_if_still_dead(&dead);
    }

    /// Sessions whose agent's connection broke: `(agent, session id)`.
    fn dead_sessions(&self) -> Vec<(String, u64)> {
        let clients = self.clients.lock();
        clients
            .by_name
            .iter()
            .filter(|(name, _)| self.agent.check_peer(name).is_err())
            .map(|(name, s)| (name.clone(), s.id))
            .collect()
    }

    /// Ends each of `dead` that still is: a client that said hello again since has a new
    /// session and a new peer, both of which stay.
    fn drop_if_still_dead(&self, dead: &[(String, u64)]) {
        let mut clients = self.clients.lock();
        for (name, id) in dead {
            let same = clients.by_name.get(name).is_some_and(|s| s.id == *id);
            if same && self.agent.check_peer(name).is_err() {
                clients.by_name.remove(name);
                self.agent.disconnect_peer(name);
                self.direct.close_session(*id);
                tracing::info!(client = id, agent = %name, why = "connection lost", "client gone");
            }
        }
    }

    pub(super) fn pool_desc(&self, slot: Slot) -> freight_core::Desc {
        freight_core::Desc { addr: self.pool.addr() + slot.offset, len: slot.len, dev: 0 }
    }

    /// A slot's bytes.
    ///
    /// # Safety
    /// Nothing writes the slot while the slice lives: the caller holds its read pin.
    pub(super) unsafe fn pool_slice(&self, slot: Slot) -> &[u8] {
        assert!(slot.offset + slot.len <= self.pool.len() as u64, "a slot past the pool");
        std::slice::from_raw_parts((self.pool.addr() + slot.offset) as *const u8, slot.len as usize)
    }

    /// A slot's bytes, to fill.
    ///
    /// # Safety
    /// The slot is reserved for the caller alone, and nothing reads it while the slice
    /// lives (a reservation is read only once committed).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn pool_slice_mut(&self, slot: Slot) -> &mut [u8] {
        assert!(slot.offset + slot.len <= self.pool.len() as u64, "a slot past the pool");
        std::slice::from_raw_parts_mut((self.pool.addr() + slot.offset) as *mut u8, slot.len as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{agent, sessions, test_config, test_server as server, UNCHECKED};
    use super::super::{Server, ServerConfig};
    use super::*;
    use freight_core::AgentConfig;
    use std::time::Duration;

    #[test]
    fn a_hello_that_names_no_agent_token_opens_no_session() {
        let s = server();
        let client = agent(&format!("tokenless-{}", rand::random::<u32>()));
        let e = s.shared.hello(&client.metadata(), b"").err().unwrap();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("no token for its agent")), "{e}");
        assert_eq!(sessions(&s), 0);
    }

    #[test]
    fn a_sweep_keeps_a_client_that_said_hello_again_meanwhile() {
        let s = server();
        let client = agent(&format!("sweep-{}", rand::random::<u32>()));
        let first = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        // Its connection breaks: the sweep finds it dead...
        s.shared.agent.remove_peer(&first.agent).unwrap();
        let dead = s.shared.dead_sessions();
        assert_eq!(dead, vec![(first.agent.clone(), first.id)]);
        // ...but before it ends the session, the client says hello again.
        let second = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        s.shared.drop_if_still_dead(&dead);
        assert_eq!(sessions(&s), 1, "the new session stays");
        assert!(s.shared.agent.check_peer(&second.agent).is_ok(), "and so does its peer");
        assert!(s.shared.clients.lock().find(second.id, &second.token).is_some());
        // A session that is still dead when the sweep ends it goes.
        s.shared.agent.remove_peer(&second.agent).unwrap();
        s.shared.drop_dead_clients();
        assert_eq!(sessions(&s), 0);
    }

    #[test]
    fn only_the_session_token_ends_or_refreshes_a_session() {
        let s = server();
        let client = agent(&format!("token-{}", rand::random::<u32>()));
        let opened = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        let wrong = [0u8; 16];
        s.shared.goodbye(opened.id, &wrong);
        assert_eq!(sessions(&s), 1, "a goodbye with another token ends nothing");
        let e = s.shared.refresh(opened.id, &wrong, &client.metadata()).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("no session")), "{e}");
        s.shared.refresh(opened.id, &opened.token, &client.metadata()).unwrap();
        s.shared.goodbye(opened.id, &opened.token);
        assert_eq!(sessions(&s), 0);
        assert!(s.shared.agent.check_peer(&opened.agent).is_err(), "its peer is gone too");
    }

    #[test]
    fn another_agent_of_a_live_sessions_name_is_refused() {
        let s = server();
        let name = format!("twin-{}", rand::random::<u32>());
        let (one, other) = (agent(&name), agent(&name));
        let first = s.shared.hello(&one.metadata(), UNCHECKED).unwrap();
        let e = s.shared.hello(&other.metadata(), UNCHECKED).err().unwrap();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("already has a live session")), "{e}");
        assert!(s.shared.clients.lock().find(first.id, &first.token).is_some(), "the live session stays");
        // The same agent again is a reconnect; and once the first is gone, the name is free.
        let again = s.shared.hello(&one.metadata(), UNCHECKED).unwrap();
        s.shared.agent.remove_peer(&again.agent).unwrap();
        s.shared.hello(&other.metadata(), UNCHECKED).unwrap();
        assert_eq!(sessions(&s), 1);
    }

    /// The worker moves every client's data: a dial it made at a client's first
    /// transfer would hold up every other client while it lasts.
    #[test]
    fn hello_opens_the_data_path_so_the_worker_dials_nothing() {
        let engine = AgentConfig { require: Some(freight_core::TransportKind::Tcp), ..Default::default() };
        let config = ServerConfig { engine: engine.clone(), ..test_config() };
        let s = Server::start(config).unwrap();
        let client = Agent::new(&format!("dialled-{}", rand::random::<u32>()), engine).unwrap();
        let opened = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        let stats = s.shared.agent.connection_stats(&opened.agent).unwrap();
        assert_eq!((stats.control_connections, stats.tcp_connections), (1, 1), "{stats:?}");
    }

    #[test]
    fn a_client_the_server_cannot_reach_is_told_at_hello() {
        let s = server();
        let gone = agent(&format!("gone-{}", rand::random::<u32>()));
        let metadata = gone.metadata();
        gone.close();
        let started = Instant::now();
        let e = s.shared.hello(&metadata, UNCHECKED).err().unwrap();
        assert!(matches!(&e, Error::PeerDisconnected { reason, .. } if reason.contains("cannot reach")), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(sessions(&s), 0, "no session is left behind");
    }
}
