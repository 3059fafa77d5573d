//! One row of `bench p2p`: verify, then time, one (block size, batch size) pair.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use freight_core::{Agent, DescList, MemKind, OpKind, Request, SharedSegment};
use rand::seq::SliceRandom;
use serde::Serialize;

use super::report::round4;
use super::stats::Stats;
use crate::options::{format_size, CliError, CliResult};
use crate::pattern;
use crate::target::child::{Link, Remote};
use crate::target::messages::Command;
use crate::wait_done;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Prepare both lists and build the request once per row; post it every iteration.
    Prepared,
    /// Call transfer() every iteration (prepare + build + post each time).
    Oneshot,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Prepared => "prepared",
            Mode::Oneshot => "oneshot",
        }
    }
}

/// How long each row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Iters(usize),
    Time(Duration),
}

/// Keeps a long --duration on tiny blocks from growing the sample vectors without bound.
const MAX_SAMPLES: usize = 1_000_000;
/// Preparing is measured on the side; this many samples give a stable average and p99.
const MAX_PREPARE_SAMPLES: usize = 100;

impl Budget {
    fn more(self, done: usize, elapsed: Duration) -> bool {
        match self {
            Budget::Iters(n) => done < n,
            Budget::Time(d) => done == 0 || (elapsed < d && done < MAX_SAMPLES),
        }
    }
    fn prepare_samples(self) -> usize {
        match self {
            Budget::Iters(n) => n.clamp(1, MAX_PREPARE_SAMPLES),
            Budget::Time(_) => MAX_PREPARE_SAMPLES,
        }
    }
}

/// What one row measured. Times are in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct RowResult {
    pub block_size: u64,
    pub batch_size: u64,
    /// Bytes per request (block size x batch size).
    pub bytes: u64,
    pub transport: String,
    pub path_reason: String,
    /// Copies after the engine merged descriptors that are neighbours on both sides.
    pub copies: usize,
    /// 10^9 bytes per second: bytes / median transfer time.
    pub gbps: f64,
    /// prepare_local + prepare_remote + make_request (prepared mode only).
    pub prepare_us: Option<Stats>,
    /// Until post() returns (oneshot: the whole transfer() call).
    pub post_us: Stats,
    /// From post (or transfer()) until the request is done.
    pub transfer_us: Stats,
    pub verified: bool,
    pub memcpy_gbps: Option<f64>,
    /// gbps / memcpy_gbps.
    pub memcpy_ratio: Option<f64>,
}

/// Everything a row needs; rows differ only in block and batch size.
pub struct Runner<'a, 'l> {
    pub agent: &'a Agent,
    pub link: &'l mut Link<'a>,
    pub local: Arc<SharedSegment>,
    pub local_kind: MemKind,
    pub remote: Remote,
    pub remote_kind: MemKind,
    pub op: OpKind,
    pub mode: Mode,
    pub random_order: bool,
    pub budget: Budget,
    pub warmup: usize,
    /// Destination of the in-process memcpy baseline, when asked for.
    pub baseline: Option<Arc<SharedSegment>>,
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Block `i` of the batch lives at `base + i * block`; `order` says which block is the
/// request's k-th descriptor (the same on both sides, so byte offsets match). Always one
/// descriptor per block, never a strided run, so that preparing costs what an
/// application with scattered blocks would pay.
fn batch_list(kind: MemKind, base: u64, block: u64, order: &[u64]) -> DescList {
    let descs = order.iter().map(|&i| freight_core::Desc { addr: base + i * block, len: block, dev: 0 });
    DescList::from_descs(kind, descs).expect("blocks are non-empty and in range")
}

impl Runner<'_, '_> {
    pub fn run_row(&mut self, block: u64, batch: u64) -> CliResult<RowResult> {
        let mut order: Vec<u64> = (0..batch).collect();
        if self.random_order {
            order.shuffle(&mut rand::rng());
        }
        let local = batch_list(self.local_kind, self.local.addr(), block, &order);
        let remote = batch_list(self.remote_kind, self.remote.addr, block, &order);
        let bytes = block * batch;
        let what = format!("{} x {}", batch, format_size(block));
        self.verify(&local, &remote, bytes, &what)?;

        let (agent, peer, op) = (self.agent, self.link.peer.clone(), self.op);
        let mut prepare = Vec::new();
        let (last, post, xfer) = match self.mode {
            Mode::Prepared => {
                let mut req = None;
                for _ in 0..self.budget.prepare_samples() {
                    let t = Instant::now();
                    let l = agent.prepare_local(&local)?;
                    let r = agent.prepare_remote(&peer, &remote)?;
                    req = Some(agent.make_request(op, &l, None, &r, None, None)?);
                    prepare.push(micros(t.elapsed()));
                }
                let req = req.expect("at least one sample");
                let (post, xfer) = self.iterate(|| {
                    let t = Instant::now();
                    req.post()?;
                    let posted = t.elapsed();
                    wait_done(&req, &what)?;
                    Ok((posted, t.elapsed()))
                })?;
                (req, post, xfer)
            }
            Mode::Oneshot => {
                let mut last = None;
                let (post, xfer) = self.iterate(|| {
                    let t = Instant::now();
                    let req = agent.transfer(op, &local, &peer, &remote, None)?;
                    let posted = t.elapsed();
                    wait_done(&req, &what)?;
                    let took = t.elapsed();
                    last = Some(req);
                    Ok((posted, took))
                })?;
                (last.expect("at least one iteration"), post, xfer)
            }
        };
        let transfer_us = Stats::of(&xfer).expect("at least one iteration");
        // Medians on both sides: a shared host's scheduler hiccups move averages of a few
        // dozen samples more than anything freight or memcpy does.
        let gbps = round4(bytes as f64 / transfer_us.p50 / 1e3);
        let memcpy_gbps = self.baseline.clone().map(|dst| round4(self.memcpy_gbps(&dst, block, &order)));
        Ok(RowResult {
            block_size: block,
            batch_size: batch,
            bytes,
            transport: last.path().transport.to_string(),
            path_reason: last.path().reason.clone(),
            copies: last.copies(),
            gbps,
            prepare_us: Stats::of(&prepare),
            post_us: Stats::of(&post).expect("at least one iteration"),
            transfer_us,
            verified: true,
            memcpy_gbps,
            memcpy_ratio: memcpy_gbps.map(|m| round4(gbps / m)),
        })
    }

    /// Warm-up, then timed iterations; returns (post, transfer) samples in microseconds.
    fn iterate(&self, mut once: impl FnMut() -> CliResult<(Duration, Duration)>) -> CliResult<(Vec<f64>, Vec<f64>)> {
        for _ in 0..self.warmup {
            once()?;
        }
        let (mut post, mut xfer) = (Vec::new(), Vec::new());
        let start = Instant::now();
        while self.budget.more(post.len(), start.elapsed()) {
            let (p, x) = once()?;
            post.push(micros(p));
            xfer.push(micros(x));
        }
        Ok((post, xfer))
    }

    /// One transfer in the row's mode, posted.
    fn post_one(&self, local: &DescList, remote: &DescList, notif: Option<Vec<u8>>) -> CliResult<Request> {
        let (agent, peer) = (self.agent, &self.link.peer);
        Ok(match self.mode {
            Mode::Prepared => {
                let l = agent.prepare_local(local)?;
                let r = agent.prepare_remote(peer, remote)?;
                let req = agent.make_request(self.op, &l, None, &r, None, notif)?;
                req.post()?;
                req
            }
            Mode::Oneshot => agent.transfer(self.op, local, peer, remote, notif)?,
        })
    }

    /// Poisons the destination, moves the pattern, and checks every byte where it landed:
    /// on the target for a WRITE (asked by the transfer's own notification), here for a READ.
    fn verify(&mut self, local: &DescList, remote: &DescList, len: u64, what: &str) -> CliResult<()> {
        let seed: u64 = rand::random();
        let mine = pattern::bytes_mut(&self.local, len);
        let found = match self.op {
            OpKind::Write => {
                pattern::fill(mine, seed);
                self.link.call(&Command::Poison { len })?;
                let req = self.post_one(local, remote, Some(Command::Check { seed, len }.encode()))?;
                wait_done(&req, &format!("verification WRITE of {what}"))?;
                self.link.outcome()?.map_err(|e| format!("the target found: {e}"))
            }
            OpKind::Read => {
                self.link.call(&Command::Fill { seed, len })?;
                mine.fill(pattern::POISON);
                let req = self.post_one(local, remote, None)?;
                wait_done(&req, &format!("verification READ of {what}"))?;
                pattern::check(mine, seed)
            }
        };
        found.map_err(|e| CliError::runtime(format!("verification failed for {} of {what}: {e}", self.op.as_str())))
    }

    /// Single-thread memcpy of the same blocks in the same order, for scale: bandwidth of
    /// the median iteration, like the transfer rows.
    fn memcpy_gbps(&self, dst: &SharedSegment, block: u64, order: &[u64]) -> f64 {
        let (src, dst) = (self.local.as_ptr(), black_box(dst.as_ptr()));
        let once = || {
            let t = Instant::now();
            for &i in order {
                let off = (i * block) as usize;
                // SAFETY: both buffers hold the largest row (checked when they were
                // allocated), they are distinct, and no transfer is in flight now.
                unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), block as usize) };
            }
            black_box(dst);
            t.elapsed()
        };
        for _ in 0..self.warmup {
            once();
        }
        let (mut samples, mut total) = (Vec::new(), Duration::ZERO);
        while self.budget.more(samples.len(), total) {
            let took = once();
            total += took;
            samples.push(micros(took));
        }
        let median_us = Stats::of(&samples).expect("at least one iteration").p50;
        (block * order.len() as u64) as f64 / median_us / 1e3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_follow_the_order() {
        let l = batch_list(MemKind::Dram, 0x10000, 4096, &[2, 0, 3, 1]);
        assert_eq!((l.runs().len(), l.len(), l.total_bytes()), (4, 4, 16384));
        assert_eq!(l.get(0).unwrap().addr, 0x10000 + 2 * 4096);
    }

    #[test]
    fn budgets() {
        assert!(Budget::Iters(2).more(1, Duration::from_secs(9)));
        assert!(!Budget::Iters(2).more(2, Duration::ZERO));
        let t = Budget::Time(Duration::from_millis(10));
        assert!(t.more(0, Duration::from_secs(1)), "at least one iteration");
        assert!(!t.more(5, Duration::from_millis(11)));
        assert_eq!(Budget::Iters(1000).prepare_samples(), MAX_PREPARE_SAMPLES);
    }
}
