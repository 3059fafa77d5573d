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
use crate::memory::PoolMemory;
use crate::pool::Slot;
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
            tls: None,
        }
    }
}

/// Clients that said hello, by their agent's name.
#[derive(Default)]
pub(crate) struct Clients {
    by_name: HashMap<String, u64>,
    next_id: u64,
}

impl Clients {
    pub(crate) fn id_of(&self, name: &str) -> Option<u64> {
        self.by_name.get(name).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }

    fn add(&mut self, name: String) -> u64 {
        self.next_id += 1;
        self.by_name.insert(name, self.next_id);
        self.next_id
    }

    fn remove(&mut self, name: &str) -> Option<u64> {
        self.by_name.remove(name)
    }
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

    /// Opens a session for the agent whose metadata this is; returns its client id.
    pub(crate) fn hello(&self, metadata: &[u8]) -> Result<(u64, String)> {
        let name = self.agent.add_peer(metadata)?;
        let mut clients = self.clients.lock();
        // The same agent saying hello again (a reconnect): its old session ends. Its
        // reservations stay with the transfers that fill them: the worker commits or
        // aborts each when its transfer settles (freeing one sooner could let another
        // value take the slot while the old copy still writes into it).
        clients.remove(&name);
        let id = clients.add(name.clone());
        tracing::info!(client = id, agent = %name, "client connected");
        Ok((id, name))
    }

    /// Takes a client's new metadata (it registered more memory).
    pub(crate) fn refresh(&self, client: u64, metadata: &[u8]) -> Result<()> {
        // The session first: metadata of an agent without one is not taken as a peer.
        let name = freight_core::metadata::AgentMetadata::decode(metadata)?.name;
        match self.clients.lock().id_of(&name) {
            Some(id) if id == client => {}
            _ => return Err(Error::InvalidArgument(format!("client {client} has no session with this server"))),
        }
        self.agent.add_peer(metadata).map(|_| ())
    }

    /// Ends the session of the client with this id (no error if there is none).
    pub(crate) fn goodbye(&self, client: u64) {
        let name = {
            let mut clients = self.clients.lock();
            let name = clients.by_name.iter().find(|(_, &id)| id == client).map(|(n, _)| n.clone());
            if let Some(n) = &name {
                clients.remove(n);
            }
            name
        };
        if let Some(name) = name {
            self.drop_client(&name, client, "said goodbye");
        }
    }

    /// Ends a session. Its PUTs still in flight end with their transfers (see `hello`).
    fn drop_client(&self, name: &str, id: u64, why: &str) {
        let _ = self.agent.remove_peer(name);
        tracing::info!(client = id, agent = %name, why, "client gone");
    }

    /// Drops clients whose agent stopped answering.
    fn drop_dead_clients(&self) {
        let dead: Vec<(String, u64)> = {
            let clients = self.clients.lock();
            clients
                .by_name
                .iter()
                .filter(|(name, _)| self.agent.check_peer(name).is_err())
                .map(|(n, &id)| (n.clone(), id))
                .collect()
        };
        for (name, id) in dead {
            self.clients.lock().remove(&name);
            self.drop_client(&name, id, "connection lost");
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
        // Distinct servers of one process (tests start several) need distinct agent names.
        let name = format!("freight-kv-server-{}-{:08x}", std::process::id(), rand::random::<u32>());
        // Clients the control plane serves on other hosts must reach the data plane too.
        let engine = crate::reach::open_to_other_hosts(config.engine.clone(), !listen.ip().is_loopback());
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
            let directory = etcd.directory()?;
            directory.publish(server.shared.agent.name(), server.url().as_bytes())?;
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

/// How long the worker sleeps in the notification queue when nothing is in flight;
/// a request wakes it at once.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// A request whose transfer is running.
enum InFlight {
    Get { client: String, first_id: u64, transfer: Request, plan: GetPlan },
    Put { client: String, first_id: u64, transfer: Request, plan: PutPlan },
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
            let notifs = crate::poll::next_notifs(&self.shared.agent, IDLE_WAIT, || settled.load(Ordering::Acquire));
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
        let request = match wire::Request::decode(&n.msg) {
            None => {
                tracing::debug!(from = %n.from, bytes = n.msg.len(), "ignored a notification that is no KV request");
                return;
            }
            Some(Err(e)) => {
                tracing::warn!(from = %n.from, error = %e, "dropped a malformed request");
                return;
            }
            Some(Ok(r)) => r,
        };
        let first_id = request.first_id();
        let refuse = |why: &str| {
            let outcomes = vec![Outcome::Failed { code: FailCode::Refused, error: why.to_string() }; request.len()];
            self.reply(&n.from, Reply { first_id, outcomes });
        };
        if stopping {
            return refuse("the server is shutting down");
        }
        if self.shared.clients.lock().id_of(&n.from).is_none() {
            return refuse("no session: say hello on the control plane first");
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
                    return self.reply(&n.from, reply);
                }
                let started = self.start(&n.from, OpKind::Write, plan.copies.iter().copied(), Some(reply.encode()));
                match started {
                    Ok(transfer) => self.in_flight.push(InFlight::Get { client: n.from, first_id, transfer, plan }),
                    Err(e) => {
                        let outcomes = plan.finish(&mut self.shared.index.lock(), Err(e)).unwrap_or_default();
                        self.reply(&n.from, Reply { first_id, outcomes });
                    }
                }
            }
            wire::Request::Put { first_id, ttl_ms, items } => {
                let plan = PutPlan::new(&mut self.shared.index.lock(), &items, ttl_ms, now);
                if plan.copies.is_empty() {
                    let outcomes = plan.finish(&mut self.shared.index.lock(), Ok(()), now);
                    return self.reply(&n.from, Reply { first_id, outcomes });
                }
                let copies = plan.copies.iter().map(|&(buffer, slot)| (slot, buffer));
                match self.start(&n.from, OpKind::Read, copies, None) {
                    Ok(transfer) => self.in_flight.push(InFlight::Put { client: n.from, first_id, transfer, plan }),
                    Err(e) => {
                        let outcomes = plan.finish(&mut self.shared.index.lock(), Err(e), now);
                        self.reply(&n.from, Reply { first_id, outcomes });
                    }
                }
            }
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
            match self.in_flight.swap_remove(i) {
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

    fn reply(&self, client: &str, reply: Reply) {
        if let Err(e) = self.shared.agent.notify(client, reply.encode()) {
            tracing::debug!(client, error = %e, "could not answer a client");
        }
    }
}
