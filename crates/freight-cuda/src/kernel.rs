//! The batched copy kernel: one launch moves every copy of a request, whatever their
//! number and sizes. CUDA C++ compiled by NVRTC at run time, once per GPU architecture.
//!
//! A request becomes a table of work items (source, destination, length), long copies
//! cut into items of at most the configured item size, and smaller where a request has
//! too few items to keep every SM busy ([`cut`]). Two kernels share the source and the
//! copy loop, which moves 16-byte vectors with several loads in flight per thread when
//! source and destination share their alignment (bytes otherwise):
//!
//! - [`KernelMode::Warp`]: each warp takes items in turn, eight loads in flight per lane.
//! - [`KernelMode::Block`]: each CUDA block takes items in turn and all its threads copy
//!   the item together, four loads in flight per thread (the shape of the SM ceiling in
//!   `bench/peers/ceilings.py`).
//!
//! The launch shape (mode, threads per block, blocks per SM) is a [`LaunchShape`]. The
//! kernel runs on the initiator's GPU and reaches the peer's memory through an IPC
//! mapping: it pushes for a WRITE and pulls for a READ.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::driver::Device;
use super::nvrtc::{self, Function, Module};
use freight_proto::error::{Error, Result};

/// Default longest work item: small enough that a few large copies still spread over
/// every SM, large enough that the item table stays small.
pub const ITEM_BYTES: u64 = 64 << 10;

/// Smallest item size that may be configured: below that the table (24 bytes an item)
/// and the per-item overhead grow out of proportion to the bytes moved.
pub const MIN_ITEM_BYTES: u64 = 1 << 10;

/// Adaptive cutting ([`cut`]) makes items no smaller than this, in whole multiples of
/// it: one round of a warp (eight 16-byte loads per lane), so that warps move cut items
/// in whole rounds.
pub const ADAPTIVE_ITEM_GRANULE: u64 = 4 << 10;

/// Items wanted per worker (a warp, or a block in block mode, that the GPU runs at
/// once): with two, a worker whose first item finishes early finds more work instead of
/// idling while others finish theirs.
const ITEMS_PER_WORKER: usize = 2;

/// Threads per block a launch may use. The kernels' `__launch_bounds__` allows the
/// largest (see [`SOURCE`]).
pub const THREADS: [u32; 4] = [128, 256, 512, 1024];

/// Most blocks an SM may be asked to hold (the hardware limit on Ampere and Hopper).
pub const MAX_BLOCKS_PER_SM: u32 = 32;

/// One work item as the kernel reads it.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// How the threads of a launch share the items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KernelMode {
    /// One warp per item.
    #[default]
    Warp,
    /// One CUDA block per item.
    Block,
}

impl KernelMode {
    pub const ALL: [KernelMode; 2] = [KernelMode::Warp, KernelMode::Block];

    pub fn parse(s: &str) -> Result<KernelMode> {
        match s.to_ascii_lowercase().as_str() {
            "warp" => Ok(KernelMode::Warp),
            "block" => Ok(KernelMode::Block),
            _ => Err(Error::InvalidArgument(format!("cuda kernel mode must be \"warp\" or \"block\", got {s:?}"))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KernelMode::Warp => "warp",
            KernelMode::Block => "block",
        }
    }

    /// The kernel's name in [`SOURCE`].
    pub fn function_name(self) -> &'static str {
        match self {
            KernelMode::Warp => "freight_copy_warp",
            KernelMode::Block => "freight_copy_block",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How a launch is laid out on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub mode: KernelMode,
    /// Threads per block: one of [`THREADS`].
    pub threads: u32,
    /// Blocks per SM at most (fewer where an SM cannot hold that many: see
    /// [`Kernel::resident_per_sm`]).
    pub blocks_per_sm: u32,
}

impl Default for LaunchShape {
    /// One block of 256 threads per item, two blocks per SM: the best shape over every
    /// case of `bench/gpu_sweep.py` on two H200s over NVLink (4 KiB to 32 MiB items,
    /// random and sequential order, WRITE and READ), within 2% of the best shape of each
    /// case where the completion thread polls (docs/bench-gpu.md).
    fn default() -> Self {
        LaunchShape { mode: KernelMode::Block, threads: 256, blocks_per_sm: 2 }
    }
}

impl LaunchShape {
    /// One warp per item, eight warps per block, eight blocks per SM asked for (an SM
    /// holds four of them: 64 registers a thread). The transfers' default before the
    /// block shape, and still the cache engine's gathers and scatters, whose many short
    /// rows it was measured with.
    pub const WARP_PER_ITEM: LaunchShape = LaunchShape { mode: KernelMode::Warp, threads: 256, blocks_per_sm: 8 };

    pub fn validate(&self) -> Result<()> {
        self.validate_threads()?;
        self.validate_blocks_per_sm()
    }

    /// Threads per block: one of [`THREADS`].
    pub fn validate_threads(&self) -> Result<()> {
        if !THREADS.contains(&self.threads) {
            return Err(Error::InvalidArgument(format!(
                "cuda kernel threads per block must be one of {THREADS:?}, got {}",
                self.threads
            )));
        }
        Ok(())
    }

    /// Blocks per SM: 1 to [`MAX_BLOCKS_PER_SM`].
    pub fn validate_blocks_per_sm(&self) -> Result<()> {
        if !(1..=MAX_BLOCKS_PER_SM).contains(&self.blocks_per_sm) {
            return Err(Error::InvalidArgument(format!(
                "cuda kernel blocks per SM must be 1 to {MAX_BLOCKS_PER_SM}, got {}",
                self.blocks_per_sm
            )));
        }
        Ok(())
    }

    /// Items one block works on at once.
    fn items_per_block(&self) -> usize {
        match self.mode {
            KernelMode::Warp => (self.threads / 32) as usize,
            KernelMode::Block => 1,
        }
    }

    fn threads_index(&self) -> Option<usize> {
        THREADS.iter().position(|&t| t == self.threads)
    }
}

/// Checks a configured item size.
pub fn validate_item_bytes(item_bytes: u64) -> Result<()> {
    if item_bytes < MIN_ITEM_BYTES || item_bytes & 15 != 0 {
        return Err(Error::InvalidArgument(format!(
            "cuda kernel item bytes must be a multiple of 16 and at least {MIN_ITEM_BYTES}, got {item_bytes}"
        )));
    }
    Ok(())
}

pub const SOURCE: &str = r#"
struct Item { unsigned long long src, dst, len; };

// `width` threads, this one ranked `rank` among them, copy bytes one at a time (ends of
// an item that are not 16-byte aligned, items whose ends differ in alignment). Not
// unrolled: rare, and unrolling would take registers from the vector loop.
__device__ __forceinline__ void copy_bytes(const unsigned char* s, unsigned char* d, unsigned long long n,
                                           unsigned rank, unsigned width) {
#pragma unroll 1
    for (unsigned long long i = rank; i < n; i += width) d[i] = s[i];
}

// `width` threads copy one item together, DEPTH 16-byte loads in flight per thread
// before any store: the item crosses the link in as few round trips as possible. Every
// round is predicated, so that the last, partial one keeps its loads in flight too (a
// 16 KiB item is one round trip for 512 threads, not two).
template <int DEPTH>
__device__ __forceinline__ void copy_item(const Item it, unsigned rank, unsigned width) {
    const unsigned char* s = (const unsigned char*)it.src;
    unsigned char* d = (unsigned char*)it.dst;
    const unsigned long long n = it.len;
    if (((it.src ^ it.dst) & 15) != 0) {  // alignments differ: no vector access is safe
        copy_bytes(s, d, n, rank, width);
        return;
    }
    unsigned long long head = (16 - (it.src & 15)) & 15;
    if (head > n) head = n;
    copy_bytes(s, d, head, rank, width);
    const unsigned long long vectors = (n - head) >> 4;
    const uint4* end = (const uint4*)(s + head) + vectors;
    const uint4* p = (const uint4*)(s + head) + rank;
    uint4* q = (uint4*)(d + head) + rank;
    const unsigned long long round = (unsigned long long)DEPTH * width;
    for (; p < end; p += round, q += round) {
        uint4 v[DEPTH];
#pragma unroll
        for (int k = 0; k < DEPTH; ++k) if (p + k * width < end) v[k] = p[k * width];
#pragma unroll
        for (int k = 0; k < DEPTH; ++k) if (p + k * width < end) q[k * width] = v[k];
    }
    const unsigned long long done = head + (vectors << 4);
    copy_bytes(s + done, d + done, n - done, rank, width);
}

// Both kernels allow 1024 threads per block, the largest launch shape. That caps them
// at 64 registers a thread: the warp kernel's eight loads in flight fit without
// spilling (a test checks), and an SM holds 1024 of its threads.

// One warp per item; the warps of the grid take the items in turn.
extern "C" __global__ void __launch_bounds__(1024) freight_copy_warp(const Item* items, unsigned long long count) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    for (unsigned long long w = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < count; w += warps) {
        copy_item<8>(items[w], lane, 32);
    }
}

// One block per item, four loads in flight per thread; the blocks of the grid take the
// items in turn.
extern "C" __global__ void __launch_bounds__(1024) freight_copy_block(const Item* items, unsigned long long count) {
    for (unsigned long long b = blockIdx.x; b < count; b += gridDim.x) {
        copy_item<4>(items[b], threadIdx.x, blockDim.x);
    }
}

// Requests of a few items, where latency is what counts: the items travel in the
// launch's parameters (no table to fetch from GPU memory before the first copy), a warp
// each, in one block. When every warp is done, the block writes `value` to the
// request's flag in host memory, which the posting thread watches.
#define FEW_ITEMS 8
struct Few { Item items[FEW_ITEMS]; unsigned long long count, flag, value; };

extern "C" __global__ void __launch_bounds__(FEW_ITEMS * 32) freight_copy_few(const Few few) {
    const unsigned warp = threadIdx.x >> 5;
    // Picked with constant indices: a computed index into the parameters would copy
    // them all to local memory first.
    Item it = few.items[0];
#pragma unroll
    for (unsigned k = 1; k < FEW_ITEMS; ++k) if (warp == k) it = few.items[k];
    if (warp < few.count) copy_item<8>(it, threadIdx.x & 31, 32);
    // Every thread's stores are visible to the whole system before the flag says so.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(few.flag), "l"(few.value) : "memory");
}
"#;

/// Most items a request may have to be launched with its items in the kernel's
/// parameters (`FEW_ITEMS` in [`SOURCE`]).
pub const FEW_ITEMS: usize = 8;

/// The parameters of `freight_copy_few`, laid out as the kernel reads them.
#[repr(C)]
struct Few {
    items: [Item; FEW_ITEMS],
    count: u64,
    flag: u64,
    value: u64,
}

/// Items the GPU works on at once with `shape`, on `multiprocessors` SMs that each hold
/// `resident_per_sm` blocks of that shape.
pub fn concurrency(shape: &LaunchShape, multiprocessors: u32, resident_per_sm: u32) -> usize {
    blocks_at_once(shape, multiprocessors, resident_per_sm) * shape.items_per_block()
}

fn blocks_at_once(shape: &LaunchShape, multiprocessors: u32, resident_per_sm: u32) -> usize {
    multiprocessors.max(1) as usize * shape.blocks_per_sm.min(resident_per_sm.max(1)) as usize
}

/// Blocks to launch for `items` work items: enough for one item each, at most as many
/// as the GPU holds at once. Blocks beyond that would run in a second wave, after the
/// first, with the same share of items each: the grid loop spreads the items over the
/// blocks that are there instead.
pub fn grid_size(items: usize, shape: &LaunchShape, multiprocessors: u32, resident_per_sm: u32) -> u32 {
    let wanted = items.div_ceil(shape.items_per_block()).max(1);
    wanted.min(blocks_at_once(shape, multiprocessors, resident_per_sm)) as u32
}

/// Cuts copies (src, dst, len) into work items of at most `item_bytes`.
pub fn items_of(copies: &[(u64, u64, u64)], item_bytes: u64) -> Vec<Item> {
    let mut items = Vec::with_capacity(count_items(copies, item_bytes));
    for &(src, dst, len) in copies {
        let mut off = 0;
        while off < len {
            let n = (len - off).min(item_bytes);
            items.push(Item { src: src + off, dst: dst + off, len: n });
            off += n;
        }
    }
    items
}

fn count_items(copies: &[(u64, u64, u64)], item_bytes: u64) -> usize {
    copies.iter().map(|&(_, _, len)| len.div_ceil(item_bytes) as usize).sum()
}

/// The item size for `copies` on a GPU that works on `workers` items at once: the
/// configured `item_bytes`, unless that yields fewer than about two items per worker.
/// Then smaller, so that every SM gets work (one 256 MiB copy in 64 KiB items is 4096
/// items, one per warp of an H200 at most), but no smaller than
/// [`ADAPTIVE_ITEM_GRANULE`] and in whole multiples of it (so cuts stay 16-byte aligned
/// relative to the copy's start).
pub fn item_size_for(copies: &[(u64, u64, u64)], item_bytes: u64, workers: usize) -> u64 {
    let wanted = workers.max(1) * ITEMS_PER_WORKER;
    if item_bytes <= ADAPTIVE_ITEM_GRANULE || count_items(copies, item_bytes) >= wanted {
        return item_bytes;
    }
    let total: u64 = copies.iter().map(|&(_, _, len)| len).sum();
    let even = total / wanted as u64 / ADAPTIVE_ITEM_GRANULE * ADAPTIVE_ITEM_GRANULE;
    even.clamp(ADAPTIVE_ITEM_GRANULE, item_bytes)
}

/// [`items_of`] with the item size of [`item_size_for`].
pub fn cut(copies: &[(u64, u64, u64)], item_bytes: u64, workers: usize) -> Vec<Item> {
    items_of(copies, item_size_for(copies, item_bytes, workers))
}

/// Compiles the kernels for one architecture ("sm_90") into a cubin. Needs NVRTC only,
/// no GPU: this is also the compile check that runs where there is none.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    build(arch, &[]).map(|(cubin, _)| cubin)
}

/// Compiles with `extra` NVRTC options; returns the cubin and the compiler's log.
fn build(arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String)> {
    nvrtc::compile("freight_copy.cu", SOURCE, arch, extra)
}

/// The kernels loaded on one GPU.
pub struct Kernel {
    /// By [`KernelMode`].
    functions: [Function; 2],
    /// `freight_copy_few`.
    few: Function,
    /// Blocks an SM holds at once, by mode and by entry of [`THREADS`] (the registers
    /// each thread needs decide it).
    resident: [[u32; THREADS.len()]; 2],
    device: &'static Device,
}

impl Kernel {
    /// The kernels on `device`: compiled once per architecture, loaded once per GPU.
    pub fn on(device: &'static Device) -> Result<Arc<Kernel>> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Kernel>>>> = OnceLock::new();
        let loaded = LOADED.get_or_init(Default::default);
        if let Some(k) = loaded.lock().get(&device.ordinal) {
            return Ok(k.clone());
        }
        let module = Module::cached(device, "freight_copy.cu", SOURCE)?;
        let _ctx = device.bind()?;
        let functions = [
            module.function(KernelMode::ALL[0].function_name())?,
            module.function(KernelMode::ALL[1].function_name())?,
        ];
        let mut resident = [[0; THREADS.len()]; 2];
        for mode in KernelMode::ALL {
            let f = &functions[mode.index()];
            for (slot, &threads) in resident[mode.index()].iter_mut().zip(&THREADS) {
                *slot = f.resident_per_sm(threads, 0)?;
            }
            use cu::CUfunction_attribute as A;
            tracing::debug!(
                gpu = device.ordinal,
                mode = mode.as_str(),
                registers = f.attribute(A::CU_FUNC_ATTRIBUTE_NUM_REGS),
                spilled_bytes = f.attribute(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                resident_blocks_per_sm = ?resident[mode.index()],
                threads = ?THREADS,
                "loaded a copy kernel"
            );
        }
        let few = module.function("freight_copy_few")?;
        let k = Arc::new(Kernel { functions, few, resident, device });
        loaded.lock().insert(device.ordinal, k.clone());
        Ok(k)
    }

    /// Blocks of `shape` one SM holds at once (0 for a shape that is not valid).
    pub fn resident_per_sm(&self, shape: &LaunchShape) -> u32 {
        shape.threads_index().map_or(0, |t| self.resident[shape.mode.index()][t])
    }

    /// Items the GPU works on at once with `shape` (see [`concurrency`]).
    pub fn concurrency(&self, shape: &LaunchShape) -> usize {
        concurrency(shape, self.device.multiprocessors, self.resident_per_sm(shape))
    }

    /// Launches `shape` over `count` items at device address `table`, on `stream`.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of this kernel's GPU (or null, its legacy default
    /// stream).
    pub unsafe fn launch_on(&self, stream: cu::CUstream, table: u64, count: usize, shape: &LaunchShape) -> Result<()> {
        shape.validate()?;
        if count == 0 {
            return Ok(());
        }
        let grid = grid_size(count, shape, self.device.multiprocessors, self.resident_per_sm(shape));
        let (mut table, mut count) = (table, count as u64);
        let mut params: [*mut c_void; 2] = [(&mut table as *mut u64).cast(), (&mut count as *mut u64).cast()];
        // SAFETY: the parameters match the kernels' signature; the table holds `count`
        // items whose ranges the plan bounds-checked; the shape's block size is within
        // the kernels' launch bounds; the caller vouches for the stream.
        unsafe { self.functions[shape.mode.index()].launch(stream, grid, shape.threads, &mut params) }
    }

    /// Launches up to [`FEW_ITEMS`] items carried in the parameters; the kernel writes
    /// `value` to the host word at device address `flag` once every copy is visible.
    ///
    /// # Safety
    ///
    /// As for [`Kernel::launch_on`]; `flag` must be a word of mapped host memory (see
    /// [`super::flags`]).
    pub unsafe fn launch_few(&self, stream: cu::CUstream, items: &[Item], flag: u64, value: u64) -> Result<()> {
        if items.is_empty() || items.len() > FEW_ITEMS {
            return Err(Error::InvalidArgument(format!("{} items for the few-items kernel", items.len())));
        }
        let mut few =
            Few { items: [Item { src: 0, dst: 0, len: 0 }; FEW_ITEMS], count: items.len() as u64, flag, value };
        few.items[..items.len()].copy_from_slice(items);
        let mut params: [*mut c_void; 1] = [(&mut few as *mut Few).cast()];
        let threads = 32 * items.len() as u32;
        // SAFETY: the one parameter matches the kernel's `Few`; the items' ranges were
        // bounds-checked by the plan; the caller vouches for the stream and the flag.
        unsafe { self.few.launch(stream, 1, threads, &mut params) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SMS: u32 = 132;

    #[test]
    fn long_copies_are_cut_into_items() {
        let items = items_of(&[(0, 1 << 30, ITEM_BYTES * 2 + 5), (100, 200, 3)], ITEM_BYTES);
        assert_eq!(items.len(), 4);
        assert_eq!(items[0], Item { src: 0, dst: 1 << 30, len: ITEM_BYTES });
        assert_eq!(items[2], Item { src: 2 * ITEM_BYTES, dst: (1 << 30) + 2 * ITEM_BYTES, len: 5 });
        assert_eq!(items[3], Item { src: 100, dst: 200, len: 3 });
        assert_eq!(std::mem::size_of::<Item>(), 24);
    }

    #[test]
    fn the_grid_fills_the_gpu_and_no_more() {
        let warp = LaunchShape::WARP_PER_ITEM;
        assert_eq!(grid_size(1, &warp, H200_SMS, 8), 1);
        assert_eq!(grid_size(9, &warp, H200_SMS, 8), 2);
        assert_eq!(grid_size(1 << 20, &warp, H200_SMS, 8), H200_SMS * 8);
        // An SM that holds fewer blocks than asked gets only those.
        assert_eq!(grid_size(1 << 20, &warp, H200_SMS, 5), H200_SMS * 5);
        let block = LaunchShape { mode: KernelMode::Block, threads: 512, blocks_per_sm: 2 };
        assert_eq!(grid_size(9, &block, H200_SMS, 4), 9);
        assert_eq!(grid_size(1 << 20, &block, H200_SMS, 4), H200_SMS * 2);
        assert_eq!(concurrency(&warp, H200_SMS, 8), 8448);
        assert_eq!(concurrency(&block, H200_SMS, 4), 264);
    }

    #[test]
    fn a_lone_long_copy_is_cut_finer_to_reach_every_sm() {
        let workers = concurrency(&LaunchShape::WARP_PER_ITEM, H200_SMS, 8);
        let copy = [(0u64, 1u64 << 40, 256u64 << 20)];
        let items = cut(&copy, ITEM_BYTES, workers);
        assert!(items.len() >= 2 * workers, "{} items for {workers} warps", items.len());
        assert_eq!(items.iter().map(|i| i.len).sum::<u64>(), 256 << 20);
        for w in items.windows(2) {
            assert_eq!(w[0].src + w[0].len, w[1].src, "items tile the copy");
        }
        assert!(items.iter().all(|i| i.len % ADAPTIVE_ITEM_GRANULE == 0 && i.len <= ITEM_BYTES));
        // Block mode runs fewer items at once: 64 KiB items are enough there.
        let block = LaunchShape { mode: KernelMode::Block, threads: 512, blocks_per_sm: 2 };
        assert_eq!(item_size_for(&copy, ITEM_BYTES, concurrency(&block, H200_SMS, 4)), ITEM_BYTES);
    }

    #[test]
    fn many_small_copies_and_tiny_requests_are_left_alone_or_floored() {
        let workers = concurrency(&LaunchShape::WARP_PER_ITEM, H200_SMS, 8);
        let small: Vec<_> = (0..65536u64).map(|i| (i * 4096, (1 << 40) + i * 8192, 4096)).collect();
        assert_eq!(item_size_for(&small, ITEM_BYTES, workers), ITEM_BYTES);
        assert_eq!(cut(&small, ITEM_BYTES, workers).len(), 65536);
        // A 100 KiB copy: as many 4 KiB items as it has, no smaller.
        let one = [(0u64, 1u64 << 40, 100u64 << 10)];
        assert_eq!(item_size_for(&one, ITEM_BYTES, workers), ADAPTIVE_ITEM_GRANULE);
        assert_eq!(cut(&one, ITEM_BYTES, workers).len(), 25);
        // A configured size at or below the granule is never changed.
        assert_eq!(item_size_for(&one, 1024, workers), 1024);
        // Nor is a size that already makes enough items.
        let big = [(0u64, 1u64 << 40, 4u64 << 30)];
        assert_eq!(item_size_for(&big, 16 << 10, workers), 16 << 10);
    }

    #[test]
    fn bad_shapes_and_item_sizes_are_refused_with_the_reason() {
        assert!(LaunchShape::default().validate().is_ok());
        assert!(LaunchShape::WARP_PER_ITEM.validate().is_ok());
        for threads in THREADS {
            for mode in KernelMode::ALL {
                assert!(LaunchShape { mode, threads, blocks_per_sm: 1 }.validate().is_ok());
            }
        }
        let e = LaunchShape { threads: 384, ..Default::default() }.validate().unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("threads") && m.contains("384")), "{e}");
        let e = LaunchShape { blocks_per_sm: 0, ..Default::default() }.validate().unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("blocks per SM")), "{e}");
        assert!(LaunchShape { blocks_per_sm: MAX_BLOCKS_PER_SM + 1, ..Default::default() }.validate().is_err());
        assert!(validate_item_bytes(ITEM_BYTES).is_ok() && validate_item_bytes(MIN_ITEM_BYTES).is_ok());
        for bad in [0, 16, MIN_ITEM_BYTES - 16, ITEM_BYTES + 8] {
            let e = validate_item_bytes(bad).unwrap_err();
            assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("multiple of 16")), "{e}");
        }
        assert_eq!(KernelMode::parse("Block").unwrap(), KernelMode::Block);
        assert!(matches!(KernelMode::parse("thread"), Err(Error::InvalidArgument(m)) if m.contains("\"warp\"")));
    }

    #[test]
    fn the_launch_bounds_allow_every_shape() {
        let largest = THREADS.iter().max().unwrap();
        assert_eq!(SOURCE.matches(&format!("__launch_bounds__({largest})")).count(), KernelMode::ALL.len());
        assert!(SOURCE.contains(&format!("#define FEW_ITEMS {FEW_ITEMS}\n")));
        assert_eq!(std::mem::size_of::<Few>(), FEW_ITEMS * 24 + 24, "laid out as the kernel's struct");
    }

    /// Compiles the kernels where NVRTC is installed (CI installs it from PyPI); says
    /// why it skips where it is not. The launch bounds cap registers at 64 a thread: the
    /// copy loops must fit without spilling to local memory.
    #[test]
    fn the_kernels_compile_for_hopper_and_ampere_without_spills() {
        if let Err(e) = nvrtc::init() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        for arch in ["sm_90", "sm_80"] {
            let (cubin, log) = build(arch, &["--ptxas-options=--verbose"]).unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: not a cubin");
            for function in KernelMode::ALL.map(KernelMode::function_name).into_iter().chain(["freight_copy_few"]) {
                let name = function.as_bytes();
                assert!(cubin.windows(name.len()).any(|w| w == name), "{arch}: no {function}");
            }
            let stack = log.lines().any(|l| l.contains("bytes stack frame") && !l.contains(" 0 bytes stack frame"));
            assert!(!stack, "{arch}: a kernel uses local memory:\n{log}");
            eprintln!("{arch}:\n{log}");
            let spilling = log.lines().any(|l| l.contains("spill stores") && !l.contains(" 0 bytes spill stores"));
            assert!(!spilling, "{arch}: a kernel spills registers:\n{log}");
        }
    }
}
