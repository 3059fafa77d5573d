//! `freight demo`: the shortest honest tour of the engine. A second process owns a
//! buffer; we WRITE a pattern into it with a notification, it checks every byte when the
//! notification arrives, then we READ the buffer back and check it here. Over shm and
//! tcp, with the engine's own words for why each path was taken.

use std::time::Instant;

use clap::Args;
use freight_core::{Agent, AgentConfig, Desc, DescList, MemKind, OpKind, SharedSegment, TransportKind};

use freight_bench::options::{format_size, parse_positive_size, CliError, CliResult, TransportChoice, SIZE_GRAMMAR};
use freight_bench::target::child::{Link, TargetProcess};
use freight_bench::target::messages::Command;
use freight_bench::{emit, pattern, wait_done, Context};

#[derive(Debug, Args)]
#[command(after_help = SIZE_GRAMMAR)]
pub struct DemoArgs {
    /// Bytes to move each way.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = parse_positive_size)]
    size: u64,

    /// auto shows both paths: the engine's choice (shm on this host) and tcp, required.
    /// shm or tcp runs only that one.
    #[arg(long, value_enum, default_value_t = TransportChoice::Auto, ignore_case = true)]
    transport: TransportChoice,

    /// The buffer moves as a batch of descriptors of this size (one request).
    #[arg(long, value_name = "SIZE", default_value = "1MiB", value_parser = parse_positive_size)]
    block: u64,
}

/// More descriptors than this is a benchmark, not a demo.
const MAX_BLOCKS: u64 = 1 << 20;

pub fn run(a: &DemoArgs, ctx: &Context) -> CliResult<()> {
    if a.block > a.size {
        return Err(CliError::usage(format!(
            "--block ({}) is larger than --size ({})",
            format_size(a.block),
            format_size(a.size)
        )));
    }
    let blocks = a.size.div_ceil(a.block);
    if blocks > MAX_BLOCKS {
        return Err(CliError::usage(format!("--size / --block gives {blocks} blocks; use at most {MAX_BLOCKS}")));
    }
    let len = usize::try_from(a.size).map_err(|_| CliError::usage("--size does not fit in memory"))?;
    // A buffer here and one in the target, on this host.
    freight_bench::host_memory::ensure_room(
        a.size.saturating_mul(2),
        "demo (this process and its target)",
        "lower --size",
    )?;
    let passes: Vec<Option<TransportKind>> = match a.transport {
        TransportChoice::Auto => vec![None, Some(TransportKind::Tcp)],
        t => vec![t.require()],
    };

    // A transport asked for by name is opened by the target too (fabric is opened only where asked for).
    let target_args = match a.transport {
        TransportChoice::Auto => vec![],
        t => vec!["--transport".to_string(), t.as_str().to_string()],
    };
    let target = TargetProcess::spawn(&ctx.self_command, &ctx.log_args, &target_args, &[])?;
    // One buffer each side: the READ lands back in the source after it was poisoned.
    // Fresh shared pages cost a fault each, which on a small VM is most of the run time.
    let src = SharedSegment::allocate(len)?;
    emit(&format!(
        "freight demo: {} from this process (pid {}) to a second process and back, as {blocks} blocks of {}\n\
         target process: pid {}, listening on {}\n",
        format_size(a.size),
        std::process::id(),
        format_size(a.block),
        target.pid,
        target.addr,
    ))?;

    let start = Instant::now();
    let mut used = Vec::new();
    for (i, require) in passes.iter().enumerate() {
        let last = i + 1 == passes.len();
        let label = require.map_or("auto", |t| t.as_str());
        let agent =
            Agent::new(&format!("freight-demo-{label}"), AgentConfig { require: *require, ..AgentConfig::default() })?;
        let mut link = Link::open(&agent, &target.addr, Some(&target))?;
        let pass = Pass { agent: &agent, src: &src, size: a.size, block: a.block };
        let outcome = pass.run(&mut link, i + 1, passes.len(), *require);
        // Also after a failure, so that the target does not wait for us forever.
        let bye = if last || outcome.is_err() { link.bye() } else { Ok(()) };
        used.push(outcome?);
        bye?;
    }
    target.finish()?;
    let names: Vec<&str> = used.iter().map(|t| t.as_str()).collect();
    emit(&format!(
        "\ndemo passed: {} moved and every byte verified, over {} ({:.1}s in all).\n",
        format_size(a.size * 2 * used.len() as u64),
        names.join(" and "),
        start.elapsed().as_secs_f64()
    ))
}

struct Pass<'a> {
    agent: &'a Agent,
    src: &'a std::sync::Arc<SharedSegment>,
    size: u64,
    block: u64,
}

impl Pass<'_> {
    /// One WRITE and one READ over whatever path `require` leads to.
    fn run(&self, link: &mut Link, n: usize, of: usize, require: Option<TransportKind>) -> CliResult<TransportKind> {
        let (agent, size) = (self.agent, self.size);
        let remote = link.setup(size, MemKind::Dram)?;
        agent.register(MemKind::Dram, self.src.addr(), size, 0)?;
        let path = agent.path_to(&link.peer)?;
        let how = match require {
            None => "transport chosen by the engine",
            Some(_) => "transport required with AgentConfig.require",
        };
        emit(&format!("\n[{n}/{of}] {how}: {}\n      why: {}\n", path.transport, path.reason))?;

        let local = self.blocks(self.src.addr());
        let remote_list = self.blocks(remote.addr);
        let seed: u64 = rand::random();
        let mine = pattern::bytes_mut(self.src, size);
        pattern::fill(mine, seed);

        // Untimed first pass, for costs that only the first transfer pays: opening tcp
        // streams (one block is enough), or for shm faulting in our mapping of the
        // target's buffer page by page (all of it).
        let warm = if path.transport == TransportKind::Shm { size } else { self.block };
        let (warm, warm_remote) = (self.blocks_upto(self.src.addr(), warm), self.blocks_upto(remote.addr, warm));
        wait_done(&agent.transfer(OpKind::Write, &warm, &link.peer, &warm_remote, None)?, "warm-up WRITE")?;

        link.call(&Command::Poison { len: size })?;
        let t = Instant::now();
        let check = Command::Check { seed, len: size };
        let req = agent.transfer(OpKind::Write, &local, &link.peer, &remote_list, Some(check.encode()))?;
        wait_done(&req, "WRITE")?;
        let write_time = t.elapsed();
        let verdict = link.outcome()?;
        self.report(
            "WRITE",
            req.path().transport,
            write_time,
            &verdict,
            "the target checked every byte when the notification arrived",
        )?;
        verdict.map_err(|e| CliError::runtime(format!("the target found wrong bytes after the WRITE: {e}")))?;

        mine.fill(pattern::POISON);
        let t = Instant::now();
        let req = agent.transfer(OpKind::Read, &local, &link.peer, &remote_list, None)?;
        wait_done(&req, "READ")?;
        let read_time = t.elapsed();
        let verdict = pattern::check(mine, seed);
        self.report("READ ", req.path().transport, read_time, &verdict, "checked every byte here")?;
        verdict.map_err(|e| CliError::runtime(format!("wrong bytes after the READ: {e}")))?;
        Ok(req.path().transport)
    }

    fn blocks(&self, base: u64) -> DescList {
        self.blocks_upto(base, self.size)
    }

    /// The first `size` bytes at `base`, cut into blocks.
    fn blocks_upto(&self, base: u64, size: u64) -> DescList {
        let descs = (0..size.div_ceil(self.block)).map(|i| {
            let off = i * self.block;
            Desc { addr: base + off, len: self.block.min(size - off), dev: 0 }
        });
        DescList::from_descs(MemKind::Dram, descs).expect("blocks are non-empty and in range")
    }

    fn report(
        &self,
        op: &str,
        transport: TransportKind,
        took: std::time::Duration,
        verdict: &Result<(), String>,
        how: &str,
    ) -> CliResult<()> {
        let gbps = self.size as f64 / took.as_secs_f64() / 1e9;
        let result = match verdict {
            Ok(()) => format!("{how}: ok"),
            Err(e) => format!("MISMATCH: {e}"),
        };
        emit(&format!(
            "      {op} {} over {transport} in {:.1} ms = {gbps:.2} GB/s; {result}\n",
            format_size(self.size),
            took.as_secs_f64() * 1e3
        ))
    }
}
