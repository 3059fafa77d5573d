//! One rank's expert-parallel buffer: its workspace (exported to the other ranks of the
//! host by CUDA IPC), the peers' workspaces mapped here, scratch space, and the calls
//! that queue dispatch and combine on the caller's stream.
//!
//! Dispatch takes two calls because its output size is known only once every rank's
//! rows are in: [`Buffer::dispatch_begin`] lays the tokens out, sends them, numbers what
//! arrived and returns the counts (the one host synchronisation); the caller allocates
//! the outputs; [`Buffer::dispatch_finish`] fills them. In low-latency mode
//! ([`Buffer::dispatch_low_latency`]) the outputs are sized for the most any dispatch
//! delivers, so one call queues everything and nothing waits for the GPU: a CUDA graph
//! can capture it. Combine is one call and does not synchronise; a failure it meets
//! shows at the next call that waits, or at [`Buffer::check`].

use std::sync::{Arc, Weak};
use std::time::Duration;

use cudarc::driver::sys as cu;
use freight_core::{Error, Result};
use freight_cuda::bounce::PinnedBuffer;
use freight_cuda::driver::{check, Device, DeviceBuffer};
use freight_cuda::ipc::{self, ImportCache, Imported};
use freight_proto::metadata::HostIdentity;
use freight_proto::region::GpuLocation;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::engine_relay::{self as relay, Backend, Relay};
use crate::kernels::{
    fp8_row_bytes, CombineArgs, Control, DispatchInputs, DispatchOutputs, Kernels, PlanScratch, Site, FP8_GROUP,
};
use crate::layout::{Config, Shape};
use crate::rendezvous::{Group, RENDEZVOUS_LOST};
use crate::status;

/// What each rank tells the others when a buffer is created.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Announcement {
    rank: usize,
    host: HostIdentity,
    workspace: GpuLocation,
    /// Where the workspace starts (its allocation may begin earlier).
    workspace_addr: u64,
    workspace_bytes: u64,
    sizes: Sizes,
    backend: String,
    /// How to reach this rank through the engine (engine backends).
    engine: Option<relay::Announcement>,
}

/// What a buffer was made for, as the ranks must agree on it: the kernels index peers'
/// workspaces and records with these (fp8 follows from the hidden size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Sizes {
    hidden: usize,
    max_tokens: usize,
    topk: usize,
    experts_per_rank: usize,
}

impl Sizes {
    fn of(config: &Config) -> Sizes {
        Sizes {
            hidden: config.hidden,
            max_tokens: config.max_tokens,
            topk: config.topk,
            experts_per_rank: config.local_experts,
        }
    }

    /// Fails naming the first size in which rank `rank`'s buffer (`peer`) differs from
    /// this rank's.
    fn agree(&self, rank: usize, peer: &Sizes) -> Result<()> {
        let fields = [
            ("hidden size", self.hidden, peer.hidden),
            ("max tokens", self.max_tokens, peer.max_tokens),
            ("topk", self.topk, peer.topk),
            ("experts per rank", self.experts_per_rank, peer.experts_per_rank),
        ];
        match fields.iter().find(|(_, mine, theirs)| mine != theirs) {
            None => Ok(()),
            Some((name, mine, theirs)) => Err(Error::InvalidArgument(format!(
                "rank {rank} made its buffer with {name} {theirs}, this rank with {mine}: every rank must pass the same hidden size, max tokens, topk and experts per rank"
            ))),
        }
    }
}

/// How a buffer reaches the other ranks, and how long it waits for them.
#[derive(Debug, Clone)]
pub struct Options {
    pub backend: Backend,
    /// Where the engine listens (engine backends): "host:port".
    pub listen: String,
    pub timeout: Duration,
}

/// The host-memory words the kernels and the host share: the status word, the abort
/// word (a dead rank's number plus one), the input word (what was wrong with the
/// caller's routing), then the counts dispatch publishes (per source rank, then per
/// local expert).
struct HostWords {
    memory: PinnedBuffer,
}

// SAFETY: the words are read and written with volatile accesses; their meaning is
// settled by the protocol (the kernels write counts before the host reads them after a
// synchronisation; status and abort are single words).
unsafe impl Sync for HostWords {}
unsafe impl Send for HostWords {}

impl HostWords {
    const STATUS: usize = 0;
    const ABORT: usize = 1;
    const INPUT: usize = 2;
    const COUNTS: usize = 32;

    fn new(device: &Device, counts: usize) -> Result<HostWords> {
        let memory = PinnedBuffer::new(device, Self::COUNTS + counts * 4)?;
        // SAFETY: freshly allocated, large enough, not yet shared.
        unsafe { std::ptr::write_bytes(memory.as_ptr(), 0, memory.len()) };
        Ok(HostWords { memory })
    }

    fn word(&self, index: usize) -> *mut u64 {
        // SAFETY: within the allocation (index 0 or 1).
        unsafe { (self.memory.as_ptr() as *mut u64).add(index) }
    }

    fn address(&self, byte_offset: usize) -> u64 {
        self.memory.as_ptr() as u64 + byte_offset as u64
    }

    fn status(&self) -> u64 {
        // SAFETY: an aligned word of live pinned memory.
        unsafe { std::ptr::read_volatile(self.word(Self::STATUS)) }
    }

    /// Takes what the layout kernel found wrong with the routing, leaving the word clear.
    fn take_input_error(&self) -> Option<Error> {
        // SAFETY: an aligned word of live pinned memory.
        let word = unsafe { std::ptr::read_volatile(self.word(Self::INPUT)) };
        if word != 0 {
            // Cleared only once set: a layout kernel still running sets it by a
            // compare-and-swap from zero, which fails until then, so no report slips in
            // between the read and the clear.
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(self.word(Self::INPUT), 0) };
        }
        status::decode(word, 0.0)
    }

    /// The abort word: 0 while every rank is alive.
    fn aborted(&self) -> u64 {
        // SAFETY: an aligned word of live pinned memory.
        unsafe { std::ptr::read_volatile(self.word(Self::ABORT)) }
    }

    fn abort(&self, dead_rank: usize) {
        // SAFETY: as above; kernels only read it.
        unsafe { std::ptr::write_volatile(self.word(Self::ABORT), abort_word(dead_rank)) };
    }

    fn count(&self, index: usize) -> usize {
        // SAFETY: within the allocation; written by a kernel the caller synchronised with.
        unsafe { std::ptr::read_volatile((self.memory.as_ptr().add(Self::COUNTS) as *const i32).add(index)) as usize }
    }
}

/// The abort word for a death hook's `dead_rank`: the rank plus one (the kernels report
/// the word less one), or for a lost rendezvous the word they report as
/// [`status::RENDEZVOUS_LOST`].
fn abort_word(dead_rank: usize) -> u64 {
    if dead_rank == RENDEZVOUS_LOST {
        status::RENDEZVOUS_LOST + 1
    } else {
        dead_rank as u64 + 1
    }
}

/// Scratch space on the GPU, carved out of one allocation.
struct Scratch {
    _memory: DeviceBuffer,
    send_count: u64,
    expert_count_global: u64,
    plan: PlanScratch,
    /// The last dispatch and combine completed (two u64; see kernels.cu).
    epochs: u64,
    /// The device copy of the status word.
    failed: u64,
    /// Where tokens are quantized to fp8 before they are sent (0 when the hidden size
    /// does not allow fp8).
    fp8_staging: u64,
    /// One "blocks finished" counter per signalling kernel.
    done: u64,
}

/// Records `e` as what broke the buffer (the ranks' steps no longer agree) and returns it.
fn broken(state: &mut State, e: Error) -> Error {
    state.broken.get_or_insert_with(|| e.clone());
    e
}

/// Checks that `outputs` take rows of `row_bytes`, before anything is sent: a dispatch
/// whose expansion is refused once its rows are in never releases them.
fn outputs_fit(outputs: &DispatchOutputs, row_bytes: u64) -> Result<()> {
    if outputs.row_bytes != row_bytes || outputs.head_bytes > row_bytes {
        return Err(Error::InvalidArgument(format!(
            "outputs for rows of {} bytes ({} of them to recv_x); the dispatch sent rows of {row_bytes}",
            outputs.row_bytes, outputs.head_bytes
        )));
    }
    Ok(())
}

/// fp8 needs whole groups of channels, and scales that keep rows 16-byte aligned.
fn fp8_allowed(hidden: usize) -> bool {
    hidden.is_multiple_of(FP8_GROUP * 4)
}

impl Scratch {
    fn new(device: &'static Device, config: &Config) -> Result<Scratch> {
        let words = |n: usize| (n * 4).div_ceil(256) as u64 * 256;
        let sizes = [
            words(config.ranks),
            words(config.ranks),
            words(config.num_experts()),
            words(config.local_experts),
            words(config.local_experts * config.ranks * config.max_tokens),
            words(4),
            words(4),
            words(2),
            if fp8_allowed(config.hidden) { fp8_row_bytes(config.hidden) * config.max_tokens as u64 } else { 0 },
        ];
        // The counters must start at zero.
        let memory = DeviceBuffer::zeroed(device, sizes.iter().sum::<u64>() as usize)?;
        let mut at = memory.addr();
        let mut next = |size: u64| {
            let here = at;
            at += size;
            here
        };
        let send_count = next(sizes[0]);
        let recv_count = next(sizes[1]);
        let expert_count_global = next(sizes[2]);
        let expert_count = next(sizes[3]);
        let expert_pos = next(sizes[4]);
        Ok(Scratch {
            send_count,
            expert_count_global,
            plan: PlanScratch { recv_count, expert_pos, expert_count },
            epochs: next(sizes[5]),
            done: next(sizes[6]),
            failed: next(sizes[7]),
            fp8_staging: if sizes[8] > 0 { next(sizes[8]) } else { 0 },
            _memory: memory,
        })
    }

    fn done(&self, kernel: u64) -> u64 {
        self.done + 4 * kernel
    }
}

/// What [`Buffer::dispatch_begin`] learnt: rows received from each rank, and pairs
/// (token, expert) for each local expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchCounts {
    pub per_source_rank: Vec<usize>,
    pub per_local_expert: Vec<usize>,
}

impl DispatchCounts {
    pub fn received_rows(&self) -> usize {
        self.per_source_rank.iter().sum()
    }

    pub fn received_pairs(&self) -> usize {
        self.per_local_expert.iter().sum()
    }
}

/// Where a dispatch stands: begun (counts known, outputs not yet filled) or idle.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Idle,
    /// `input`: what the caller's routing got wrong (the bad choices were dropped so
    /// that every rank completes the dispatch); raised once it is complete.
    /// `row_bytes`: of the rows sent (bf16 or fp8).
    Begun {
        received: usize,
        input: Option<Error>,
        row_bytes: u64,
    },
}

pub struct Buffer {
    config: Config,
    shape: Shape,
    device: &'static Device,
    group: Arc<dyn Group>,
    kernels: Arc<Kernels>,
    workspace: DeviceBuffer,
    /// The other ranks' workspaces, mapped here; kept open for the buffer's life.
    _imports: Vec<Arc<Imported>>,
    _cache: ImportCache,
    /// Where each rank's workspace is mapped here (ours included), as the kernels read it.
    peers: DeviceBuffer,
    /// Ships to the ranks reached through the engine (engine backends).
    relay: Option<Relay>,
    scratch: Scratch,
    host: Arc<HostWords>,
    control: Control,
    timeout: Duration,
    state: Mutex<State>,
    event: cu::CUevent,
}

struct State {
    /// Dispatches and combines queued so far (the engine backends wait for the peers'
    /// releases of the previous one).
    dispatches: u64,
    combines: u64,
    phase: Phase,
    /// Set once a kernel gave up: the epochs no longer agree between ranks.
    broken: Option<Error>,
}

// SAFETY: the event is a driver handle usable from any thread; mutable state is behind
// the mutex.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Creates this rank's buffer on GPU `device` and connects it to every other rank of
    /// `group` (a collective: every rank must call it). All ranks must be on this host.
    pub fn new(group: Arc<dyn Group>, device: usize, mut config: Config, options: &Options) -> Result<Buffer> {
        let timeout = options.timeout;
        config.rank = group.rank();
        config.ranks = group.world();
        let shape = Shape::of(&config)?;
        let device = Device::get(device)?;
        let kernels = Kernels::on(device)?;
        // The signal words must start at zero (epoch 0), before any peer can write.
        let workspace = DeviceBuffer::zeroed(device, shape.workspace_bytes() as usize)?;
        let _ctx = device.bind()?;
        let (relay, engine) = match options.backend {
            Backend::Ipc => (None, None),
            backend => {
                let (relay, me) =
                    Relay::new(group.clone(), &shape, device, &workspace, backend, &options.listen, timeout)?;
                (Some(relay), Some(me))
            }
        };
        let me = Announcement {
            rank: config.rank,
            host: freight_host::identity(),
            workspace: ipc::export(device, workspace.addr(), workspace.len() as u64)?,
            workspace_addr: workspace.addr(),
            workspace_bytes: shape.workspace_bytes(),
            sizes: Sizes::of(&config),
            backend: format!("{:?}", options.backend),
            engine,
        };
        let blob = serde_json::to_vec(&me).map_err(|e| Error::Metadata(e.to_string()))?;
        let blobs = group.all_gather(&blob, timeout)?;
        let cache = ImportCache::default();
        let mut imports = Vec::new();
        let mut addresses = Vec::with_capacity(config.ranks);
        let announced: Vec<Announcement> = blobs
            .iter()
            .enumerate()
            .map(|(rank, blob)| {
                serde_json::from_slice(blob).map_err(|e| {
                    Error::Metadata(format!("rank {rank} announced its buffer in a form not understood: {e}"))
                })
            })
            .collect::<Result<_>>()?;
        if let Some(other) = announced.iter().find(|a| a.backend != me.backend) {
            return Err(Error::InvalidArgument(format!(
                "rank {} uses the {} backend, this rank {}: every rank must use the same",
                other.rank, other.backend, me.backend
            )));
        }
        for peer in &announced {
            me.sizes.agree(peer.rank, &peer.sizes)?;
        }
        let mut relay = relay;
        if let Some(relay) = relay.as_mut() {
            let engines: Vec<relay::Announcement> = announced.iter().filter_map(|a| a.engine.clone()).collect();
            relay.connect(&engines)?;
        }
        for (rank, peer) in announced.into_iter().enumerate() {
            if peer.rank != rank || peer.workspace_bytes != shape.workspace_bytes() {
                return Err(Error::InvalidArgument(format!(
                    "rank {rank} made its buffer with another configuration ({} workspace bytes, {} here): every rank must pass the same hidden size, max tokens, topk and experts per rank",
                    peer.workspace_bytes,
                    shape.workspace_bytes()
                )));
            }
            if rank == config.rank {
                addresses.push(workspace.addr());
                continue;
            }
            if let Some(base) = relay.as_ref().and_then(|r| r.kernel_base(rank)) {
                addresses.push(base);
                continue;
            }
            if !peer.host.same_host(&me.host) {
                return Err(Error::TransportUnavailable(format!(
                    "rank {rank} runs on host '{}': the ipc backend needs every rank on this host (the freight or none backends reach other hosts)",
                    peer.host.hostname
                )));
            }
            let mapped = cache.open(device, &peer.workspace)?;
            addresses.push(mapped.base + (peer.workspace_addr - peer.workspace.alloc_base));
            imports.push(mapped);
        }
        let peers = DeviceBuffer::upload(device, &addresses.iter().flat_map(|a| a.to_le_bytes()).collect::<Vec<u8>>())?;
        let scratch = Scratch::new(device, &config)?;
        let host = Arc::new(HostWords::new(device, config.ranks + config.local_experts)?);
        let control = Control {
            status: host.address(HostWords::STATUS * 8),
            abort: host.address(HostWords::ABORT * 8),
            input: host.address(HostWords::INPUT * 8),
            failed: scratch.failed,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
        };
        // Weak: the group keeps its hooks until a death, and must not keep every buffer's
        // pinned words alive until then.
        let watched: Weak<HostWords> = Arc::downgrade(&host);
        group.on_dead(Box::new(move |rank, reason| {
            let Some(host) = watched.upgrade() else { return };
            if rank == RENDEZVOUS_LOST {
                tracing::warn!(reason, "the expert-parallel rendezvous was lost; aborting this rank's waits");
            } else {
                tracing::warn!(rank, reason, "an expert-parallel rank died; aborting this rank's waits");
            }
            host.abort(rank);
        }));
        let mut event = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device's context is current.
        check(
            unsafe { cu::cuEventCreate(&mut event, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
            "cuEventCreate",
        )?;
        // Nobody writes into a peer before every peer has mapped everyone.
        if let Err(e) = group.barrier(timeout) {
            // SAFETY: our event, never recorded.
            unsafe { cu::cuEventDestroy_v2(event) };
            return Err(e);
        }
        tracing::info!(
            rank = config.rank,
            ranks = config.ranks,
            gpu = device.ordinal,
            workspace_mib = shape.workspace_bytes() >> 20,
            "expert-parallel buffer ready"
        );
        Ok(Buffer {
            config,
            shape,
            device,
            group,
            kernels,
            workspace,
            _imports: imports,
            _cache: cache,
            peers,
            relay,
            scratch,
            host,
            control,
            timeout,
            state: Mutex::new(State { dispatches: 0, combines: 0, phase: Phase::Idle, broken: None }),
            event,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn device(&self) -> &'static Device {
        self.device
    }

    pub fn group(&self) -> &Arc<dyn Group> {
        &self.group
    }

    /// The error a kernel recorded, if any (does not wait for the GPU). Once one is
    /// recorded the buffer is broken: every later call fails with it. Then bad routing
    /// that a low-latency dispatch met since the last report (the buffer stays usable).
    pub fn check(&self) -> Result<()> {
        let mut state = self.state.lock();
        self.check_locked(&mut state)?;
        self.host.take_input_error().map_or(Ok(()), Err)
    }

    /// Gives up a dispatch that was begun and will not be finished (its outputs could not
    /// be made, or the caller was interrupted): its rows are never released to their
    /// senders, so the ranks' steps no longer agree and every later call fails saying so.
    /// Does nothing when no dispatch is half done.
    pub fn abandon(&self) {
        let mut state = self.state.lock();
        if state.phase != Phase::Idle {
            state.phase = Phase::Idle;
            broken(
                &mut state,
                Error::InvalidState(
                    "a dispatch was begun and never finished, so the ranks' steps no longer agree: this buffer is unusable; make a new one on every rank".into(),
                ),
            );
        }
    }

    fn check_locked(&self, state: &mut State) -> Result<()> {
        if let Some(e) = &state.broken {
            return Err(e.clone());
        }
        // A kernel's report first (it names the wait it gave up in); else a death
        // learnt since the last call: nothing more is queued that would write into the
        // dead rank's memory, or wait for it until the timeout.
        let failure = status::decode(self.host.status(), self.timeout.as_secs_f64())
            .or_else(|| status::dead_before_call(self.host.aborted()));
        if let Some(e) = failure {
            state.broken = Some(e.clone());
            return Err(e);
        }
        Ok(())
    }

    /// Waits until the work queued on `stream` so far is done (polls briefly, then
    /// sleeps in the driver), then checks the status word.
    fn wait(&self, stream: cu::CUstream, state: &mut State) -> Result<()> {
        // SAFETY: our event; the caller's live stream.
        check(unsafe { cu::cuEventRecord(self.event, stream) }, "cuEventRecord")?;
        let query = || {
            // SAFETY: our event.
            match unsafe { cu::cuEventQuery(self.event) } {
                cu::CUresult::CUDA_ERROR_NOT_READY => None,
                other => Some(other),
            }
        };
        let result = match freight_host::poll::briefly(Duration::from_millis(2), query) {
            Some(r) => r,
            // SAFETY: our event.
            None => unsafe { cu::cuEventSynchronize(self.event) },
        };
        check(result, "waiting for expert-parallel kernels")?;
        self.check_locked(state)
    }

    /// What every launch on `stream` shares.
    fn site(&self, stream: cu::CUstream) -> Site<'_> {
        Site {
            stream,
            shape: &self.shape,
            peers: self.peers.addr(),
            own: self.workspace.addr(),
            epochs: self.scratch.epochs,
            control: &self.control,
        }
    }

    fn tokens_within_limit(&self, tokens: usize) -> Result<i32> {
        if tokens > self.config.max_tokens {
            return Err(Error::InvalidArgument(format!(
                "{tokens} tokens, but this buffer was made for at most {} per call",
                self.config.max_tokens
            )));
        }
        Ok(tokens as i32)
    }

    /// Computes the layout of `tokens` tokens' choices (`topk_idx`, i64 `[tokens,
    /// topk]`, -1 for none) into caller memory: `slot` (i32 `[tokens, ranks]`: the row
    /// each token takes among those sent to each rank, -1 where it is not sent),
    /// `send_count` (i32 `[ranks]`) and `expert_count` (i32 `[experts]`). Waits for it,
    /// so bad indices raise here.
    ///
    /// # Safety
    ///
    /// The addresses are device memory of this GPU of the sizes above; `stream` is a live
    /// stream of the GPU.
    pub unsafe fn layout(
        &self,
        stream: cu::CUstream,
        topk_idx: u64,
        tokens: usize,
        slot: u64,
        send_count: u64,
        expert_count: u64,
    ) -> Result<()> {
        let mut state = self.state.lock();
        self.check_locked(&mut state)?;
        let inputs = DispatchInputs {
            x: 0,
            row_bytes: self.shape.row_bytes,
            topk_idx,
            topk_weights: 0,
            tokens: self.tokens_within_limit(tokens)?,
            slot,
        };
        // SAFETY: as the caller promises.
        unsafe { self.kernels.layout(&self.site(stream), &inputs, send_count, expert_count)? };
        self.wait(stream, &mut state)?;
        self.host.take_input_error().map_or(Ok(()), Err)
    }

    /// First half of a dispatch: lays out `x` (bf16 `[tokens, hidden]`) by `topk_idx`
    /// (i64 `[tokens, topk]`) and `topk_weights` (f32 `[tokens, topk]`), writes `slot`
    /// (i32 `[tokens, ranks]`, kept for combine), sends every token to the ranks of its
    /// experts, waits for every rank's tokens and returns what arrived.
    ///
    /// # Safety
    ///
    /// As [`Buffer::layout`]; `x` and the weights are device memory of the sizes above.
    pub unsafe fn dispatch_begin(&self, stream: cu::CUstream, inputs: &DispatchInputs) -> Result<DispatchCounts> {
        let mut state = self.state.lock();
        self.idle(&mut state, inputs)?;
        // SAFETY: as the caller promises.
        let sent = unsafe { self.send(stream, &mut state, inputs, self.host.address(HostWords::COUNTS))? };
        self.wait(stream, &mut state)?;
        let counts = DispatchCounts {
            per_source_rank: (0..self.config.ranks).map(|r| self.host.count(r)).collect(),
            per_local_expert: (0..self.config.local_experts).map(|e| self.host.count(self.config.ranks + e)).collect(),
        };
        let input = self.host.take_input_error();
        state.phase = Phase::Begun { received: counts.received_rows(), input, row_bytes: sent.row_bytes };
        Ok(counts)
    }

    /// Checks that no failure was recorded, no dispatch is half done, and `inputs` hold
    /// no more tokens than the buffer was made for.
    fn idle(&self, state: &mut State, inputs: &DispatchInputs) -> Result<()> {
        self.check_locked(state)?;
        if state.phase != Phase::Idle {
            return Err(Error::InvalidState(
                "a dispatch was begun and not finished; call dispatch_finish first".into(),
            ));
        }
        self.tokens_within_limit(inputs.tokens.max(0) as usize)?;
        let bf16 = self.shape.row_bytes;
        let fp8 = fp8_row_bytes(self.config.hidden);
        if inputs.row_bytes != bf16 && (inputs.row_bytes != fp8 || !self.fp8_available()) {
            let or_fp8 = if self.fp8_available() { format!(" or fp8 rows ({fp8} bytes)") } else { String::new() };
            return Err(Error::InvalidArgument(format!(
                "rows of {} bytes: this buffer sends bf16 rows ({bf16} bytes){or_fp8}",
                inputs.row_bytes
            )));
        }
        Ok(())
    }

    /// Whether dispatch can send fp8 (hidden a multiple of 512).
    pub fn fp8_available(&self) -> bool {
        self.scratch.fp8_staging != 0
    }

    /// Bytes of a dispatched row, and how many of them are the token's values (the rest
    /// are its fp8 scales).
    pub fn row_bytes(&self, fp8: bool) -> (u64, u64) {
        if fp8 {
            (fp8_row_bytes(self.config.hidden), self.config.hidden as u64)
        } else {
            (self.shape.row_bytes, self.shape.row_bytes)
        }
    }

    /// Queues a dispatch's layout, send and numbering of what arrives; `host_counts` (or
    /// 0) is where the counts go for the host. Inputs whose `row_bytes` ask for fp8 are
    /// bf16 tokens quantized here first; returns the inputs as sent.
    ///
    /// # Safety
    ///
    /// As [`Buffer::dispatch_begin`].
    unsafe fn send(
        &self,
        stream: cu::CUstream,
        state: &mut State,
        inputs: &DispatchInputs,
        host_counts: u64,
    ) -> Result<DispatchInputs> {
        let (at, k, sc) = (self.site(stream), &self.kernels, &self.scratch);
        let mut sent = *inputs;
        // SAFETY: as the caller promises; scratch and workspace are ours and sized by the
        // shape.
        unsafe {
            if inputs.row_bytes != self.shape.row_bytes {
                k.quantize_fp8(&at, inputs, sc.fp8_staging)?;
                sent.x = sc.fp8_staging;
            }
            k.layout(&at, &sent, sc.send_count, sc.expert_count_global)?;
        }
        if let Some(relay) = self.relay.as_ref().filter(|_| state.dispatches > 0) {
            relay.await_signal(relay::DISPATCH_RELEASED).map_err(|e| broken(state, e))?;
        }
        state.dispatches += 1;
        // SAFETY: as above.
        unsafe { k.dispatch_send(&at, &sent, sc.send_count, sc.done(0))? };
        // The rows may be on their way: from here a failure leaves this rank a step
        // behind its peers, so the buffer is given up.
        let planned = (|| {
            if let Some(relay) = &self.relay {
                self.wait(stream, state)?;
                let counts = self.device_words(sc.send_count, self.config.ranks)?;
                relay
                    .ship(relay::DISPATCH_ARRIVED, |r| relay.dispatch_runs(counts[r] as usize, sent.row_bytes))
                    .and_then(|_| relay.await_signal(relay::DISPATCH_ARRIVED))?;
            }
            // SAFETY: as above.
            unsafe { k.dispatch_plan(&at, &sc.plan, host_counts, sent.row_bytes) }
        })();
        planned.map_err(|e| broken(state, e))?;
        Ok(sent)
    }

    /// `n` i32 words of device memory at `addr`, read after the stream was waited for.
    fn device_words(&self, addr: u64, n: usize) -> Result<Vec<i32>> {
        let mut words = vec![0i32; n];
        if n > 0 {
            freight_cuda::driver::copy_sync(self.device, words.as_mut_ptr() as u64, addr, n * 4)?;
        }
        Ok(words)
    }

    /// Ships signal word `kind` to the ranks reached through the engine, once the work
    /// queued on `stream` that wrote it is done (a no-op for the ipc backend).
    fn ship_signal(&self, stream: cu::CUstream, state: &mut State, kind: u64) -> Result<()> {
        let Some(relay) = &self.relay else { return Ok(()) };
        self.wait(stream, state)?;
        relay.ship(kind, |_| Vec::new()).map_err(|e| broken(state, e))
    }

    /// Queues the expansion of what arrived (rows of `row_bytes`) into `outputs`, at
    /// most `most_rows` tokens.
    ///
    /// # Safety
    ///
    /// As [`Buffer::dispatch_finish`].
    unsafe fn expand(
        &self,
        stream: cu::CUstream,
        outputs: &DispatchOutputs,
        row_bytes: u64,
        most_rows: usize,
    ) -> Result<()> {
        outputs_fit(outputs, row_bytes)?;
        let sc = &self.scratch;
        // SAFETY: as the caller promises.
        unsafe { self.kernels.dispatch_expand(&self.site(stream), &sc.plan, outputs, most_rows, sc.done(1)) }
    }

    /// Most tokens one dispatch delivers to a rank.
    pub fn most_received(&self) -> usize {
        self.config.ranks * self.config.max_tokens
    }

    /// A whole dispatch in low-latency mode: nothing waits for the GPU, so a CUDA graph
    /// can capture it. `outputs.recv_x` holds `most_received()` rows per local expert
    /// (`outputs.expert_stride` must be that), and the other outputs are sized for
    /// `most_received()` tokens; `counts` (i32 per local expert) gets the rows each
    /// expert received. Bad routing shows at the next call that waits.
    ///
    /// # Safety
    ///
    /// As [`Buffer::dispatch_begin`] and [`Buffer::dispatch_finish`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dispatch_low_latency(
        &self,
        stream: cu::CUstream,
        inputs: &DispatchInputs,
        outputs: &DispatchOutputs,
        counts: u64,
    ) -> Result<()> {
        let mut state = self.state.lock();
        self.idle(&mut state, inputs)?;
        if self.relay.is_some() {
            return Err(Error::InvalidArgument(
                "low-latency mode needs the ipc backend (the engine backends ship rows from the host)".into(),
            ));
        }
        if outputs.expert_stride != self.most_received() as u64 {
            return Err(Error::InvalidArgument(format!(
                "low-latency outputs hold {} rows per expert; this buffer needs {}",
                outputs.expert_stride,
                self.most_received()
            )));
        }
        outputs_fit(outputs, inputs.row_bytes)?;
        // SAFETY: as the caller promises.
        let sent = unsafe { self.send(stream, &mut state, inputs, 0)? };
        // SAFETY: as above.
        let bytes = 4 * self.config.local_experts;
        let queued = unsafe {
            self.expand(stream, outputs, sent.row_bytes, self.most_received()).and_then(|()| {
                check(
                    cu::cuMemcpyDtoDAsync_v2(counts, self.scratch.plan.expert_count, bytes, stream),
                    "cuMemcpyDtoDAsync (expert counts)",
                )
            })
        };
        // The rows are sent: a dispatch that cannot be completed leaves the ranks apart.
        queued.map_err(|e| broken(&mut state, e))
    }

    /// Second half of a dispatch: fills the outputs sized by the counts
    /// [`Buffer::dispatch_begin`] returned, and hands the rows back to their senders.
    /// Does not wait. Returns what was wrong with the routing, if anything (an expert
    /// index out of range, or an expert twice for one token: those choices were
    /// dropped): the dispatch is complete all the same, and the peers expect the
    /// combine that undoes it.
    ///
    /// # Safety
    ///
    /// As [`Buffer::layout`]; the outputs are device memory of the sizes
    /// [`DispatchOutputs`] describes for those counts.
    pub unsafe fn dispatch_finish(&self, stream: cu::CUstream, outputs: &DispatchOutputs) -> Result<Option<Error>> {
        let mut state = self.state.lock();
        self.check_locked(&mut state)?;
        let Phase::Begun { row_bytes, .. } = state.phase else {
            return Err(Error::InvalidState("dispatch_finish without dispatch_begin".into()));
        };
        // Refused outputs leave the dispatch begun, for a call with the right ones.
        if outputs.expert_stride != 0 {
            return Err(Error::InvalidArgument("dispatch_finish fills packed outputs (expert_stride 0)".into()));
        }
        outputs_fit(outputs, row_bytes)?;
        let Phase::Begun { received, input, .. } = std::mem::replace(&mut state.phase, Phase::Idle) else {
            return Err(Error::InvalidState("dispatch_finish without dispatch_begin".into()));
        };
        // SAFETY: as the caller promises.
        let queued = unsafe { self.expand(stream, outputs, row_bytes, received) };
        // The rows are in: a dispatch that cannot be completed leaves the ranks apart.
        queued.map_err(|e| broken(&mut state, e))?;
        self.ship_signal(stream, &mut state, relay::DISPATCH_RELEASED)?;
        Ok(input)
    }

    /// Combine: sums each received token's expert outputs with their weights, sends the
    /// sums back, and writes into `args.out` each token's sum over the ranks it went to
    /// (see [`CombineArgs`]). Does not wait.
    ///
    /// # Safety
    ///
    /// As [`Buffer::layout`], for the sizes of the dispatch the arguments came from.
    pub unsafe fn combine(&self, stream: cu::CUstream, args: &CombineArgs) -> Result<()> {
        let mut state = self.state.lock();
        self.check_locked(&mut state)?;
        if state.phase != Phase::Idle {
            return Err(Error::InvalidState("combine in the middle of a dispatch; call dispatch_finish first".into()));
        }
        self.tokens_within_limit(args.tokens.max(0) as usize)?;
        if args.most_rows > self.most_received() {
            let most = args.most_rows;
            return Err(Error::InvalidArgument(format!("{most} received rows is more than any dispatch delivers")));
        }
        let (at, sc) = (self.site(stream), &self.scratch);
        if let Some(relay) = self.relay.as_ref().filter(|_| state.combines > 0) {
            relay.await_signal(relay::COMBINE_RELEASED).map_err(|e| broken(&mut state, e))?;
        }
        state.combines += 1;
        // SAFETY: as the caller promises.
        unsafe { self.kernels.combine_send(&at, args, sc.done(2))? };
        if let Some(relay) = &self.relay {
            self.wait(stream, &mut state)?;
            let sources = self.device_words(args.row_source, 2 * args.most_rows)?;
            let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); self.config.ranks];
            for pair in sources.chunks_exact(2) {
                tokens[pair[0] as usize].push(pair[1] as u32);
            }
            relay
                .ship(relay::COMBINE_ARRIVED, |r| relay::combine_runs(&self.shape, &tokens[r]))
                .and_then(|_| relay.await_signal(relay::COMBINE_ARRIVED))
                .map_err(|e| broken(&mut state, e))?;
        }
        // SAFETY: as above.
        unsafe { self.kernels.combine_reduce(&at, args, sc.done(3))? };
        self.ship_signal(stream, &mut state, relay::COMBINE_RELEASED)
    }

    /// Waits for the work queued on `stream` and reports any failure of the kernels; then,
    /// as [`Buffer::check`], bad routing that a low-latency dispatch met.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this buffer's GPU.
    pub unsafe fn synchronize(&self, stream: cu::CUstream) -> Result<()> {
        let mut state = self.state.lock();
        self.wait(stream, &mut state)?;
        self.host.take_input_error().map_or(Ok(()), Err)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: our event; work that recorded it was waited for or is abandoned with
        // the buffer.
        unsafe { cu::cuEventDestroy_v2(self.event) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes() -> Sizes {
        Sizes { hidden: 7168, max_tokens: 128, topk: 8, experts_per_rank: 8 }
    }

    #[test]
    fn ranks_that_agree_on_every_size_pass() {
        assert!(sizes().agree(1, &sizes()).is_ok());
        let config = Config { ranks: 2, rank: 0, max_tokens: 128, hidden: 7168, topk: 8, local_experts: 8 };
        assert_eq!(Sizes::of(&config), sizes());
    }

    #[test]
    fn a_size_that_differs_is_named_with_both_values() {
        let base = sizes();
        let cases = [
            (Sizes { hidden: 4096, ..base }, "hidden size 4096, this rank with 7168"),
            (Sizes { max_tokens: 64, ..base }, "max tokens 64, this rank with 128"),
            (Sizes { topk: 6, ..base }, "topk 6, this rank with 8"),
            (Sizes { experts_per_rank: 4, ..base }, "experts per rank 4, this rank with 8"),
        ];
        for (peer, want) in cases {
            match base.agree(3, &peer) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.starts_with("rank 3 made its buffer with ") && m.contains(want), "{m}")
                }
                other => panic!("{want}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_sizes_travel_in_the_announcement() {
        let json = serde_json::to_value(sizes()).unwrap();
        assert_eq!(json["experts_per_rank"], 8);
        assert_eq!(serde_json::from_value::<Sizes>(json).unwrap(), sizes());
    }

    #[test]
    fn an_abort_names_the_dead_rank_or_the_lost_rendezvous() {
        // The kernels report the abort word less one, in the status word's low 48 bits.
        let reported = |rank: usize| status::decode((2 << 56) | ((abort_word(rank) - 1) & 0xffff_ffff_ffff), 1.0);
        match reported(3) {
            Some(Error::PeerDisconnected { peer, .. }) => assert_eq!(peer, "rank 3"),
            other => panic!("{other:?}"),
        }
        match reported(RENDEZVOUS_LOST) {
            Some(Error::PeerDisconnected { peer, .. }) => assert_eq!(peer, "rendezvous"),
            other => panic!("{other:?}"),
        }
    }
}
