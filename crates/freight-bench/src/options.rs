//! Value parsers and options shared by several commands, and the CLI's error type.
//!
//! Everything here is pure so that the rules users type against are unit-tested.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use clap::{Args, ValueEnum};
use freight_core::{AgentConfig, FabricConfig, MemKind, Pinning, ShmConfig, TcpConfig, TransportKind};

/// How a command failed. The split decides the exit code: a usage error (2) means "you
/// asked for something impossible", a runtime error (1) means "it did not work".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CliError {
    Usage(String),
    Runtime(String),
}

impl CliError {
    pub fn usage(msg: impl Into<String>) -> Self {
        CliError::Usage(msg.into())
    }
    pub fn runtime(msg: impl Into<String>) -> Self {
        CliError::Runtime(msg.into())
    }
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Runtime(_) => 1,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Runtime(m) => f.write_str(m),
        }
    }
}

impl From<freight_core::Error> for CliError {
    fn from(e: freight_core::Error) -> Self {
        CliError::Runtime(e.to_string())
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::Runtime(e.to_string())
    }
}

pub type CliResult<T> = Result<T, CliError>;

// ---------------------------------------------------------------------------------------
// Sizes, lists, durations.
// ---------------------------------------------------------------------------------------

/// Help text shared by every size option, so the grammar is stated once.
pub const SIZE_GRAMMAR: &str =
    "Sizes take an optional unit: B, K/KiB (1024), KB (1000), M/MiB, MB, G/GiB, GB, T/TiB, TB; case does not matter (4k = 4KiB)";

fn unit_multiplier(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    })
}

/// Parses `4096`, `4k`, `4KiB`, `1.5MiB`, `1GB`, `64 MiB`. Fractions are allowed when the
/// result is a whole number of bytes. Zero is allowed here; callers that need a positive
/// size use [`parse_positive_size`].
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    if num.is_empty() {
        return Err(format!("'{s}' is not a size (expected a number with an optional unit, e.g. 64MiB)"));
    }
    let mult = unit_multiplier(unit).ok_or_else(|| format!("unknown size unit '{unit}' in '{s}' ({SIZE_GRAMMAR})"))?;
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || !(frac.is_empty() || digits(frac)) || (num.contains('.') && frac.is_empty()) {
        return Err(format!("'{s}' is not a size (expected a number with an optional unit, e.g. 64MiB)"));
    }
    let too_big = || format!("'{s}' is too large");
    let whole: u64 = int.parse().map_err(|_| too_big())?;
    let mut bytes = whole.checked_mul(mult).ok_or_else(too_big)?;
    if !frac.is_empty() {
        if frac.len() > 12 {
            return Err(format!("'{s}' has too many decimals"));
        }
        let scale = 10u128.pow(frac.len() as u32);
        let f: u128 = frac.parse::<u128>().map_err(|_| too_big())? * mult as u128;
        if f % scale != 0 {
            return Err(format!("'{s}' is not a whole number of bytes"));
        }
        bytes = bytes.checked_add(u64::try_from(f / scale).map_err(|_| too_big())?).ok_or_else(too_big)?;
    }
    Ok(bytes)
}

pub fn parse_positive_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("'{s}': size must be positive")),
        n => Ok(n),
    }
}

/// A list of sizes or counts as typed: `a,b,c` with ranges `lo:hi` (doubling) or
/// `lo:hi:factor`. Order is kept, duplicates dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumList(pub Vec<u64>);

/// A list bigger than this is a typo, not a benchmark.
const MAX_LIST: usize = 4096;

fn parse_list(s: &str, item: fn(&str) -> Result<u64, String>) -> Result<NumList, String> {
    let mut out: Vec<u64> = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("empty item in list '{s}'"));
        }
        let pieces: Vec<&str> = part.split(':').collect();
        let values = match pieces.as_slice() {
            [one] => vec![item(one)?],
            [lo, hi] => range(item(lo)?, item(hi)?, 2, part)?,
            [lo, hi, f] => {
                let factor = f.trim().trim_start_matches(['x', 'X']).parse::<u64>().ok().filter(|&f| f >= 2);
                let factor =
                    factor.ok_or_else(|| format!("range '{part}': the factor must be an integer of at least 2"))?;
                range(item(lo)?, item(hi)?, factor, part)?
            }
            _ => return Err(format!("'{part}' is not a value or a range lo:hi[:factor]")),
        };
        for v in values {
            if v == 0 {
                return Err(format!("'{part}': values must be positive"));
            }
            if !out.contains(&v) {
                out.push(v);
            }
            if out.len() > MAX_LIST {
                return Err(format!("'{s}' expands to more than {MAX_LIST} values"));
            }
        }
    }
    Ok(NumList(out))
}

fn range(lo: u64, hi: u64, factor: u64, part: &str) -> Result<Vec<u64>, String> {
    if lo == 0 || lo > hi {
        return Err(format!("range '{part}' must go from a positive value up to a value at least as large"));
    }
    let mut v = Vec::new();
    let mut x = lo;
    while x <= hi && v.len() <= MAX_LIST {
        v.push(x);
        match x.checked_mul(factor) {
            Some(n) => x = n,
            None => break,
        }
    }
    Ok(v)
}

/// Sizes: `4KiB,64KiB,1MiB` or `4KiB:64MiB`.
pub fn parse_size_list(s: &str) -> Result<NumList, String> {
    parse_list(s, parse_size)
}

/// Plain counts: `1,16,128` or `1:1024`.
pub fn parse_count_list(s: &str) -> Result<NumList, String> {
    parse_list(s, |t| t.trim().parse::<u64>().map_err(|_| format!("'{t}' is not a whole number")))
}

/// `500ms`, `2s`, `1.5s`, `1m`, `250us`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let value: f64 = num.parse().map_err(|_| format!("'{s}' is not a duration (e.g. 500ms, 2s, 1m)"))?;
    let secs = match unit.to_ascii_lowercase().as_str() {
        "" | "s" | "sec" | "secs" => value,
        "ms" => value / 1e3,
        "us" => value / 1e6,
        "m" | "min" => value * 60.0,
        other => return Err(format!("unknown duration unit '{other}' in '{s}' (use us, ms, s or m)")),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 86_400.0 {
        return Err(format!("'{s}': a duration must be positive and at most a day"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A positive count that fits comfortably in memory (threads, streams, windows).
pub fn parse_small_positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=4096).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' must be a whole number from 1 to 4096")),
    }
}

/// The address option `opt` gives: IP:PORT, or HOST:PORT resolved (a lookup, the one
/// thing here that is not pure), its IPv4 address first, as listeners default to IPv4
/// (127.0.0.1 or 0.0.0.0). A usage error names the option.
pub fn resolve_addr(opt: &str, v: &str) -> CliResult<SocketAddr> {
    if let Ok(a) = v.parse() {
        return Ok(a);
    }
    let unusable = |why: String| CliError::usage(format!("{opt} '{v}': {why} (expected IP:PORT or HOST:PORT)"));
    match v.to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            addrs
                .iter()
                .find(|a| a.is_ipv4())
                .or(addrs.first())
                .copied()
                .ok_or_else(|| unusable("the name has no address".into()))
        }
        Err(e) => Err(unusable(e.to_string())),
    }
}

/// Bytes for people: `256 MiB`, `4 KiB`, `1.5 GiB`, `1000 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{} {}", v as u64, UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

// ---------------------------------------------------------------------------------------
// Enumerations users pick from.
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportChoice {
    /// Let the engine choose (shm on the same host, tcp otherwise).
    Auto,
    /// Require shared memory; fail if it cannot serve the path.
    Shm,
    /// Require tcp, even on the same host.
    Tcp,
    /// Require one-sided RDMA through libfabric (see --fabric-provider).
    Fabric,
}

impl TransportChoice {
    pub fn require(self) -> Option<TransportKind> {
        match self {
            TransportChoice::Auto => None,
            TransportChoice::Shm => Some(TransportKind::Shm),
            TransportChoice::Tcp => Some(TransportKind::Tcp),
            TransportChoice::Fabric => Some(TransportKind::Fabric),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Shm => "shm",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Fabric => "fabric",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SegKind {
    /// Host memory.
    #[value(name = "DRAM")]
    Dram,
    /// GPU memory (this command's buffers are host memory, so the engine refuses it;
    /// bench/gpu.py measures GPU memory).
    #[value(name = "VRAM")]
    Vram,
    /// File-backed memory (no transport moves it yet: the engine refuses it).
    #[value(name = "FILE")]
    File,
}

impl SegKind {
    pub fn mem_kind(self) -> MemKind {
        match self {
            SegKind::Dram => MemKind::Dram,
            SegKind::Vram => MemKind::Vram,
            SegKind::File => MemKind::File,
        }
    }
}

/// Engine tuning shared by commands that move data. `None` keeps the engine's default.
#[derive(Debug, Clone, Args)]
pub struct EngineOpts {
    /// Transport: auto (engine picks: shm on the same host, else tcp), or require shm, tcp
    /// or fabric. FREIGHT_TRANSPORT overrides it.
    #[arg(long, value_enum, default_value_t = TransportChoice::Auto, ignore_case = true)]
    pub transport: TransportChoice,

    /// tcp: parallel data streams per peer [engine default: 4].
    #[arg(long, value_name = "N", value_parser = parse_small_positive)]
    pub streams: Option<usize>,

    /// tcp: largest message payload; bigger copies are split into chunks of this size,
    /// at most 1GiB [engine default: 1MiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_chunk_size)]
    pub chunk_size: Option<u64>,

    /// tcp: chunks in flight per stream before the sender waits for acknowledgements
    /// [engine default: 8].
    #[arg(long, value_name = "N", value_parser = parse_small_positive)]
    pub window: Option<usize>,

    /// shm: copy threads for requests larger than 256KiB [engine default: cores, at most 8].
    #[arg(long, value_name = "N", value_parser = parse_small_positive)]
    pub shm_threads: Option<usize>,

    /// tcp: send every payload with ordinary copies, never MSG_ZEROCOPY (which is used
    /// by default for payloads >= 64KiB to other hosts).
    #[arg(long)]
    pub no_zerocopy: bool,

    /// tcp: local addresses (one per NIC, comma-separated) that data streams are bound
    /// to in turn; each stream then dials the peer's address closest to its own
    /// [engine default: every local NIC whose subnet holds one of the peer's addresses,
    /// else wherever the kernel routes].
    #[arg(long, value_name = "IP,IP", value_delimiter = ',')]
    pub local_addrs: Vec<std::net::IpAddr>,

    /// tcp: where each stream's sender and receiver threads run: numa (on the cores of
    /// the NUMA node of the stream's NIC, where it has one), off, or a core list such
    /// as 0-3,8 (stream threads take its cores in turn) [engine default: numa].
    #[arg(long, value_name = "off|numa|CORES", value_parser = Pinning::parse)]
    pub pin: Option<Pinning>,

    /// fabric: the libfabric provider (efa, verbs, tcp, shm...); naming one opens the
    /// fabric transport. `freight doctor` lists those found [FREIGHT_FABRIC_PROVIDER
    /// overrides it; default: the first that offers RDMA reads and writes].
    #[arg(long, value_name = "NAME")]
    pub fabric_provider: Option<String>,

    /// fabric: domains to use as rails, comma-separated, one endpoint each (for the tcp
    /// provider, interface names; a name may repeat) [FREIGHT_FABRIC_DOMAINS overrides
    /// it; default: the provider's first domain].
    #[arg(long, value_name = "NAME,NAME", value_delimiter = ',')]
    pub fabric_domains: Vec<String>,

    /// fabric: largest single RDMA operation; bigger copies are split and dealt to the
    /// rails in turn [engine default: 4MiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_positive_size)]
    pub fabric_chunk_size: Option<u64>,

    /// fabric: stage GPU memory through pinned host buffers even where the provider
    /// could register it (FI_HMEM), to compare the two [FREIGHT_FABRIC_GPU_DIRECT=0
    /// does the same; default: registered where the provider offers FI_HMEM].
    #[arg(long)]
    pub fabric_stage_gpu: bool,

    /// A token that this command's engine agents require on every connection and
    /// present to each other (read from FREIGHT_AGENT_TOKEN when not given here, so
    /// that it stays out of `ps`; processes this command starts get it the same way).
    /// Give both ends of a benchmark the same one. `serve` and `kv-bench` take none:
    /// their data-plane agents make tokens of their own (docs/kv.md, "Trust").
    #[arg(long, env = AGENT_TOKEN_ENV, hide_env_values = true, value_parser = parse_agent_token)]
    pub agent_token: Option<String>,
}

/// Where [`EngineOpts::agent_token`] is read from, and handed to child processes.
pub const AGENT_TOKEN_ENV: &str = "FREIGHT_AGENT_TOKEN";

fn parse_agent_token(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("an empty token would let every peer in: give a non-empty one, or none".into());
    }
    Ok(s.to_string())
}

pub fn parse_chunk_size(s: &str) -> Result<u64, String> {
    let n = parse_positive_size(s)?;
    if n > freight_proto::frame::MAX_PAYLOAD {
        return Err(format!(
            "'{s}': the chunk size must be at most {}",
            format_size(freight_proto::frame::MAX_PAYLOAD)
        ));
    }
    Ok(n)
}

impl EngineOpts {
    /// The options again, as a command line (for a child process started alike).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec!["--transport".to_string(), self.transport.as_str().to_string()];
        let mut push = |flag: &str, value: Option<String>| {
            if let Some(value) = value {
                v.extend([flag.to_string(), value]);
            }
        };
        push("--streams", self.streams.map(|n| n.to_string()));
        push("--chunk-size", self.chunk_size.map(|n| n.to_string()));
        push("--window", self.window.map(|n| n.to_string()));
        push("--shm-threads", self.shm_threads.map(|n| n.to_string()));
        if self.no_zerocopy {
            v.push("--no-zerocopy".into());
        }
        if !self.local_addrs.is_empty() {
            let list: Vec<String> = self.local_addrs.iter().map(|a| a.to_string()).collect();
            v.extend(["--local-addrs".to_string(), list.join(",")]);
        }
        if let Some(p) = &self.pin {
            let value = match p {
                Pinning::Off => "off".to_string(),
                Pinning::Numa => "numa".to_string(),
                Pinning::Cores(c) => c.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(","),
            };
            v.extend(["--pin".to_string(), value]);
        }
        v.extend(self.fabric_args());
        if let Some(n) = self.fabric_chunk_size {
            v.extend(["--fabric-chunk-size".to_string(), n.to_string()]);
        }
        if self.fabric_stage_gpu {
            v.push("--fabric-stage-gpu".into());
        }
        v
    }

    /// The environment a child process started alike needs: the token, kept out of
    /// its command line.
    pub fn child_env(&self) -> Vec<(&'static str, String)> {
        self.agent_token.iter().map(|t| (AGENT_TOKEN_ENV, t.clone())).collect()
    }

    fn fabric_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(p) = &self.fabric_provider {
            v.extend(["--fabric-provider".to_string(), p.clone()]);
        }
        if !self.fabric_domains.is_empty() {
            v.extend(["--fabric-domains".to_string(), self.fabric_domains.join(",")]);
        }
        v
    }

    pub fn fabric_config(&self) -> FabricConfig {
        FabricConfig {
            provider: self.fabric_provider.clone(),
            domains: self.fabric_domains.clone(),
            chunk_size: self.fabric_chunk_size.unwrap_or(FabricConfig::default().chunk_size),
            gpu_direct: !self.fabric_stage_gpu,
            ..FabricConfig::default()
        }
    }

    /// The agent configuration these options describe, listening on `listen`.
    pub fn agent_config(&self, listen: &str, require: Option<TransportKind>) -> AgentConfig {
        let tcp = TcpConfig::default();
        let shm = ShmConfig::default();
        AgentConfig {
            listen: listen.to_string(),
            require,
            tcp: TcpConfig {
                streams: self.streams.unwrap_or(tcp.streams),
                chunk_size: self.chunk_size.unwrap_or(tcp.chunk_size),
                window: self.window.unwrap_or(tcp.window),
                zerocopy: tcp.zerocopy && !self.no_zerocopy,
                local_addrs: self.local_addrs.clone(),
                pin: self.pin.clone().unwrap_or(tcp.pin),
            },
            shm: ShmConfig { threads: self.shm_threads.unwrap_or(shm.threads), ..shm },
            fabric: self.fabric_config(),
            token: self.agent_token.as_ref().map(|t| t.as_bytes().to_vec()),
            ..AgentConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4kib"), Ok(4096));
        assert_eq!(parse_size("4KB"), Ok(4000));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("64 MiB"), Ok(64 << 20));
        assert_eq!(parse_size(" 1GB "), Ok(1_000_000_000));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("1.5MiB"), Ok(3 << 19));
        assert_eq!(parse_size("0.5k"), Ok(512));
        assert_eq!(parse_size("12B"), Ok(12));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn bad_sizes_say_why() {
        for bad in ["", "k", "4XB", "-4k", "4.k", ".5k", "1.0000001", "1..2k", "4 k b", "99999999999999999999"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(parse_size("4XB").unwrap_err().contains("unknown size unit"));
        assert!(parse_size("0.3B").unwrap_err().contains("whole number"));
        assert!(parse_size("20000000TiB").unwrap_err().contains("too large"));
        assert!(parse_positive_size("0").is_err());
    }

    #[test]
    fn lists_and_ranges() {
        assert_eq!(parse_size_list("4KiB,64KiB,1MiB").unwrap().0, vec![4096, 65536, 1 << 20]);
        let r = parse_size_list("4KiB:64MiB").unwrap().0;
        assert_eq!(r.len(), 15);
        assert_eq!((r[0], r[14]), (4096, 64 << 20));
        assert_eq!(parse_size_list("1k:16k:4").unwrap().0, vec![1024, 4096, 16384]);
        assert_eq!(parse_size_list("3KiB:13KiB").unwrap().0, vec![3072, 6144, 12288]);
        assert_eq!(parse_size_list("4k,4096,8k").unwrap().0, vec![4096, 8192]);
        assert_eq!(parse_count_list("1,16,128").unwrap().0, vec![1, 16, 128]);
        assert_eq!(parse_count_list("1:8").unwrap().0, vec![1, 2, 4, 8]);
        assert!(parse_count_list("1,,2").is_err());
        assert!(parse_count_list("0,1").is_err());
        assert!(parse_count_list("4k").is_err());
        assert!(parse_size_list("64k:4k").is_err());
        assert!(parse_size_list("1k:4k:1").is_err());
        assert!(parse_size_list("1:2:3:4").is_err());
        assert!(parse_count_list("1:100000000:2").is_ok());
        assert!(parse_count_list(&(1..5000).map(|i| i.to_string()).collect::<Vec<_>>().join(",")).is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("2 fortnights").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(256 << 20), "256 MiB");
        assert_eq!(format_size(3 << 19), "1.5 MiB");
        assert_eq!(format_size(1000), "1000 B");
    }

    #[test]
    fn engine_options_reach_the_config() {
        let o = EngineOpts {
            transport: TransportChoice::Tcp,
            streams: Some(2),
            chunk_size: Some(4096),
            window: None,
            shm_threads: Some(1),
            no_zerocopy: true,
            local_addrs: vec!["10.0.0.1".parse().unwrap(), "10.0.1.1".parse().unwrap()],
            pin: Some(Pinning::Cores(vec![2, 3])),
            fabric_provider: Some("tcp".into()),
            fabric_domains: vec!["a1".into(), "a2".into()],
            fabric_chunk_size: Some(1 << 20),
            fabric_stage_gpu: true,
            agent_token: Some("t0ken".into()),
        };
        assert!(!o.to_args().iter().any(|a| a.contains("t0ken")), "the token stays off command lines");
        assert_eq!(o.child_env(), [(AGENT_TOKEN_ENV, "t0ken".to_string())]);
        assert!(o.to_args().join(" ").ends_with(
            "--no-zerocopy --local-addrs 10.0.0.1,10.0.1.1 --pin 2,3 --fabric-provider tcp --fabric-domains a1,a2 \
             --fabric-chunk-size 1048576 --fabric-stage-gpu"
        ));
        let c = o.agent_config("127.0.0.1:0", o.transport.require());
        assert!(!c.tcp.zerocopy);
        assert_eq!(c.tcp.local_addrs, o.local_addrs);
        assert_eq!(c.tcp.pin, Pinning::Cores(vec![2, 3]));
        assert_eq!(c.fabric.provider.as_deref(), Some("tcp"));
        assert_eq!((c.fabric.domains.len(), c.fabric.chunk_size), (2, 1 << 20));
        assert!(!c.fabric.gpu_direct);
        assert_eq!(c.token.as_deref(), Some(&b"t0ken"[..]));
        assert!(parse_agent_token("").is_err());
        assert_eq!(
            (c.tcp.streams, c.tcp.chunk_size, c.tcp.window, c.shm.threads),
            (2, 4096, TcpConfig::default().window, 1)
        );
        assert_eq!(c.require, Some(TransportKind::Tcp));
        assert!(parse_chunk_size("2GiB").is_err());
        assert!(parse_small_positive("0").is_err());
    }
}
