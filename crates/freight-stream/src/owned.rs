//! Memory a receiver keeps objects in once they leave a pipe buffer, and the pool it
//! comes from.
//!
//! A store takes in one object after another, often of the same few sizes (KV chunks),
//! and frees them as they are consumed. Fresh allocations for each would cost page
//! faults (host) or `cuMemAlloc`/`cuMemFree` (GPU) on every object, so freed buffers
//! go back to a process-wide pool, by memory kind, device and size, and the next object
//! of that size reuses one. The pool keeps at most [`RETAIN_HOST`] bytes of host memory
//! and [`RETAIN_DEVICE`] bytes per GPU; [`trim`] gives everything back.

use std::collections::HashMap;
use std::sync::OnceLock;

use freight_core::{Error, MemKind, Result};
use freight_cuda::driver::{CopyBatch, DeviceBuffer};
use freight_cuda::Device;
use parking_lot::Mutex;

/// Host memory the pool keeps for reuse.
pub const RETAIN_HOST: u64 = 4 << 30;
/// GPU memory the pool keeps for reuse, per GPU.
pub const RETAIN_DEVICE: u64 = 16 << 30;

enum Mem {
    Host(Vec<u8>),
    Device(DeviceBuffer),
}

impl Mem {
    /// (is on a GPU, GPU, bytes asked for): the pool's key. (A GPU allocation may be
    /// larger than asked for.)
    fn class(&self, len: usize) -> (bool, usize, usize) {
        match self {
            Mem::Host(_) => (false, 0, len),
            Mem::Device(b) => (true, b.device().ordinal, len),
        }
    }
}

#[derive(Default)]
struct Pool {
    free: HashMap<(bool, usize, usize), Vec<Mem>>,
    /// Bytes kept, by (is on a GPU, GPU).
    kept: HashMap<(bool, usize), u64>,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

fn take(class: (bool, usize, usize)) -> Option<Mem> {
    let mut p = pool().lock();
    let mem = p.free.get_mut(&class)?.pop()?;
    *p.kept.entry((class.0, class.1)).or_default() -= class.2 as u64;
    Some(mem)
}

fn give(mem: Mem, len: usize) {
    let class = mem.class(len);
    let limit = if class.0 { RETAIN_DEVICE } else { RETAIN_HOST };
    let mut p = pool().lock();
    let kept = p.kept.entry((class.0, class.1)).or_default();
    if *kept + class.2 as u64 <= limit {
        *kept += class.2 as u64;
        p.free.entry(class).or_default().push(mem);
    }
    // Otherwise `mem` is freed here.
}

/// Frees every buffer the pool keeps.
pub fn trim() {
    let mut p = pool().lock();
    p.free.clear();
    p.kept.clear();
}

/// An object's bytes in memory of their own (host memory, or a GPU's), back to the pool
/// when dropped.
pub struct Owned {
    mem: Option<Mem>,
    len: u64,
}

impl Owned {
    /// `len` bytes of host memory (contents unspecified: the caller fills them).
    pub fn host(len: u64) -> Result<Owned> {
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument("object too large".into()))?;
        let mem = match take((false, 0, n)) {
            Some(m) => m,
            None => {
                // The size may come from a peer: too much is an error, not an abort.
                let mut v = Vec::new();
                v.try_reserve_exact(n)
                    .map_err(|e| Error::NoSpace(format!("cannot allocate {n} bytes of host memory: {e}")))?;
                v.resize(n, 0);
                Mem::Host(v)
            }
        };
        Ok(Owned { mem: Some(mem), len })
    }

    /// `len` bytes on GPU `dev` (contents unspecified: the caller fills them).
    pub fn device(dev: u64, len: u64) -> Result<Owned> {
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument("object too large".into()))?;
        let mem = match take((true, dev as usize, n)) {
            Some(m) => m,
            None => Mem::Device(DeviceBuffer::alloc(Device::get(dev as usize)?, n)?),
        };
        Ok(Owned { mem: Some(mem), len })
    }

    /// `len` bytes of memory like `kind` on `dev`.
    pub fn like(kind: MemKind, dev: u64, len: u64) -> Result<Owned> {
        match kind {
            MemKind::Vram => Owned::device(dev, len),
            _ => Owned::host(len),
        }
    }

    fn mem(&self) -> &Mem {
        self.mem.as_ref().expect("present until dropped")
    }

    /// (kind, address, device) of the bytes.
    pub fn location(&self) -> (MemKind, u64, u64) {
        match self.mem() {
            Mem::Host(v) => (MemKind::Dram, v.as_ptr() as u64, 0),
            Mem::Device(b) => (MemKind::Vram, b.addr(), b.device().ordinal as u64),
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, when they are in host memory.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self.mem() {
            Mem::Host(v) => Some(&v[..self.len as usize]),
            Mem::Device(_) => None,
        }
    }

    /// Copies the bytes to `dst` (host memory, or device memory of `dst_kind`).
    pub fn copy_to(&self, dst_kind: MemKind, dst: u64) -> Result<()> {
        let (kind, src, dev) = self.location();
        copy_bytes(kind, dev, dst_kind, dst, src, self.len())
    }

    /// Copies `len` bytes from `src` (of `src_kind`, on this memory's GPU if any) to
    /// `offset` of this memory.
    pub fn fill_from(&mut self, offset: u64, src_kind: MemKind, src: u64, len: u64) -> Result<()> {
        let mut batch = CopyBatch::default();
        self.fill_from_queued(&mut batch, offset, src_kind, src, len)?;
        batch.finish()
    }

    /// [`Owned::fill_from`], a copy that involves a GPU queued on `batch` (this memory
    /// and `src` must outlive it).
    pub fn fill_from_queued(
        &mut self,
        batch: &mut CopyBatch,
        offset: u64,
        src_kind: MemKind,
        src: u64,
        len: u64,
    ) -> Result<()> {
        debug_assert!(offset + len <= self.len());
        let (kind, dst, dev) = self.location();
        queue_copy(batch, src_kind, dev, kind, dst + offset, src, len)
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            give(mem, self.len as usize);
        }
    }
}

/// Copies between host and device memory in any direction, synchronously. `dev` is the
/// GPU of whichever side is on one.
pub fn copy_bytes(src_kind: MemKind, dev: u64, dst_kind: MemKind, dst: u64, src: u64, len: u64) -> Result<()> {
    let mut batch = CopyBatch::default();
    queue_copy(&mut batch, src_kind, dev, dst_kind, dst, src, len)?;
    batch.finish()
}

/// [`copy_bytes`], but a copy that involves a GPU is only queued on `batch`: both ranges
/// must stay valid until it is finished (or dropped). Host to host copies at once.
pub fn queue_copy(
    batch: &mut CopyBatch,
    src_kind: MemKind,
    dev: u64,
    dst_kind: MemKind,
    dst: u64,
    src: u64,
    len: u64,
) -> Result<()> {
    if src_kind != MemKind::Vram && dst_kind != MemKind::Vram {
        // SAFETY: the caller vouches for `dst`; `src` is live memory of a message or an
        // object, `len` bytes long.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) };
        return Ok(());
    }
    // SAFETY: the caller keeps both ranges alive until the batch is waited for.
    unsafe { batch.copy(Device::get(dev as usize)?, dst, src, len as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_host_memory_is_reused_for_the_same_size() {
        let a = Owned::host(12_345).unwrap();
        let addr = a.location().1;
        drop(a);
        let b = Owned::host(12_345).unwrap();
        assert_eq!(b.location().1, addr, "the same buffer again");
        let c = Owned::host(12_345).unwrap();
        assert_ne!(c.location().1, addr, "one buffer serves one owner");
        assert_eq!((b.len(), b.bytes().unwrap().len()), (12_345, 12_345));
        let mut d = Owned::host(4).unwrap();
        let src = [1u8, 2, 3, 4];
        d.fill_from(0, MemKind::Dram, src.as_ptr() as u64, 4).unwrap();
        assert_eq!(d.bytes().unwrap(), &src);
        let mut out = [0u8; 4];
        d.copy_to(MemKind::Dram, out.as_mut_ptr() as u64).unwrap();
        assert_eq!(out, src);
    }
}
