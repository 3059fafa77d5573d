//! Moving a chunk between KV memory on a GPU and a chunk in host memory, through a
//! scratch chunk on that GPU: the batched copy kernel gathers the runs into the scratch
//! chunk (or scatters them out of it), and the copy engine moves the scratch chunk over
//! PCIe in large pieces, because SM loads and stores over PCIe reach only about 60% of
//! what the copy engines do.
//!
//! The chunk is cut into segments ([`segments`]) and the two engines work as a
//! pipeline, each on a stream of its own with an event between them: while the copy
//! engine moves one segment, the kernel gathers the next (or scatters the one before).
//! Moves do not wait for themselves: two scratch chunks take turns, so the host queues
//! the next chunk while this one crosses PCIe, and the caller waits once, at the end
//! ([`wait`]).

use freight_core::Result;
use freight_cuda::driver::{Event, Stream};
use freight_cuda::kernel::{items_of, Item, Kernel, LaunchShape};
use freight_cuda::Device;

use crate::layout::Run;
use crate::per_gpu::{Grown, ItemTable, PerGpu};
use crate::place::{Direction, Place};

/// Bytes of a segment: small enough that the one kernel left unhidden is short (a few
/// microseconds), large enough that the copy engine moves each piece at full speed and
/// that the hand-offs between the streams are few.
pub const SEGMENT_BYTES: u64 = 8 << 20;

/// Longest work item of the kernel's part. The kernel works in GPU memory, at several
/// times PCIe speed, so a few hundred warps per segment are enough: finer items would
/// only make the table longer.
const ITEM_BYTES: u64 = 16 << 10;

/// `runs` (covering a chunk of `len` bytes from 0) cut at every multiple of `segment`
/// bytes of the chunk: entry `i` holds the runs of bytes `[i * segment, (i + 1) *
/// segment)`. A run that crosses a boundary is cut there, its two ends moving together.
pub fn segments(runs: &[Run], len: u64, segment: u64) -> Vec<Vec<Run>> {
    assert!(segment > 0, "a segment holds some bytes");
    let mut out = vec![Vec::new(); len.div_ceil(segment) as usize];
    for r in runs {
        let mut done = 0;
        while done < r.len {
            let at = r.chunk + done;
            let i = (at / segment) as usize;
            let n = (r.len - done).min((i as u64 + 1) * segment - at);
            out[i].push(Run { kv: r.kv + done, chunk: at, len: n });
            done += n;
        }
    }
    out
}

/// Queues the move of `runs` between `kv` (GPU memory) and `chunk` (host memory)
/// through one of the GPU's scratch chunks, and returns before it is done: the next
/// chunk's work is queued while this one crosses PCIe, so that the copy engine never
/// waits for the host. Nothing may read the destination, or write the source, before
/// [`wait`] for the KV memory's GPU returns.
pub fn staged(kv: Place, chunk: Place, runs: &[Run], direction: Direction) -> Result<()> {
    let len = runs.iter().map(|r| r.chunk + r.len).max().unwrap_or(0);
    if len == 0 {
        return Ok(());
    }
    let device = Device::get(kv.dev as usize)?;
    let kernel = Kernel::on(device)?;
    let _ctx = device.bind()?;
    STAGERS.with(
        device.ordinal,
        || Stager::new(device),
        |stager| {
            let queued = stager.queue(&kernel, kv.addr, chunk.addr, runs, len, direction);
            if queued.is_err() {
                // Half a move queued: let it finish before anything reuses the buffers.
                let _ = stager.finish();
            }
            queued
        },
    )
}

/// Waits until every move queued by [`staged`] on GPU `gpu` is done. Moves of one GPU
/// share its streams, so this also waits for other callers' moves on it, and reports
/// their failure; moves on other GPUs are not waited for.
pub fn wait(gpu: usize) -> Result<()> {
    STAGERS.with_existing(gpu, |stager| stager.device.bind().and_then(|_ctx| stager.finish()))
}

static STAGERS: PerGpu<Stager> = PerGpu::new();

/// Scratch chunks (and item tables) a GPU's stager alternates between: one moves over
/// PCIe while the next is gathered into (or scattered from).
const BUFFERS: usize = 2;

/// One segment of a staged move: bytes `[start, start + len)` of the chunk, and its
/// work items in the table.
struct Segment {
    start: u64,
    len: u64,
    first: usize,
    count: usize,
}

/// One scratch chunk and the item table of the move that uses it.
struct Buffer {
    scratch: Grown,
    table: ItemTable,
    /// Recorded after the last work that uses the scratch chunk.
    released: Event,
}

/// A GPU's scratch buffers and the two streams of the pipeline.
struct Stager {
    device: &'static Device,
    buffers: Vec<Buffer>,
    /// The buffer the next move uses.
    next: usize,
    kernels: Stream,
    copies: Stream,
    /// From one stream to the other: a segment's first step is done.
    handoff: Event,
    kernels_done: Event,
    copies_done: Event,
}

impl Stager {
    fn new(device: &'static Device) -> Result<Stager> {
        let buffers = (0..BUFFERS)
            .map(|_| {
                Ok(Buffer { scratch: Grown::default(), table: ItemTable::new(device)?, released: Event::new(device)? })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Stager {
            device,
            buffers,
            next: 0,
            kernels: Stream::new(device)?,
            copies: Stream::new(device)?,
            handoff: Event::new(device)?,
            kernels_done: Event::new(device)?,
            copies_done: Event::new(device)?,
        })
    }

    /// Queues one move (see [`staged`]) on the next buffer.
    fn queue(&mut self, kernel: &Kernel, kv: u64, chunk: u64, runs: &[Run], len: u64, dir: Direction) -> Result<()> {
        let device = self.device;
        let b = self.next;
        self.next = (b + 1) % BUFFERS;
        let mut items: Vec<Item> = Vec::new();
        let mut plan = Vec::new();
        let table_bytes = |n: usize| (n * std::mem::size_of::<Item>()) as u64;
        let pieces = segments(runs, len, SEGMENT_BYTES);
        let item_count: usize = pieces.iter().flatten().map(|r| r.len.div_ceil(ITEM_BYTES) as usize).sum();
        if self.buffers[b].scratch.len() < len || self.buffers[b].table.len() < table_bytes(item_count) {
            // New allocations: nothing queued may still use the ones they replace.
            self.finish()?;
        }
        let scratch = self.buffers[b].scratch.reserve(device, len)?.addr();
        for (i, piece) in pieces.iter().enumerate() {
            let copies: Vec<(u64, u64, u64)> = piece
                .iter()
                .map(|r| {
                    let (k, s) = (kv + r.kv, scratch + r.chunk);
                    match dir {
                        Direction::Gather => (k, s, r.len),
                        Direction::Scatter => (s, k, r.len),
                    }
                })
                .collect();
            let start = i as u64 * SEGMENT_BYTES;
            let first = items.len();
            items.extend(items_of(&copies, ITEM_BYTES));
            plan.push(Segment { start, len: SEGMENT_BYTES.min(len - start), first, count: items.len() - first });
        }
        debug_assert_eq!(items.len(), item_count);
        let table = self.buffers[b].table.upload(device, &self.kernels, &items)?;
        // The scratch chunk's previous move must be done with it: a wait on the GPU,
        // not here.
        let released = &self.buffers[b].released;
        match dir {
            Direction::Gather => self.kernels.wait_for(released)?,
            Direction::Scatter => self.copies.wait_for(released)?,
        }
        let item = std::mem::size_of::<Item>() as u64;
        let launch = |s: &Segment| {
            // SAFETY: the stream is this GPU's; the table holds the segment's items,
            // whose ranges lie in the bounds-checked KV memory and the scratch chunk.
            unsafe {
                kernel.launch_on(
                    self.kernels.raw(),
                    table + s.first as u64 * item,
                    s.count,
                    &LaunchShape::WARP_PER_ITEM,
                )
            }
        };
        for s in &plan {
            let (host, gpu) = (chunk + s.start, scratch + s.start);
            // SAFETY (copies): the host chunk is the caller's, bounds-checked by the
            // engine and kept until `wait_all`; the range lies in the scratch chunk.
            match dir {
                Direction::Gather => {
                    launch(s)?;
                    self.kernels.record(&self.handoff)?;
                    self.copies.wait_for(&self.handoff)?;
                    unsafe { self.copies.copy(host, gpu, s.len as usize)? };
                }
                Direction::Scatter => {
                    unsafe { self.copies.copy(gpu, host, s.len as usize)? };
                    self.copies.record(&self.handoff)?;
                    self.kernels.wait_for(&self.handoff)?;
                    launch(s)?;
                }
            }
        }
        match dir {
            Direction::Gather => self.copies.record(released),
            Direction::Scatter => self.kernels.record(released),
        }
    }

    /// Waits for everything queued on both streams.
    fn finish(&mut self) -> Result<()> {
        let kernels = self.kernels.record(&self.kernels_done).and_then(|_| self.kernels_done.synchronize());
        let copies = self.copies.record(&self.copies_done).and_then(|_| self.copies_done.synchronize());
        kernels.and(copies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_run_across_a_boundary_is_cut_there() {
        let runs = [Run { kv: 1000, chunk: 0, len: 6 }, Run { kv: 50, chunk: 6, len: 10 }];
        let segs = segments(&runs, 16, 4);
        assert_eq!(segs.len(), 4);
        assert_eq!(segs[0], vec![Run { kv: 1000, chunk: 0, len: 4 }]);
        assert_eq!(segs[1], vec![Run { kv: 1004, chunk: 4, len: 2 }, Run { kv: 50, chunk: 6, len: 2 }]);
        assert_eq!(segs[3], vec![Run { kv: 56, chunk: 12, len: 4 }]);
    }

    proptest! {
        /// Every byte of every run lands in exactly one segment, at its own chunk and
        /// KV offsets, and each segment keeps within its bounds.
        #[test]
        fn segments_partition_the_runs(lens in proptest::collection::vec(1u64..5000, 1..40), segment in 1u64..3000) {
            let mut runs = Vec::new();
            let mut at = 0;
            for (i, &n) in lens.iter().enumerate() {
                runs.push(Run { kv: (i as u64) << 32, chunk: at, len: n });
                at += n;
            }
            let segs = segments(&runs, at, segment);
            prop_assert_eq!(segs.len() as u64, at.div_ceil(segment));
            let mut seen = 0;
            for (i, seg) in segs.iter().enumerate() {
                for r in seg {
                    prop_assert!(r.chunk >= i as u64 * segment && r.chunk + r.len <= (i as u64 + 1) * segment);
                    prop_assert_eq!(r.chunk, seen, "in chunk order, no gaps");
                    let whole = runs.iter().find(|w| w.chunk <= r.chunk && r.chunk < w.chunk + w.len).unwrap();
                    prop_assert_eq!(r.kv - whole.kv, r.chunk - whole.chunk);
                    seen += r.len;
                }
            }
            prop_assert_eq!(seen, at);
        }
    }
}
