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
//!
//! Here: its configuration and start-up ([`Server::start`]: the pool, the engine agent,
//! the control plane, the metrics endpoint, the worker, the cluster entry); the
//! clients' [`sessions`]; the data-plane [`worker`]; the gRPC control plane ([`rpc`]);
//! the Prometheus endpoint ([`metrics`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use freight_core::{Agent, AgentConfig, Error, MemKind, Result};
use parking_lot::Mutex;

use crate::cluster::EtcdConfig;
use crate::index::{Index, IndexConfig};
use crate::pool_memory::PoolMemory;

mod direct;
pub mod metrics;
mod rpc;
mod sessions;
#[cfg(test)]
pub(crate) mod test_support;
mod worker;

pub use crate::control::DEFAULT_LISTEN;
use sessions::Clients;
pub(crate) use sessions::Shared;
use worker::Worker;

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
    /// Direct connections for clients reached over tcp.
    direct: direct::Listener,
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
        if config.token.as_deref().is_some_and(|t| !t.bytes().all(|b| (b' '..=b'~').contains(&b))) {
            // It travels in an HTTP header ("authorization: Bearer <token>").
            return Err(Error::InvalidArgument(
                "the token must be printable ASCII (no line breaks or other control characters)".into(),
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
        // Direct connections listen where the engine does: clients that reach one reach both.
        let engine_ip = agent.config().listen.parse::<SocketAddr>().map(|a| a.ip()).map_err(|e| {
            Error::InvalidArgument(format!(
                "the engine's listen address {:?} is not IP:PORT: {e}",
                agent.config().listen
            ))
        })?;
        let mut direct = direct::Listener::bind(engine_ip, &agent.addresses())?;
        let shared = Arc::new(Shared {
            agent,
            pool,
            index: Mutex::new(Index::new(IndexConfig { capacity: config.memory_bytes, evict: config.evict })),
            clients: Mutex::new(Clients::default()),
            started: Instant::now(),
            stop: AtomicBool::new(false),
            direct: direct::Connections::default(),
            direct_addresses: direct.addresses().to_vec(),
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
        let service = rpc::service(shared.clone(), config.token.clone());
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
                let app = metrics::router(shared.clone());
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
        // Before the `Server` exists, a failure here must stop the worker by hand.
        if let Err(e) = direct.serve(shared.clone()) {
            shared.stop.store(true, Ordering::Release);
            let _ = worker.join();
            return Err(e);
        }
        let mut server = Server {
            shared,
            addr,
            scheme,
            metrics_addr,
            runtime: Some(runtime),
            stop_rpc,
            worker: Some(worker),
            direct,
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
        self.direct.stop(&self.shared);
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

#[cfg(test)]
mod tests {
    use super::test_support::test_config;
    use super::*;

    #[test]
    fn an_empty_token_is_refused_before_anything_starts() {
        match Server::start(ServerConfig { token: Some(String::new()), ..test_config() }) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("empty token"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a server with an empty token started"),
        }
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
