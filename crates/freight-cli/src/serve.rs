//! `freight serve` (also `freight kv-server`): runs the KV cache server until SIGINT or
//! SIGTERM, then stops taking requests, finishes those in flight and exits.

use clap::Args;
use freight_kv::{Server, ServerConfig};

use crate::args::{CliError, CliResult, EngineOpts};
use crate::emit;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// gRPC control plane address. Loopback by default; [::]:50051 or 0.0.0.0:50051
    /// listens on every interface.
    #[arg(long, value_name = "IP:PORT", default_value = freight_kv::server::DEFAULT_LISTEN)]
    pub listen: String,

    /// Size of the value pool in MiB (allocated and touched at start).
    #[arg(long, value_name = "MIB", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=16 << 20))]
    pub memory_mb: u64,

    /// When the pool is full, reject writes with an out-of-memory error instead of
    /// evicting the least recently used values.
    #[arg(long)]
    pub no_evict: bool,

    /// Address of the data plane's engine listener (clients on other hosts reach the
    /// server's agent there over tcp; port 0 picks one) [default: 127.0.0.1:0, or every
    /// interface when --listen is not a loopback address; 127.0.0.1:0 given here counts
    /// as the default].
    #[arg(long, value_name = "IP:PORT")]
    pub data_listen: Option<String>,

    /// Serve Prometheus metrics (GET /metrics) on this address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_listen: Option<String>,

    /// Join a cluster: publish this server in etcd at these endpoints (comma-separated,
    /// e.g. http://127.0.0.1:2379); clients of the cluster find it there.
    #[arg(long, value_name = "URLS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    /// The etcd key prefix the cluster's servers publish under.
    #[arg(long, value_name = "PREFIX", default_value = freight_kv::cluster::DEFAULT_PREFIX)]
    pub etcd_prefix: String,

    /// The address clients of the cluster reach this server at, published in etcd:
    /// HOST (with the port listened on) or HOST:PORT. Needed where --listen is every
    /// interface (0.0.0.0 or [::]); by default the listen address is published.
    #[arg(long, value_name = "HOST[:PORT]", requires = "etcd_endpoints")]
    pub advertise: Option<String>,

    /// Seconds a server that died stays listed in etcd (its lease's time to live).
    #[arg(long, value_name = "SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub etcd_ttl: u64,

    /// TLS on the control plane: the server's certificate chain (PEM file). Needs
    /// --tls-key; clients then connect to https://...
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key (PEM file) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// A shared secret that every client must present (read from the variable
    /// FREIGHT_KV_TOKEN when not given here, so that it stays out of `ps`).
    #[arg(long, env = "FREIGHT_KV_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    #[command(flatten)]
    pub engine: EngineOpts,
}

pub fn run(a: &ServeArgs) -> CliResult<()> {
    // Blocked before any thread starts, so that every thread inherits the mask and the
    // signals wait for `sigwait` below instead of killing the process mid-request.
    let signals = block_stop_signals()?;
    let config = ServerConfig {
        listen: a.listen.clone(),
        memory_bytes: a.memory_mb << 20,
        evict: !a.no_evict,
        // Unset, the server opens it up where its control plane faces other hosts.
        engine: a.engine.agent_config(
            a.data_listen.as_deref().unwrap_or(&freight_core::AgentConfig::default().listen),
            a.engine.transport.require(),
        ),
        token: a.token.clone(),
        metrics_listen: a.metrics_listen.clone(),
        etcd: (!a.etcd_endpoints.is_empty()).then(|| freight_kv::EtcdConfig {
            endpoints: a.etcd_endpoints.clone(),
            prefix: a.etcd_prefix.clone(),
            ttl: std::time::Duration::from_secs(a.etcd_ttl),
        }),
        advertise: a.advertise.clone(),
        tls: tls_identity(a)?,
        ..Default::default()
    };
    let server = Server::start(config).map_err(|e| match e {
        freight_core::Error::InvalidArgument(m) => CliError::usage(m),
        other => CliError::from(other),
    })?;
    let metrics = server.metrics_addr().map(|m| format!(", metrics on http://{m}/metrics")).unwrap_or_default();
    emit(&format!(
        "freight KV server listening on {} (pool {} MiB, {}{metrics}); stop with Ctrl-C\n",
        server.url(),
        a.memory_mb,
        if a.no_evict { "full pool rejects writes" } else { "LRU eviction" }
    ))?;
    let signal = wait_for(&signals);
    tracing::info!(signal, "stopping");
    server.shutdown();
    emit("freight KV server stopped\n")
}

fn tls_identity(a: &ServeArgs) -> CliResult<Option<freight_kv::TlsIdentity>> {
    let (Some(cert), Some(key)) = (&a.tls_cert, &a.tls_key) else { return Ok(None) };
    let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| CliError::usage(format!("{}: {e}", p.display())));
    Ok(Some(freight_kv::TlsIdentity { cert_pem: read(cert)?, key_pem: read(key)? }))
}

fn block_stop_signals() -> CliResult<libc::sigset_t> {
    // SAFETY: plain libc calls on a local signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(CliError::runtime("cannot block SIGINT and SIGTERM"));
        }
        Ok(set)
    }
}

fn wait_for(set: &libc::sigset_t) -> i32 {
    let mut signal = 0;
    // SAFETY: a signal set blocked in every thread (see block_stop_signals).
    unsafe { libc::sigwait(set, &mut signal) };
    signal
}
