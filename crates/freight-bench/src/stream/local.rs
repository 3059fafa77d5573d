//! `freight bench cache-engine --role local`: one process stores a prompt's KV cache
//! (on --device) into a cache engine whose only tier is host memory (pinned for the GPU:
//! chunks go through a scratch chunk on the GPU and the copy engine), then retrieves it
//! back; beside the pinned copy bandwidth of the same GPU, measured in the same run.

use std::sync::Arc;
use std::time::Instant;

use freight_cache::{CacheConfig, CacheEngine};
use freight_core::Agent;
use freight_cuda::bounce::PinnedBuffer;
use freight_cuda::driver::{copy_sync, DeviceBuffer};
use freight_cuda::Device as Gpu;
use serde_json::json;

use super::buffers::{check, Device, Memory};
use super::cache::{kv_memory, tokens_of};
use super::{gbps, mean_std, say, seed_of, Product, Round, Shape, StreamArgs, KV_SIZE_OPTIONS};
use crate::emit;
use crate::options::{CliError, CliResult};
use crate::report::host_json;

/// Bytes moved to measure the pinned copy bandwidth.
const CEILING_BYTES: u64 = 1 << 30;

pub fn run_local(a: &StreamArgs) -> CliResult<()> {
    let shape = Shape::from_args(Product::CacheEngine, a);
    let spec = shape.kv.clone().expect("cache-engine shapes have a KV spec");
    let device = Device::parse(&a.device, 0)?;
    let agent = Arc::new(Agent::new("freight-cache-local", a.engine.agent_config("127.0.0.1:0", None))?);
    let bytes = shape.round_bytes();
    // Room for a whole round, so that nothing is evicted while it is retrieved.
    let host_bytes = bytes.saturating_add(spec.chunk_bytes());
    let remedy = format!("lower {KV_SIZE_OPTIONS}");
    let kv_on_host = if device == Device::Cpu { bytes } else { 0 };
    crate::host_memory::ensure_room(host_bytes.saturating_add(kv_on_host), "bench cache-engine --role local", &remedy)?;
    let kv = Memory::alloc(&agent, device, bytes, &remedy)?;
    for i in 0..shape.num_objs {
        kv.fill(i * shape.obj_size, shape.obj_size, seed_of(i))?;
    }
    let gpu = match device {
        Device::Cuda(g) => Some(g),
        Device::Cpu => None,
    };
    let config = CacheConfig { chunk_tokens: spec.chunk_tokens, shape: spec.shape(), gpu, gpu_bytes: 0, host_bytes };
    let mut engine = CacheEngine::new(&agent, config)?;
    say(
        a.json,
        &format!(
            "Generated {} chunks of {} tokens ({:.2} MB each, {:.2} MB in all) on {}; tier: host memory{}",
            shape.num_objs,
            spec.chunk_tokens,
            shape.obj_size as f64 / 1e6,
            bytes as f64 / 1e6,
            device.name(),
            if gpu.is_some() { " (pinned)" } else { "" }
        ),
    );
    let ceiling = match gpu {
        Some(g) => Some(pinned_bandwidth(g)?),
        None => None,
    };
    if let Some((d2h, h2d)) = ceiling {
        say(a.json, &format!("Pinned copy bandwidth: GPU->host {d2h:.2} GB/s, host->GPU {h2d:.2} GB/s"));
    }
    let mut rounds = Vec::new();
    for (r, &round) in shape.rounds.iter().enumerate() {
        let tokens = tokens_of(r, &shape, &spec);
        let memory = kv_memory(&kv, &shape)?;
        let start = Instant::now();
        engine.store(&tokens, &memory)?;
        let store = start.elapsed().as_secs_f64();
        if round == Round::Verify {
            for i in 0..shape.num_objs {
                kv.fill(i * shape.obj_size, shape.obj_size, 0xdead_0000 + i)?;
            }
        }
        let start = Instant::now();
        let found = engine.retrieve(&tokens, &memory)?;
        let retrieve = start.elapsed().as_secs_f64();
        if found != tokens.len() {
            return Err(CliError::runtime(format!("round {r}: retrieved {found} of {} tokens", tokens.len())));
        }
        if round == Round::Verify {
            for i in 0..shape.num_objs {
                check(kv.kind, kv.addr + i * shape.obj_size, kv.dev, shape.obj_size, seed_of(i))
                    .map_err(|e| CliError::runtime(format!("chunk {i} came back wrong: {e}")))?;
            }
            say(a.json, "All data verified successfully!");
        }
        say(
            a.json,
            &format!(
                "Round {r} ({round:?}): store {:.2} GB/s ({store:.4} s), retrieve {:.2} GB/s ({retrieve:.4} s)",
                gbps(bytes, store),
                gbps(bytes, retrieve)
            ),
        );
        rounds.push((round, store, retrieve));
    }
    let timed: Vec<&(Round, f64, f64)> = rounds.iter().filter(|r| r.0 != Round::Verify).collect();
    let (store, store_std) = mean_std(&timed.iter().map(|r| gbps(bytes, r.1)).collect::<Vec<_>>());
    let (retrieve, retrieve_std) = mean_std(&timed.iter().map(|r| gbps(bytes, r.2)).collect::<Vec<_>>());
    say(
        a.json,
        &format!("Store: {store:.2} +- {store_std:.2} GB/s; retrieve: {retrieve:.2} +- {retrieve_std:.2} GB/s"),
    );
    if let Some((d2h, h2d)) = ceiling {
        say(
            a.json,
            &format!("Of pinned bandwidth: store {:.1}%, retrieve {:.1}%", 100.0 * store / d2h, 100.0 * retrieve / h2d),
        );
    }
    if a.json {
        let doc = json!({
            "benchmark": "freight bench cache-engine --role local",
            "host": host_json(),
            "device": device.name(),
            "num_chunks": shape.num_objs,
            "chunk_tokens": spec.chunk_tokens,
            "chunk_bytes": shape.obj_size,
            "kv": spec,
            "verified": !a.no_verify,
            "rounds": rounds.iter().map(|(round, s, r)| json!({
                "kind": format!("{round:?}").to_lowercase(),
                "store_seconds": s, "retrieve_seconds": r,
                "store_gbps": gbps(bytes, *s), "retrieve_gbps": gbps(bytes, *r),
            })).collect::<Vec<_>>(),
            "store_gbps": { "mean": store, "std": store_std },
            "retrieve_gbps": { "mean": retrieve, "std": retrieve_std },
            "pinned_gbps": ceiling.map(|(d2h, h2d)| json!({ "gpu_to_host": d2h, "host_to_gpu": h2d })),
        });
        emit(&(serde_json::to_string_pretty(&doc).expect("json values always print") + "\n"))?;
    }
    Ok(())
}

/// GPU->host and host->GPU GB/s of one large copy to and from pinned memory (best of 3).
fn pinned_bandwidth(gpu: usize) -> CliResult<(f64, f64)> {
    let device = Gpu::get(gpu)?;
    let n = CEILING_BYTES as usize;
    let host = PinnedBuffer::new(device, n)?;
    let dev = DeviceBuffer::alloc(device, n)?;
    let best = |dst: u64, src: u64| -> CliResult<f64> {
        let mut best: f64 = 0.0;
        for _ in 0..3 {
            let start = Instant::now();
            copy_sync(device, dst, src, n)?;
            best = best.max(gbps(CEILING_BYTES, start.elapsed().as_secs_f64()));
        }
        Ok(best)
    };
    Ok((best(host.as_ptr() as u64, dev.addr())?, best(dev.addr(), host.as_ptr() as u64)?))
}
