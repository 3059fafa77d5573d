//! The `freight` command line, as a library so that the Python wheel can expose it too:
//! the binary and `python -m freight` both end up in [`run`].

mod demo;
mod doctor;
pub mod logs;
mod serve;

/// The options and values the commands share (`freight_bench::options`).
pub use freight_bench::options as args;
use freight_bench::{kv_bench, mesh, target, BenchCommand, Context};

use std::io::IsTerminal;

use clap::{Parser, Subcommand};

use freight_bench::options::{CliError, CliResult};

const ABOUT: &str = "freight: moves bytes between the registered memory of processes \
(shared memory on one host, tcp across hosts), with prepared, batched, notified transfers.";

const AFTER_HELP: &str = "\
Examples:
  freight demo                                   move 256 MiB to a second process and back, verified
  freight bench p2p --block-sizes 4KiB,1MiB      time transfers between two processes
  freight bench p2p --role target --listen 0.0.0.0:7000      (host A)
  freight bench p2p --connect HOST_A:7000                    (host B)
  freight bench descriptors                      time registration and descriptor preparation
  freight serve --memory-mb 4096                 a KV cache server on [::1]:50051
  freight kv-bench --value-size 64KiB            its read throughput and latency (--embedded: in-process)

Logs: --log-level, else the FREIGHT_LOG or RUST_LOG variable (e.g. FREIGHT_LOG=freight_core=debug);
--log-format json (or FREIGHT_LOG_FORMAT=json) for one JSON object per line.";

#[derive(Debug, Parser)]
#[command(name = "freight", version, about = ABOUT, after_help = AFTER_HELP, propagate_version = true)]
struct Cli {
    /// Engine log level on stderr: error, warn, info, debug, trace, off, or a filter such
    /// as freight_core=debug,warn [default: the FREIGHT_LOG variable, else RUST_LOG, else warn].
    #[arg(long, global = true, value_name = "LEVEL")]
    log_level: Option<String>,

    /// How log records are written: text, or json (one object per line) [default: the
    /// FREIGHT_LOG_FORMAT variable, else text].
    #[arg(long, global = true, value_name = "FORMAT", ignore_case = true)]
    log_format: Option<logs::Format>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Move a buffer to a second process and back over shm and tcp, verifying every byte
    /// (needs no GPU and nothing else running).
    Demo(demo::DemoArgs),
    /// Benchmarks: transfers between two processes (p2p), descriptor handling
    /// (descriptors), disaggregated prefill (pipe, channel, storage, cache-engine). MoE
    /// expert parallelism's is the script bench/ep_bench.py of the source tree.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
    /// The KV cache server: values in a memory pool, a gRPC control plane, a zero-copy
    /// data plane through the engine.
    #[command(alias = "kv-server")]
    Serve(serve::ServeArgs),
    /// The P/D proxy of disaggregated serving: an OpenAI-compatible front before
    /// prefill and decode vLLM instances. Runs on aiohttp, so the Python package
    /// implements it (`freight proxy --help` from the installed `freight` command).
    #[command(disable_help_flag = true)]
    Proxy {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
    /// Read throughput and latency of a KV server: write phase, warmup, concurrent
    /// reads, latency of random GETs (against --server-addr, or --embedded).
    KvBench(kv_bench::KvBenchArgs),
    /// What a performance investigation needs to know about this machine: CPUs, NUMA
    /// nodes, NICs (speed, MTU, NUMA node, IRQ affinity), GPUs and their closest NICs,
    /// GPU peer access, libfabric providers. Needs no GPU.
    Doctor(doctor::DoctorArgs),
    /// The target side of `demo` and `bench p2p`, started by them as a child process.
    #[command(name = target::SUBCOMMAND, hide = true)]
    Target(target::TargetArgs),
    /// One process of `bench p2p --full-mesh`, started by it.
    #[command(name = mesh::SUBCOMMAND, hide = true)]
    MeshMember(mesh::MemberArgs),
}

/// Runs the CLI. `args` is the full argument vector (`args[0]` is the program name);
/// `self_command` is how to start this CLI again in a child process (e.g. the binary's
/// path, or `[python, -m, freight]`). Returns the process exit code: 0 on success, 1 when
/// the work failed, 2 for usage errors.
pub fn run(args: Vec<String>, self_command: Vec<String>) -> i32 {
    let cli = match Cli::try_parse_from(&args) {
        Ok(c) => c,
        Err(e) => {
            // Help and version also arrive here, with exit code 0.
            let _ = e.print();
            return e.exit_code();
        }
    };
    let self_command = if self_command.is_empty() { args.first().cloned().into_iter().collect() } else { self_command };
    let result = init_logging(cli.log_level.as_deref(), cli.log_format).and_then(|()| {
        // Child processes (targets, mesh members) log as this one does.
        let mut log_args = Vec::new();
        if let Some(level) = &cli.log_level {
            log_args.extend(["--log-level".to_string(), level.clone()]);
        }
        if let Some(format) = cli.log_format {
            log_args.extend(["--log-format".to_string(), format.name().to_string()]);
        }
        let ctx = Context { self_command, log_args };
        match &cli.command {
            Command::Demo(a) => demo::run(a, &ctx),
            Command::Bench { which } => freight_bench::run(which, &ctx),
            Command::Serve(a) => serve::run(a),
            // Only the native binary gets here: the Python package's `freight` takes
            // `proxy` before the native CLI sees it.
            Command::Proxy { .. } => Err(CliError::usage(
                "the proxy runs on aiohttp, so only the Python package's `freight` command runs it \
                 (`python -m freight proxy`), not this binary",
            )),
            Command::KvBench(a) => kv_bench::run(a),
            Command::Doctor(a) => doctor::run(a),
            Command::Target(a) => target::run_child(a),
            Command::MeshMember(a) => mesh::run_member(a),
        }
    });
    match result {
        Ok(()) => 0,
        Err(e) => {
            match &e {
                CliError::Usage(m) => {
                    eprintln!("error: {m}\n\nFor more information, try '--help'.")
                }
                CliError::Runtime(m) => eprintln!("freight: error: {m}"),
            }
            e.exit_code()
        }
    }
}

/// Warnings and errors by default; `--log-level`, `FREIGHT_LOG` or `RUST_LOG` (a level,
/// or an env-filter expression such as `freight_core=debug`) shows more. A bad level,
/// given or in the environment, is a usage error: logging nothing is no answer to it.
const DEFAULT_FILTER: &str = "warn";

fn init_logging(level: Option<&str>, format: Option<logs::Format>) -> CliResult<()> {
    let filter = match level {
        Some(l) => logs::filter(l).map_err(|e| CliError::usage(format!("--log-level '{l}': {e}")))?,
        None => match logs::filter_from_env().map_err(CliError::usage)? {
            Some((filter, _var)) => filter,
            None => tracing_subscriber::EnvFilter::new(DEFAULT_FILTER),
        },
    };
    let format = match format {
        Some(f) => f,
        None => logs::Format::from_env().map_err(CliError::usage)?.unwrap_or_default(),
    };
    // Colours only for a person: escape codes would litter a log file or a pipe.
    let ansi = std::io::stderr().is_terminal();
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A host process (Python) may call run() more than once: the first subscriber stays.
    let _ = match format {
        logs::Format::Text => fmt.with_ansi(ansi).try_init(),
        logs::Format::Json => fmt.json().with_ansi(false).try_init(),
    };
    Ok(())
}
