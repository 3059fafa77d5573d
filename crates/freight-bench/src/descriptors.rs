//! `freight bench descriptors`: the bookkeeping around transfers, in one process. No
//! bytes move: this times what an application pays before and between transfers.

use std::time::{Duration, Instant};

use clap::Args;
use freight_core::{Agent, AgentConfig, Desc, DescList, MemKind, OpKind};
use serde::Serialize;
use serde_json::json;

use super::report::{fmt_us, host_json, round4, Table};
use crate::emit;
use crate::options::{format_size, parse_positive_size, CliError, CliResult, SIZE_GRAMMAR};

#[derive(Debug, Args)]
#[command(after_help = SIZE_GRAMMAR)]
pub struct DescriptorArgs {
    /// Regions to register and then deregister (non-overlapping slices of one segment).
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = parse_count)]
    regions: u64,

    /// Descriptors in each list (local, remote, strided).
    #[arg(long, value_name = "N", default_value_t = 65_536, value_parser = parse_count)]
    descriptors: u64,

    /// Size of each region and of each descriptor.
    #[arg(long, value_name = "SIZE", default_value = "4KiB", value_parser = parse_positive_size)]
    block: u64,

    /// Repetitions of the whole sequence; the best and the median are reported.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = parse_reps)]
    reps: usize,

    /// Print one JSON document on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

/// The same descriptors in an order of their own, the same every run.
fn scramble(mut descs: Vec<Desc>) -> Vec<Desc> {
    use rand::{seq::SliceRandom, SeedableRng};
    descs.shuffle(&mut rand::rngs::StdRng::seed_from_u64(1));
    descs
}

fn parse_count(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(n) if (1..=10_000_000).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' must be a whole number from 1 to 10000000")),
    }
}

fn parse_reps(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=1000).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' must be a whole number from 1 to 1000")),
    }
}

/// The lists' memory is reserved, never touched; this still bounds the address space asked for.
const MAX_SPAN: u64 = 1 << 40;

#[derive(Debug, Serialize)]
struct Row {
    operation: String,
    items: u64,
    best_us: f64,
    median_us: f64,
    best_ns_per_item: f64,
}

/// Samples of every operation, in the order they are first seen.
#[derive(Default)]
struct Samples(Vec<(String, u64, Vec<Duration>)>);

impl Samples {
    fn time<T>(&mut self, op: &str, items: u64, f: impl FnOnce() -> CliResult<T>) -> CliResult<T> {
        let t = Instant::now();
        let out = f()?;
        let took = t.elapsed();
        match self.0.iter_mut().find(|(name, ..)| name == op) {
            Some((.., v)) => v.push(took),
            None => self.0.push((op.to_string(), items, vec![took])),
        }
        Ok(out)
    }

    fn rows(&self) -> Vec<Row> {
        self.0
            .iter()
            .map(|(op, items, v)| {
                let mut us: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e6).collect();
                us.sort_by(f64::total_cmp);
                let median = crate::stats::median(&us);
                Row {
                    operation: op.clone(),
                    items: *items,
                    best_us: round4(us[0]),
                    median_us: round4(median),
                    best_ns_per_item: round4(us[0] * 1e3 / *items as f64),
                }
            })
            .collect()
    }
}

pub fn run(a: &DescriptorArgs) -> CliResult<()> {
    // Gaps between descriptors keep the engine from merging them into longer copies:
    // every request copies each block on its own. In order, the plan still finds the
    // stride (one run of copies); the scrambled row is the one that pairs block by block.
    let stride = a.block.checked_mul(2).ok_or_else(|| CliError::usage("--block is too large"))?;
    let span = a.descriptors.checked_mul(stride).filter(|&s| s <= MAX_SPAN);
    let span = span.ok_or_else(|| {
        CliError::usage(format!("--descriptors x 2 x --block must stay under {}", format_size(MAX_SPAN)))
    })?;
    let region_span = a.regions.checked_mul(a.block).filter(|&s| s <= MAX_SPAN);
    let region_span = region_span
        .ok_or_else(|| CliError::usage(format!("--regions x --block must stay under {}", format_size(MAX_SPAN))))?;
    let n = a.descriptors;

    let local = Agent::new("freight-desc-local", AgentConfig::default())?;
    let remote = Agent::new("freight-desc-remote", AgentConfig::default())?;
    let slices = local.alloc(region_span as usize)?;
    let lbuf = local.alloc(span as usize)?;
    let rbuf = remote.alloc(span as usize)?;
    local.register(MemKind::Dram, lbuf.addr(), span, 0)?;
    remote.register(MemKind::Dram, rbuf.addr(), span, 0)?;
    let peer = local.add_peer(&remote.metadata())?;
    let blocks = |base: u64| (0..n).map(move |i| Desc { addr: base + i * stride, len: a.block, dev: 0 });
    let strided = |base: u64| -> CliResult<DescList> {
        let mut l = DescList::new(MemKind::Dram);
        l.push_strided(base, a.block, 0, stride, n)?;
        Ok(l)
    };

    let mut s = Samples::default();
    let mut copies = 0;
    for _ in 0..a.reps {
        let keys = s.time("register regions", a.regions, || {
            (0..a.regions)
                .map(|i| local.register(MemKind::Dram, slices.addr() + i * a.block, a.block, 0))
                .collect::<Result<Vec<u64>, _>>()
                .map_err(CliError::from)
        })?;
        s.time("deregister regions", a.regions, || {
            keys.iter().try_for_each(|&k| local.deregister(k)).map_err(CliError::from)
        })?;

        let llist =
            s.time("build a descriptor list", n, || Ok(DescList::from_descs(MemKind::Dram, blocks(lbuf.addr()))?))?;
        let rlist = DescList::from_descs(MemKind::Dram, blocks(rbuf.addr()))?;
        let lp = s.time("prepare_local", n, || Ok(local.prepare_local(&llist)?))?;
        let rp = s.time("prepare_remote", n, || Ok(local.prepare_remote(&peer, &rlist)?))?;
        let req = s.time("make_request", n, || Ok(local.make_request(OpKind::Write, &lp, None, &rp, None, None)?))?;
        copies = req.copies();

        // The remote blocks in a scrambled order: no two neighbours continue each
        // other, so the plan has a copy per descriptor (what a KV cache load of
        // scattered blocks asks for).
        let scrambled = DescList::from_descs(MemKind::Dram, scramble(blocks(rbuf.addr()).collect()))?;
        let rp = local.prepare_remote(&peer, &scrambled)?;
        s.time("make_request, scrambled order", n, || {
            Ok(local.make_request(OpKind::Write, &lp, None, &rp, None, None)?)
        })?;

        let (ls, rs) = (strided(lbuf.addr())?, strided(rbuf.addr())?);
        let lp = s.time("prepare_local, strided run", n, || Ok(local.prepare_local(&ls)?))?;
        let rp = s.time("prepare_remote, strided run", n, || Ok(local.prepare_remote(&peer, &rs)?))?;
        s.time("make_request, strided run", n, || {
            Ok(local.make_request(OpKind::Write, &lp, None, &rp, None, None)?)
        })?;
    }
    let rows = s.rows();

    if a.json {
        let doc = json!({
            "tool": "freight bench descriptors",
            "version": env!("CARGO_PKG_VERSION"),
            "percentile": crate::stats::PERCENTILE,
            "host": host_json(),
            "config": { "regions": a.regions, "descriptors": n, "block": a.block, "reps": a.reps },
            "copies_per_request": copies,
            "rows": rows,
        });
        return emit(&(serde_json::to_string_pretty(&doc).expect("json") + "\n"));
    }
    let mut t = Table::new(&["Operation", "Items", "Best (us)", "Median (us)", "Best per item (ns)"]);
    for r in &rows {
        t.push(vec![
            r.operation.clone(),
            r.items.to_string(),
            fmt_us(r.best_us),
            fmt_us(r.median_us),
            fmt_us(r.best_ns_per_item),
        ]);
    }
    emit(&format!(
        "freight bench descriptors: {} regions and lists of {n} descriptors of {} (every other block, \
         so none merge into longer copies: {copies} copies per request), best and median of {} repetitions\n\n{}",
        a.regions,
        format_size(a.block),
        a.reps,
        t.render()
    ))
}
