//! `freight bench`: measurements, printed as aligned tables or as JSON.

mod descriptors;
mod measure;
pub mod mesh;
mod p2p;
pub(crate) mod report;
mod stream;

use clap::Subcommand;

use crate::args::{CliError, CliResult};
use crate::Context;

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
    /// MoE expert parallelism: dispatch/combine across GPU ranks beside an NCCL
    /// all_to_all baseline. Runs on PyTorch, so the Python package implements it
    /// (`freight bench ep --help` from the installed `freight` command).
    #[command(disable_help_flag = true)]
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
        // Only the native binary gets here: the Python package's `freight` takes `bench
        // ep` (with --log-level anywhere) before the native CLI sees it.
        BenchCommand::Ep { .. } => Err(CliError::usage(
            "bench ep runs on PyTorch, so only the Python package's `freight` command runs it \
             (`python -m freight bench ep`), not this binary",
        )),
    }
}
