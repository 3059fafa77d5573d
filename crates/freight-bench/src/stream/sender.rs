//! The sending side of `bench pipe` / `channel` / `storage`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_cache::StoreTimes;
use freight_core::{Agent, DescList};
use freight_stream::{ChannelSender, CommitStats, Outgoing, PipeConfig, PipeSender, StoreSender};
use serde_json::json;

use super::buffers::{Device, Memory};
use super::{gbps, mean_std, say, seed_of, work_after, Product, Round, Shape, StreamArgs};
use crate::emit;
use crate::options::{format_size, CliError, CliResult};
use crate::report::host_json;

/// The sender's simulated work per 10 objects.
const SENDER_WORK_MS: u64 = 50;

pub const AGENT_NAME: &str = "freight-stream-sender";

struct RoundResult {
    round: Round,
    secs: f64,
    work_secs: f64,
    /// storage: the round's commits.
    commits: Vec<CommitStats>,
    /// cache-engine: where the sender's engine spent the round.
    engine_times: Option<StoreTimes>,
}

pub fn run(product: Product, a: &StreamArgs, addr: &str) -> CliResult<()> {
    let shape = Shape::from_args(product, a);
    let device = Device::parse(&a.device, 0)?;
    let agent = Arc::new(Agent::new(AGENT_NAME, a.engine.agent_config("0.0.0.0:0", a.engine.transport.require()))?);
    let total = shape.round_bytes();
    let source = Memory::alloc(&agent, device, total, &product.host_remedy())?;
    for i in 0..shape.num_objs {
        source.fill(i * shape.obj_size, shape.obj_size, seed_of(i))?;
    }
    say(
        a.json,
        &format!(
            "Generated {} objects with total size {:.2} MiB on {}",
            shape.num_objs,
            total as f64 / (1 << 20) as f64,
            device.name()
        ),
    );
    let config = PipeConfig { timeout: a.timeout, ..PipeConfig::default() };
    let pipe = PipeSender::connect(&agent, addr, &config)
        .map_err(|e| CliError::runtime(format!("cannot open a pipe to {addr}: {e}")))?;
    let path_taken = agent.path_to(pipe.peer()).ok();
    let path = path_taken.as_ref().map(|p| format!("{} ({})", p.transport, p.reason)).unwrap_or_default();
    say(
        a.json,
        &format!(
            "Pipe open: {} buffer in the receiver's {} memory; path {path}",
            format_size(pipe.capacity()),
            pipe.buffer().kind.as_str()
        ),
    );
    // The first message tells the receiver the run's shape.
    let hello = serde_json::to_vec(&shape).expect("the shape always encodes");
    let first_byte = DescList::from_descs(source.kind, [source.desc(0, 1)])?;
    pipe.send(&first_byte, hello)?;
    let mut sink = match product {
        Product::Pipe => Sink::Pipe(pipe),
        Product::Channel => Sink::Channel(ChannelSender::new(pipe, shape.batch_size as usize, None)?),
        Product::Storage => Sink::Store(StoreSender::new(
            ChannelSender::new(pipe, shape.batch_size as usize, None)?,
            shape.commit_size as usize,
        )?),
        Product::CacheEngine => Sink::Cache(Box::new(super::cache::Prefill::new(&agent, pipe, &shape, device)?)),
    };
    let mut results = Vec::new();
    for (r, &round) in shape.rounds.iter().enumerate() {
        say(a.json, &format!("Round {r} ({round:?}): sending {} objects...", shape.num_objs));
        let result = send_round(&mut sink, &source, &shape, r, round, a.json)?;
        let rate = gbps(total, result.secs);
        say(
            a.json,
            &format!(
                "Sent {} objects in {:.6} seconds (until the receiver released the last)",
                shape.num_objs, result.secs
            ),
        );
        say(a.json, &format!("Throughput: {rate:.2} GB/s"));
        if round == Round::Work {
            say(a.json, &format!("Simulated work on the sender: {:.3} s", result.work_secs));
        }
        results.push(result);
        if product.needs_round_sync() {
            super::wait_round_done(&agent, r, a.timeout)?;
        }
    }
    sink.close()?;
    report(product, a, &shape, &results, device, &path_taken)
}

enum Sink {
    Pipe(PipeSender),
    Channel(ChannelSender),
    Store(StoreSender),
    Cache(Box<super::cache::Prefill>),
}

impl Sink {
    /// Until the receiver has released (or, for the store, taken) everything: a round
    /// ends end to end.
    fn end_round(&mut self, commits: &mut Vec<CommitStats>, json: bool) -> CliResult<()> {
        match self {
            Sink::Pipe(p) => p.drain(),
            Sink::Channel(c) => c.drain(),
            Sink::Store(s) => s.commit().map(|c| commits.extend(c.inspect(|c| say_commit(json, c)))),
            Sink::Cache(_) => Ok(()),
        }
        .map_err(|e| CliError::runtime(format!("the stream failed: {e}")))
    }

    fn close(self) -> CliResult<()> {
        match self {
            Sink::Pipe(p) => p.close(),
            Sink::Channel(c) => c.close(),
            Sink::Store(s) => s.close(),
            Sink::Cache(prefill) => return prefill.close(),
        }
        .map_err(|e| CliError::runtime(format!("closing the stream failed: {e}")))
    }
}

fn say_commit(json: bool, c: &CommitStats) {
    say(
        json,
        &format!(
            "Committed {} objects ({:.2} MB) in {:.4} ms: transfer time {:.4} ms, wait for receiver {:.4} ms; \
             pure transfer throughput {:.2} GB/s",
            c.objects,
            c.bytes as f64 / 1e6,
            c.total().as_secs_f64() * 1e3,
            c.transfer.as_secs_f64() * 1e3,
            c.wait_receiver.as_secs_f64() * 1e3,
            c.transfer_gbps()
        ),
    );
}

/// Object `k` of round `r`, as the channel and the store send it.
fn outgoing(source: &Memory, shape: &Shape, r: usize, k: u64) -> Outgoing {
    Outgoing {
        key: key_of(r, k),
        kind: source.kind,
        local: source.desc(k * shape.obj_size, shape.obj_size),
        meta: Vec::new(),
    }
}

/// Object `i` of round `r`: its key (channel) or tag (pipe).
pub fn key_of(round: usize, i: u64) -> String {
    format!("r{round}-{i}")
}

fn send_round(
    sink: &mut Sink,
    source: &Memory,
    shape: &Shape,
    r: usize,
    round: Round,
    json: bool,
) -> CliResult<RoundResult> {
    let failed = |e: freight_core::Error| CliError::runtime(format!("round {r}: {e}"));
    let mut work = Duration::ZERO;
    let mut commits = Vec::new();
    let step = match sink {
        Sink::Pipe(_) | Sink::Store(_) => 1,
        Sink::Channel(_) => shape.batch_size,
        Sink::Cache(prefill) => {
            // One store of the whole prompt: it returns once the receiver holds it.
            let (secs, times) = prefill.round(source, shape, r)?;
            say(
                json,
                &format!(
                    "Sender's engine: gathering {:.4} s, sending {:.4} s, waiting for the receiver {:.4} s",
                    times.gathering.as_secs_f64(),
                    times.sending.as_secs_f64(),
                    times.waiting_for_peer.as_secs_f64()
                ),
            );
            return Ok(RoundResult { round, secs, work_secs: 0.0, commits, engine_times: Some(times) });
        }
    };
    let start = Instant::now();
    let mut i = 0;
    while i < shape.num_objs {
        let end = (i + step).min(shape.num_objs);
        match sink {
            Sink::Pipe(p) => {
                let local = DescList::from_descs(source.kind, [source.desc(i * shape.obj_size, shape.obj_size)])?;
                p.send(&local, key_of(r, i).into_bytes()).map_err(failed)?;
            }
            Sink::Channel(c) => {
                let batch: Vec<Outgoing> = (i..end).map(|k| outgoing(source, shape, r, k)).collect();
                c.send(&batch).map_err(failed)?;
            }
            Sink::Store(s) => {
                if let Some(c) = s.put(outgoing(source, shape, r, i)).map_err(failed)? {
                    say_commit(json, &c);
                    commits.push(c);
                }
            }
            Sink::Cache(_) => unreachable!("stored whole above"),
        }
        if round == Round::Work {
            for done in i + 1..=end {
                if let Some(d) = work_after(done, SENDER_WORK_MS) {
                    std::thread::sleep(d);
                    work += d;
                }
            }
        }
        i = end;
    }
    sink.end_round(&mut commits, json)?;
    Ok(RoundResult {
        round,
        secs: start.elapsed().as_secs_f64(),
        work_secs: work.as_secs_f64(),
        commits,
        engine_times: None,
    })
}

/// The path the pipe took: the transport and why.
type PathTaken = Option<freight_core::TransferPath>;

fn report(
    product: Product,
    a: &StreamArgs,
    shape: &Shape,
    results: &[RoundResult],
    device: Device,
    path_taken: &PathTaken,
) -> CliResult<()> {
    let bytes = shape.round_bytes();
    let timed: Vec<&RoundResult> = results.iter().filter(|r| r.round != Round::Verify).collect();
    let main_kind = if a.simulate_work { Round::Work } else { Round::Transfer };
    let main: Vec<f64> = timed.iter().filter(|r| r.round == main_kind).map(|r| gbps(bytes, r.secs)).collect();
    let (mean, std) = mean_std(&main);
    say(a.json, &format!("Throughput over {} round(s): {mean:.2} +- {std:.2} GB/s", main.len()));
    let transfer_only = timed.iter().find(|r| r.round == Round::Transfer).map(|r| r.secs);
    if a.simulate_work {
        let with_work: Vec<f64> = timed.iter().filter(|r| r.round == Round::Work).map(|r| r.secs).collect();
        let (work_round, _) = mean_std(&with_work);
        let sender_work = shape.num_objs / 10 * SENDER_WORK_MS;
        let receiver_work = shape.num_objs / 10 * super::receiver::RECEIVER_WORK_MS;
        let transfer = transfer_only.unwrap_or(0.0);
        let bound = (sender_work.max(receiver_work) as f64 / 1e3).max(transfer);
        say(
            a.json,
            &format!(
                "Overlap: a round with work takes {work_round:.3} s; work alone {:.3} s (sender) / {:.3} s (receiver), \
                 transfers alone {transfer:.3} s; max of them {bound:.3} s, sum (nothing overlapped) {:.3} s",
                sender_work as f64 / 1e3,
                receiver_work as f64 / 1e3,
                (sender_work + receiver_work) as f64 / 1e3 + transfer,
            ),
        );
    }
    if a.json {
        let doc = json!({
            "benchmark": format!("freight bench {}", product.command()),
            "host": host_json(),
            "device": device.name(),
            "num_objs": shape.num_objs,
            "obj_size": shape.obj_size,
            "buffer_size": a.buffer_size,
            "batch_size": shape.batch_size,
            "transport": a.engine.transport.as_str(),
            "path": path_taken.as_ref().map(|p| json!({"transport": p.transport.to_string(), "reason": p.reason})),
            "verified": !a.no_verify,
            "simulate_work": a.simulate_work,
            "rounds": results.iter().map(|r| json!({
                "kind": format!("{:?}", r.round).to_lowercase(),
                "seconds": r.secs,
                "gbps": gbps(bytes, r.secs),
                "sender_work_seconds": r.work_secs,
                "commits": r.commits.iter().map(commit_json).collect::<Vec<_>>(),
                "engine_seconds": r.engine_times.map(|t| json!({
                    "gathering": t.gathering.as_secs_f64(),
                    "sending": t.sending.as_secs_f64(),
                    "waiting_for_receiver": t.waiting_for_peer.as_secs_f64(),
                })),
            })).collect::<Vec<_>>(),
            "throughput_gbps": { "mean": mean, "std": std, "rounds": main },
            "transfer_only_seconds": transfer_only,
            "commit_size": matches!(product, Product::Storage | Product::CacheEngine).then_some(shape.commit_size),
            "pure_transfer_gbps": pure_transfer(&timed),
        });
        emit(&(serde_json::to_string_pretty(&doc).expect("json values always print") + "\n"))?;
    }
    Ok(())
}

fn commit_json(c: &CommitStats) -> serde_json::Value {
    json!({
        "objects": c.objects,
        "bytes": c.bytes,
        "transfer_seconds": c.transfer.as_secs_f64(),
        "wait_receiver_seconds": c.wait_receiver.as_secs_f64(),
        "transfer_gbps": c.transfer_gbps(),
    })
}

/// storage: the timed rounds' bytes over their commits' transfer time (None for the
/// other products).
fn pure_transfer(timed: &[&RoundResult]) -> Option<f64> {
    let commits: Vec<&CommitStats> = timed.iter().flat_map(|r| &r.commits).collect();
    if commits.is_empty() {
        return None;
    }
    let bytes = commits.iter().map(|c| c.bytes).sum();
    Some(gbps(bytes, commits.iter().map(|c| c.transfer.as_secs_f64()).sum()))
}
