//! Device memory shared between processes of one host with CUDA IPC handles.
//!
//! A handle names a whole allocation, so the exporter publishes the allocation's base
//! and the handle with each registered region; the importer opens each allocation once,
//! caches the mapping, and translates addresses by their offset from the base. When the
//! peer revokes the last region of an allocation the cache lets go of it, and the
//! mapping closes as soon as no prepared request uses it any more.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::driver::{allocation_range, check, legacy_ipc_capable, Device};
use freight_proto::error::{Error, Result};
pub use freight_proto::region::GpuLocation;

/// Exports the allocation that contains `[addr, addr+len)` on `device`.
pub fn export(device: &Device, addr: u64, len: u64) -> Result<GpuLocation> {
    let _ctx = device.bind()?;
    if !legacy_ipc_capable(addr)? {
        // A pool's or the VMM API's memory (PyTorch's expandable segments map a tensor
        // over several chunks): no handle names it, and its chunks say nothing of what
        // was allocated, so the region stands for itself. Same-host peers are told they
        // cannot map it; this process and staged transports use it.
        tracing::debug!(addr, len, "GPU memory CUDA IPC cannot share");
        return Ok(GpuLocation { bus_id: device.bus_id.clone(), alloc_base: addr, alloc_len: len, handle: Vec::new() });
    }
    let (alloc_base, alloc_len) = allocation_range(addr)?;
    if addr.checked_add(len).is_none_or(|end| end > alloc_base + alloc_len) {
        return Err(Error::InvalidArgument(format!(
            "GPU memory [{addr:#x}, +{len}) spans more than one allocation (its allocation is [{alloc_base:#x}, +{alloc_len}))"
        )));
    }
    let mut handle = cu::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local; the base is the start of a live allocation.
    check(unsafe { cu::cuIpcGetMemHandle(&mut handle, alloc_base) }, "cuIpcGetMemHandle")?;
    let handle = handle.reserved.iter().map(|&b| b as u8).collect();
    Ok(GpuLocation { bus_id: device.bus_id.clone(), alloc_base, alloc_len, handle })
}

/// A peer's allocation opened in this process.
pub struct Imported {
    /// Where the allocation's first byte is mapped here.
    pub base: u64,
    device: &'static Device,
}

impl Drop for Imported {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.device.bind() {
            // SAFETY: opened by us; no program that uses it is alive any more.
            unsafe { cu::cuIpcCloseMemHandle(self.base) };
        }
    }
}

/// An opened allocation and the handle it was opened with.
struct Opened {
    handle: Vec<u8>,
    len: u64,
    mapping: Arc<Imported>,
}

/// The allocations of one peer opened here, keyed by the peer's allocation base.
#[derive(Default)]
pub struct ImportCache {
    opened: Mutex<HashMap<(usize, u64), Opened>>,
}

impl ImportCache {
    /// Maps the peer's allocation into `device`'s context (opening it on first use).
    ///
    /// The base alone does not name an allocation: the peer may free one and get a new
    /// one at the same address, and the news of the first one's revocation may arrive
    /// after the new region (or never, where no control link was up yet). The handle
    /// does name it, so a mapping is reused only for the handle it was opened with;
    /// requests prepared against the old mapping keep it until they are dropped.
    pub fn open(&self, device: &'static Device, loc: &GpuLocation) -> Result<Arc<Imported>> {
        let key = (device.ordinal, loc.alloc_base);
        let mut opened = self.opened.lock();
        if let Some(o) = opened.get(&key) {
            if o.handle == loc.handle && o.len == loc.alloc_len {
                return Ok(o.mapping.clone());
            }
            tracing::debug!(
                gpu = device.ordinal,
                base = loc.alloc_base,
                "a peer's allocation was replaced at the same address; opening the new one"
            );
            opened.remove(&key);
        }
        if loc.handle.len() != 64 {
            return Err(Error::Metadata(format!("a CUDA IPC handle has 64 bytes, not {}", loc.handle.len())));
        }
        let mut handle = cu::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in handle.reserved.iter_mut().zip(&loc.handle) {
            *d = *s as std::ffi::c_char;
        }
        let _ctx = device.bind()?;
        let mut base = 0;
        // SAFETY: a handle the peer exported; lazy peer access lets a GPU map memory of
        // another GPU (even one this process does not see).
        check(
            unsafe {
                cu::cuIpcOpenMemHandle_v2(
                    &mut base,
                    handle,
                    cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        tracing::debug!(gpu = device.ordinal, peer_gpu = %loc.bus_id, len = loc.alloc_len, "opened a peer's GPU allocation");
        let m = Arc::new(Imported { base, device });
        opened.insert(key, Opened { handle: loc.handle.clone(), len: loc.alloc_len, mapping: m.clone() });
        Ok(m)
    }

    /// Lets go of the allocations for which `keep(base, handle)` is false (their regions
    /// were all revoked). The handle tells an allocation from a later one the owner made
    /// at the same address: the earlier one's mapping must go, or the owner's memory is
    /// never given back to its GPU.
    pub fn retain(&self, keep: impl Fn(u64, &[u8]) -> bool) {
        self.opened.lock().retain(|(_, base), o| keep(*base, &o.handle));
    }
}
