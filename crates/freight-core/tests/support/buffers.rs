//! Test memory helpers shared by the integration tests: host descriptor lists and the
//! bytes of shared segments the tests own.

#![allow(dead_code)] // each test file uses its own share of these

use freight_core::{Desc, DescList, MemKind, SharedSegment};

/// One run of host memory.
pub fn list(addr: u64, len: u64) -> DescList {
    DescList::from_descs(MemKind::Dram, [Desc { addr, len, dev: 0 }]).unwrap()
}

pub fn bytes(seg: &SharedSegment) -> &[u8] {
    // SAFETY: test buffers we own; no transfer touches them while a test looks.
    unsafe { std::slice::from_raw_parts(seg.as_ptr(), seg.len()) }
}

/// Byte `i` of the segment becomes `f(i)`.
pub fn set(seg: &SharedSegment, f: impl Fn(usize) -> u8) {
    // SAFETY: as in `bytes`, for writing.
    let b = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), seg.len()) };
    for (i, x) in b.iter_mut().enumerate() {
        *x = f(i);
    }
}

/// A pattern that differs with `seed`.
pub fn fill(seg: &SharedSegment, seed: usize) {
    set(seg, |i| ((i + seed) * 7 % 251) as u8);
}
