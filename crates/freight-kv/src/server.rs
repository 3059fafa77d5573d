//! The KV server: a pool of values in memory registered with a freight engine agent,
//! a gRPC control plane ([`crate::rpc`]) and a data-plane worker.
//!
//! The worker takes clients' requests from the agent's notifications and moves every
//! value itself, as one engine transfer per request: a GET writes the values from the
//! pool into the client's buffers (its reply rides on the transfer, so it arrives after
//! the bytes), a PUT reads them from the client's buffers into fresh slots and commits
//! them once the transfer is done. Clients never address the pool, so they can touch
//! no value but through a request the server carried out for them. Transfers run
//! while the worker takes more requests; [`crate::service`] decides what each request
//! pins, reserves and answers.
//!
//! The same server runs embedded in a process (tests, single-process users) and as
//! `freight serve`: [`Server::start`] is both.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use freight_core::{Agent, AgentConfig, DescList, Error, MemKind, Notification, OpKind, Request, Result, Status};
use parking_lot::Mutex;

use crate::cluster::EtcdConfig;
use crate::index::{Index, IndexConfig};
use crate::pool::Slot;
use crate::pool_memory::PoolMemory;
use crate::service::{GetPlan, PutPlan};
use crate::wire::{self, Buffer, FailCode, Outcome, Reply};

/// The control plane's default address: loopback only, unless told otherwise.
pub const DEFAULT_LISTEN: &str = "[::1]:50051";

/// How a server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// gRPC control plane address (port 0 picks a free one).
    pub listen: String,
    /// Bytes of the value pool.
    pub memory_bytes: u64,
    /// A full pool evicts least recently used values; off, it rejects writes.
    pub evict: bool,
    /// The data plane's engine agent (its own listener, transports...).
    pub engine: AgentConfig,
    /// How often expired values are swept and dead clients dropped.
    pub sweep_every: Duration,
    /// A shared secret every control-plane call must present (and so every client,
    /// before it learns how to reach the data plane).
    pub token: Option<String>,
    /// Where to serve Prometheus metrics (`GET /metrics`); none when unset.
    pub metrics_listen: Option<String>,
    /// Join a cluster: publish this server in etcd (see [`crate::cluster`]).
    pub etcd: Option<EtcdConfig>,
    /// The address clients reach the control plane at, as published in etcd: "HOST" (the
    /// port is the one listened on) or "HOST:PORT". Unset, the listen address is
    /// published, which then must name one interface (not 0.0.0.0 or ::).
    pub advertise: Option<String>,
    /// TLS on the control plane: the server's certificate chain and private key (PEM).
    /// Clients then use an `https://` URL.
    pub tls: Option<TlsIdentity>,
}

/// A server's certificate chain and private key, PEM-encoded.
#[derive(Debug, Clone)]
pub struct TlsIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: DEFAULT_LISTEN.into(),
            memory_bytes: 1 << 30,
            evict: true,
            engine: AgentConfig::default(),
            sweep_every: Duration::from_millis(100),
            token: None,
            metrics_listen: None,
            etcd: None,
            advertise: None,
            tls: None,
        }
    }
}

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
    fn find(&self, id: u64, token: &[u8]) -> Option<String> {
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
}

/// What the control plane and the worker share.
pub(crate) struct Shared {
    pub(crate) agent: Arc<Agent>,
    pool: PoolMemory,
    pub(crate) index: Mutex<Index>,
    pub(crate) clients: Mutex<Clients>,
    started: Instant,
    stop: AtomicBool,
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
        if let Err(e) = connected {
            self.end_session(&name, id, "unreachable");
            return Err(Error::PeerDisconnected {
                peer: name,
                reason: format!(
                    "the KV server cannot reach this client's engine agent at {}: {e}",
                    md.addresses.join(", ")
                ),
            });
        }
        tracing::info!(client = id, agent = %name, "client connected");
        Ok(Opened { id, token, agent: name })
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
            tracing::info!(client = id, agent = %name, why, "client gone");
        }
    }

    /// Drops clients whose agent stopped answering.
    fn drop_dead_clients(&self) {
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
                tracing::info!(client = id, agent = %name, why = "connection lost", "client gone");
            }
        }
    }

    fn pool_desc(&self, slot: Slot) -> freight_core::Desc {
        freight_core::Desc { addr: self.pool.addr() + slot.offset, len: slot.len, dev: 0 }
    }
}

/// A running server. Dropping it shuts it down.
pub struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// "https" with TLS, else "http".
    scheme: &'static str,
    metrics_addr: Option<SocketAddr>,
    runtime: Option<tokio::runtime::Runtime>,
    /// Tells the control plane and the metrics endpoint to stop.
    stop_rpc: tokio::sync::watch::Sender<bool>,
    /// This server's entry in etcd, withdrawn (its lease revoked) when it stops.
    membership: Option<freight_core::exchange::etcd::EtcdDirectory>,
    worker: Option<JoinHandle<()>>,
}

impl Server {
    /// Allocates and registers the pool, starts the data-plane worker and the gRPC
    /// control plane; returns once both accept requests.
    pub fn start(config: ServerConfig) -> Result<Server> {
        if config.memory_bytes == 0 {
            return Err(Error::InvalidArgument("the value pool needs some memory (memory_bytes is 0)".into()));
        }
        if config.token.as_deref().is_some_and(str::is_empty) {
            // A client that sends no token sends the empty one: every client would pass.
            return Err(Error::InvalidArgument(
                "an empty token lets every client in: give a non-empty one, or none (unset FREIGHT_KV_TOKEN)".into(),
            ));
        }
        let metrics_listen: Option<SocketAddr> = config
            .metrics_listen
            .as_deref()
            .map(|m| {
                m.parse().map_err(|e| Error::InvalidArgument(format!("metrics address {m:?} is not IP:PORT: {e}")))
            })
            .transpose()?;
        let listen: SocketAddr = config.listen.parse().map_err(|e| {
            Error::InvalidArgument(format!(
                "listen address {:?} is not IP:PORT ([::1]:50051 for IPv6): {e}",
                config.listen
            ))
        })?;
        if config.etcd.is_some() {
            // Checked before anything starts: what clients of the cluster will dial.
            published_authority(config.advertise.as_deref(), listen)?;
        }
        // Distinct servers of one process (tests start several) need distinct agent names.
        let name = format!("freight-kv-server-{}-{:08x}", std::process::id(), rand::random::<u32>());
        // Clients the control plane serves on other hosts must reach the data plane too.
        let engine = crate::reach::data_plane(config.engine.clone(), !listen.ip().is_loopback());
        let agent = Arc::new(Agent::new(&name, engine)?);
        let len = usize::try_from(config.memory_bytes)
            .map_err(|_| Error::InvalidArgument(format!("{} bytes of memory is too many", config.memory_bytes)))?;
        let pool = PoolMemory::allocate(len)?;
        // Private: no client can address the pool; the server moves every value itself.
        agent.register_private(MemKind::Dram, pool.addr(), config.memory_bytes, 0)?;
        let shared = Arc::new(Shared {
            agent,
            pool,
            index: Mutex::new(Index::new(IndexConfig { capacity: config.memory_bytes, evict: config.evict })),
            clients: Mutex::new(Clients::default()),
            started: Instant::now(),
            stop: AtomicBool::new(false),
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("freight-kv-rpc")
            .enable_all()
            .build()
            .map_err(|e| Error::Io(format!("cannot start the control plane's runtime: {e}")))?;
        let incoming = {
            let _in_runtime = runtime.enter();
            tonic::transport::server::TcpIncoming::bind(listen)
                .map_err(|e| Error::Io(format!("cannot listen on {listen} for the control plane: {e}")))?
                .with_nodelay(Some(true))
        };
        let addr = incoming.local_addr().map_err(|e| Error::Io(e.to_string()))?;
        let (stop_rpc, stopped) = tokio::sync::watch::channel(false);
        let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|&stop| stop).await;
        };
        let service = crate::rpc::service(shared.clone(), config.token.clone());
        let rpc_stopped = until_stopped(stopped.clone());
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &config.tls {
            let identity = tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem);
            builder = builder
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                .map_err(|e| Error::InvalidArgument(format!("the TLS certificate or key: {e}")))?;
        }
        let scheme = if config.tls.is_some() { "https" } else { "http" };
        runtime.spawn(async move {
            let served = builder.add_service(service).serve_with_incoming_shutdown(incoming, rpc_stopped).await;
            if let Err(e) = served {
                tracing::error!(error = %e, "the control plane stopped");
            }
        });
        let metrics_addr = match metrics_listen {
            None => None,
            Some(m) => {
                let listener = runtime
                    .block_on(tokio::net::TcpListener::bind(m))
                    .map_err(|e| Error::Io(format!("cannot listen on {m} for metrics: {e}")))?;
                let bound = listener.local_addr().map_err(|e| Error::Io(e.to_string()))?;
                let app = crate::metrics::router(shared.clone());
                let metrics_stopped = until_stopped(stopped.clone());
                runtime.spawn(async move {
                    if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(metrics_stopped).await {
                        tracing::error!(error = %e, "the metrics endpoint stopped");
                    }
                });
                Some(bound)
            }
        };
        // Started last: until the `Server` exists nothing would stop it, so an earlier
        // failure (a port in use, say) must not leave it running with the pool.
        let worker = {
            let shared = shared.clone();
            let sweep = config.sweep_every;
            std::thread::Builder::new()
                .name("freight-kv-worker".into())
                .spawn(move || Worker::new(shared, sweep).run())
                .map_err(|e| Error::Io(format!("cannot start the KV worker: {e}")))?
        };
        let mut server = Server {
            shared,
            addr,
            scheme,
            metrics_addr,
            runtime: Some(runtime),
            stop_rpc,
            worker: Some(worker),
            membership: None,
        };
        if let Some(etcd) = &config.etcd {
            // Published last: clients find the server only once it serves.
            let url = format!("{scheme}://{}", published_authority(config.advertise.as_deref(), addr)?);
            let directory = etcd.directory()?;
            directory.publish(server.shared.agent.name(), url.as_bytes())?;
            tracing::info!(%url, "published in etcd");
            server.membership = Some(directory);
        }
        tracing::info!(%addr, agent = %server.shared.agent.name(), pool_bytes = config.memory_bytes, evict = config.evict, cluster = config.etcd.is_some(), "KV server started");
        Ok(server)
    }

    /// The control plane's address (with the port picked, where 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address as a client's `server` setting: "http://[::1]:50051" (https with TLS).
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    /// Where Prometheus metrics are served, when they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    pub fn stats(&self) -> crate::index::Stats {
        self.shared.index.lock().stats()
    }

    /// What the control plane and the worker share, for tests that reach past the API.
    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops taking requests, lets those in flight finish, and releases everything.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        // Out of the cluster first, so that clients stop sending here.
        drop(self.membership.take());
        let _ = self.stop_rpc.send(true);
        self.shared.stop.store(true, Ordering::Release);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
        self.shared.agent.close();
        tracing::info!(addr = %self.addr, "KV server stopped");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// "HOST:PORT" of the control plane as clients of a cluster reach it: `advertise` (with
/// `bound`'s port where it names none), or `bound` itself when it is one interface's.
fn published_authority(advertise: Option<&str>, bound: SocketAddr) -> Result<String> {
    let Some(given) = advertise.map(str::trim) else {
        if bound.ip().is_unspecified() {
            return Err(Error::InvalidArgument(format!(
                "the control plane listens on {bound}, every interface, so there is no one address to publish in \
                 etcd: give the address clients reach it at (ServerConfig::advertise, --advertise HOST[:PORT])"
            )));
        }
        return Ok(bound.to_string());
    };
    let bad = |why: &str| Error::InvalidArgument(format!("advertised address {given:?}: {why} (HOST or HOST:PORT)"));
    let unspecified = |ip: std::net::IpAddr| {
        if ip.is_unspecified() {
            Err(bad("an unspecified address reaches no one"))
        } else {
            Ok(())
        }
    };
    if let Ok(a) = given.parse::<SocketAddr>() {
        unspecified(a.ip())?;
        return Ok(a.to_string());
    }
    let bare = given.strip_prefix('[').and_then(|g| g.strip_suffix(']')).unwrap_or(given);
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        unspecified(ip)?;
        return Ok(SocketAddr::new(ip, bound.port()).to_string());
    }
    let (host, port) = match given.rsplit_once(':') {
        Some((host, port)) => (host, port.parse::<u16>().map_err(|_| bad("the port is not a number"))?),
        None => (given, bound.port()),
    };
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_';
    if host.is_empty() || !host.chars().all(name_char) {
        return Err(bad("not a host name or IP address"));
    }
    Ok(format!("{host}:{port}"))
}

/// How long the worker sleeps in the notification queue when nothing is in flight;
/// a request wakes it at once.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// A request whose transfer is running.
enum InFlight {
    Get { client: Client, first_id: u64, transfer: Request, plan: GetPlan },
    Put { client: Client, first_id: u64, transfer: Request, plan: PutPlan },
}

/// The client a request came from: its agent's name and its session.
struct Client {
    agent: String,
    session: u64,
}

impl InFlight {
    fn transfer(&self) -> &Request {
        match self {
            InFlight::Get { transfer, .. } | InFlight::Put { transfer, .. } => transfer,
        }
    }
}

/// The data-plane loop: takes requests, starts their transfers, finishes them.
struct Worker {
    shared: Arc<Shared>,
    in_flight: Vec<InFlight>,
    /// Set by a transfer that settled (with a wake-up of the notification wait), so one
    /// wait covers requests and completions alike; cleared before each look at them.
    settled: Arc<AtomicBool>,
    sweep_every: Duration,
    last_sweep: Instant,
}

impl Worker {
    fn new(shared: Arc<Shared>, sweep_every: Duration) -> Worker {
        Worker {
            shared,
            in_flight: Vec::new(),
            settled: Arc::new(AtomicBool::new(false)),
            sweep_every,
            last_sweep: Instant::now(),
        }
    }

    fn run(mut self) {
        loop {
            let stopping = self.shared.stop.load(Ordering::Acquire);
            if stopping && self.in_flight.is_empty() {
                break;
            }
            let settled = &self.settled;
            let notifs =
                crate::notif_wait::next_notifs(&self.shared.agent, IDLE_WAIT, || settled.load(Ordering::Acquire));
            self.settled.store(false, Ordering::Release);
            for n in notifs {
                self.take(n, stopping);
            }
            self.finish_done();
            if self.last_sweep.elapsed() >= self.sweep_every {
                self.last_sweep = Instant::now();
                let expired = self.shared.index.lock().expire(self.shared.now_ms());
                if expired > 0 {
                    tracing::debug!(expired, "swept expired values");
                }
                self.shared.drop_dead_clients();
            }
        }
    }

    /// Starts one request (or answers it at once).
    fn take(&mut self, n: Notification, stopping: bool) {
        let (token, request) = match wire::Request::decode(&n.msg) {
            None => {
                tracing::debug!(from = %n.from, bytes = n.msg.len(), "ignored a notification that is no KV request");
                return;
            }
            Some(Err(e)) => return self.refuse_malformed(&n, &e),
            Some(Ok(r)) => r,
        };
        let first_id = request.first_id();
        let Some(client) = self.client(n.from, &token, first_id) else { return };
        let refuse = |why: &str| {
            let outcomes = vec![Outcome::Failed { code: FailCode::Refused, error: why.to_string() }; request.len()];
            self.reply(&client, Reply { first_id, outcomes });
        };
        if stopping {
            return refuse("the server is shutting down");
        }
        let (items, kind) = match &request {
            wire::Request::Get { items, .. } | wire::Request::Put { items, .. } => {
                (items, items.first().map(|i| i.1.kind))
            }
        };
        if items.iter().any(|(_, b)| Some(b.kind) != kind) {
            return refuse("a request's buffers must all be of one memory kind");
        }
        let now = self.shared.now_ms();
        match request {
            wire::Request::Get { first_id, items } => {
                let plan = GetPlan::new(&mut self.shared.index.lock(), &items, now);
                let reply = Reply { first_id, outcomes: plan.outcomes().to_vec() };
                if plan.copies.is_empty() {
                    return self.reply(&client, reply);
                }
                let started =
                    self.start(&client.agent, OpKind::Write, plan.copies.iter().copied(), Some(reply.encode()));
                match started {
                    Ok(transfer) => self.in_flight.push(InFlight::Get { client, first_id, transfer, plan }),
                    Err(e) => {
                        self.drop_if_unresponsive(&client, &e);
                        let outcomes = plan.finish(&mut self.shared.index.lock(), Err(e)).unwrap_or_default();
                        self.reply(&client, Reply { first_id, outcomes });
                    }
                }
            }
            wire::Request::Put { first_id, ttl_ms, items } => {
                let plan = PutPlan::new(&mut self.shared.index.lock(), &items, ttl_ms, now);
                if plan.copies.is_empty() {
                    let outcomes = plan.finish(&mut self.shared.index.lock(), Ok(()), now);
                    return self.reply(&client, Reply { first_id, outcomes });
                }
                let copies = plan.copies.iter().map(|&(buffer, slot)| (slot, buffer));
                match self.start(&client.agent, OpKind::Read, copies, None) {
                    Ok(transfer) => self.in_flight.push(InFlight::Put { client, first_id, transfer, plan }),
                    Err(e) => {
                        self.drop_if_unresponsive(&client, &e);
                        let outcomes = plan.finish(&mut self.shared.index.lock(), Err(e), now);
                        self.reply(&client, Reply { first_id, outcomes });
                    }
                }
            }
        }
    }

    /// The client whose session sent a request with `token`, or `None` when it is no
    /// session's: the request is then dropped unanswered. Anyone may connect under
    /// another client's name, so an answer would reach that client as the answer to a
    /// request it did make. An agent without a session is not answered either: its
    /// session ended, and with it its connections (see `end_session`), so there is
    /// usually no one to answer; and the agent saying hello right now must not be
    /// dialled, or hung up on, from here.
    fn client(&self, from: String, token: &wire::SessionToken, first_id: u64) -> Option<Client> {
        let sender = self.shared.clients.lock().sender(&from, token);
        match sender {
            Sender::Session(session) => Some(Client { agent: from, session }),
            Sender::NoSession => {
                tracing::info!(%from, first_id, "dropped a request from an agent without a session");
                None
            }
            Sender::Impostor => {
                tracing::warn!(%from, first_id, "dropped a request without its session's token");
                None
            }
        }
    }

    /// Answers a request that does not decode with a protocol error, so that its client
    /// fails at once instead of waiting out its timeout: where its head can be read and
    /// names its sender's session (see `client`).
    fn refuse_malformed(&self, n: &Notification, e: &Error) {
        let Some((token, first_id)) = wire::Request::recover_head(&n.msg) else {
            return tracing::warn!(from = %n.from, error = %e, "dropped a request that does not decode");
        };
        if let Some(client) = self.client(n.from.clone(), &token, first_id) {
            tracing::warn!(from = %n.from, first_id, error = %e, "refused a request that does not decode");
            let outcomes = vec![Outcome::Failed { code: FailCode::Protocol, error: e.to_string() }];
            self.reply(&client, Reply { first_id, outcomes });
        }
    }

    /// One transfer between pool slots and a client's buffers.
    fn start(
        &self,
        client: &str,
        op: OpKind,
        copies: impl Iterator<Item = (Slot, Buffer)>,
        notif: Option<Vec<u8>>,
    ) -> Result<Request> {
        let (mut local, mut remote) = (DescList::new(MemKind::Dram), None::<DescList>);
        for (slot, buffer) in copies {
            local.push(self.shared.pool_desc(slot))?;
            remote.get_or_insert_with(|| DescList::new(buffer.kind)).push(buffer.desc())?;
        }
        let remote = remote.expect("a transfer with something to copy");
        let transfer = self.shared.agent.transfer(op, &local, client, &remote, notif)?;
        let (settled, waker) = (self.settled.clone(), self.shared.agent.waker());
        transfer.on_settled(move || {
            settled.store(true, Ordering::Release);
            waker.wake();
        });
        Ok(transfer)
    }

    /// Finishes every request whose transfer has ended.
    fn finish_done(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            let result = match self.in_flight[i].transfer().status() {
                Status::Done => Ok(()),
                Status::Error(e) => Err(e),
                Status::Idle | Status::Pending => {
                    i += 1;
                    continue;
                }
            };
            let in_flight = self.in_flight.swap_remove(i);
            if let Err(e) = &result {
                let (InFlight::Get { client, .. } | InFlight::Put { client, .. }) = &in_flight;
                self.drop_if_unresponsive(client, e);
            }
            match in_flight {
                InFlight::Get { client, first_id, plan, .. } => {
                    // Bound first: the index lock must not be held while replying.
                    let failed = plan.finish(&mut self.shared.index.lock(), result);
                    if let Some(outcomes) = failed {
                        self.reply(&client, Reply { first_id, outcomes });
                    }
                }
                InFlight::Put { client, first_id, plan, .. } => {
                    let now = self.shared.now_ms();
                    let outcomes = plan.finish(&mut self.shared.index.lock(), result, now);
                    self.reply(&client, Reply { first_id, outcomes });
                }
            }
        }
    }

    /// Answers a client. One that cannot be answered loses its session: for a client on
    /// this host that takes no notifications, each answer would wait out the engine's
    /// peer timeout for room in its queue, holding up every other client meanwhile;
    /// without a session its answers fail at once.
    fn reply(&self, client: &Client, reply: Reply) {
        if let Err(e) = self.shared.agent.notify(&client.agent, reply.encode()) {
            tracing::warn!(client = client.session, agent = %client.agent, error = %e, "could not answer a client");
            self.shared.end_session(&client.agent, client.session, "its answers cannot be delivered");
        }
    }

    /// Ends the session of a client that a transfer found gone or unresponsive (a GET's
    /// answer rides on its transfer, so it fails the same way): answering it, or moving
    /// its next request's values, would wait the same way again.
    fn drop_if_unresponsive(&self, client: &Client, e: &Error) {
        if matches!(e, Error::Timeout(_) | Error::PeerDisconnected { .. }) {
            self.shared.end_session(&client.agent, client.session, "a transfer found it unresponsive");
        }
    }
}

/// A server on a free loopback port with 1 MiB of memory, for unit tests.
#[cfg(test)]
pub(crate) fn test_server() -> Server {
    Server::start(test_config()).unwrap()
}

#[cfg(test)]
pub(crate) fn test_config() -> ServerConfig {
    ServerConfig { listen: "127.0.0.1:0".into(), memory_bytes: 1 << 20, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::test_server as server;

    /// An engine agent standing in for a client.
    fn agent(name: &str) -> Agent {
        Agent::new(name, AgentConfig::default()).unwrap()
    }

    /// The agent token these tests' hellos name: their agents require none, and an
    /// agent without a token ignores the one presented.
    const UNCHECKED: &[u8] = b"unchecked";

    /// `client` takes the server's agent as a peer, with the token that agent requires
    /// (a client learns it in its hello).
    fn dial_server(client: &Agent, s: &Server) -> Result<String> {
        client.add_peer_with_token(&s.shared.agent.metadata(), s.shared.agent.config().token.as_deref())
    }

    #[test]
    fn a_hello_that_names_no_agent_token_opens_no_session() {
        let s = server();
        let client = agent(&format!("tokenless-{}", rand::random::<u32>()));
        let e = s.shared.hello(&client.metadata(), b"").err().unwrap();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("no token for its agent")), "{e}");
        assert_eq!(sessions(&s), 0);
    }

    fn sessions(s: &Server) -> usize {
        s.shared.clients.lock().len()
    }

    #[test]
    fn an_empty_token_is_refused_before_anything_starts() {
        match Server::start(ServerConfig { token: Some(String::new()), ..test_config() }) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("empty token"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a server with an empty token started"),
        }
    }

    /// A worker of the test's own: it takes the requests that the test hands it as if
    /// they came from the named agent.
    fn worker(s: &Server) -> Worker {
        Worker::new(s.shared.clone(), Duration::from_secs(3600))
    }

    fn from(agent: &str, msg: Vec<u8>) -> Notification {
        Notification { from: agent.to_string(), msg }
    }

    fn put_request(first_id: u64, token: &wire::SessionToken) -> Vec<u8> {
        let buffer = wire::Buffer { kind: MemKind::Dram, addr: 1, len: 1, dev: 0 };
        wire::Request::Put { first_id, ttl_ms: 0, items: vec![(b"k".to_vec(), buffer)] }.encode(token)
    }

    /// A request that does not decode, its head intact: a PUT cut short.
    fn malformed(first_id: u64, token: &wire::SessionToken) -> Vec<u8> {
        let mut put = put_request(first_id, token);
        put.truncate(put.len() - 3);
        put
    }

    /// The replies `client` receives until the one to `first_id`, that one included.
    fn replies_until(client: &Agent, first_id: u64) -> Vec<Reply> {
        let until = Instant::now() + Duration::from_secs(5);
        let mut got: Vec<Reply> = Vec::new();
        while !matches!(got.last(), Some(r) if r.first_id == first_id) {
            assert!(Instant::now() < until, "no answer to request {first_id}; got {got:?}");
            got.extend(replies_within(client, Duration::from_millis(100)));
        }
        got
    }

    fn replies_within(client: &Agent, wait: Duration) -> Vec<Reply> {
        client.wait_notifs(wait).iter().filter_map(|n| Reply::decode(&n.msg)).map(|r| r.unwrap()).collect()
    }

    #[test]
    fn a_request_that_does_not_decode_is_answered_at_once_when_its_id_can_be_read() {
        let s = server();
        let client = agent(&format!("raw-{}", rand::random::<u32>()));
        let opened = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        let server_agent = dial_server(&client, &s).unwrap();
        client.notify(&server_agent, malformed(41, &opened.token)).unwrap();
        let reply = replies_until(&client, 41).pop().unwrap();
        assert!(
            matches!(&reply.outcomes[..], [Outcome::Failed { code: FailCode::Protocol, error }] if error.contains("malformed")),
            "{reply:?}"
        );
    }

    /// Anyone may connect under a client's name: an answer to such an agent's request
    /// reaches the client, which takes it for the answer to its own request of that id
    /// (and fails that one while the server still carries it out in its buffer).
    #[test]
    fn requests_without_their_sessions_token_are_not_answered() {
        let s = server();
        let victim = agent(&format!("victim-{}", rand::random::<u32>()));
        let opened = s.shared.hello(&victim.metadata(), UNCHECKED).unwrap();
        let mut w = worker(&s);
        let forged = [0; 16];
        w.take(from(&opened.agent, malformed(41, &forged)), false);
        let stopping = true;
        w.take(from(&opened.agent, put_request(42, &forged)), stopping);
        // The session's own, answered in order after whatever the others got.
        w.take(from(&opened.agent, malformed(43, &opened.token)), false);
        w.take(from(&opened.agent, put_request(44, &opened.token)), stopping);
        let got = replies_until(&victim, 44);
        assert_eq!(got.iter().map(|r| r.first_id).collect::<Vec<_>>(), [43, 44], "{got:?}");
        assert!(
            matches!(&got[1].outcomes[..], [Outcome::Failed { code: FailCode::Refused, error }] if error.contains("shutting down")),
            "{got:?}"
        );
    }

    /// The worker reads the sessions under their lock, but a hello of the request's
    /// agent may add its peer and session right after: hanging up on that agent then
    /// would drop its new session's peer, and answering it would dial it from the
    /// worker. Such a request is dropped, nothing more.
    #[test]
    fn a_request_from_an_agent_without_a_session_is_dropped_and_its_peer_left_alone() {
        let s = server();
        let client = agent(&format!("early-{}", rand::random::<u32>()));
        // The peer that the agent's hello adds, as if it came right after the lookup.
        let name = s.shared.agent.add_peer(&client.metadata()).unwrap();
        worker(&s).take(from(&name, put_request(1, &[0; 16])), false);
        assert!(s.shared.agent.peers().contains(&name), "its peer was removed");
        assert!(replies_within(&client, Duration::from_millis(300)).is_empty(), "it was answered");
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

    /// Every client knows the server agent's secret, so another agent may introduce
    /// itself under a client's name: its requests, lacking that client's session
    /// token, must not move that client's memory (here: store it under a key of its
    /// choosing, to GET later).
    #[test]
    fn a_request_without_its_sessions_token_is_not_carried_out() {
        let s = server();
        let name = format!("victim-{}", rand::random::<u32>());
        let victim = agent(&name);
        let secret = victim.alloc(4096).unwrap();
        victim.register(MemKind::Dram, secret.addr(), 4096, 0).unwrap();
        let opened = s.shared.hello(&victim.metadata(), UNCHECKED).unwrap();
        let impostor = agent(&name);
        let server_agent = dial_server(&impostor, &s).unwrap();
        let put = |key: &[u8], first_id, token| {
            let buffer = wire::Buffer { kind: MemKind::Dram, addr: secret.addr(), len: 4096, dev: 0 };
            wire::Request::Put { first_id, ttl_ms: 0, items: vec![(key.to_vec(), buffer)] }.encode(token)
        };
        impostor.notify(&server_agent, put(b"forged", 1, &[0; 16])).unwrap();
        // The same connection with the session's token: taken, after the forged one.
        impostor.notify(&server_agent, put(b"genuine", 2, &opened.token)).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while !s.shared.index.lock().exists(b"genuine", s.shared.now_ms()) {
            assert!(Instant::now() < until, "the request with the session's token never ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!s.shared.index.lock().exists(b"forged", s.shared.now_ms()), "a forged request ran");
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

    #[test]
    fn the_published_address_is_one_clients_can_dial() {
        let bound: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let e = published_authority(None, bound).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("advertise")), "{e}");
        let e = published_authority(None, "[::]:7000".parse().unwrap()).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("advertise")), "{e}");
        assert_eq!(published_authority(None, "10.0.0.2:7000".parse().unwrap()).unwrap(), "10.0.0.2:7000");
        for (given, want) in [
            ("10.0.0.5", "10.0.0.5:7000"),
            ("10.0.0.5:8000", "10.0.0.5:8000"),
            ("::1", "[::1]:7000"),
            ("[fd00::1]", "[fd00::1]:7000"),
            ("[fd00::1]:8000", "[fd00::1]:8000"),
            ("kv-1.example.com", "kv-1.example.com:7000"),
            ("kv-1:8000", "kv-1:8000"),
        ] {
            assert_eq!(published_authority(Some(given), bound).unwrap(), want, "{given}");
        }
        for bad in ["0.0.0.0", "[::]:9", "", "kv host", "kv:port", "http://kv:1"] {
            let e = published_authority(Some(bad), bound).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
        }
    }
}
