//! `freight bench cache-engine`: the sender's cache engine stores a prompt's KV cache
//! (`--num-chunks` chunks of `--chunk-tokens` tokens) and puts every chunk to the
//! receiver's store; the receiver's engine finds them there and retrieves them into its
//! own KV memory. Both sides' KV memory has the same layout (contiguous, or paged with
//! `--block-size` and the same block table), so the receiver checks its bytes against
//! the pattern the sender filled its own with.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use freight_cache::{CacheConfig, CacheEngine, KvLayout, KvMemory, KvShape, Place, StoreTimes};
use freight_core::{Agent, MemKind};
use freight_stream::{ChannelReceiver, ChannelSender, PipeReceiver, PipeSender, StoreReceiver, StoreSender};
use serde::{Deserialize, Serialize};

use super::buffers::{check, Device, Memory};
use super::{seed_of, Shape};
use crate::options::{format_size, parse_positive_size, CliError, CliResult};

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "KV cache (cache-engine)")]
pub struct KvArgs {
    /// Tokens per chunk.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub chunk_tokens: u64,

    /// Model layers.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub kv_layers: u64,

    /// KV heads.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub kv_heads: u64,

    /// Elements per head.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub head_dim: u64,

    /// Bytes per element (2: fp16 / bf16).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub elem_bytes: u64,

    /// Paged KV memory with blocks of this many tokens (0: contiguous).
    #[arg(long, default_value_t = 0)]
    pub block_size: u64,

    /// The sender's local tier (on the GPU with a GPU, else in host memory).
    #[arg(long, value_name = "SIZE", default_value = "2GiB", value_parser = parse_positive_size)]
    pub tier_size: u64,

    /// Commits that may await the receiver while the sender gathers and sends the next
    /// chunks (0: the sender waits for each commit). Commits then take at most the
    /// tier's slots over this number plus one.
    #[arg(long, default_value_t = freight_cache::DEFAULT_COMMITS_IN_FLIGHT, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=64))]
    pub commits_in_flight: usize,
}

/// The KV geometry of a run, as the sender tells the receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSpec {
    pub chunk_tokens: u64,
    pub layers: u64,
    pub heads: u64,
    pub head_dim: u64,
    pub elem_bytes: u64,
    pub block_size: u64,
    pub tier_size: u64,
    pub commits_in_flight: usize,
}

impl KvSpec {
    pub fn from_args(a: &KvArgs) -> KvSpec {
        KvSpec {
            chunk_tokens: a.chunk_tokens,
            layers: a.kv_layers,
            heads: a.kv_heads,
            head_dim: a.head_dim,
            elem_bytes: a.elem_bytes,
            block_size: a.block_size,
            tier_size: a.tier_size,
            commits_in_flight: a.commits_in_flight,
        }
    }

    pub fn shape(&self) -> KvShape {
        KvShape { layers: self.layers, heads: self.heads, head_dim: self.head_dim, elem_bytes: self.elem_bytes }
    }

    pub fn chunk_bytes(&self) -> u64 {
        self.shape().chunk_bytes(self.chunk_tokens)
    }

    /// What the engines would refuse once both processes run, refused before either
    /// starts: a chunk or a prompt too large to count, a block size that does not divide
    /// the prompt, and (where this process sends) a tier that cannot hold one chunk.
    pub fn check(&self, num_chunks: u64, sender: bool) -> CliResult<()> {
        let too_large = || {
            CliError::usage(
                "--num-chunks x --chunk-tokens tokens of this KV shape (--kv-layers, --kv-heads, --head-dim, \
                 --elem-bytes) exceed 2^64 bytes",
            )
        };
        let chunk = self.shape().checked_chunk_bytes(self.chunk_tokens).map_err(|_| too_large())?;
        chunk.checked_mul(num_chunks).ok_or_else(too_large)?;
        self.layout(num_chunks * self.chunk_tokens)?;
        if sender && self.tier_size < chunk {
            return Err(CliError::usage(format!(
                "--tier-size {} cannot hold one chunk of {} ({} tokens of this KV shape); raise --tier-size \
                 or lower --chunk-tokens",
                format_size(self.tier_size),
                format_size(chunk),
                self.chunk_tokens
            )));
        }
        Ok(())
    }

    /// The KV memory of a prompt of `tokens` tokens: paged memory has just enough
    /// blocks, used in reverse order so that no two neighbours in the prompt are
    /// neighbours in memory.
    fn layout(&self, tokens: u64) -> CliResult<KvLayout> {
        if self.block_size == 0 {
            return Ok(KvLayout::Contiguous { tokens });
        }
        if tokens % self.block_size != 0 {
            return Err(CliError::usage(format!(
                "--block-size {} must divide the prompt's {tokens} tokens (--num-chunks x --chunk-tokens)",
                self.block_size
            )));
        }
        let blocks = tokens / self.block_size;
        Ok(KvLayout::Paged {
            block_size: self.block_size,
            num_blocks: blocks,
            block_table: (0..blocks).rev().collect(),
        })
    }
}

/// The prompt of round `r`: rounds differ from their first token on, so no round finds
/// another's chunks.
pub(super) fn tokens_of(round: usize, shape: &Shape, spec: &KvSpec) -> Vec<u32> {
    let n = shape.num_objs * spec.chunk_tokens;
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(round as u32 * 7919 + 1)).collect()
}

fn spec(shape: &Shape) -> &KvSpec {
    shape.kv.as_ref().expect("a cache-engine run has a KV spec")
}

pub(super) fn kv_memory(memory: &Memory, shape: &Shape) -> CliResult<KvMemory> {
    let spec = spec(shape);
    let place = match memory.kind {
        MemKind::Vram => Place::gpu(memory.addr, memory.dev),
        _ => Place::host(memory.addr),
    };
    Ok(KvMemory { place, len: memory.len, layout: spec.layout(shape.num_objs * spec.chunk_tokens)? })
}

fn config(spec: &KvSpec, device: Device, tier: u64) -> CacheConfig {
    let (gpu, gpu_bytes, host_bytes) = match device {
        Device::Cuda(g) => (Some(g), tier, 0),
        Device::Cpu => (None, 0, tier),
    };
    CacheConfig { chunk_tokens: spec.chunk_tokens, shape: spec.shape(), gpu, gpu_bytes, host_bytes }
}

/// The sender's side: its engine (a local tier, and the receiver's store as its remote
/// sink).
pub struct Prefill {
    engine: CacheEngine,
}

impl Prefill {
    pub fn new(agent: &Arc<Agent>, pipe: PipeSender, shape: &Shape, device: Device) -> CliResult<Prefill> {
        let spec = spec(shape);
        spec.layout(shape.num_objs * spec.chunk_tokens)?;
        let channel = ChannelSender::new(pipe, shape.batch_size as usize, None)?;
        let sink = StoreSender::new(channel, shape.commit_size as usize)?;
        let engine = CacheEngine::new(agent, config(spec, device, spec.tier_size))?
            .with_remote_sink(sink)?
            .with_commits_in_flight(spec.commits_in_flight);
        Ok(Prefill { engine })
    }

    /// Stores round `r`'s prompt from `kv` and returns the seconds until the receiver
    /// held every chunk, and where the engine's time went.
    pub fn round(&mut self, kv: &Memory, shape: &Shape, r: usize) -> CliResult<(f64, StoreTimes)> {
        let tokens = tokens_of(r, shape, spec(shape));
        let memory = kv_memory(kv, shape)?;
        let start = Instant::now();
        let report = self.engine.store(&tokens, &memory)?;
        let secs = start.elapsed().as_secs_f64();
        if report.new_chunks as u64 != shape.num_objs {
            return Err(CliError::runtime(format!(
                "round {r}: {} of {} chunks were new; rounds must not share chunks",
                report.new_chunks, shape.num_objs
            )));
        }
        Ok((secs, report.times))
    }

    pub fn close(self) -> CliResult<()> {
        Ok(self.engine.close()?)
    }
}

/// The receiver's side: its engine (reading the store its pipe fills) and KV memory.
pub struct Decode {
    engine: CacheEngine,
    kv: Memory,
}

impl Decode {
    pub fn new(
        agent: &Arc<Agent>,
        pipe: PipeReceiver,
        shape: &Shape,
        device: Device,
        timeout: Duration,
    ) -> CliResult<Decode> {
        let spec = spec(shape);
        let store = StoreReceiver::new(ChannelReceiver::new(vec![pipe], timeout), None);
        // Chunks come from the store; the local tier only has to exist.
        let engine = CacheEngine::new(agent, config(spec, device, spec.chunk_bytes()))?.with_remote_source(store);
        let kv = Memory::alloc(agent, device, shape.round_bytes(), &super::Product::CacheEngine.host_remedy())?;
        Ok(Decode { engine, kv })
    }

    fn store(&self) -> &StoreReceiver {
        self.engine.remote_source().expect("built with a source")
    }

    /// Waits for round `r`'s chunks, retrieves them (timed) and, when `verify`, checks
    /// every byte; then frees them in the store.
    pub fn round(&mut self, shape: &Shape, r: usize, verify: bool, timeout: Duration) -> CliResult<f64> {
        let tokens = tokens_of(r, shape, spec(shape));
        let names: Vec<String> = self.engine.keys(&tokens).iter().map(|k| k.name()).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        self.store().wait_for(&refs, timeout)?;
        if verify {
            // Poisoned first, so that bytes left over from anything else cannot pass.
            for i in 0..shape.num_objs {
                self.kv.fill(i * shape.obj_size, shape.obj_size, 0xdead_0000 + i)?;
            }
        }
        let memory = kv_memory(&self.kv, shape)?;
        let start = Instant::now();
        let found = self.engine.retrieve(&tokens, &memory)?;
        let secs = start.elapsed().as_secs_f64();
        if found != tokens.len() {
            return Err(CliError::runtime(format!("round {r}: retrieved {found} of {} tokens", tokens.len())));
        }
        if verify {
            for i in 0..shape.num_objs {
                let at = self.kv.addr + i * shape.obj_size;
                check(self.kv.kind, at, self.kv.dev, shape.obj_size, seed_of(i))
                    .map_err(|e| CliError::runtime(format!("KV bytes of chunk {i} are wrong: {e}")))?;
            }
        }
        for n in &names {
            self.store().remove(n);
        }
        Ok(secs)
    }

    /// After the last round: the sender closed and put nothing more.
    pub fn expect_end(&self, timeout: Duration) -> CliResult<()> {
        self.store().wait_closed(timeout)?;
        if !self.store().is_empty() {
            return Err(CliError::runtime("the sender put more chunks than the run announced"));
        }
        Ok(())
    }
}
