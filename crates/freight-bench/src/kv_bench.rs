//! `freight kv-bench`: read throughput and latency of a KV server, in the phases users
//! of KV cache servers expect: one thread writes every key, the reader threads warm up,
//! then read every key at once (each thread its own client, as separate processes
//! would), then one thread times random GETs one by one. Every value read is checked.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use freight_kv::{Client, ClientConfig, Server, ServerConfig};
use serde_json::json;

use crate::emit;
use crate::options::{format_size, parse_positive_size, CliError, CliResult, EngineOpts};
use crate::report::host_json;

#[derive(Debug, Args)]
pub struct KvBenchArgs {
    /// The server's gRPC endpoint (ignored with --embedded).
    #[arg(long, value_name = "URL", default_value = "http://[::1]:50051")]
    pub server_addr: String,

    /// Keys to write and read.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub num_keys: u64,

    /// Size of each value: 1024, 16KB, 64KiB, 1MB, 10MiB...
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_positive_size)]
    pub value_size: u64,

    /// Reader threads, each with a client of its own.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub num_threads: u32,

    /// Receive buffer per client in MiB (at least the value size).
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub buffer_mb: u64,

    /// TTL of the written keys in seconds; 0: no expiry.
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub ttl: u64,

    /// Warmup reads per thread before the timed read phase.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,

    /// Client ids (in names and logs) start here, one per thread.
    #[arg(long, default_value_t = 100)]
    pub base_client_id: u64,

    /// Run the server in this process (the same server as `freight serve`, through the
    /// same sockets) instead of connecting to --server-addr.
    #[arg(long)]
    pub embedded: bool,

    /// Pool of the embedded server in MiB [default: every value, plus a quarter].
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    pub memory_mb: Option<u64>,

    /// Check every byte of each value read (full), 64 words of each (sample), or
    /// nothing (none).
    #[arg(long, value_enum, default_value_t = Verify::Full)]
    pub verify: Verify,

    /// GETs timed one by one in the latency phase.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub latency_samples: u64,

    /// For an https:// server: the certificate authority to trust (PEM file; the
    /// server's own certificate when it signed itself).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<std::path::PathBuf>,

    /// The server's shared secret (read from FREIGHT_KV_TOKEN when not given here).
    #[arg(long, env = "FREIGHT_KV_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Print the results as JSON on stdout (the phases' text goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Move requests and values through the engine even where the server offers a
    /// client it reaches over tcp a direct connection (to compare the two).
    #[arg(long)]
    pub no_direct: bool,

    #[command(flatten)]
    pub engine: EngineOpts,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Verify {
    Full,
    Sample,
    None,
}

pub fn run(a: &KvBenchArgs) -> CliResult<()> {
    let buffer = a.buffer_mb << 20;
    if a.value_size > buffer {
        return Err(CliError::usage(format!(
            "--value-size {} does not fit --buffer-mb {} ({}): raise --buffer-mb",
            format_size(a.value_size),
            a.buffer_mb,
            format_size(buffer)
        )));
    }
    let tls_ca_pem = match &a.tls_ca {
        Some(p) => Some(std::fs::read(p).map_err(|e| CliError::usage(format!("--tls-ca {}: {e}", p.display())))?),
        None => None,
    };
    let embedded = if a.embedded { Some(start_embedded(a)?) } else { None };
    let url = embedded.as_ref().map_or_else(|| a.server_addr.clone(), Server::url);
    let say = |line: &str| {
        if a.json {
            eprintln!("{line}");
        } else {
            let _ = emit(&format!("{line}\n"));
        }
    };
    let bar = "==============================================";
    say(bar);
    say("KV Cache Read Throughput Benchmark");
    say(bar);
    say(&format!("Server:        {url}{}", if a.embedded { " (embedded)" } else { "" }));
    say(&format!("Keys:          {}", a.num_keys));
    say(&format!("Value size:    {}", format_size(a.value_size)));
    say(&format!("Read threads:  {}", a.num_threads));
    say(&format!("Buffer/client: {} MiB", a.buffer_mb));
    say(&format!("Transport:     freight engine ({})", a.engine.transport.as_str()));
    say(&format!("Verify:        {}", format!("{:?}", a.verify).to_lowercase()));
    say(bar);
    let connect = |id: u64| -> CliResult<Client> {
        Client::connect(ClientConfig {
            server: url.clone(),
            buffer_bytes: buffer,
            name: format!("kv-bench-{id}"),
            engine: client_engine(a),
            token: a.token.clone(),
            tls_ca_pem: tls_ca_pem.clone(),
            direct: !a.no_direct,
            ..Default::default()
        })
        .map_err(CliError::from)
    };

    say("\n=== Write Phase ===");
    say(&format!("Writing {} keys with {} values...", a.num_keys, format_size(a.value_size)));
    let mut writer = connect(a.base_client_id)?;
    let direct = writer.direct();
    say(&format!("Values take:   {}", if direct { "a direct connection" } else { "the engine" }));
    let ttl = Duration::from_secs(a.ttl);
    let start = Instant::now();
    for i in 0..a.num_keys {
        writer
            .put_with(&key(i), a.value_size, ttl, |b| fill(i, b))
            .map_err(|e| CliError::runtime(format!("writing key {i}: {e}")))?;
    }
    let write = Phase::new(a.num_keys, a.value_size, start.elapsed());
    say(&format!("Wrote {0}/{0} keys.", a.num_keys));
    say(&format!("Write completed in {:.2}s", write.seconds));
    say(&format!("Write throughput: {:.0} ops/sec, {:.2} MiB/s", write.ops_per_sec(), write.mib_per_sec()));

    say("\n=== Warmup Phase ===");
    say(&format!("Running {} warmup iterations with {} threads...", a.warmup, a.num_threads));
    let threads = a.num_threads as u64;
    let ready = Arc::new(Barrier::new(a.num_threads as usize + 1));
    let go = Arc::new(Barrier::new(a.num_threads as usize + 1));
    let readers: Vec<_> = (0..threads)
        .map(|t| {
            let client = connect(a.base_client_id + 1 + t);
            let (ready, go) = (ready.clone(), go.clone());
            let (num_keys, value_size, warmup, verify) = (a.num_keys, a.value_size, a.warmup, a.verify);
            std::thread::spawn(move || -> CliResult<(Client, Vec<f64>)> {
                // Both barriers are passed whatever happens here, so that a failing
                // thread cannot leave the others (and the main thread) waiting forever.
                let warmed = client.and_then(|mut client| {
                    let mut rng = rand::rng();
                    (0..warmup)
                        .try_for_each(|_| {
                            read(&mut client, rand::Rng::random_range(&mut rng, 0..num_keys), value_size, verify)
                        })
                        .map(|()| client)
                });
                ready.wait();
                go.wait();
                let mut client = warmed?;
                let mut micros = Vec::with_capacity((num_keys / threads + 1) as usize);
                for i in (t..num_keys).step_by(threads as usize) {
                    let start = Instant::now();
                    read(&mut client, i, value_size, verify)?;
                    micros.push(start.elapsed().as_secs_f64() * 1e6);
                }
                Ok((client, micros))
            })
        })
        .collect();
    ready.wait();
    say("Warmup ended");

    say("\n=== Read Phase ===");
    say(&format!("Reading {} keys with {} threads...", a.num_keys, a.num_threads));
    let start = Instant::now();
    go.wait();
    let mut clients = Vec::new();
    let mut under_load = Vec::new();
    let mut first_error = None;
    for r in readers {
        match r.join().map_err(|_| CliError::runtime("a reader thread panicked"))? {
            Ok((c, micros)) => {
                clients.push(c);
                under_load.extend(micros);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let read_phase = Phase::new(a.num_keys, a.value_size, start.elapsed());
    say(&format!("Read {0}/{0} keys.", a.num_keys));
    say(&format!("Read completed in {:.2}s", read_phase.seconds));
    say(&format!("Read throughput: {:.0} ops/sec, {:.2} MiB/s", read_phase.ops_per_sec(), read_phase.mib_per_sec()));
    let loaded = Latency::of(&mut under_load);
    say(&format!(
        "GET latency with {} threads reading: median {:.2} us, p99 {:.2} us",
        a.num_threads, loaded.median, loaded.p99
    ));

    say("\n=== Latency Analysis ===");
    say(&format!("Measuring latency for {} random GET operations...", a.latency_samples));
    let client = clients.first_mut().expect("at least one reader");
    let mut rng = rand::rng();
    let mut micros = Vec::with_capacity(a.latency_samples as usize);
    for _ in 0..a.latency_samples {
        let i = rand::Rng::random_range(&mut rng, 0..a.num_keys);
        let start = Instant::now();
        read(client, i, a.value_size, a.verify)?;
        micros.push(start.elapsed().as_secs_f64() * 1e6);
    }
    let latency = Latency::of(&mut micros);
    say("Latency statistics (microseconds):");
    for (name, v) in latency.rows() {
        say(&format!("  {name:<8} {v:>10.2} us"));
    }

    say("\n=== Summary ===");
    say(&format!("Write: {:.2}s, {:.0} ops/sec", write.seconds, write.ops_per_sec()));
    say(&format!(
        "Read:  {:.2}s, {:.0} ops/sec ({:.1}x the write rate with {} threads)",
        read_phase.seconds,
        read_phase.ops_per_sec(),
        read_phase.ops_per_sec() / write.ops_per_sec(),
        a.num_threads
    ));
    say(&format!("Total data read: {:.2} MiB", (a.num_keys * a.value_size) as f64 / (1u64 << 20) as f64));
    say(&format!("Read throughput: {:.2} MiB/s", read_phase.mib_per_sec()));
    let stats = clients[0].stats()?;
    if a.json {
        let doc = json!({
            "benchmark": "freight kv-bench",
            "percentile": crate::stats::PERCENTILE,
            "host": host_json(),
            "server": url,
            "embedded": a.embedded,
            "num_keys": a.num_keys,
            "value_size": a.value_size,
            "num_threads": a.num_threads,
            "buffer_bytes": buffer,
            "ttl_seconds": a.ttl,
            "transport": a.engine.transport.as_str(),
            "direct": direct,
            "verify": format!("{:?}", a.verify).to_lowercase(),
            "write": write.json(),
            "read": read_phase.json(),
            "latency_us": latency.json(),
            "read_latency_us": loaded.json(),
            "server_stats": { "keys": stats.keys, "hits": stats.hits, "misses": stats.misses, "evictions": stats.evictions },
        });
        emit(&(serde_json::to_string_pretty(&doc).expect("json values always print") + "\n"))?;
    }
    for c in clients {
        let _ = c.close();
    }
    let _ = writer.close();
    drop(embedded);
    Ok(())
}

fn start_embedded(a: &KvBenchArgs) -> CliResult<Server> {
    let need = a.num_keys.saturating_mul(a.value_size.next_multiple_of(freight_kv::pool::ALIGN));
    let memory = a.memory_mb.map_or(need + need / 4 + (1 << 20), |mb| mb << 20);
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory_bytes: memory,
        engine: a.engine.agent_config("127.0.0.1:0", a.engine.transport.require()),
        token: a.token.clone(),
        ..Default::default()
    })
    .map_err(CliError::from)
}

/// The clients' agent. The server moves every value, over what the client's agent
/// offers: a transport asked for is the only one it offers.
fn client_engine(a: &KvBenchArgs) -> freight_core::AgentConfig {
    let require = a.engine.transport.require();
    let mut engine = a.engine.agent_config("127.0.0.1:0", require);
    if let Some(t) = require {
        engine.transports = vec![t];
    }
    engine
}

fn key(i: u64) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

/// Word `w` of key `i`'s value: distinct for every key and offset, so that a value
/// of another key, or from another place, does not pass for this one.
fn word(i: u64, w: u64) -> u64 {
    (i.wrapping_add(1)).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ w.wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

fn fill(i: u64, buf: &mut [u8]) {
    let words = buf.len() / 8;
    let mut chunks = buf.chunks_exact_mut(8);
    for (w, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(i, w as u64).to_le_bytes());
    }
    fill_tail(i, words, chunks.into_remainder());
}

/// Whether `value` is key `i`'s value of `len` bytes (all of it, or 64 of its words).
fn check(i: u64, value: &[u8], len: u64, verify: Verify) -> bool {
    if value.len() as u64 != len {
        return false;
    }
    let words = value.len() / 8;
    let at = |w: usize| u64::from_le_bytes(value[w * 8..w * 8 + 8].try_into().expect("8 bytes")) == word(i, w as u64);
    match verify {
        Verify::None => true,
        Verify::Sample => (0..64).map(|k| k * words / 64).filter(|&w| w < words).all(at),
        Verify::Full => {
            let mut expect = vec![0u8; value.len() % 8];
            let tail = &value[words * 8..];
            fill_tail(i, words, &mut expect);
            (0..words).all(at) && tail == &expect[..]
        }
    }
}

fn fill_tail(i: u64, words: usize, out: &mut [u8]) {
    let last = word(i, words as u64).to_le_bytes();
    let n = out.len();
    out.copy_from_slice(&last[..n]);
}

fn read(client: &mut Client, i: u64, len: u64, verify: Verify) -> CliResult<()> {
    match client.get_with(&key(i), |v| check(i, v, len, verify)) {
        Ok(Some(true)) => Ok(()),
        Ok(Some(false)) => Err(CliError::runtime(format!("key {i} came back with the wrong bytes"))),
        Ok(None) => Err(CliError::runtime(format!(
            "key {i} is missing (expired, or evicted: is the server's pool large enough for every value?)"
        ))),
        Err(e) => Err(CliError::runtime(format!("reading key {i}: {e}"))),
    }
}

/// Counts and time of one phase.
struct Phase {
    ops: u64,
    bytes: u64,
    seconds: f64,
}

impl Phase {
    fn new(ops: u64, value_size: u64, took: Duration) -> Phase {
        Phase { ops, bytes: ops * value_size, seconds: took.as_secs_f64().max(1e-9) }
    }

    fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.seconds
    }

    fn mib_per_sec(&self) -> f64 {
        self.bytes as f64 / self.seconds / (1u64 << 20) as f64
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "ops": self.ops, "seconds": self.seconds, "ops_per_sec": self.ops_per_sec(),
            "bytes_per_sec": self.bytes as f64 / self.seconds, "gbps": self.bytes as f64 / self.seconds / 1e9,
        })
    }
}

/// Latency statistics in microseconds.
struct Latency {
    min: f64,
    median: f64,
    avg: f64,
    p95: f64,
    p99: f64,
    max: f64,
    samples: usize,
}

impl Latency {
    fn of(micros: &mut [f64]) -> Latency {
        micros.sort_by(f64::total_cmp);
        let n = micros.len();
        let at = |q: f64| crate::stats::percentile(micros, q);
        Latency {
            min: micros[0],
            median: at(0.5),
            avg: micros.iter().sum::<f64>() / n as f64,
            p95: at(0.95),
            p99: at(0.99),
            max: micros[n - 1],
            samples: n,
        }
    }

    fn rows(&self) -> [(&'static str, f64); 6] {
        [
            ("Min:", self.min),
            ("Median:", self.median),
            ("Avg:", self.avg),
            ("P95:", self.p95),
            ("P99:", self.p99),
            ("Max:", self.max),
        ]
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "min": self.min, "median": self.median, "avg": self.avg,
            "p95": self.p95, "p99": self.p99, "max": self.max, "samples": self.samples,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_check_against_their_own_key_only() {
        for len in [1usize, 7, 8, 9, 4096, 65_537] {
            let mut v = vec![0u8; len];
            fill(42, &mut v);
            for verify in [Verify::Full, Verify::Sample] {
                assert!(check(42, &v, len as u64, verify), "{len} {verify:?}");
            }
            assert!(!check(42, &v, len as u64 + 1, Verify::Full), "a wrong length fails");
            if len >= 8 {
                assert!(!check(43, &v, len as u64, Verify::Full), "another key's value fails");
            }
            let last = len - 1;
            v[last] ^= 1;
            assert!(!check(42, &v, len as u64, Verify::Full), "one flipped byte fails a full check ({len})");
        }
    }

    #[test]
    fn latency_percentiles_pick_samples() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Latency::of(&mut v);
        assert_eq!((l.min, l.median, l.p95, l.p99, l.max), (1.0, 50.0, 95.0, 99.0, 100.0));
        assert!((l.avg - 50.5).abs() < 1e-9);
    }
}
