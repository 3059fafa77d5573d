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
use freight_proto::error::{Error, Result};

/// Who relies on a pinned range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// A registered region of an agent (agent id, region key): released when the region
    /// is deregistered or the agent goes away. By region, not by agent: two regions of
    /// one agent may share a page, and so a pinned range.
    Region { agent: u64, key: u64 },
    /// Memory a component pins for itself (a peer's segment mapped here, a client's
    /// receive buffer), by its address, unique while it is mapped.
    Memory(u64),
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
    if register(addr, len)? {
        tracing::debug!(addr, len, ?owner, "pinned host memory for GPU access");
        pinned.insert(addr, Pinned { len, device, owners: vec![owner] });
        return Ok(());
    }
    // Part of it is registered already: by freight (ranges of ours it overlaps) or by
    // someone else. The driver tracks registrations by byte, not by page: share the
    // ranges of ours, and pin exactly the bytes between them.
    let end = addr + len;
    let ours: Vec<(u64, u64)> =
        pinned.range(..end).filter(|(&a, p)| a + p.len > addr).map(|(&a, p)| (a, p.len)).collect();
    let mut next = addr;
    for &(a, l) in &ours {
        let p = pinned.get_mut(&a).expect("just listed");
        if !p.owners.contains(&owner) {
            p.owners.push(owner);
        }
        pin_gap(&mut pinned, device, next, a, owner)?;
        next = next.max(a + l);
    }
    pin_gap(&mut pinned, device, next, end, owner)
}

/// Pins the bytes `[from, to)` (nothing where empty) for `owner`. Where someone else
/// registered them (PyTorch's `pin_memory`, `cudaHostAlloc`), they are usable as they
/// are and not ours to unpin; but such a registration may cover only part of the range,
/// and a kernel that reaches an unpinned byte faults, so both ends must be registered.
fn pin_gap(
    pinned: &mut BTreeMap<u64, Pinned>,
    device: &'static Device,
    from: u64,
    to: u64,
    owner: Owner,
) -> Result<()> {
    if from >= to {
        return Ok(());
    }
    if register(from, to - from)? {
        tracing::debug!(addr = from, len = to - from, ?owner, "pinned host memory beside a registered neighbour");
        pinned.insert(from, Pinned { len: to - from, device, owners: vec![owner] });
        return Ok(());
    }
    match [from, to - 1].into_iter().find(|&at| !registered(at)) {
        None => Ok(()),
        Some(at) => Err(Error::InvalidArgument(format!(
            "host memory [{from:#x}, {to:#x}) is partly registered with CUDA outside freight, and byte {at:#x} is not: \
             register it whole, or not at all, before giving it to freight"
        ))),
    }
}

/// Whether the byte at `addr` lies in host memory registered with (or allocated by) CUDA.
fn registered(addr: u64) -> bool {
    matches!(super::driver::host_memory_registered(addr), Ok(true))
}

/// Pins `[addr, addr+len)` for every GPU (portable, mapped), in the current context;
/// false where some of it is pinned already.
fn register(addr: u64, len: u64) -> Result<bool> {
    let flags = cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the range is host memory the caller keeps mapped until it unpins.
    match unsafe { cu::cuMemHostRegister_v2(addr as *mut std::ffi::c_void, len as usize, flags) } {
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => Ok(false),
        r => check(r, "cuMemHostRegister").map(|()| true),
    }
}

/// `owner` no longer needs what it pinned (its memory is about to be deregistered,
/// unmapped or handed back).
pub fn release(owner: Owner) {
    release_where(|o| *o == owner);
}

/// Agent `agent` (closing) lets go of everything its regions pinned.
pub fn release_agent(agent: u64) {
    release_where(|o| matches!(o, Owner::Region { agent: a, .. } if *a == agent));
}

fn release_where(gone: impl Fn(&Owner) -> bool) {
    let mut pinned = table().lock();
    let emptied: Vec<u64> = pinned
        .iter_mut()
        .filter_map(|(&a, p)| {
            let had = p.owners.len();
            p.owners.retain(|o| !gone(o));
            (p.owners.len() < had && p.owners.is_empty()).then_some(a)
        })
        .collect();
    for a in emptied {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The first GPU, or `None` (saying so) where there is none.
    fn gpu() -> Option<&'static Device> {
        match Device::get(0) {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("SKIPPED (no GPU): {e}");
                None
            }
        }
    }

    fn every_byte_registered(addr: u64, len: u64) -> bool {
        (addr..addr + len).step_by(64).chain([addr + len - 1]).all(registered)
    }

    #[test]
    fn a_range_overlapping_one_of_ours_is_pinned_to_its_last_byte() {
        let Some(device) = gpu() else { return };
        let memory = vec![0u8; 64 << 10];
        let base = memory.as_ptr() as u64;
        let (a, b) = (Owner::Memory(base), Owner::Memory(base + 500));
        pin(device, base, 1000, a).unwrap();
        // Shares bytes with the first range and runs on past it within the same page.
        pin(device, base + 500, 2500, b).unwrap();
        assert!(every_byte_registered(base + 500, 2500));
        release(a);
        assert!(every_byte_registered(base + 1000, 2000), "the second range's own bytes stay pinned");
        release(b);
        assert!(!registered(base + 1500));
    }

    #[test]
    fn memory_registered_in_part_by_someone_else_is_refused() {
        let Some(device) = gpu() else { return };
        let memory = vec![0u8; 64 << 10];
        let base = memory.as_ptr() as u64;
        let _ctx = device.bind().unwrap();
        // Someone else pins the middle 16 KiB.
        assert!(register(base + (16 << 10), 16 << 10).unwrap());
        let whole = pin(device, base + (16 << 10), 16 << 10, Owner::Memory(base));
        assert!(whole.is_ok(), "memory pinned whole by someone else is usable: {whole:?}");
        match pin(device, base + (20 << 10), 24 << 10, Owner::Memory(base + 1)) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("partly registered"), "{m}"),
            other => panic!("a range that runs past someone else's registration: {other:?}"),
        }
        release(Owner::Memory(base));
        // SAFETY: registered above, and nothing uses it.
        check(unsafe { cu::cuMemHostUnregister((base + (16 << 10)) as *mut std::ffi::c_void) }, "unregister").unwrap();
    }
}
