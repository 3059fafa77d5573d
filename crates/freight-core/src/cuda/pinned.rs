//! Page-locked host memory: GPUs reach registered host memory at PCIe speed only when it
//! is pinned. freight pins host ranges the first time a GPU path needs them (local
//! regions, and peers' shared segments mapped here) and unpins them before they go away.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use cudarc::driver::sys::{self as cu, CUresult};
use parking_lot::Mutex;

use super::driver::{check, Device};
use crate::error::Result;

fn table() -> &'static Mutex<BTreeMap<u64, u64>> {
    static PINNED: OnceLock<Mutex<BTreeMap<u64, u64>>> = OnceLock::new();
    PINNED.get_or_init(Default::default)
}

/// Pins `[addr, addr+len)` for every GPU (portable, mapped), once.
pub fn pin(device: &Device, addr: u64, len: u64) -> Result<()> {
    let mut pinned = table().lock();
    if pinned.range(..=addr).next_back().is_some_and(|(&a, &l)| addr + len <= a + l) {
        return Ok(());
    }
    device.bind()?;
    let flags = cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the range is host memory the caller keeps mapped until `unpin`.
    match unsafe { cu::cuMemHostRegister_v2(addr as *mut std::ffi::c_void, len as usize, flags) } {
        // Pinned by someone else (PyTorch's pin_memory, cudaHostAlloc): usable as is,
        // and not ours to unpin.
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => return Ok(()),
        r => check(r, "cuMemHostRegister")?,
    }
    tracing::debug!(addr, len, "pinned host memory for GPU access");
    pinned.insert(addr, len);
    Ok(())
}

/// Unpins what [`pin`] pinned inside `[addr, addr+len)`, before that memory is unmapped
/// or handed back.
pub fn unpin_within(addr: u64, len: u64) {
    let mut pinned = table().lock();
    let inside: Vec<u64> = pinned.range(addr..addr + len).map(|(&a, _)| a).collect();
    for a in inside {
        pinned.remove(&a);
        // SAFETY: we pinned it; the driver waits for work that uses it.
        unsafe { cu::cuMemHostUnregister(a as *mut std::ffi::c_void) };
    }
}

/// Whether anything is pinned (lets callers skip the lock when CUDA is unused).
pub fn any() -> bool {
    !table().lock().is_empty()
}
