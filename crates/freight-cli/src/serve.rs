//! `freight serve` (also `freight kv-server`): runs the KV cache server until SIGINT or
//! SIGTERM, then stops taking requests, finishes those in flight and exits.

use std::path::Path;

use rustls_pki_types::pem::{PemObject, SectionKind};

use clap::Args;
use freight_kv::{Server, ServerConfig};

use freight_bench::emit;
use freight_bench::options::{resolve_addr, CliError, CliResult, EngineOpts};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// gRPC control plane address (a host name is resolved, its IPv4 address first).
    /// Loopback by default; [::]:50051 or 0.0.0.0:50051 listens on every interface.
    #[arg(long, value_name = "HOST:PORT", default_value = freight_kv::server::DEFAULT_LISTEN)]
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
    #[arg(long, value_name = "HOST:PORT")]
    pub data_listen: Option<String>,

    /// Serve Prometheus metrics (GET /metrics) on this address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "HOST:PORT")]
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
    let checked = check(a)?;
    // Blocked before any thread starts, so that every thread inherits the mask and the
    // signals wait for `sigwait` below instead of killing the process mid-request.
    let signals = block_stop_signals()?;
    let config = ServerConfig {
        listen: checked.listen,
        memory_bytes: a.memory_mb << 20,
        evict: !a.no_evict,
        // Unset, the server opens it up where its control plane faces other hosts.
        engine: a.engine.agent_config(
            checked.data_listen.as_deref().unwrap_or(&freight_core::AgentConfig::default().listen),
            a.engine.transport.require(),
        ),
        token: a.token.clone(),
        metrics_listen: checked.metrics_listen,
        etcd: (!a.etcd_endpoints.is_empty()).then(|| freight_kv::EtcdConfig {
            endpoints: a.etcd_endpoints.clone(),
            prefix: a.etcd_prefix.clone(),
            ttl: std::time::Duration::from_secs(a.etcd_ttl),
        }),
        advertise: a.advertise.clone(),
        tls: checked.tls,
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

/// The options, as the server takes them: addresses resolved, TLS files read.
#[derive(Debug)]
struct Checked {
    listen: String,
    data_listen: Option<String>,
    metrics_listen: Option<String>,
    tls: Option<freight_kv::TlsIdentity>,
}

/// What the server would refuse late (an address after the pool was allocated), vaguely
/// (a TLS file that is not PEM: "transport error") or not at all (a pool larger than the
/// host: the OOM killer, while it is touched), refused first and by the option's name.
fn check(a: &ServeArgs) -> CliResult<Checked> {
    let resolve = |opt: &str, v: Option<&String>| v.map(|v| resolve_addr(opt, v).map(|a| a.to_string())).transpose();
    let checked = Checked {
        listen: resolve_addr("--listen", &a.listen)?.to_string(),
        data_listen: resolve("--data-listen", a.data_listen.as_ref())?,
        metrics_listen: resolve("--metrics-listen", a.metrics_listen.as_ref())?,
        tls: tls_identity(a)?,
    };
    freight_bench::host_memory::ensure_room(
        a.memory_mb << 20,
        &format!("--memory-mb {} (the value pool, allocated and touched at start)", a.memory_mb),
        "lower --memory-mb",
    )?;
    Ok(checked)
}

fn tls_identity(a: &ServeArgs) -> CliResult<Option<freight_kv::TlsIdentity>> {
    let (Some(cert), Some(key)) = (&a.tls_cert, &a.tls_key) else { return Ok(None) };
    let read = |opt: &str, p: &Path, want: PemKind| {
        let bytes = std::fs::read(p).map_err(|e| CliError::usage(format!("{opt} {}: {e}", p.display())))?;
        check_pem(&bytes, want).map_err(|why| CliError::usage(format!("{opt} {}: {why}", p.display())))?;
        Ok::<_, CliError>(bytes)
    };
    Ok(Some(freight_kv::TlsIdentity {
        cert_pem: read("--tls-cert", cert, PemKind::Certificate)?,
        key_pem: read("--tls-key", key, PemKind::PrivateKey)?,
    }))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PemKind {
    Certificate,
    PrivateKey,
}

impl PemKind {
    fn label(self) -> &'static str {
        match self {
            PemKind::Certificate => "CERTIFICATE",
            PemKind::PrivateKey => "PRIVATE KEY",
        }
    }
}

/// The kinds of the PEM sections in `bytes` that TLS uses (others, such as encrypted
/// keys, are skipped), or why they do not parse.
fn pem_sections(bytes: &[u8]) -> Result<Vec<SectionKind>, String> {
    <(SectionKind, Vec<u8>)>::pem_slice_iter(bytes)
        .map(|section| section.map(|(kind, _)| kind).map_err(|e| format!("not valid PEM ({e})")))
        .collect()
}

/// Whether `bytes` hold what `want` asks for, and if not, what they hold instead.
fn check_pem(bytes: &[u8], want: PemKind) -> Result<(), String> {
    let kinds = pem_sections(bytes)?;
    let is_key =
        |k: &SectionKind| matches!(k, SectionKind::PrivateKey | SectionKind::RsaPrivateKey | SectionKind::EcPrivateKey);
    let found = match want {
        PemKind::Certificate => kinds.contains(&SectionKind::Certificate),
        PemKind::PrivateKey => kinds.iter().any(is_key),
    };
    // Sections TLS cannot use are skipped by the parser: an encrypted key is one.
    let encrypted = bytes.windows(b"ENCRYPTED PRIVATE KEY".len()).any(|w| w == b"ENCRYPTED PRIVATE KEY");
    match (found, want) {
        (true, _) => Ok(()),
        (false, PemKind::PrivateKey) if encrypted => {
            Err("the private key is encrypted; give it decrypted (e.g. openssl pkey -in KEY -out PLAIN)".into())
        }
        (false, _) if kinds.is_empty() => Err(format!("not a PEM file (no -----BEGIN {}----- block)", want.label())),
        (false, PemKind::Certificate) if kinds.iter().any(is_key) => {
            Err("holds a private key, not a certificate (--tls-cert and --tls-key swapped?)".into())
        }
        (false, PemKind::PrivateKey) if kinds.contains(&SectionKind::Certificate) => {
            Err("holds a certificate, not a private key (--tls-cert and --tls-key swapped?)".into())
        }
        (false, _) => Err(format!("PEM, but no {} block in it (found {kinds:?})", want.label())),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn args(extra: &[&str]) -> ServeArgs {
        T::try_parse_from(["serve", "--memory-mb", "1"].into_iter().chain(extra.iter().copied())).unwrap().a
    }

    fn usage_error(a: &ServeArgs) -> String {
        match check(a).unwrap_err() {
            CliError::Usage(m) => m,
            other => panic!("not a usage error: {other}"),
        }
    }

    #[test]
    fn addresses_take_host_names_and_errors_name_the_option() {
        let c = check(&args(&["--listen", "localhost:50051", "--data-listen", "localhost:0"])).unwrap();
        assert_eq!((c.listen.as_str(), c.data_listen.as_deref()), ("127.0.0.1:50051", Some("127.0.0.1:0")));
        assert_eq!(check(&args(&[])).unwrap().listen, "[::1]:50051");
        for opt in ["--listen", "--data-listen", "--metrics-listen"] {
            let m = usage_error(&args(&[opt, "bogus"]));
            assert!(m.starts_with(&format!("{opt} 'bogus'")), "{m}");
        }
    }

    #[test]
    fn a_pool_larger_than_the_host_is_refused() {
        let a = T::try_parse_from(["serve", "--memory-mb", "16777216"]).unwrap().a;
        let m = usage_error(&a);
        assert!(m.starts_with("--memory-mb 16777216") && m.contains("of host memory"), "{m}");
    }

    #[test]
    fn tls_files_that_are_not_pem_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p.to_str().unwrap().to_string()
        };
        let cert = write("cert.pem", "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n");
        let key = write("key.pem", "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49\n-----END PRIVATE KEY-----\n");
        let junk = write("junk.txt", "not a certificate\n");
        let tls = |c: &str, k: &str| args(&["--tls-cert", c, "--tls-key", k]);
        assert!(check(&tls(&cert, &key)).unwrap().tls.is_some());
        let m = usage_error(&tls(&junk, &key));
        assert!(m.starts_with(&format!("--tls-cert {junk}: not a PEM file")), "{m}");
        let m = usage_error(&tls(&cert, &junk));
        assert!(m.starts_with(&format!("--tls-key {junk}: not a PEM file")), "{m}");
        assert!(usage_error(&tls(&key, &cert)).contains("swapped"));
        let missing = dir.path().join("missing.pem");
        let m = usage_error(&tls(missing.to_str().unwrap(), &key));
        assert!(m.starts_with("--tls-cert ") && m.contains("missing.pem"), "{m}");
    }

    #[test]
    fn pem_sections_are_named_and_broken_ones_refused() {
        let ec = b"-----BEGIN EC PRIVATE KEY-----\nab+/\n-----END EC PRIVATE KEY-----\n";
        assert_eq!(pem_sections(ec).unwrap(), [SectionKind::EcPrivateKey]);
        assert!(check_pem(ec, PemKind::PrivateKey).is_ok());
        assert!(pem_sections(b"-----BEGIN CERTIFICATE-----\nMIIB\n").is_err(), "no END");
        assert!(pem_sections(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END PRIVATE KEY-----\n").is_err());
        let encrypted = b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n";
        assert!(check_pem(encrypted, PemKind::PrivateKey).unwrap_err().contains("encrypted"));
    }
}
