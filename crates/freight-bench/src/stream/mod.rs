//! `freight bench pipe | channel | storage | cache-engine`: the disaggregated-prefill
//! benchmarks. A sender streams `--num-objs` objects of `--obj-size` bytes per round to a
//! receiver, through a pipe whose buffer (`--buffer-size`, in the receiver's memory) may
//! be far smaller than a round; `channel` sends them as keyed objects in batches;
//! `storage` puts them into a keyed store on the receiver, committed `--commit-size` at
//! a time, and the receiver gets each by key; `cache-engine` stores a prompt's KV cache
//! in chunks through a cache engine whose remote peer is the receiver's engine, which
//! retrieves them into its own KV memory (see [`cache`]).
//!
//! A run starts with a verification round, whose every byte the receiver checks, then
//! times `--num-rounds` rounds. With `--simulate-work` both sides also pretend to
//! compute (the sender 50 ms per 10 objects, the receiver 20 ms per 10), and a round of
//! transfers alone is timed first, so that the overlap shows: a round with work should
//! take about max(work, transfer), not their sum.

mod buffers;
mod cache;
mod local;
mod receiver;
mod sender;

use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::options::{format_size, parse_duration, parse_positive_size, CliError, CliResult, EngineOpts, SIZE_GRAMMAR};
use crate::target::child::TargetProcess;
use crate::Context;

pub use buffers::Device;

/// After [`SIZE_GRAMMAR`] in the help's footer.
const AFTER_HELP: &str = "\
The seed's runs (two GPUs; the receiver is started as a child process on the next GPU):
  freight bench pipe --num-objs 500 --obj-size 32MiB --buffer-size 4GiB
  freight bench pipe --num-rounds 5 --num-objs 500 --simulate-work
  freight bench channel --num-objs 1000 --batch-size 30 --simulate-work
  freight bench storage --num-objs 500
  freight bench cache-engine --num-chunks 500 --num-rounds 5

Two shells or two hosts: start the receiver, then the sender:
  freight bench pipe --role receiver --listen 0.0.0.0:7100 --device cuda:1
  freight bench pipe --role sender --connect RECEIVER_IP:7100 --device cuda:0

The receiver takes the run's shape (objects, sizes, rounds, work) from the sender.";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StreamRole {
    /// Send, and start the receiver as a child process (or use --connect).
    Auto,
    /// Send to a receiver given with --connect.
    Sender,
    /// Own the pipe's buffer and receive one sender's run, then exit.
    Receiver,
    /// cache-engine only: one process, the KV memory on --device and the chunks in
    /// (pinned) host memory; stores and retrieves beside the pinned copy bandwidth.
    Local,
}

/// What sizes a cache-engine run: its chunks are KV, --obj-size plays no part.
const KV_SIZE_OPTIONS: &str =
    "--num-chunks, --chunk-tokens or the KV shape (--kv-layers, --kv-heads, --head-dim, --elem-bytes)";

/// Which product carries the objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Product {
    Pipe,
    Channel,
    Storage,
    CacheEngine,
}

impl Product {
    fn command(self) -> &'static str {
        match self {
            Product::Pipe => "pipe",
            Product::Channel => "channel",
            Product::Storage => "storage",
            Product::CacheEngine => "cache-engine",
        }
    }

    /// The options that shrink a run's host memory, for the message that refuses one.
    /// The cache engine sizes its objects by the KV shape, not by --obj-size.
    pub fn host_remedy(self) -> String {
        let what = match self {
            Product::CacheEngine => format!("{KV_SIZE_OPTIONS}, --tier-size or --buffer-size"),
            _ => "--num-objs or --obj-size (or --buffer-size)".to_string(),
        };
        format!("lower {what}, or keep the data on a GPU with --device cuda")
    }
}

#[derive(Debug, Clone, Args)]
#[command(after_help = format!("{SIZE_GRAMMAR}.\n\n{AFTER_HELP}"))]
pub struct StreamArgs {
    /// auto: send, with a receiver started as a child process; sender; receiver; local
    /// (cache-engine only).
    #[arg(long, value_enum, default_value_t = StreamRole::Auto)]
    pub role: StreamRole,

    /// Receiver: address to listen on.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:0")]
    pub listen: String,

    /// Sender: the receiver's address, as it printed it (implies --role sender).
    #[arg(long, value_name = "IP:PORT")]
    pub connect: Option<String>,

    /// Objects per round (cache-engine: chunks per round).
    #[arg(long, alias = "num-chunks", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub num_objs: u64,

    /// Size of each object (cache-engine: set by the KV shape instead).
    #[arg(long, value_name = "SIZE", default_value = "32MiB", value_parser = parse_positive_size)]
    pub obj_size: u64,

    /// Receiver: size of the pipe's buffer, in the receiver's memory.
    #[arg(long, value_name = "SIZE", default_value = "4GiB", value_parser = parse_positive_size)]
    pub buffer_size: u64,

    /// Timed rounds.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub num_rounds: u32,

    /// channel, storage: objects per send call (a batch fills one or more pipe messages).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub batch_size: u64,

    /// storage: objects per commit (a commit returns once the receiver holds them all).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub commit_size: u64,

    /// Pretend to compute: the sender 50 ms per 10 objects, the receiver 20 ms per 10.
    #[arg(long, alias = "simulate-workload")]
    pub simulate_work: bool,

    /// Where this process keeps its data: cpu, cuda, cuda:N, or auto (a GPU when there
    /// is one: the sender's first, the receiver child's second).
    #[arg(long, default_value = "auto")]
    pub device: String,

    /// Skip the verification round (every byte of it is checked by default).
    #[arg(long)]
    pub no_verify: bool,

    /// Bound on every wait (a pipe to open, room in the buffer, the next message).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub timeout: Duration,

    #[command(flatten)]
    pub kv: cache::KvArgs,

    #[command(flatten)]
    pub engine: EngineOpts,

    /// Print the results as JSON on stdout (the narration goes to stderr).
    #[arg(long)]
    pub json: bool,

    /// Set on the receiver a sender starts: exit when the sender goes away.
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
}

/// What kind of round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Round {
    /// Every byte checked by the receiver; not timed.
    Verify,
    /// Transfers alone, timed.
    Transfer,
    /// Transfers with simulated work on both sides, timed.
    Work,
}

/// The run's shape, sent by the sender in the pipe's first message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub product: Product,
    pub num_objs: u64,
    pub obj_size: u64,
    pub batch_size: u64,
    pub commit_size: u64,
    pub rounds: Vec<Round>,
    /// cache-engine: the KV geometry.
    pub kv: Option<cache::KvSpec>,
}

impl Shape {
    pub fn from_args(product: Product, a: &StreamArgs) -> Shape {
        let mut rounds = Vec::new();
        if !a.no_verify {
            rounds.push(Round::Verify);
        }
        if a.simulate_work {
            rounds.push(Round::Transfer);
        }
        let timed = if a.simulate_work { Round::Work } else { Round::Transfer };
        rounds.extend(std::iter::repeat(timed).take(a.num_rounds as usize));
        let kv = (product == Product::CacheEngine).then(|| cache::KvSpec::from_args(&a.kv));
        Shape {
            product,
            num_objs: a.num_objs,
            obj_size: kv.as_ref().map_or(a.obj_size, |k| k.chunk_bytes()),
            batch_size: a.batch_size,
            commit_size: a.commit_size,
            rounds,
            kv,
        }
    }

    pub fn round_bytes(&self) -> u64 {
        self.num_objs * self.obj_size
    }
}

/// The pattern seed of object `i` (objects differ, so a misplaced one is caught).
pub fn seed_of(i: u64) -> u64 {
    0x5eed_0000 + i
}

/// Simulated work: `ms_per_10` milliseconds for every 10 objects.
pub fn work_after(objects_done: u64, ms_per_10: u64) -> Option<Duration> {
    (objects_done % 10 == 0).then(|| Duration::from_millis(ms_per_10))
}

/// What this process does, after the role options were checked against each other.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Plan {
    Receiver,
    Local,
    Sender { connect: Option<String> },
}

fn plan(a: &StreamArgs) -> CliResult<Plan> {
    match (a.role, &a.connect) {
        (StreamRole::Receiver, Some(_)) => Err(CliError::usage("--role receiver listens; --connect is for the sender")),
        (StreamRole::Receiver, None) => Ok(Plan::Receiver),
        (StreamRole::Local, None) => Ok(Plan::Local),
        (StreamRole::Local, Some(_)) => Err(CliError::usage("--role local runs in one process; drop --connect")),
        (StreamRole::Sender, None) => {
            Err(CliError::usage("--role sender needs --connect IP:PORT (the address a --role receiver printed)"))
        }
        (_, connect) => Ok(Plan::Sender { connect: connect.clone() }),
    }
}

pub fn run(product: Product, a: &StreamArgs, ctx: &Context) -> CliResult<()> {
    if product == Product::CacheEngine && a.simulate_work {
        return Err(CliError::usage("cache-engine has no --simulate-work (pipe, channel and storage do)"));
    }
    if a.obj_size.checked_mul(a.num_objs).is_none() {
        return Err(CliError::usage("--num-objs x --obj-size is too large"));
    }
    let plan = plan(a)?;
    if product == Product::CacheEngine {
        // Before a receiver starts: one that waits for chunks a sender never sends only
        // adds its own complaint to the sender's.
        cache::KvSpec::from_args(&a.kv).check(a.num_objs, matches!(plan, Plan::Sender { .. }))?;
    }
    match plan {
        Plan::Receiver => receiver::run(product, a),
        Plan::Local if product == Product::CacheEngine => local::run_local(a),
        Plan::Local => Err(CliError::usage("--role local is for cache-engine only")),
        Plan::Sender { connect: Some(addr) } => sender::run(product, a, &addr),
        Plan::Sender { connect: None } => {
            check_both_sides(product, a)?;
            let child = spawn_receiver(product, a, ctx)?;
            let sent = sender::run(product, a, &child.addr);
            // The receiver's verdict counts as much as ours.
            let received = child.finish();
            sent.and(received)
        }
    }
}

/// Where this process starts the receiver, it knows both sides' options: what cannot
/// work is refused before either process starts. An object a pipe cannot hold; and,
/// with the data in host memory, the sender's objects, the receiver's buffer and (for
/// the cache engine) the receiver's KV memory must all fit.
fn check_both_sides(product: Product, a: &StreamArgs) -> CliResult<()> {
    if product == Product::Pipe && a.obj_size > a.buffer_size {
        return Err(CliError::usage(format!(
            "bench pipe sends each object whole: --obj-size {} does not fit in --buffer-size {} \
             (bench channel splits large objects)",
            format_size(a.obj_size),
            format_size(a.buffer_size)
        )));
    }
    if Device::parse(&a.device, 0)? != Device::Cpu {
        return Ok(());
    }
    let shape = Shape::from_args(product, a);
    let round = shape.round_bytes();
    // The cache engine's receiver retrieves into KV memory of a round, and the sender's
    // local tier is host memory too, as much of it as the run's chunks fill.
    let (receiver_kv, sender_tier) = match &shape.kv {
        Some(kv) => (round, kv.tier_size.min(round.saturating_mul(shape.rounds.len() as u64))),
        None => (0, 0),
    };
    let needed = round.saturating_add(a.buffer_size).saturating_add(receiver_kv).saturating_add(sender_tier);
    crate::host_memory::ensure_room(
        needed,
        &format!("bench {} (sender and receiver)", product.command()),
        &product.host_remedy(),
    )
}

fn spawn_receiver(product: Product, a: &StreamArgs, ctx: &Context) -> CliResult<TargetProcess> {
    let device = match Device::parse(&a.device, 1)? {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(n) if a.device.trim().eq_ignore_ascii_case("auto") => Device::Cuda(n).name(),
        // An explicit GPU for the sender: the receiver takes the next one, as in the seed.
        Device::Cuda(n) => {
            let count = freight_cuda::driver::device_count().unwrap_or(1).max(1);
            Device::Cuda((n + 1) % count).name()
        }
    };
    let mut args: Vec<String> = vec!["bench".into(), product.command().into(), "--role".into(), "receiver".into()];
    args.extend(["--listen".into(), "127.0.0.1:0".into(), "--device".into(), device, "--exit-with-parent".into()]);
    args.extend(["--buffer-size".into(), a.buffer_size.to_string()]);
    args.extend(["--timeout".into(), format!("{}us", a.timeout.as_micros())]);
    args.extend(a.engine.to_args());
    TargetProcess::spawn_with(&ctx.self_command, &args, &ctx.log_args, &a.engine.child_env())
}

impl Product {
    /// Whether a round ends for the sender before the receiver is done with it (the
    /// store holds the objects, the receiver still reads them): then the receiver says
    /// when it is done, and the sender waits for that before the next round, so that
    /// no round's time is shared with the receiver's work on the one before.
    fn needs_round_sync(self) -> bool {
        matches!(self, Product::Storage | Product::CacheEngine)
    }
}

/// What the receiver says when it is done with round `r` (an engine notification).
fn round_done(r: usize) -> Vec<u8> {
    format!("freight-bench round {r} done").into_bytes()
}

/// The receiver's side of the round handshake.
pub fn say_round_done(agent: &freight_core::Agent, sender: &str, r: usize) -> CliResult<()> {
    Ok(agent.notify(sender, round_done(r))?)
}

/// The sender's side: waits (untimed) until the receiver is done with round `r`.
pub fn wait_round_done(agent: &std::sync::Arc<freight_core::Agent>, r: usize, timeout: Duration) -> CliResult<()> {
    // The router owns the agent's notifications while a pipe is open.
    let router = freight_stream::router::Router::of(agent);
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(CliError::runtime(format!("the receiver did not finish round {r} in time")));
        }
        if router.wait_foreign(left).iter().any(|n| n.msg == round_done(r)) {
            return Ok(());
        }
    }
}

/// Gigabytes (10^9) per second.
pub fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// Mean and sample standard deviation.
pub fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64 } else { 0.0 };
    (mean, var.sqrt())
}

/// Narration: stdout, or stderr when stdout carries JSON.
pub fn say(json: bool, line: &str) {
    use std::io::Write;
    if json {
        eprintln!("{line}");
    } else {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: StreamArgs,
    }

    fn args(v: &[&str]) -> StreamArgs {
        Cli::try_parse_from(std::iter::once("x").chain(v.iter().copied())).unwrap().a
    }

    #[test]
    fn roles_are_checked() {
        assert_eq!(plan(&args(&[])).unwrap(), Plan::Sender { connect: None });
        assert_eq!(plan(&args(&["--role", "receiver"])).unwrap(), Plan::Receiver);
        assert_eq!(plan(&args(&["--role", "local"])).unwrap(), Plan::Local);
        assert!(matches!(plan(&args(&["--role", "local", "--connect", "1.2.3.4:5"])), Err(CliError::Usage(_))));
        assert_eq!(
            plan(&args(&["--connect", "1.2.3.4:5"])).unwrap(),
            Plan::Sender { connect: Some("1.2.3.4:5".into()) }
        );
        assert!(matches!(plan(&args(&["--role", "sender"])), Err(CliError::Usage(_))));
        assert!(matches!(plan(&args(&["--role", "receiver", "--connect", "1.2.3.4:5"])), Err(CliError::Usage(_))));
    }

    #[test]
    fn the_shape_lists_verification_transfer_and_work_rounds() {
        let s = Shape::from_args(Product::Pipe, &args(&["--num-rounds", "2"]));
        assert_eq!(s.rounds, vec![Round::Verify, Round::Transfer, Round::Transfer]);
        let s = Shape::from_args(Product::Channel, &args(&["--num-rounds", "2", "--simulate-work", "--no-verify"]));
        assert_eq!(s.rounds, vec![Round::Transfer, Round::Work, Round::Work]);
        assert_eq!(s.round_bytes(), 500 * (32 << 20));
        let s = Shape::from_args(Product::Pipe, &args(&["--simulate-workload"]));
        assert_eq!(s.rounds, vec![Round::Verify, Round::Transfer, Round::Work]);
    }

    #[test]
    fn what_cannot_work_is_refused_before_the_receiver_starts() {
        let fits = args(&["--device", "cpu", "--num-objs", "4", "--obj-size", "1MiB", "--buffer-size", "8MiB"]);
        check_both_sides(Product::Pipe, &fits).unwrap();
        let whole = args(&["--device", "cpu", "--num-objs", "4", "--obj-size", "16MiB", "--buffer-size", "8MiB"]);
        let err = check_both_sides(Product::Pipe, &whole).unwrap_err().to_string();
        assert!(err.contains("does not fit"), "{err}");
        // Split by the channel: fine.
        check_both_sides(Product::Channel, &whole).unwrap();
        // A petabyte of objects in host memory.
        let huge = args(&["--device", "cpu", "--num-objs", "1000", "--obj-size", "1TiB"]);
        let err = check_both_sides(Product::Channel, &huge).unwrap_err().to_string();
        assert!(err.contains("of host memory") && err.contains("--num-objs"), "{err}");
    }

    #[test]
    fn a_cache_engine_run_too_large_for_the_host_names_the_options_that_size_it() {
        let huge = args(&["--device", "cpu", "--num-chunks", "1000000", "--chunk-tokens", "100000"]);
        let err = check_both_sides(Product::CacheEngine, &huge).unwrap_err().to_string();
        assert!(
            err.contains("of host memory") && err.contains("--num-chunks") && err.contains("--chunk-tokens"),
            "{err}"
        );
        assert!(!err.contains("--obj-size") && !err.contains("--num-objs"), "{err}");
    }

    #[test]
    fn a_cache_engine_run_the_engines_would_refuse_is_refused_before_the_receiver_starts() {
        let ctx = Context { self_command: vec!["/nonexistent/freight".into()], log_args: Vec::new() };
        let run_with = |v: &[&str]| run(Product::CacheEngine, &args(v), &ctx).unwrap_err();
        let err = run_with(&["--device", "cpu", "--num-chunks", "4", "--tier-size", "1k"]);
        assert!(matches!(&err, CliError::Usage(m) if m.contains("--tier-size 1 KiB cannot hold one chunk")), "{err}");
        let err = run_with(&["--device", "cpu", "--num-chunks", "4", "--block-size", "7"]);
        assert!(matches!(&err, CliError::Usage(m) if m.contains("--block-size 7")), "{err}");
        let err = run_with(&["--num-chunks", "1000000", "--chunk-tokens", "1000000", "--kv-layers", "10000"]);
        assert!(matches!(&err, CliError::Usage(m) if m.contains("exceed 2^64 bytes")), "{err}");
        // The receiver's tier holds one chunk whatever --tier-size says.
        cache::KvSpec::from_args(&args(&["--tier-size", "1k"]).kv).check(4, false).unwrap();
    }

    #[test]
    fn the_help_states_every_size_unit() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("T/TiB") && help.contains("The seed's runs"), "{help}");
    }

    #[test]
    fn bad_options_are_usage_errors() {
        for bad in [
            &["--num-objs", "0"][..],
            &["--obj-size", "0"],
            &["--num-rounds", "0"],
            &["--batch-size", "0"],
            &["--commit-size", "0"],
        ] {
            assert!(Cli::try_parse_from(std::iter::once("x").chain(bad.iter().copied())).is_err(), "{bad:?}");
        }
        assert!(Device::parse("tpu", 0).is_err());
        assert_eq!(Device::parse("cuda:3", 0).unwrap(), Device::Cuda(3));
        assert_eq!(Device::parse("CPU", 0).unwrap(), Device::Cpu);
    }

    #[test]
    fn statistics() {
        assert_eq!(mean_std(&[2.0, 4.0]), (3.0, 2f64.sqrt()));
        assert_eq!(mean_std(&[5.0]), (5.0, 0.0));
        assert_eq!(gbps(2_000_000_000, 2.0), 1.0);
        assert_eq!(work_after(20, 50), Some(Duration::from_millis(50)));
        assert_eq!(work_after(21, 50), None);
    }
}
