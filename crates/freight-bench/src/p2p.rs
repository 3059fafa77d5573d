//! `freight bench p2p`: nixlbench's point-to-point benchmark for freight. An initiator
//! moves batches of blocks to or from a target process, row by row over a grid of block
//! and batch sizes, and reports bandwidth and latencies.

use std::io::IsTerminal;
use std::time::Duration;

use clap::{Args, ValueEnum};
use freight_core::{Agent, Desc, DescList, OpKind, SharedSegment};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::measure::{Budget, Mode, RowResult, Runner};
use super::report::{p2p_header, p2p_json, p2p_table};
use crate::options::{
    format_size, parse_count_list, parse_duration, parse_positive_size, parse_size_list, resolve_addr, CliError,
    CliResult, EngineOpts, NumList, SegKind, SIZE_GRAMMAR,
};
use crate::target::child::{Link, TargetProcess};
use crate::{emit, target, Context};

/// After [`SIZE_GRAMMAR`] in the help's footer.
const AFTER_HELP: &str = "\
Lists are comma-separated values and ranges lo:hi (doubling) or lo:hi:factor, e.g. 4KiB:1MiB,64MiB.

Every row is verified before it is timed. The defaults keep a run short on a small machine
(block x batch at most 64 MiB, 50 iterations). A full run, nixlbench style:
  freight bench p2p --iters 1000 --warmup 100 --max-request-bytes 1GiB
  freight bench p2p --total-bytes 256MiB --block-sizes 4KiB:64MiB --mode oneshot --json

Two hosts (or two shells): start the target, then the initiator:
  freight bench p2p --role target --listen 0.0.0.0:7000
  freight bench p2p --role initiator --connect TARGET_IP:7000 --transport tcp";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Be the initiator and start the target as a child process (or use --connect).
    Auto,
    /// Drive the benchmark against a target given with --connect.
    Initiator,
    /// Own the buffer and serve one initiator, then exit. --listen and the engine
    /// options apply (give it the initiator's); the initiator decides the rest.
    Target,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Op {
    /// The initiator pulls from the target's memory.
    #[value(name = "READ")]
    Read,
    /// The initiator pushes into the target's memory.
    #[value(name = "WRITE")]
    Write,
}

impl Op {
    pub(super) fn kind(self) -> OpKind {
        match self {
            Op::Read => OpKind::Read,
            Op::Write => OpKind::Write,
        }
    }
}

#[derive(Debug, Args)]
#[command(after_help = format!("{SIZE_GRAMMAR}.\n{AFTER_HELP}"))]
pub struct P2pArgs {
    /// Which side this process plays.
    #[arg(long, value_enum, default_value_t = Role::Auto)]
    pub(super) role: Role,

    /// Target: address to listen on (port 0 picks one; the address is printed).
    /// Initiator: address the target connects back to with its answers
    /// [default: 127.0.0.1:0, or 0.0.0.0:0 when --connect is not a loopback address].
    #[arg(long, value_name = "IP:PORT")]
    pub(super) listen: Option<String>,

    /// Address of a target started with --role target, as IP:PORT or HOST:PORT
    /// (implies --role initiator).
    #[arg(long, value_name = "HOST:PORT")]
    pub(super) connect: Option<String>,

    /// Direction, seen from the initiator.
    #[arg(long, value_enum, default_value_t = Op::Write, ignore_case = true)]
    pub(super) op: Op,

    /// Memory the initiator's buffer is registered as (its buffers are host memory, so
    /// only DRAM moves here; the engine refuses the others with its reason).
    #[arg(long, value_enum, value_name = "KIND", default_value_t = SegKind::Dram, ignore_case = true)]
    pub(super) initiator_seg: SegKind,

    /// Memory the target's buffer is registered as (see --initiator-seg).
    #[arg(long, value_enum, value_name = "KIND", default_value_t = SegKind::Dram, ignore_case = true)]
    pub(super) target_seg: SegKind,

    /// Block sizes (one descriptor each): a list like 4KiB,64KiB,1MiB and/or ranges lo:hi
    /// (doubling).
    #[arg(long, value_name = "LIST", default_value = "4KiB:64MiB", value_parser = parse_size_list)]
    pub(super) block_sizes: NumList,

    /// Descriptors per request: a list like 1,16,128 and/or ranges lo:hi (doubling)
    /// [default: 1,16,128].
    #[arg(long, value_name = "LIST", value_parser = parse_count_list, conflicts_with = "total_bytes")]
    pub(super) batch_sizes: Option<NumList>,

    /// Instead of --batch-sizes: bytes per request; each row's batch size is this divided
    /// by its block size (rounded down).
    #[arg(long, value_name = "SIZE", value_parser = parse_positive_size)]
    pub(super) total_bytes: Option<u64>,

    /// Skip rows whose block x batch exceeds this; bounds run time and the buffers (one of
    /// this size on each side). Not applied with --total-bytes.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_positive_size)]
    pub(super) max_request_bytes: u64,

    /// How each iteration gets its request.
    #[arg(long, value_enum, default_value_t = Mode::Prepared)]
    pub(super) mode: Mode,

    #[command(flatten)]
    pub(super) engine: EngineOpts,

    /// Timed iterations per row.
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = parse_iters)]
    pub(super) iters: usize,

    /// Untimed iterations before each row's timed ones.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = parse_warmup)]
    pub(super) warmup: usize,

    /// Run each row for this long instead of --iters (e.g. 500ms, 2s).
    #[arg(long, value_name = "TIME", value_parser = parse_duration, conflicts_with = "iters")]
    pub(super) duration: Option<Duration>,

    /// Shuffle each request's descriptors (the same order on both sides), so that the
    /// engine cannot merge neighbouring blocks into one copy.
    #[arg(long)]
    pub(super) random_order: bool,

    /// Print one JSON document on stdout (configuration, host, per-row results) instead
    /// of the table; no progress bar.
    #[arg(long)]
    pub(super) json: bool,

    /// Also time a single-thread memcpy of the same blocks in this process, and show
    /// freight's bandwidth relative to it.
    #[arg(long)]
    pub(super) memcpy_baseline: bool,

    /// Instead of initiator and target: start N processes (one GPU each, in turn, where
    /// GPUs exist) that all WRITE blocks of the largest --block-sizes to each other at
    /// once for --duration (default 3s) over --transport, every byte checked at the end;
    /// reports each process's bandwidth and the total.
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_mesh_size,
        conflicts_with_all = [
            "connect", "role", "listen", "op", "iters", "warmup", "batch_sizes", "total_bytes",
            "random_order", "memcpy_baseline", "initiator_seg", "target_seg", "mode",
        ]
    )]
    pub(super) full_mesh: Option<usize>,

    /// With --full-mesh: where the processes' buffers live: auto (GPU memory where GPUs
    /// exist), host or gpu.
    #[arg(long, value_enum, default_value_t = super::mesh::MeshMemory::Auto)]
    pub(super) mesh_memory: super::mesh::MeshMemory,
}

fn parse_mesh_size(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (2..=64).contains(&n) => Ok(n),
        _ => Err(format!("'{s}': a full mesh needs at least 2 processes (and at most 64)")),
    }
}

fn parse_iters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=100_000_000).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' must be a whole number from 1 to 100000000")),
    }
}

fn parse_warmup(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n <= 100_000_000 => Ok(n),
        _ => Err(format!("'{s}' must be a whole number from 0 to 100000000")),
    }
}

/// What this process does, after the role options were checked against each other.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    Target { listen: String },
    Initiator { connect: Option<String>, listen: String },
}

/// The rows to run, and those left out by --max-request-bytes or --total-bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Grid {
    pub(super) rows: Vec<(u64, u64)>,
    pub(super) skipped: Vec<(u64, u64)>,
    /// Block sizes larger than --total-bytes: not even one of them fits in a request.
    pub(super) over_total: Vec<u64>,
}

pub(super) const DEFAULT_BATCHES: [u64; 3] = [1, 16, 128];

impl P2pArgs {
    fn plan(&self) -> CliResult<Plan> {
        if let Some(l) = &self.listen {
            resolve_addr("--listen", l)?;
        }
        match (self.role, &self.connect) {
            (Role::Target, Some(_)) => {
                Err(CliError::usage("--connect is for the initiator; a target only needs --listen"))
            }
            (Role::Target, None) => {
                Ok(Plan::Target { listen: self.listen.clone().unwrap_or_else(|| "127.0.0.1:0".into()) })
            }
            (Role::Initiator, None) => {
                Err(CliError::usage("--role initiator needs --connect IP:PORT (the address a --role target printed)"))
            }
            (_, Some(c)) => {
                let target = resolve_addr("--connect", c)?;
                let default = if target.ip().is_loopback() { "127.0.0.1:0" } else { "0.0.0.0:0" };
                Ok(Plan::Initiator {
                    connect: Some(target.to_string()),
                    listen: self.listen.clone().unwrap_or_else(|| default.into()),
                })
            }
            (Role::Auto, None) => Ok(Plan::Initiator {
                connect: None,
                listen: self.listen.clone().unwrap_or_else(|| "127.0.0.1:0".into()),
            }),
        }
    }

    fn grid(&self) -> CliResult<Grid> {
        let (mut rows, mut skipped, mut over_total) = (Vec::new(), Vec::new(), Vec::new());
        for &block in &self.block_sizes.0 {
            let batches = match (self.total_bytes, &self.batch_sizes) {
                (Some(total), _) if block > total => {
                    over_total.push(block);
                    continue;
                }
                (Some(total), _) => vec![total / block],
                (None, Some(list)) => list.0.clone(),
                (None, None) => DEFAULT_BATCHES.to_vec(),
            };
            for batch in batches {
                let bytes = block
                    .checked_mul(batch)
                    .ok_or_else(|| CliError::usage(format!("{batch} x {} overflows", format_size(block))))?;
                if self.total_bytes.is_none() && bytes > self.max_request_bytes {
                    skipped.push((block, batch));
                } else {
                    rows.push((block, batch));
                }
            }
        }
        match (rows.is_empty(), self.total_bytes) {
            (true, Some(total)) => Err(CliError::usage(format!(
                "every block size is larger than --total-bytes {}; raise it or pick smaller --block-sizes",
                format_size(total)
            ))),
            (true, None) => Err(CliError::usage(format!(
                "every block x batch exceeds --max-request-bytes {}; raise it or pick smaller sizes",
                format_size(self.max_request_bytes)
            ))),
            (false, _) => Ok(Grid { rows, skipped, over_total }),
        }
    }

    /// Refuses a grid whose buffers the host cannot hold: the initiator's (and its memcpy
    /// baseline's), and the target's where this command starts it on this host. A
    /// target started by hand checks its own.
    fn ensure_host_room(&self, grid: &Grid, child_target: bool) -> CliResult<()> {
        let buffers = 1 + u64::from(child_target) + u64::from(self.memcpy_baseline);
        let what = if child_target { "bench p2p (initiator and target)" } else { "bench p2p (the initiator)" };
        crate::host_memory::ensure_room(
            grid.largest().saturating_mul(buffers),
            what,
            "lower --block-sizes x --batch-sizes, --total-bytes or --max-request-bytes",
        )
    }

    pub(super) fn budget(&self) -> Budget {
        self.duration.map_or(Budget::Iters(self.iters), Budget::Time)
    }
}

impl Grid {
    /// The largest request, and so the size of the buffers on each side.
    pub(super) fn largest(&self) -> u64 {
        self.rows.iter().map(|(b, n)| b * n).max().expect("at least one row")
    }
}

pub fn run(a: &P2pArgs, ctx: &Context) -> CliResult<()> {
    if let Some(n) = a.full_mesh {
        let block = a.block_sizes.0.iter().copied().max().unwrap_or(64 << 20);
        let duration = a.duration.unwrap_or(Duration::from_secs(3));
        return super::mesh::run(n, a.mesh_memory, block, duration, &a.engine, a.json, ctx);
    }
    match a.plan()? {
        Plan::Target { listen } => target::serve(&listen, true, &a.engine),
        Plan::Initiator { connect, listen } => {
            let grid = a.grid()?;
            initiator(a, &grid, connect.as_deref(), &listen, ctx)
        }
    }
}

fn initiator(a: &P2pArgs, grid: &Grid, connect: Option<&str>, listen: &str, ctx: &Context) -> CliResult<()> {
    a.ensure_host_room(grid, connect.is_none())?;
    let process = match connect {
        None => {
            Some(TargetProcess::spawn(&ctx.self_command, &ctx.log_args, &a.engine.to_args(), &a.engine.child_env())?)
        }
        Some(_) => None,
    };
    let target_addr = connect.map_or_else(|| process.as_ref().expect("spawned").addr.clone(), str::to_string);
    let name = format!("freight-bench-{}", std::process::id());
    let agent = Agent::new(&name, a.engine.agent_config(listen, a.engine.transport.require()))?;
    let mut link = Link::open(&agent, &target_addr, process.as_ref())?;
    let outcome = measure(a, grid, &agent, &mut link, &target_addr, process.is_some());
    // Also after a failure, so that a target started by hand does not wait forever.
    let bye = link.bye();
    drop(link);
    let (rows, target) = outcome?;
    bye?;
    if let Some(p) = process {
        p.finish()?;
    }
    if a.json {
        emit(&p2p_json(a, grid, &rows, &target))
    } else {
        emit(&p2p_table(a, grid, &rows))
    }
}

/// The target as the report names it.
pub(super) struct TargetInfo {
    pub(super) addr: String,
    pub(super) pid: u32,
    /// Started by this command (rather than by hand with --role target).
    pub(super) child: bool,
}

fn measure<'a>(
    a: &P2pArgs,
    grid: &Grid,
    agent: &'a Agent,
    link: &mut Link<'a>,
    target_addr: &str,
    child: bool,
) -> CliResult<(Vec<RowResult>, TargetInfo)> {
    let max = grid.largest();
    let len = usize::try_from(max).map_err(|_| CliError::usage("the largest request does not fit in memory"))?;
    let remote = link.setup(max, a.target_seg.mem_kind())?;
    let local = agent.alloc(len)?;
    agent.register(a.initiator_seg.mem_kind(), local.addr(), max, 0)?;
    let baseline = if a.memcpy_baseline { Some(agent.alloc(len)?) } else { None };
    probe(a, grid, agent, &link.peer, &local, remote.addr)?;
    let target = TargetInfo { addr: target_addr.to_string(), pid: remote.pid, child };
    if !a.json {
        emit(&p2p_header(a, grid, &target, max))?;
    }
    let bar = progress(grid.rows.len(), a.json);
    let mut runner = Runner {
        agent,
        link,
        local,
        local_kind: a.initiator_seg.mem_kind(),
        remote,
        remote_kind: a.target_seg.mem_kind(),
        op: a.op.kind(),
        mode: a.mode,
        random_order: a.random_order,
        budget: a.budget(),
        warmup: a.warmup,
        baseline,
    };
    let mut rows = Vec::with_capacity(grid.rows.len());
    for &(block, batch) in &grid.rows {
        bar.set_message(format!("{batch} x {}", format_size(block)));
        let r = runner.run_row(block, batch);
        let r = r.inspect_err(|_| bar.abandon())?;
        rows.push(r);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((rows, target))
}

/// Builds (without posting) a request of the first row, so that a path the engine cannot
/// serve (VRAM, FILE, a required transport that does not reach) fails before any output.
fn probe(a: &P2pArgs, grid: &Grid, agent: &Agent, peer: &str, local: &SharedSegment, remote: u64) -> CliResult<()> {
    let block = grid.rows[0].0;
    let one = |kind: SegKind, addr: u64| DescList::from_descs(kind.mem_kind(), [Desc { addr, len: block, dev: 0 }]);
    let l = agent.prepare_local(&one(a.initiator_seg, local.addr())?)?;
    let r = agent.prepare_remote(peer, &one(a.target_seg, remote)?)?;
    agent
        .make_request(a.op.kind(), &l, None, &r, None, None)
        .map(drop)
        .map_err(|e| CliError::runtime(format!("the engine cannot run this benchmark: {e}")))
}

/// On stderr, only for a person watching: hidden for JSON and when stderr is not a terminal.
fn progress(rows: usize, json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(rows as u64), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} rows  {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    bar.set_style(style);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::net::SocketAddr;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: P2pArgs,
    }

    fn args(extra: &[&str]) -> Result<P2pArgs, clap::Error> {
        T::try_parse_from(std::iter::once("p2p").chain(extra.iter().copied())).map(|t| t.a)
    }

    #[test]
    fn full_mesh_takes_its_own_options_only() {
        assert_eq!(args(&["--full-mesh", "4", "--duration", "1s"]).unwrap().full_mesh, Some(4));
        for bad in [
            &["--full-mesh", "1"][..],
            &["--full-mesh", "65"],
            &["--full-mesh", "4", "--iters", "10"],
            &["--full-mesh", "4", "--op", "READ"],
            &["--full-mesh", "4", "--connect", "127.0.0.1:7000"],
        ] {
            assert!(args(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn connect_takes_a_host_name() {
        let a = args(&["--connect", "localhost:7000"]).unwrap();
        let Plan::Initiator { connect: Some(c), .. } = a.plan().unwrap() else { panic!("not an initiator") };
        let c = c.parse::<SocketAddr>().unwrap();
        assert!(c.ip().is_loopback() && c.is_ipv4(), "{c}");
        let err = args(&["--connect", "no-such-host.invalid:7000"]).unwrap().plan().unwrap_err().to_string();
        assert!(err.contains("--connect"), "{err}");
    }

    #[test]
    fn the_default_grid_is_modest() {
        let g = args(&[]).unwrap().grid().unwrap();
        assert!(g.rows.iter().all(|(b, n)| b * n <= 64 << 20));
        assert_eq!(g.rows.len() + g.skipped.len(), 15 * 3);
        assert_eq!(g.rows[0], (4096, 1));
        assert!(g.skipped.contains(&(64 << 20, 128)));
    }

    #[test]
    fn total_bytes_sets_the_batch() {
        let g = args(&["--block-sizes", "4KiB,1MiB", "--total-bytes", "256MiB"]).unwrap().grid().unwrap();
        assert_eq!(g.rows, vec![(4096, 65536), (1 << 20, 256)]);
        let e = args(&["--block-sizes", "1GiB", "--total-bytes", "1MiB"]).unwrap().grid().unwrap_err();
        assert!(matches!(e, CliError::Usage(m) if m.contains("every block size is larger than --total-bytes")));
        assert!(args(&["--batch-sizes", "1", "--total-bytes", "1MiB"]).is_err(), "the two are exclusive");
    }

    #[test]
    fn blocks_larger_than_total_bytes_are_skipped_with_a_note() {
        let a = args(&["--total-bytes", "1MiB"]).unwrap();
        let g = a.grid().unwrap();
        assert_eq!(g.rows.len(), 9, "4KiB to 1MiB: {:?}", g.rows);
        assert_eq!(g.rows.last(), Some(&(1 << 20, 1)));
        assert_eq!(g.over_total, (21..=26).map(|p| 1u64 << p).collect::<Vec<_>>());
        let table = p2p_table(&a, &g, &[]);
        assert!(table.contains("note: skipped block sizes larger than --total-bytes 1 MiB: 2 MiB, 4 MiB,"), "{table}");
    }

    #[test]
    fn buffers_the_host_cannot_hold_are_refused_before_anything_starts() {
        for extra in [
            &["--block-sizes", "4k", "--total-bytes", "1024TiB"][..],
            &["--batch-sizes", "100000000", "--max-request-bytes", "1024TiB"],
        ] {
            let a = args(extra).unwrap();
            let err = a.ensure_host_room(&a.grid().unwrap(), true).unwrap_err();
            assert!(matches!(&err, CliError::Usage(m) if m.contains("of host memory")), "{extra:?}: {err}");
        }
        let a = args(&[]).unwrap();
        a.ensure_host_room(&a.grid().unwrap(), true).unwrap();
    }

    #[test]
    fn the_help_states_every_size_unit() {
        use clap::CommandFactory;
        let help = T::command().render_long_help().to_string();
        assert!(help.contains("T/TiB") && help.contains("lo:hi:factor"), "{help}");
    }

    #[test]
    fn a_grid_that_is_all_skipped_is_a_usage_error() {
        let e = args(&["--block-sizes", "64MiB", "--batch-sizes", "16"]).unwrap().grid().unwrap_err();
        assert!(matches!(e, CliError::Usage(m) if m.contains("--max-request-bytes")));
        let g = args(&["--block-sizes", "64MiB", "--batch-sizes", "16", "--max-request-bytes", "1GiB"])
            .unwrap()
            .grid()
            .unwrap();
        assert_eq!(g.rows, vec![(64 << 20, 16)]);
    }

    #[test]
    fn roles_are_checked() {
        let plan = |x: &[&str]| args(x).unwrap().plan();
        assert_eq!(plan(&[]).unwrap(), Plan::Initiator { connect: None, listen: "127.0.0.1:0".into() });
        assert_eq!(plan(&["--role", "target"]).unwrap(), Plan::Target { listen: "127.0.0.1:0".into() });
        assert_eq!(
            plan(&["--connect", "10.1.2.3:7000"]).unwrap(),
            Plan::Initiator { connect: Some("10.1.2.3:7000".into()), listen: "0.0.0.0:0".into() }
        );
        assert!(matches!(plan(&["--role", "initiator"]), Err(CliError::Usage(_))));
        assert!(matches!(plan(&["--role", "target", "--connect", "1.2.3.4:5"]), Err(CliError::Usage(_))));
        assert!(matches!(plan(&["--connect", "somehost"]), Err(CliError::Usage(_))));
        assert!(matches!(plan(&["--role", "target", "--listen", "nope"]), Err(CliError::Usage(_))));
    }

    #[test]
    fn values_are_validated_by_the_parser() {
        assert!(args(&["--op", "read"]).is_ok(), "case does not matter");
        assert!(args(&["--op", "COPY"]).is_err());
        assert!(args(&["--initiator-seg", "vram"]).is_ok());
        assert!(args(&["--iters", "0"]).is_err());
        assert!(args(&["--iters", "5", "--duration", "1s"]).is_err());
        assert!(args(&["--block-sizes", "4XB"]).is_err());
        assert!(args(&["--streams", "0"]).is_err());
        assert!(args(&["--chunk-size", "2GiB"]).is_err());
        assert!(args(&["--transport", "rdma"]).is_err());
        assert_eq!(args(&["--duration", "250ms"]).unwrap().budget(), Budget::Time(Duration::from_millis(250)));
    }
}
