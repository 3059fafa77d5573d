//! Descriptor lists: which bytes a transfer touches.
//!
//! A list is a sequence of runs. A run is one descriptor `(addr, len, dev)` or a strided
//! family `(addr, len, dev, stride, count)` that stands for `count` descriptors without
//! materialising them, so a paged KV cache of 10^5 blocks costs a few words.

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Result};
use crate::memory::MemKind;

/// One contiguous range of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Desc {
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
}

/// `count` descriptors of `len` bytes, the i-th at `addr + i * stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
    pub stride: u64,
    pub count: u64,
}

impl Run {
    pub fn single(d: Desc) -> Run {
        Run { addr: d.addr, len: d.len, dev: d.dev, stride: d.len, count: 1 }
    }

    pub fn get(&self, i: u64) -> Desc {
        Desc { addr: self.addr + i * self.stride, len: self.len, dev: self.dev }
    }

    /// First byte and one-past-last byte that any descriptor of the run touches.
    pub fn span(&self) -> (u64, u64) {
        (self.addr, self.addr + (self.count - 1) * self.stride + self.len)
    }
}

/// A list of descriptors of one memory kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescList {
    kind: MemKind,
    runs: Vec<Run>,
    /// `first[i]` is the list index of run i's first descriptor.
    first: Vec<u64>,
    count: u64,
    bytes: u64,
}

impl DescList {
    pub fn new(kind: MemKind) -> Self {
        DescList { kind, runs: Vec::new(), first: Vec::new(), count: 0, bytes: 0 }
    }

    pub fn from_descs(kind: MemKind, descs: impl IntoIterator<Item = Desc>) -> Result<Self> {
        let mut list = DescList::new(kind);
        for d in descs {
            list.push(d)?;
        }
        Ok(list)
    }

    /// Appends one descriptor.
    pub fn push(&mut self, d: Desc) -> Result<()> {
        self.push_run(Run::single(d))
    }

    /// Appends `count` descriptors of `len` bytes spaced `stride` apart.
    pub fn push_strided(&mut self, addr: u64, len: u64, dev: u64, stride: u64, count: u64) -> Result<()> {
        self.push_run(Run { addr, len, dev, stride, count })
    }

    fn push_run(&mut self, run: Run) -> Result<()> {
        if run.len == 0 {
            return Err(invalid(format!("descriptor at {:#x} has zero length", run.addr)));
        }
        if run.count == 0 {
            return Err(invalid(format!("strided descriptor at {:#x} has count 0", run.addr)));
        }
        let last = (run.count - 1)
            .checked_mul(run.stride)
            .and_then(|o| o.checked_add(run.addr))
            .and_then(|a| a.checked_add(run.len));
        if last.is_none() {
            return Err(invalid(format!("descriptor at {:#x} wraps around the address space", run.addr)));
        }
        let bytes = run.len.checked_mul(run.count).and_then(|b| b.checked_add(self.bytes));
        self.bytes = bytes.ok_or_else(|| invalid("descriptor list is larger than 2^64 bytes"))?;
        self.first.push(self.count);
        self.count += run.count;
        self.runs.push(run);
        Ok(())
    }

    pub fn kind(&self) -> MemKind {
        self.kind
    }
    /// Number of descriptors (strided runs count each member).
    pub fn len(&self) -> u64 {
        self.count
    }
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
    /// Total bytes over all descriptors.
    pub fn total_bytes(&self) -> u64 {
        self.bytes
    }
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// The run holding descriptor `i` and `i`'s position inside it.
    pub fn locate(&self, i: u64) -> Option<(usize, u64)> {
        if i >= self.count {
            return None;
        }
        let r = self.first.partition_point(|&f| f <= i) - 1;
        Some((r, i - self.first[r]))
    }

    pub fn get(&self, i: u64) -> Option<Desc> {
        self.locate(i).map(|(r, k)| self.runs[r].get(k))
    }

    /// Every descriptor in order (materialises them one at a time, never all at once).
    pub fn iter(&self) -> impl Iterator<Item = Desc> + '_ {
        self.runs.iter().flat_map(|r| (0..r.count).map(move |k| r.get(k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_lists_index_without_materialising() {
        let mut l = DescList::new(MemKind::Dram);
        l.push(Desc { addr: 0x100, len: 16, dev: 0 }).unwrap();
        l.push_strided(0x1000, 64, 0, 128, 1_000_000).unwrap();
        l.push(Desc { addr: 0x50, len: 8, dev: 0 }).unwrap();
        assert_eq!(l.len(), 1_000_002);
        assert_eq!(l.runs().len(), 3);
        assert_eq!(l.get(0).unwrap().addr, 0x100);
        assert_eq!(l.get(1).unwrap().addr, 0x1000);
        assert_eq!(l.get(1_000_000).unwrap().addr, 0x1000 + 999_999 * 128);
        assert_eq!(l.get(1_000_001).unwrap().addr, 0x50);
        assert!(l.get(1_000_002).is_none());
        assert_eq!(l.total_bytes(), 16 + 64 * 1_000_000 + 8);
    }

    #[test]
    fn malformed_descriptors_are_rejected() {
        let mut l = DescList::new(MemKind::Dram);
        assert!(l.push(Desc { addr: 1, len: 0, dev: 0 }).is_err());
        assert!(l.push_strided(1, 8, 0, 8, 0).is_err());
        assert!(l.push(Desc { addr: u64::MAX, len: 2, dev: 0 }).is_err());
        assert!(l.push_strided(0, 8, 0, u64::MAX / 2, 4).is_err());
        assert!(l.is_empty());
    }
}
