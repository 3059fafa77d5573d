//! Pinned bounce buffers: where GPU memory has to pass through host memory (the tcp
//! transport sends and receives from host memory only), it is copied into or out of a
//! page-locked buffer by the copy engines, which reach pinned memory at PCIe speed.
//!
//! A [`Bounce`] holds one such buffer and a stream per GPU it has copied with. Copies are
//! queued asynchronously; [`Bounce::wait`] returns once all of them are done, so a
//! caller can queue the next buffer's copies before sending the previous one.

use cudarc::driver::sys as cu;

use super::driver::{check, Device, Event, Stream};
use freight_proto::error::Result;

/// How long [`Bounce::wait`] watches its copies before sleeping until they are done
/// (a 1 MiB message crosses PCIe in 20 to 40 us).
const WATCH: std::time::Duration = std::time::Duration::from_micros(100);

/// Page-locked host memory allocated by freight, visible to every GPU.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory; access is synchronised by its owner.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn new(device: &Device, len: usize) -> Result<PinnedBuffer> {
        let _ctx = device.bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; PORTABLE makes the memory pinned for every
        // context, not only the one current here.
        check(unsafe { cu::cuMemHostAlloc(&mut ptr, len.max(1), cu::CU_MEMHOSTALLOC_PORTABLE) }, "cuMemHostAlloc")?;
        Ok(PinnedBuffer { ptr: ptr.cast(), len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: we allocated it; every copy that used it was waited for by its owner.
        unsafe { cu::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// A stream of this buffer's own on one GPU, so its copies do not queue behind other
/// work of the agent (kernels of the cuda transport), and an event to wait on.
struct Lane {
    device: &'static Device,
    stream: Stream,
    event: Event,
    busy: bool,
}

impl Lane {
    fn new(device: &'static Device) -> Result<Lane> {
        Ok(Lane { device, stream: Stream::new(device)?, event: Event::new(device)?, busy: false })
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.busy {
            let _ = self.event.synchronize();
        }
    }
}

/// Which way a staged copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// GPU memory into the buffer (before sending it).
    ToBuffer,
    /// The buffer into GPU memory (after receiving into it).
    ToGpu,
}

/// A pinned buffer and the GPU copies in flight to or from it.
pub struct Bounce {
    buffer: PinnedBuffer,
    lanes: Vec<Lane>,
}

impl Bounce {
    pub fn new(device: &'static Device, capacity: usize) -> Result<Bounce> {
        Ok(Bounce { buffer: PinnedBuffer::new(device, capacity)?, lanes: Vec::new() })
    }

    pub fn capacity(&self) -> usize {
        self.buffer.len()
    }

    /// Makes room for `len` bytes, dropping the contents (waits for copies in flight).
    pub fn reserve(&mut self, device: &'static Device, len: usize) -> Result<()> {
        if len > self.buffer.len() {
            self.wait()?;
            self.buffer = PinnedBuffer::new(device, len.next_power_of_two())?;
        }
        Ok(())
    }

    /// Queues a copy between `len` bytes of GPU memory at `gpu_addr` (of `device`) and the
    /// buffer at `offset`. The range must lie in the buffer (checked) and in memory
    /// the caller keeps registered until [`Bounce::wait`] returns.
    pub fn copy(
        &mut self,
        device: &'static Device,
        dir: Direction,
        gpu_addr: u64,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.buffer.len()), "staged copy out of the buffer");
        let lane = match self.lanes.iter().position(|l| l.device.ordinal == device.ordinal) {
            Some(i) => i,
            None => {
                self.lanes.push(Lane::new(device)?);
                self.lanes.len() - 1
            }
        };
        let lane = &mut self.lanes[lane];
        let _ctx = lane.device.bind()?;
        // SAFETY: the host side lies in our pinned buffer (asserted above); the GPU side
        // is registered memory the caller keeps alive until `wait`.
        let host = unsafe { self.buffer.as_ptr().add(offset) } as u64;
        let (dst, src) = match dir {
            Direction::ToBuffer => (host, gpu_addr),
            Direction::ToGpu => (gpu_addr, host),
        };
        // SAFETY: as above; the buffer is pinned, so the copy is queued, not staged.
        unsafe { lane.stream.copy(dst, src, len)? };
        lane.busy = true;
        Ok(())
    }

    /// Waits for every queued copy: looks for a little while before sleeping in the
    /// driver, since a staged message's copies take tens of microseconds, about what
    /// waking a sleeping thread costs.
    pub fn wait(&mut self) -> Result<()> {
        let mut first_error = None;
        for lane in self.lanes.iter_mut().filter(|l| l.busy) {
            let waited = lane.device.bind().and_then(|_ctx| lane.stream.record(&lane.event)).and_then(|_| {
                match freight_host::poll::briefly(WATCH, || lane.event.query().ok().filter(|&done| done)) {
                    Some(_) => Ok(()),
                    None => lane.event.synchronize(),
                }
            });
            match waited {
                Ok(()) => lane.busy = false,
                // Not known to be idle: the drop waits for the whole stream instead.
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The first `len` bytes of the buffer. Only meaningful after [`Bounce::wait`].
    pub fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.buffer.len());
        // SAFETY: within our allocation; no copy writes it after `wait`.
        unsafe { std::slice::from_raw_parts(self.buffer.as_ptr(), len) }
    }

    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.buffer.len());
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.buffer.as_ptr(), len) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // Copies still in flight use the buffer: let them finish before it is freed.
        if self.wait().is_err() {
            for lane in self.lanes.iter().filter(|l| l.busy) {
                let _ = lane.stream.synchronize();
            }
        }
    }
}
