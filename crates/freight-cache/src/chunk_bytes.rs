//! Moving chunk bytes: between the caller's KV memory and a tier's slot, in host memory
//! or on a GPU, and the memory a tier owns.
//!
//! KV memory on a GPU and a chunk in GPU memory: all the runs of a chunk move in one
//! launch of the engine's batched copy kernel (a gather from paged KV into a contiguous
//! chunk, or a scatter back). KV memory on a GPU and a chunk in host memory: through a
//! scratch chunk on the GPU, the kernel and the copy engine in a pipeline ([`gpu_scratch`]).
//! Host-only copies are plain memcpy; anything else goes run by run through the
//! driver's copy.

use std::sync::Arc;
use std::time::Duration;

use freight_core::{Agent, Desc, Error, MemKind, Result, SharedSegment};
use freight_cuda::driver::{copy_sync, DeviceBuffer, Event, Stream};
use freight_cuda::kernel::{items_of, Kernel, LaunchShape, ITEM_BYTES};
use freight_cuda::pinned::pin;
use freight_cuda::Device;

use crate::gpu_scratch;
use crate::layout::Run;
use crate::per_gpu::{ItemTable, PerGpu};
use crate::place::{Direction, Place};

/// The GPU a move between `kv` and `chunk` memory is queued on, when [`move_runs`]
/// returns before it is done ([`gpu_scratch::wait`] for that GPU waits for it).
pub fn staged_on(kv: Place, chunk: Place) -> Option<usize> {
    (kv.on_gpu() && !chunk.on_gpu()).then_some(kv.dev as usize)
}

/// Moves a chunk's `runs` between `kv` memory and `chunk` memory; see [`staged_on`] for
/// the moves still in flight when it returns.
pub fn move_runs(kv: Place, chunk: Place, runs: &[Run], direction: Direction) -> Result<()> {
    if staged_on(kv, chunk).is_some() {
        return gpu_scratch::staged(kv, chunk, runs, direction);
    }
    direct(kv, chunk, runs, direction)
}

fn direct(kv: Place, chunk: Place, runs: &[Run], direction: Direction) -> Result<()> {
    let copies: Vec<(u64, u64, u64)> = runs
        .iter()
        .map(|r| {
            let (k, c) = (kv.addr + r.kv, chunk.addr + r.chunk);
            match direction {
                Direction::Gather => (k, c, r.len),
                Direction::Scatter => (c, k, r.len),
            }
        })
        .collect();
    let (src, dst) = match direction {
        Direction::Gather => (kv, chunk),
        Direction::Scatter => (chunk, kv),
    };
    copy(src, dst, &copies)
}

/// Runs `copies` (source, destination, length) from memory like `src` to memory like `dst`.
pub fn copy(src: Place, dst: Place, copies: &[(u64, u64, u64)]) -> Result<()> {
    if !src.on_gpu() && !dst.on_gpu() {
        for &(s, d, len) in copies {
            // SAFETY: the caller vouches for both ranges (bounds-checked by the engine
            // against the memory it was given or owns).
            unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len as usize) };
        }
        return Ok(());
    }
    let gpu = if src.on_gpu() { src.dev } else { dst.dev };
    if src.on_gpu() && dst.on_gpu() && src.dev != dst.dev {
        return Err(Error::InvalidArgument(format!(
            "a chunk on GPU {} and KV memory on GPU {}: keep a cache engine's memory on one GPU",
            src.dev, dst.dev
        )));
    }
    let device = Device::get(gpu as usize)?;
    if src.mapped && dst.mapped {
        return kernel_copy(device, copies);
    }
    for &(s, d, len) in copies {
        copy_sync(device, d, s, len as usize)?;
    }
    Ok(())
}

/// What a GPU's direct copies keep between calls: the kernel's work table, a stream of
/// the cache's own (so that its gathers and scatters do not queue behind the engine's
/// transfers on the device's stream: the next chunk is gathered while the last one is
/// on its way) and the event that marks a launch done.
struct Launcher {
    table: ItemTable,
    stream: Stream,
    done: Event,
}

/// How long a direct copy is watched before its thread sleeps in the driver: a chunk's
/// gather or scatter takes tens of microseconds, about what a wake-up costs.
const WATCH: Duration = Duration::from_micros(200);

/// Every copy in one launch of the batched copy kernel, waited for.
///
/// Items of [`ITEM_BYTES`], not cut finer for more warps: a KV chunk (64 runs of 512
/// KiB for a 32-layer model) then takes 512 items instead of 8192, and its launch as
/// long as with the finer cut (`bench/cache_gather.py` on an H200: 35.9 against 33.0
/// us), while the table to build and upload shrinks sixteenfold.
fn kernel_copy(device: &'static Device, copies: &[(u64, u64, u64)]) -> Result<()> {
    let kernel = Kernel::on(device)?;
    let items = items_of(copies, ITEM_BYTES);
    static LAUNCHERS: PerGpu<Launcher> = PerGpu::new();
    // The wait stays inside: the table is not another caller's until the kernel is done.
    LAUNCHERS.with(
        device.ordinal,
        || Ok(Launcher { table: ItemTable::new(device)?, stream: Stream::new(device)?, done: Event::new(device)? }),
        |l| {
            // Queued ahead of the kernel on its stream, so it is in place when the kernel
            // reads it.
            let table = l.table.upload(device, &l.stream, &items)?;
            let _ctx = device.bind()?;
            // SAFETY: our own live stream on this kernel's GPU.
            unsafe { kernel.launch_on(l.stream.raw(), table, items.len(), &LaunchShape::WARP_PER_ITEM)? };
            l.stream.record(&l.done)?;
            freight_host::poll::briefly(WATCH, || l.done.query().ok().filter(|&d| d));
            l.done.synchronize()
        },
    )
}

/// Memory a tier owns, registered with the engine's agent (so that its chunks can be
/// sent from where they are).
pub struct Arena {
    agent: Arc<Agent>,
    key: u64,
    place: Place,
    len: u64,
    _host: Option<Arc<SharedSegment>>,
    _gpu: Option<DeviceBuffer>,
}

impl Arena {
    /// `len` bytes of host memory, pinned for `gpu` when there is one.
    pub fn host(agent: &Arc<Agent>, len: u64, gpu: Option<usize>) -> Result<Arena> {
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument("tier too large".into()))?;
        let seg = agent.alloc(n)?;
        // Touched once now, so that the first stores do not pay for page faults (shared
        // memory pages are allocated on first touch, and slowly).
        // SAFETY: the whole segment is ours and nothing else uses it yet.
        unsafe { std::ptr::write_bytes(seg.as_ptr(), 0, n) };
        let key = agent.register(MemKind::Dram, seg.addr(), len, 0)?;
        let mut arena =
            Arena { agent: agent.clone(), key, place: Place::host(seg.addr()), len, _host: Some(seg), _gpu: None };
        if let Some(g) = gpu {
            // The agent's: the arena's deregistration (at drop, also if this fails) unpins it.
            pin(Device::get(g)?, arena.place.addr, len, agent.pin_owner(key))?;
            arena.place.mapped = true;
        }
        Ok(arena)
    }

    /// `len` bytes on GPU `gpu`.
    pub fn gpu(agent: &Arc<Agent>, len: u64, gpu: usize) -> Result<Arena> {
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument("tier too large".into()))?;
        let buf = DeviceBuffer::alloc(Device::get(gpu)?, n)?;
        let place = Place::gpu(buf.addr(), gpu as u64);
        let key = agent.register(MemKind::Vram, buf.addr(), len, gpu as u64)?;
        Ok(Arena { agent: agent.clone(), key, place, len, _host: None, _gpu: Some(buf) })
    }

    pub fn place(&self) -> Place {
        self.place
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `offset`, as a descriptor the engine's agent can send from.
    pub fn desc(&self, offset: u64, len: u64) -> Desc {
        Desc { addr: self.place.addr + offset, len, dev: self.place.dev }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if let Err(e) = self.agent.deregister(self.key) {
            tracing::warn!(error = %e, "could not deregister a cache tier's memory");
        }
    }
}
