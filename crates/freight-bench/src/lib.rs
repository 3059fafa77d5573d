//! freight's benchmark programs, run by the `freight` command: `freight bench p2p |
//! descriptors | pipe | channel | storage | cache-engine` ([`BenchCommand`]) and
//! `freight kv-bench` ([`kv_bench`]), each printing an aligned table or JSON; and the
//! two-process harness they share with `freight demo` ([`target`]: a target process
//! started as a child, what the two say to each other, and the [`pattern`] every moved
//! byte is checked against).
//!
//! The statistics every program reports, and how they are defined (percentiles by
//! nearest rank), are [`stats`]'s: the same definition as bench/reporting.py, which
//! the scripts under bench/ use for freight and its peers alike.

mod descriptors;
pub mod host_memory;
pub mod kv_bench;
mod measure;
pub mod mesh;
pub mod options;
mod p2p;
pub mod pattern;
pub mod report;
pub mod stats;
mod stream;
pub mod target;

use std::io::Write;
use std::time::Duration;

use clap::Subcommand;
use freight_core::{Request, Status};

use crate::options::{CliError, CliResult};

/// What commands need from the invocation besides their own arguments.
pub struct Context {
    /// How to start this same command again (for a target or member process).
    pub self_command: Vec<String>,
    /// The log options (`--log-level`, `--log-format`) passed on to child processes,
    /// so that every process logs alike.
    pub log_args: Vec<String>,
}

/// Writes to stdout in one piece; a closed pipe (`| head`) is a quiet failure, not a panic.
pub fn emit(text: &str) -> CliResult<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| CliError::runtime(format!("cannot write to stdout: {e}")))
}

/// Generous: a stalled transfer should fail with a message, not hang a benchmark forever.
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);

/// Waits for `req`, naming `what` in the error where it fails or does not finish.
pub fn wait_done(req: &Request, what: &str) -> CliResult<()> {
    match req.wait(Some(TRANSFER_TIMEOUT)) {
        Status::Done => Ok(()),
        Status::Error(e) => Err(CliError::runtime(format!("{what} failed: {e}"))),
        other => Err(CliError::runtime(format!(
            "{what} did not finish within {}s (status {other:?})",
            TRANSFER_TIMEOUT.as_secs()
        ))),
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Transfers between two processes, like nixlbench: bandwidth and prepare/post/transfer
    /// latencies per block size and batch size, every row verified first.
    P2p(Box<p2p::P2pArgs>),
    /// Descriptor handling in one process: registering regions, preparing local, remote
    /// and strided descriptor lists, building requests.
    Descriptors(descriptors::DescriptorArgs),
    /// Disaggregated prefill's pipe: objects streamed through a bounded buffer in the
    /// receiver's memory (a second process), verified, timed over rounds.
    Pipe(Box<stream::StreamArgs>),
    /// The same run as keyed objects over a channel, sent in batches.
    Channel(Box<stream::StreamArgs>),
    /// The same run put into a keyed store on the receiver, committed in batches
    /// (--commit-size), with per-commit transfer and wait-for-receiver times.
    Storage(Box<stream::StreamArgs>),
    /// The KV cache engine: the sender stores a prompt's KV cache in chunks
    /// (--num-chunks of --chunk-tokens tokens), put to the receiver's engine, which
    /// retrieves them into its own KV memory.
    #[command(name = "cache-engine")]
    CacheEngine(Box<stream::StreamArgs>),
    /// MoE expert parallelism (dispatch/combine across GPU ranks beside NCCL) is not a
    /// command: it needs PyTorch and NCCL, which the wheel does not ship, so it is a
    /// script of the source tree, bench/ep_bench.py (this says so).
    #[command(disable_help_flag = true, hide = true)]
    Ep {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
}

pub fn run(cmd: &BenchCommand, ctx: &Context) -> CliResult<()> {
    match cmd {
        BenchCommand::P2p(a) => p2p::run(a, ctx),
        BenchCommand::Descriptors(a) => descriptors::run(a),
        BenchCommand::Pipe(a) => stream::run(stream::Product::Pipe, a, ctx),
        BenchCommand::Channel(a) => stream::run(stream::Product::Channel, a, ctx),
        BenchCommand::Storage(a) => stream::run(stream::Product::Storage, a, ctx),
        BenchCommand::CacheEngine(a) => stream::run(stream::Product::CacheEngine, a, ctx),
        BenchCommand::Ep { .. } => Err(CliError::usage(
            "freight bench ep: the expert-parallel benchmark is a script of freight's source tree, not a \
             freight command: run python bench/ep_bench.py (same options) from a checkout, since it needs \
             PyTorch and NCCL, which the freight wheel does not ship",
        )),
    }
}
