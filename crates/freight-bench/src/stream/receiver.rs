//! The receiving side of `bench pipe` / `channel` / `storage`: owns the pipe's buffer,
//! takes the run's shape from the sender's first message, receives (and in the
//! verification round checks) every object; the store's objects are got by key and
//! removed once looked at.

use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_core::Agent;
use freight_stream::{Buffer, BufferInfo, ChannelReceiver, PipeConfig, PipeListener, PipeReceiver, StoreReceiver};

use super::buffers::{check, Device, Memory};
use super::sender::key_of;
use super::{gbps, say, seed_of, work_after, Product, Round, Shape, StreamArgs};
use crate::options::{format_size, CliError, CliResult};
use crate::target;

/// The receiver's simulated work per 10 objects.
pub const RECEIVER_WORK_MS: u64 = 20;

pub const AGENT_NAME: &str = "freight-stream-receiver";

pub fn run(product: Product, a: &StreamArgs) -> CliResult<()> {
    if a.exit_with_parent {
        crate::target::child::exit_with_parent()?;
    }
    let device = Device::parse(&a.device, 1)?;
    let agent = Arc::new(Agent::new(AGENT_NAME, a.engine.agent_config(&a.listen, a.engine.transport.require()))?);
    // The line a parent process (or a person) reads the address from.
    say(a.json, &target::listen_line(&agent.addresses(), std::process::id()));
    let (buffer, _memory) = match device {
        Device::Cpu => {
            crate::host_memory::ensure_room(a.buffer_size, "the receiver's buffer", "lower --buffer-size")?;
            (Buffer::Host { capacity: a.buffer_size }, None)
        }
        Device::Cuda(_) => {
            let m = Memory::alloc(&agent, device, a.buffer_size, &product.host_remedy())?;
            (Buffer::Registered(BufferInfo { kind: m.kind, addr: m.addr, len: m.len, dev: m.dev }), Some(m))
        }
    };
    let config = PipeConfig { timeout: a.timeout, ..PipeConfig::default() };
    let pipe = PipeListener::new(&agent)
        .accept(buffer, &config)
        .map_err(|e| CliError::runtime(format!("no pipe was opened: {e}")))?;
    say(
        a.json,
        &format!("Pipe from '{}' with a {} buffer on {}", pipe.peer(), format_size(a.buffer_size), device.name()),
    );
    say(a.json, "Waiting to receive data...");
    let hello = pipe.recv(None)?.ok_or_else(|| CliError::runtime("the sender closed the pipe at once"))?;
    let shape: Shape = serde_json::from_slice(hello.tag())
        .map_err(|e| CliError::runtime(format!("the sender's first message is not a run description: {e}")))?;
    drop(hello);
    if shape.product != product {
        return Err(CliError::runtime(format!(
            "the sender runs bench {:?}, this receiver bench {product:?}",
            shape.product
        )));
    }
    let sender = pipe.peer().to_string();
    let mut source = match product {
        Product::Pipe => Source::Pipe(pipe),
        Product::Channel => Source::Channel(ChannelReceiver::new(vec![pipe], a.timeout)),
        Product::Storage => {
            Source::Store(StoreReceiver::new(ChannelReceiver::new(vec![pipe], a.timeout), None), a.timeout)
        }
        Product::CacheEngine => {
            Source::Cache(Box::new(super::cache::Decode::new(&agent, pipe, &shape, device, a.timeout)?), a.timeout)
        }
    };
    for (r, &round) in shape.rounds.iter().enumerate() {
        let timed = receive_round(&mut source, &shape, r, round)?;
        if product.needs_round_sync() {
            super::say_round_done(&agent, &sender, r)?;
        }
        say(a.json, &format!("Received all {} objects (round {r}, {round:?})", shape.num_objs));
        if round == Round::Verify {
            say(a.json, "All data verified successfully!");
        }
        match timed.bytes {
            0 => say(a.json, "Receiver throughput: not measured (the round arrived at once)"),
            bytes => say(
                a.json,
                &format!("Receiver throughput: {:.2} GB/s over {:.6} s", gbps(bytes, timed.secs), timed.secs),
            ),
        }
    }
    source.expect_end()?;
    say(a.json, "Test completed");
    Ok(())
}

enum Source {
    Pipe(PipeReceiver),
    Channel(ChannelReceiver),
    /// The store, and how long to wait for a key.
    Store(StoreReceiver, Duration),
    /// The receiver's cache engine, and how long to wait for a round's chunks.
    Cache(Box<super::cache::Decode>, Duration),
}

/// One received object: (key, kind, address, device, length), and what keeps it alive.
type Object = (String, freight_core::MemKind, u64, u64, u64);

impl Source {
    /// The next objects (the store: the one under `key`), with whatever must live
    /// while they are looked at.
    fn next(&mut self, key: &str) -> CliResult<(Vec<Object>, Box<dyn std::any::Any>)> {
        let ended = || CliError::runtime("the sender closed the stream early");
        match self {
            Source::Pipe(p) => {
                let m = p.recv(None)?.ok_or_else(ended)?;
                let (kind, addr, dev) = m.location();
                let key = String::from_utf8_lossy(m.tag()).into_owned();
                Ok((vec![(key, kind, addr, dev, m.len())], Box::new(m)))
            }
            Source::Channel(c) => {
                let batch = c.recv(None)?.ok_or_else(ended)?;
                let objects = batch
                    .iter()
                    .map(|o| {
                        let (kind, addr, dev) = o.location();
                        (o.key.clone(), kind, addr, dev, o.len())
                    })
                    .collect();
                Ok((objects, Box::new(batch)))
            }
            Source::Store(store, timeout) => {
                store.wait_for(&[key], *timeout)?;
                let o =
                    store.remove(key).ok_or_else(|| CliError::runtime(format!("'{key}' vanished from the store")))?;
                let (kind, addr, dev) = o.data.location();
                Ok((vec![(o.key.clone(), kind, addr, dev, o.len())], Box::new(o)))
            }
            Source::Cache(..) => unreachable!("cache-engine rounds are received whole"),
        }
    }

    fn expect_end(&mut self) -> CliResult<()> {
        let more = match self {
            Source::Pipe(p) => p.recv(None)?.is_some(),
            Source::Channel(c) => c.recv(None)?.is_some(),
            Source::Store(store, timeout) => {
                store.wait_closed(*timeout)?;
                !store.is_empty()
            }
            Source::Cache(decode, timeout) => return decode.expect_end(*timeout),
        };
        if more {
            return Err(CliError::runtime("the sender sent more than the run it announced"));
        }
        Ok(())
    }
}

/// What the receiver timed of a round.
struct Timed {
    secs: f64,
    bytes: u64,
}

/// Receives round `r`. The clock starts when its first objects arrive (the time before
/// is the sender's, not the transfer's), so those objects are not counted in the rate.
fn receive_round(source: &mut Source, shape: &Shape, r: usize, round: Round) -> CliResult<Timed> {
    if let Source::Cache(decode, timeout) = source {
        let secs = decode.round(shape, r, round == Round::Verify, *timeout)?;
        return Ok(Timed { secs, bytes: shape.round_bytes() });
    }
    let mut start = None;
    let mut untimed = 0u64;
    let mut next = 0u64;
    while next < shape.num_objs {
        let (objects, keep) = source.next(&key_of(r, next))?;
        if start.is_none() {
            start = Some(Instant::now());
            untimed = objects.len() as u64;
        }
        for (key, kind, addr, dev, len) in objects {
            let expected = key_of(r, next);
            if key != expected {
                return Err(CliError::runtime(format!("expected object '{expected}', got '{key}'")));
            }
            if len != shape.obj_size {
                return Err(CliError::runtime(format!("object '{key}' has {len} bytes, {} were sent", shape.obj_size)));
            }
            if round == Round::Verify {
                check(kind, addr, dev, len, seed_of(next))
                    .map_err(|e| CliError::runtime(format!("object '{key}' is corrupt: {e}")))?;
            }
            next += 1;
            if round == Round::Work {
                if let Some(d) = work_after(next, RECEIVER_WORK_MS) {
                    std::thread::sleep(d);
                }
            }
        }
        drop(keep);
    }
    let secs = start.map_or(Duration::ZERO, |s| s.elapsed()).as_secs_f64();
    Ok(Timed { secs, bytes: (shape.num_objs - untimed.min(shape.num_objs)) * shape.obj_size })
}
