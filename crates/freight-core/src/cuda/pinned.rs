//! Page-locked host memory: GPUs reach registered host memory at PCIe speed only when it
//! is pinned. freight pins host ranges the first time a GPU path needs them (local
//! regions, and peers' shared segments mapped here) and unpins them before they go away.
//!
//! The table is the process's, since the driver's is: a range pinned once serves every
//! agent. Each range therefore remembers who uses it, and is unpinned when the last of
//! them lets go. A range left pinned after its memory went away would be worse than a
//! leak: memory mapped later at the same address would pass for pinned, and the GPU
//! would reach the old pages through the driver's stale registration.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use cudarc::driver::sys::{self as cu, CUresult};
use parking_lot::Mutex;

use super::driver::{check, Device};
use crate::error::Result;

/// Who relies on a pinned range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// An agent's registered host memory (by agent id).
    Agent(u64),
    /// A peer's segment mapped here (by the mapping's address, unique while mapped).
    Mapping(u64),
}

struct Pinned {
    len: u64,
    /// The GPU whose context pinned it (the driver unpins in a context too).
    device: &'static Device,
    owners: Vec<Owner>,
}

fn table() -> &'static Mutex<BTreeMap<u64, Pinned>> {
    static PINNED: OnceLock<Mutex<BTreeMap<u64, Pinned>>> = OnceLock::new();
    PINNED.get_or_init(Default::default)
}

/// Pins `[addr, addr+len)` for every GPU (portable, mapped) on behalf of `owner`.
pub fn pin(device: &'static Device, addr: u64, len: u64, owner: Owner) -> Result<()> {
    let mut pinned = table().lock();
    if let Some((_, p)) = pinned.range_mut(..=addr).next_back().filter(|(&a, p)| addr + len <= a + p.len) {
        if !p.owners.contains(&owner) {
            p.owners.push(owner);
        }
        return Ok(());
    }
    let _ctx = device.bind()?;
    let flags = cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the range is host memory the caller keeps mapped until it unpins.
    match unsafe { cu::cuMemHostRegister_v2(addr as *mut std::ffi::c_void, len as usize, flags) } {
        // Pinned by someone else (PyTorch's pin_memory, cudaHostAlloc): usable as is,
        // and not ours to unpin.
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => return Ok(()),
        r => check(r, "cuMemHostRegister")?,
    }
    tracing::debug!(addr, len, ?owner, "pinned host memory for GPU access");
    pinned.insert(addr, Pinned { len, device, owners: vec![owner] });
    Ok(())
}

/// `owner` no longer needs the ranges it pinned inside `[addr, addr+len)` (its memory
/// is about to be deregistered, unmapped or handed back).
pub fn unpin_within(addr: u64, len: u64, owner: Owner) {
    let mut pinned = table().lock();
    // Ranges that start inside, and one that starts before and reaches in (pinned for
    // a larger region of another owner, which this one shared).
    let before = pinned.range(..addr).next_back().filter(|(&a, p)| a + p.len > addr).map(|(&a, _)| a);
    let inside = pinned.range(addr..addr.saturating_add(len)).map(|(&a, _)| a);
    let ranges: Vec<u64> = before.into_iter().chain(inside).collect();
    release(&mut pinned, ranges, owner);
}

/// `owner` lets go of every range it pinned (an agent that closes).
pub fn unpin_all(owner: Owner) {
    let mut pinned = table().lock();
    let held: Vec<u64> = pinned.iter().filter(|(_, p)| p.owners.contains(&owner)).map(|(&a, _)| a).collect();
    release(&mut pinned, held, owner);
}

fn release(pinned: &mut BTreeMap<u64, Pinned>, ranges: Vec<u64>, owner: Owner) {
    for a in ranges {
        let Some(p) = pinned.get_mut(&a) else { continue };
        p.owners.retain(|o| *o != owner);
        if !p.owners.is_empty() {
            continue;
        }
        let p = pinned.remove(&a).expect("just seen");
        let unpinned = p.device.bind().and_then(|_ctx| {
            // SAFETY: we pinned it; nothing queued uses it any more (its users are gone).
            check(unsafe { cu::cuMemHostUnregister(a as *mut std::ffi::c_void) }, "cuMemHostUnregister")
        });
        if let Err(e) = unpinned {
            tracing::warn!(addr = a, len = p.len, error = %e, "could not unpin host memory");
        }
    }
}

/// Whether anything is pinned (lets callers skip the lock when CUDA is unused).
pub fn any() -> bool {
    !table().lock().is_empty()
}
