//! The expert-parallel kernels (kernels.cu), compiled by NVRTC once per architecture
//! and loaded once per GPU, with typed launchers: each launcher's parameter list is the
//! kernel's, in order, so a mismatch shows up here and nowhere else.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use freight_core::Result;
use freight_cuda::driver::Device;
use freight_cuda::nvrtc::{Function, Module};

use crate::layout::Shape;

pub const SOURCE: &str = include_str!("kernels.cu");
const FILE_NAME: &str = "freight_ep.cu";

/// Threads per block of the scanning kernels (one block per rank or per expert) and of
/// the copying ones (one warp per row).
pub const SCAN_THREADS: u32 = 1024;
pub const COPY_THREADS: u32 = 512;
const WARPS_PER_COPY_BLOCK: usize = (COPY_THREADS / 32) as usize;

/// 16-byte vectors in one segment of a row, the unit a warp moves (kernels.cu's
/// `SEGMENT_VECTORS`).
const SEGMENT_VECTORS: u64 = 128;

/// Segments in one row of `row_bytes`.
pub fn segments_per_row(row_bytes: u64) -> usize {
    (row_bytes / 16).div_ceil(SEGMENT_VECTORS) as usize
}

/// Channels that share one fp8 scale.
pub const FP8_GROUP: usize = 128;

/// Bytes of a token of `hidden` channels in fp8: the values, then one f32 scale per
/// [`FP8_GROUP`] channels.
pub fn fp8_row_bytes(hidden: usize) -> u64 {
    (hidden + hidden / FP8_GROUP * 4) as u64
}

/// Where the kernels report why they gave up, and how long they wait (kernels.cu's
/// `Control`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Control {
    pub status: u64,
    pub abort: u64,
    pub input: u64,
    /// Device memory: the copy of the status word that kernels check.
    pub failed: u64,
    pub timeout_ns: u64,
}

/// Compiles the kernels for `arch` ("sm_90"): the compile check that needs no GPU.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    freight_cuda::nvrtc::compile(FILE_NAME, SOURCE, arch, &[]).map(|(cubin, _)| cubin)
}

pub struct Kernels {
    quantize_fp8: Function,
    layout: Function,
    dispatch_send: Function,
    dispatch_plan: Function,
    dispatch_expand: Function,
    combine_send: Function,
    combine_reduce: Function,
    /// Most copy blocks worth launching: two per SM keep a thousand threads of each SM
    /// moving rows.
    max_copy_blocks: usize,
}

/// A kernel parameter: the address of a value that outlives the launch call.
fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

impl Kernels {
    pub fn on(device: &'static Device) -> Result<Arc<Kernels>> {
        let module = Module::cached(device, FILE_NAME, SOURCE)?;
        Ok(Arc::new(Kernels {
            quantize_fp8: module.function("ep_quantize_fp8")?,
            layout: module.function("ep_layout")?,
            dispatch_send: module.function("ep_dispatch_send")?,
            dispatch_plan: module.function("ep_dispatch_plan")?,
            dispatch_expand: module.function("ep_dispatch_expand")?,
            combine_send: module.function("ep_combine_send")?,
            combine_reduce: module.function("ep_combine_reduce")?,
            max_copy_blocks: device.multiprocessors as usize * 2,
        }))
    }

    /// Blocks for `rows` rows of `row_bytes`: a warp per (row, segment) item, at least
    /// one block (the last block signals even when there is nothing to move).
    fn copy_grid(&self, rows: usize, row_bytes: u64) -> u32 {
        let items = rows * segments_per_row(row_bytes);
        items.div_ceil(WARPS_PER_COPY_BLOCK).clamp(1, self.max_copy_blocks) as u32
    }

    /// Queues `ep_quantize_fp8`: `inputs.x` (bf16) into `packed`, rows of
    /// [`fp8_row_bytes`].
    ///
    /// # Safety
    ///
    /// As for [`Kernels::layout`].
    pub unsafe fn quantize_fp8(&self, at: &Site, inputs: &DispatchInputs, packed: u64) -> Result<()> {
        let mut params = [arg(&inputs.x), arg(&inputs.tokens), arg(at.shape), arg(&packed)];
        let groups = inputs.tokens.max(0) as usize * (at.shape.row_bytes as usize / 2 / FP8_GROUP);
        let grid = groups.div_ceil(WARPS_PER_COPY_BLOCK).clamp(1, self.max_copy_blocks) as u32;
        unsafe { self.quantize_fp8.launch(at.stream, grid, COPY_THREADS, &mut params) }
    }

    /// Queues `ep_layout` over `inputs`' routing: `inputs.slot`, `send_count` (i32 per
    /// rank) and `expert_count` (i32 per expert) get the layout.
    ///
    /// # Safety
    ///
    /// For this and every launcher: the addresses are device memory (or host memory
    /// mapped for the device) of the site's GPU, large enough for the shape and token
    /// counts given, and the site's stream is a live stream of that GPU.
    pub unsafe fn layout(&self, at: &Site, inputs: &DispatchInputs, send_count: u64, expert_count: u64) -> Result<()> {
        let tokens = inputs.tokens;
        let mut params = [
            arg(&inputs.topk_idx),
            arg(&tokens),
            arg(at.shape),
            arg(&inputs.slot),
            arg(&send_count),
            arg(&expert_count),
            arg(at.control),
        ];
        unsafe { self.layout.launch(at.stream, at.shape.ranks as u32, SCAN_THREADS, &mut params) }
    }

    /// Queues `ep_dispatch_send`.
    ///
    /// # Safety
    ///
    /// As for [`Kernels::layout`].
    pub unsafe fn dispatch_send(&self, at: &Site, inputs: &DispatchInputs, send_count: u64, done: u64) -> Result<()> {
        let mut params = [
            arg(&inputs.x),
            arg(&inputs.row_bytes),
            arg(&inputs.topk_idx),
            arg(&inputs.topk_weights),
            arg(&inputs.slot),
            arg(&inputs.tokens),
            arg(at.shape),
            arg(&at.peers),
            arg(&at.epochs),
            arg(&send_count),
            arg(&done),
            arg(at.control),
        ];
        let grid = self.copy_grid(inputs.tokens as usize, inputs.row_bytes);
        unsafe { self.dispatch_send.launch(at.stream, grid, COPY_THREADS, &mut params) }
    }

    /// Queues `ep_dispatch_plan`: `host_counts` (or 0) gets the counts for the host.
    ///
    /// # Safety
    ///
    /// As for [`Kernels::layout`].
    pub unsafe fn dispatch_plan(
        &self,
        at: &Site,
        scratch: &PlanScratch,
        host_counts: u64,
        x_row_bytes: u64,
    ) -> Result<()> {
        let mut params = [
            arg(at.shape),
            arg(&at.own),
            arg(&at.epochs),
            arg(&scratch.recv_count),
            arg(&scratch.expert_pos),
            arg(&scratch.expert_count),
            arg(&host_counts),
            arg(&x_row_bytes),
            arg(at.control),
        ];
        unsafe { self.dispatch_plan.launch(at.stream, at.shape.local_experts as u32, SCAN_THREADS, &mut params) }
    }

    /// Queues `ep_dispatch_expand` for at most `most_rows` received tokens.
    ///
    /// # Safety
    ///
    /// As for [`Kernels::layout`].
    pub unsafe fn dispatch_expand(
        &self,
        at: &Site,
        scratch: &PlanScratch,
        outputs: &DispatchOutputs,
        most_rows: usize,
        done: u64,
    ) -> Result<()> {
        let mut params = [
            arg(at.shape),
            arg(&at.peers),
            arg(&at.epochs),
            arg(&scratch.recv_count),
            arg(&scratch.expert_pos),
            arg(&scratch.expert_count),
            arg(&outputs.expert_stride),
            arg(&outputs.row_bytes),
            arg(&outputs.head_bytes),
            arg(&outputs.recv_x),
            arg(&outputs.recv_tail),
            arg(&outputs.recv_expert),
            arg(&outputs.recv_weight),
            arg(&outputs.row_pairs),
            arg(&outputs.row_source),
            arg(&outputs.received),
            arg(&done),
            arg(at.control),
        ];
        let grid = self.copy_grid(most_rows, outputs.row_bytes);
        unsafe { self.dispatch_expand.launch(at.stream, grid, COPY_THREADS, &mut params) }
    }

    /// Queues `ep_combine_send`.
    ///
    /// # Safety
    ///
    /// As for [`Kernels::layout`].
    pub unsafe fn combine_send(&self, at: &Site, args: &CombineArgs, done: u64) -> Result<()> {
        let mut params = [
            arg(at.shape),
            arg(&at.peers),
            arg(&args.expert_out),
            arg(&args.weights),
            arg(&args.row_pairs),
            arg(&args.row_source),
            arg(&args.received),
            arg(&at.epochs),
            arg(&done),
            arg(at.control),
        ];
        let grid = self.copy_grid(args.most_rows, at.shape.row_bytes);
        unsafe { self.combine_send.launch(at.stream, grid, COPY_THREADS, &mut params) }
    }

    /// Queues `ep_combine_reduce`.
    ///
    /// # Safety
    ///
    /// As for [`Kernels::layout`].
    pub unsafe fn combine_reduce(&self, at: &Site, args: &CombineArgs, done: u64) -> Result<()> {
        let mut params = [
            arg(at.shape),
            arg(&at.peers),
            arg(&args.slot),
            arg(&args.tokens),
            arg(&args.out),
            arg(&at.epochs),
            arg(&done),
            arg(at.control),
        ];
        let grid = self.copy_grid(args.tokens as usize, at.shape.row_bytes);
        unsafe { self.combine_reduce.launch(at.stream, grid, COPY_THREADS, &mut params) }
    }
}

/// What every launch for one buffer shares.
pub struct Site<'a> {
    pub stream: cu::CUstream,
    pub shape: &'a Shape,
    /// Device array: where each rank's workspace is mapped here.
    pub peers: u64,
    /// This rank's workspace.
    pub own: u64,
    /// Device words: the last dispatch and combine completed.
    pub epochs: u64,
    pub control: &'a Control,
}

/// Scratch the two passes of a dispatch share (device memory of the buffer).
#[derive(Debug, Clone, Copy)]
pub struct PlanScratch {
    /// i32 per source rank: tokens received from it.
    pub recv_count: u64,
    /// i32 `[local experts, ranks x max_tokens]`: each received token's row among its
    /// expert's rows, or -1.
    pub expert_pos: u64,
    /// i32 per local expert: rows received for it.
    pub expert_count: u64,
}

/// A rank's tokens and their routing, as dispatch reads them (device addresses).
#[derive(Debug, Clone, Copy)]
pub struct DispatchInputs {
    /// bf16 `[tokens, hidden]` (or, once quantized, fp8 rows of [`fp8_row_bytes`]).
    pub x: u64,
    /// Bytes of one row of `x`.
    pub row_bytes: u64,
    /// i64 `[tokens, topk]`: global expert indices, -1 for none.
    pub topk_idx: u64,
    /// f32 `[tokens, topk]`.
    pub topk_weights: u64,
    pub tokens: i32,
    /// i32 `[tokens, ranks]`, written: each token's row among those sent to each rank,
    /// or -1; kept for combine.
    pub slot: u64,
}

/// What combine reads and writes (device addresses; all but `expert_out`, `weights` and
/// `out` come from the dispatch it undoes).
#[derive(Debug, Clone, Copy)]
pub struct CombineArgs {
    /// bf16 rows as dispatch laid them out.
    pub expert_out: u64,
    /// f32, one per row.
    pub weights: u64,
    pub row_pairs: u64,
    pub row_source: u64,
    /// One i32: tokens the dispatch received.
    pub received: u64,
    /// Tokens received, or an upper bound (sizes the launch).
    pub most_rows: usize,
    pub slot: u64,
    pub tokens: i32,
    /// bf16 `[tokens, hidden]`, written.
    pub out: u64,
}

/// Where dispatch's second pass writes (device addresses the caller allocated: from the
/// counts of the first pass, or for the most any dispatch delivers in low-latency mode).
#[derive(Debug, Clone, Copy)]
pub struct DispatchOutputs {
    /// bf16 rows, one per (token, local expert) pair, grouped by local expert: packed
    /// (`[pairs, hidden]`) or, in low-latency mode, `expert_stride` rows per expert
    /// (`[local experts, expert_stride, hidden]`).
    pub recv_x: u64,
    /// Rows between experts' groups in low-latency mode; 0 for packed groups.
    pub expert_stride: u64,
    /// Bytes of one dispatched row, and how many of them go to `recv_x` (all, for
    /// bf16); the rest go to `recv_tail` (an fp8 row's scales).
    pub row_bytes: u64,
    pub head_bytes: u64,
    pub recv_tail: u64,
    /// i32 per row: its local expert (0: not written, in low-latency mode).
    pub recv_expert: u64,
    /// f32 per row: its top-k weight.
    pub recv_weight: u64,
    /// `[received tokens, topk]` i32: for each token received, the row of each of its
    /// choices (or -1 where the choice is another rank's expert).
    pub row_pairs: u64,
    /// `[received tokens, 2]` i32: the source rank and the token's index there.
    pub row_source: u64,
    /// One i32: how many tokens were received (combine reads it on the GPU).
    pub received: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles the kernels where NVRTC is installed (CI installs it from PyPI) and
    /// says why it skips where it is not. Every kernel must be in the cubin, and none
    /// may spill registers to local memory.
    #[test]
    fn the_kernels_compile_for_hopper_and_ampere_without_spills() {
        if let Err(e) = freight_cuda::nvrtc::init() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        for arch in ["sm_90", "sm_80"] {
            let (cubin, log) = freight_cuda::nvrtc::compile(FILE_NAME, SOURCE, arch, &["--ptxas-options=--verbose"])
                .unwrap_or_else(|e| panic!("{arch}: {e}"));
            for name in [
                "ep_quantize_fp8",
                "ep_layout",
                "ep_dispatch_send",
                "ep_dispatch_plan",
                "ep_dispatch_expand",
                "ep_combine_send",
                "ep_combine_reduce",
            ] {
                assert!(cubin.windows(name.len()).any(|w| w == name.as_bytes()), "{arch}: no {name}");
            }
            let spilling = log.lines().any(|l| l.contains("spill stores") && !l.contains(" 0 bytes spill stores"));
            assert!(!spilling, "{arch}: a kernel spills registers:\n{log}");
            let stack = log.lines().any(|l| l.contains("bytes stack frame") && !l.contains(" 0 bytes stack frame"));
            assert!(!stack, "{arch}: a kernel uses local memory:\n{log}");
        }
    }

    /// kernels.cu's `reached`: whether epoch `v >> shift` has reached `want`.
    fn reached(v: u64, shift: u32, want: u64) -> bool {
        if shift == 32 {
            ((v >> 32) as u32).wrapping_sub(want as u32) as i32 >= 0
        } else {
            v.wrapping_sub(want) as i64 >= 0
        }
    }

    #[test]
    fn epochs_are_compared_across_their_wrap() {
        let kernel = "return shift == 32 ? (int)((u32)(v >> 32) - (u32)want) >= 0 : (i64)(v - want) >= 0;";
        assert!(SOURCE.contains(kernel), "kernels.cu's `reached` changed: update this test's copy");
        assert!(!SOURCE.contains(">> shift) >= want"), "an epoch compared without its wrap");
        // A dispatch "arrived" word: the epoch's low 32 bits, then the row count.
        let arrived = |epoch: u64, rows: u32| (epoch << 32) | rows as u64;
        for epoch in [1, 2, u32::MAX as u64, 1 << 32, (1 << 32) + 1, 3 << 32, u64::MAX] {
            assert!(reached(arrived(epoch, 7), 32, epoch), "{epoch:#x}");
            assert!(reached(arrived(epoch.wrapping_add(1), 0), 32, epoch), "{epoch:#x}");
            assert!(!reached(arrived(epoch - 1, u32::MAX), 32, epoch), "{epoch:#x}");
            assert!(reached(epoch, 0, epoch) && reached(epoch.wrapping_add(1), 0, epoch));
            assert!(!reached(epoch - 1, 0, epoch), "{epoch:#x}");
        }
        // The first dispatch waits for the release of epoch 0, which the zeroed words hold.
        assert!(reached(0, 0, 0));
    }

    #[test]
    fn rows_are_cut_into_segments_as_the_kernels_cut_them() {
        assert!(SOURCE.contains("#define VECTORS_PER_LANE 4") && SOURCE.contains("(32 * VECTORS_PER_LANE)"));
        assert_eq!(segments_per_row(7168 * 2), 7);
        assert_eq!(segments_per_row(16), 1);
        assert_eq!(segments_per_row(2048), 1);
        assert_eq!(segments_per_row(2064), 2);
        assert_eq!(fp8_row_bytes(7168), 7168 + 56 * 4);
        assert_eq!(segments_per_row(fp8_row_bytes(7168)), 4);
    }

    #[test]
    fn the_control_block_matches_the_kernels() {
        assert_eq!(std::mem::size_of::<Control>(), 40);
        let fields: Vec<&str> = SOURCE
            .split("struct Control {")
            .nth(1)
            .and_then(|rest| rest.split("};").next())
            .unwrap()
            .lines()
            .filter_map(|l| l.split(';').next()?.split_whitespace().last())
            .collect();
        assert_eq!(fields, ["status", "abort", "input", "failed", "timeout_ns"]);
    }
}
