//! The target's side of staging through landing buffers ([`super::pipeline`]): the
//! docks it lends one relay connection, registered with each of its rails, and the
//! copies between them and its registered memory that the initiator asks for.
//!
//! Every copy is checked against the registry as a tcp access is: public regions only,
//! inside their bounds, host or GPU memory. GPU copies go through the copy engines
//! (docks are pinned where the agent has GPU memory registered when they are lent;
//! others are copied through pageable memory) and are finished before the answer is
//! sent, so a landed WRITE is in place once the initiator hears of it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::rail::{Mr, Rail};
use super::Fabric;
use crate::memory::Registry;
use crate::transport::gpu_bounce::{self, Piece};
use freight_cuda::bounce::Bounce;
use freight_cuda::driver::Device;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::frame::Seg;
use freight_proto::region::MemKind;

/// Most docks one connection may borrow, and the largest dock.
pub const MAX_DOCKS: u32 = 16;
pub const MAX_DOCK_SIZE: u64 = 64 << 20;

/// Keys asked for docks' registrations where the application chooses keys: apart from
/// region keys (counting up from 1) and the staging buffers' keys (from 2^62).
static NEXT_KEY: AtomicU64 = AtomicU64::new((1 << 62) + (1 << 40));

/// A dock's bytes: pinned where the agent has GPU memory (copies to and from it need
/// pinned memory for speed), plain host memory otherwise.
enum Bytes {
    Pinned(Bounce),
    Plain(Vec<u8>),
}

/// One dock. Fields drop in order: the registrations, then the rails they belong to,
/// then the memory.
struct Dock {
    mrs: Vec<Mr>,
    _rails: Vec<Arc<Rail>>,
    bytes: Bytes,
}

impl Dock {
    fn addr(&mut self, size: u64) -> u64 {
        match &mut self.bytes {
            Bytes::Pinned(b) => b.bytes_mut(size as usize).as_mut_ptr() as u64,
            Bytes::Plain(v) => v.as_mut_ptr() as u64,
        }
    }
}

/// The docks lent to one relay connection.
pub struct Docks {
    size: u64,
    docks: Vec<Dock>,
}

impl Docks {
    /// Allocates and registers `count` docks of `size` bytes with every rail.
    pub fn open(fabric: &Fabric, registry: &Registry, count: u32, size: u64) -> Result<Docks> {
        if count == 0 || count > MAX_DOCKS || size == 0 || size > MAX_DOCK_SIZE {
            return Err(invalid(format!(
                "{count} docks of {size} bytes asked for; at most {MAX_DOCKS} of {MAX_DOCK_SIZE} bytes are lent"
            )));
        }
        // Pinned through a GPU this agent serves already (that of its first GPU region),
        // so that lending docks never opens a context on a GPU the process does not use.
        let gpu: Option<&'static Device> =
            registry.snapshot().1.iter().filter(|r| r.kind == MemKind::Vram).find_map(|r| gpu_bounce::gpu_of(r).ok());
        let mut docks = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let bytes = match gpu {
                Some(device) => Bytes::Pinned(Bounce::new(device, size as usize)?),
                None => Bytes::Plain(vec![0u8; size as usize]),
            };
            let mut dock =
                Dock { mrs: Vec::new(), _rails: fabric.workers.iter().map(|w| w.rail.clone()).collect(), bytes };
            let addr = dock.addr(size);
            for w in &fabric.workers {
                let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
                // SAFETY: the dock's memory outlives its registrations (field order).
                dock.mrs.push(unsafe { w.rail.register(addr, size, key) }?);
            }
            docks.push(dock);
        }
        Ok(Docks { size, docks })
    }

    /// What the initiator needs: per dock, its address (0 where the provider addresses
    /// memory by offset) and its key on each rail.
    pub fn describe(&mut self, virt_addr: bool) -> Vec<(u64, Vec<u64>)> {
        let size = self.size;
        self.docks
            .iter_mut()
            .map(|d| (if virt_addr { d.addr(size) } else { 0 }, d.mrs.iter().map(|m| m.key).collect()))
            .collect()
    }

    /// Copies the first `seg.len` bytes of dock `dock` into `seg`, and waits.
    pub fn land(&mut self, registry: &Registry, dock: u32, seg: &Seg) -> Result<()> {
        self.copy(registry, dock, seg, true)
    }

    /// Copies `seg` into the start of dock `dock`, and waits.
    pub fn lift(&mut self, registry: &Registry, dock: u32, seg: &Seg) -> Result<()> {
        self.copy(registry, dock, seg, false)
    }

    fn copy(&mut self, registry: &Registry, dock: u32, seg: &Seg, landing: bool) -> Result<()> {
        let count = self.docks.len();
        let d = self
            .docks
            .get_mut(dock as usize)
            .ok_or_else(|| Error::Protocol(format!("dock {dock} does not exist ({count} lent)")))?;
        if seg.len > self.size {
            return Err(Error::Protocol(format!("{} bytes do not fit a dock of {}", seg.len, self.size)));
        }
        // Landing writes the region.
        let guard = registry.get_checked(seg.region, seg.addr, seg.len, landing)?;
        let gpu = match guard.info.kind {
            MemKind::Dram => None,
            MemKind::Vram => Some(gpu_bounce::gpu_of(&guard.info)?),
            other => return Err(Error::TransportUnavailable(format!("fabric cannot stage {other} memory"))),
        };
        let piece = Piece { addr: seg.addr, len: seg.len, gpu };
        let len = seg.len as usize;
        match (&mut d.bytes, gpu) {
            (Bytes::Pinned(b), _) if landing => gpu_bounce::scatter(b, &[piece]),
            (Bytes::Pinned(b), _) => gpu_bounce::gather(b, &[piece]).and_then(|_| b.wait()),
            // Lent before this agent had GPU memory: not pinned, so the driver copies
            // through pageable memory (slower, but the relay keeps working).
            (Bytes::Plain(v), Some(device)) => {
                let (dock, there) = (v.as_mut_ptr() as u64, seg.addr);
                let (dst, src) = if landing { (there, dock) } else { (dock, there) };
                freight_cuda::driver::copy_sync(device, dst, src, len)
            }
            (Bytes::Plain(v), None) => {
                // SAFETY: the segment lies in a registered region that `guard` keeps.
                let there = unsafe { std::slice::from_raw_parts_mut(seg.addr as *mut u8, len) };
                if landing {
                    there.copy_from_slice(&v[..len]);
                } else {
                    v[..len].copy_from_slice(there);
                }
                Ok(())
            }
        }
    }
}
