//! Descriptor lists: which bytes a transfer touches.
//!
//! A list is a sequence of runs. A run is one descriptor `(addr, len, dev)` or a strided
//! family `(addr, len, dev, stride, count)` that stands for `count` descriptors without
//! materialising them, so a paged KV cache of 10^5 blocks costs a few words.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Result};
use crate::region::MemKind;

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
///
/// The runs live behind an `Arc`, so prepared lists share them instead of copying (a list
/// of 65536 blocks is 2.5 MiB of runs); pushing onto a shared list copies it first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescList {
    kind: MemKind,
    table: Arc<RunTable>,
    count: u64,
    bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct RunTable {
    runs: Vec<Run>,
    /// `first[i]` is the list index of run i's first descriptor. Left empty while every
    /// run is a single descriptor (then run i is descriptor i), which is the common case.
    first: Vec<u64>,
}

impl DescList {
    pub fn new(kind: MemKind) -> Self {
        DescList { kind, table: Arc::default(), count: 0, bytes: 0 }
    }

    pub fn from_descs(kind: MemKind, descs: impl IntoIterator<Item = Desc>) -> Result<Self> {
        let descs = descs.into_iter();
        let mut list = DescList::new(kind);
        Arc::make_mut(&mut list.table).runs.reserve(descs.size_hint().0);
        for d in descs {
            list.push(d)?;
        }
        Ok(list)
    }

    /// Appends one descriptor.
    pub fn push(&mut self, d: Desc) -> Result<()> {
        self.push_run(Run::single(d))
    }

    /// Appends descriptors, each as a member of the last run where it continues it
    /// (same length and device, and the next address of the run's stride; a single
    /// descriptor takes any higher address past its end as the second member). Lists of
    /// regular blocks (a paged KV cache: block i at base + i*stride) become a few runs,
    /// which prepare and plan in a step per run instead of per descriptor. The
    /// descriptors are the same as with [`DescList::push`]; only [`DescList::runs`]
    /// tells them apart. On error the list holds the descriptors before the bad one.
    pub fn extend_merging(&mut self, descs: impl IntoIterator<Item = Desc>) -> Result<()> {
        let (mut count, mut bytes) = (self.count, self.bytes);
        let table = Arc::make_mut(&mut self.table);
        let mut result = Ok(());
        let mut descs = descs.into_iter().peekable();
        // Room for a run per descriptor, as if none merged: growing the table step by
        // step would copy it over and over. What merging leaves unused is given back
        // below.
        let runs_before = table.runs.len();
        table.runs.reserve(descs.size_hint().0);
        while let Some(d) = descs.next() {
            if d.len == 0 {
                result = Err(invalid(format!("descriptor at {:#x} has zero length", d.addr)));
                break;
            }
            if d.addr.checked_add(d.len).is_none() {
                result = Err(invalid(format!("descriptor at {:#x} wraps around the address space", d.addr)));
                break;
            }
            let Some(total) = bytes.checked_add(d.len) else {
                result = Err(invalid("descriptor list is larger than 2^64 bytes"));
                break;
            };
            bytes = total;
            let runs = table.runs.len() as u64;
            let room = table.runs.capacity();
            let merged = match table.runs.last_mut() {
                Some(last) if last.len == d.len && last.dev == d.dev => {
                    if last.count == 1 && d.addr >= last.addr + last.len {
                        if table.first.is_empty() {
                            // Every run was one descriptor: run i starts at position i.
                            table.first = Vec::with_capacity(room);
                            table.first.extend(0..runs);
                        }
                        last.stride = d.addr - last.addr;
                        last.count = 2;
                        true
                    } else if last.count > 1
                        && last.count.checked_mul(last.stride).and_then(|o| o.checked_add(last.addr)) == Some(d.addr)
                    {
                        last.count += 1;
                        true
                    } else {
                        false
                    }
                }
                _ => false,
            };
            count += 1;
            if !merged {
                if !table.first.is_empty() {
                    table.first.push(count - 1);
                }
                table.runs.push(Run::single(d));
                continue;
            }
            // The members that follow in the run's stride, in one tight loop.
            let last = table.runs.last_mut().expect("the run just extended");
            let (len, dev, stride) = (last.len, last.dev, last.stride);
            let mut next = d.addr.checked_add(stride);
            let mut more = 0u64;
            while let Some(at) = next {
                if at.checked_add(len).is_none()
                    || descs.next_if(|p| p.addr == at && p.len == len && p.dev == dev).is_none()
                {
                    break;
                }
                more += 1;
                next = at.checked_add(stride);
            }
            let Some(total) = more.checked_mul(len).and_then(|b| b.checked_add(bytes)) else {
                result = Err(invalid("descriptor list is larger than 2^64 bytes"));
                break;
            };
            bytes = total;
            last.count += more;
            count += more;
        }
        if table.runs.capacity() > 2 * table.runs.len() && table.runs.len() > runs_before {
            table.runs.shrink_to_fit();
            table.first.shrink_to_fit();
        }
        self.count = count;
        self.bytes = bytes;
        result
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
        let table = Arc::make_mut(&mut self.table);
        if !table.first.is_empty() || run.count > 1 {
            if table.first.is_empty() {
                // The first strided run: from now on positions must be recorded.
                table.first = (0..table.runs.len() as u64).collect();
            }
            table.first.push(self.count);
        }
        self.count += run.count;
        table.runs.push(run);
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
        &self.table.runs
    }

    /// The run holding descriptor `i` and `i`'s position inside it.
    pub fn locate(&self, i: u64) -> Option<(usize, u64)> {
        if i >= self.count {
            return None;
        }
        let first = &self.table.first;
        if first.is_empty() {
            return Some((i as usize, 0));
        }
        let r = first.partition_point(|&f| f <= i) - 1;
        Some((r, i - first[r]))
    }

    pub fn get(&self, i: u64) -> Option<Desc> {
        self.locate(i).map(|(r, k)| self.table.runs[r].get(k))
    }

    /// Every descriptor in order (materialises them one at a time, never all at once).
    pub fn iter(&self) -> impl Iterator<Item = Desc> + '_ {
        self.runs().iter().flat_map(|r| (0..r.count).map(move |k| r.get(k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Merging never changes which descriptors a list holds, whatever their pattern
        /// (runs of one stride broken by repeats, gaps, other lengths and devices).
        #[test]
        fn merging_keeps_the_descriptors(steps in proptest::collection::vec((0u64..4, 1u64..4, 0u64..2), 1..60)) {
            let mut addr = 1000u64;
            let descs: Vec<Desc> = steps
                .iter()
                .map(|&(jump, len, dev)| {
                    addr += jump * 8;
                    Desc { addr, len: len * 4, dev }
                })
                .collect();
            let mut merged = DescList::new(MemKind::Dram);
            merged.push(Desc { addr: 1, len: 1, dev: 0 }).unwrap();
            merged.extend_merging(descs.iter().copied()).unwrap();
            let mut plain = DescList::new(MemKind::Dram);
            plain.push(Desc { addr: 1, len: 1, dev: 0 }).unwrap();
            for d in &descs {
                plain.push(*d).unwrap();
            }
            proptest::prop_assert!(merged.iter().eq(plain.iter()));
            proptest::prop_assert_eq!((merged.len(), merged.total_bytes()), (plain.len(), plain.total_bytes()));
            for i in 0..plain.len() {
                proptest::prop_assert_eq!(merged.get(i), plain.get(i));
            }
        }
    }

    #[test]
    fn merging_makes_regular_blocks_runs_and_keeps_every_descriptor() {
        let d = |addr: u64, len: u64| Desc { addr, len, dev: 0 };
        // Blocks of 16 every 64 bytes, then a dense stretch, then a break and a device change.
        let mut descs: Vec<Desc> = (0..100).map(|i| d(0x1000 + i * 64, 16)).collect();
        descs.extend((0..50).map(|i| d(0x10_0000 + i * 32, 32)));
        descs.push(d(0x5, 32));
        descs.push(Desc { addr: 0x40, len: 32, dev: 1 });
        descs.push(Desc { addr: 0x80, len: 32, dev: 1 });
        let mut merged = DescList::new(MemKind::Dram);
        merged.extend_merging(descs.iter().copied()).unwrap();
        let plain = DescList::from_descs(MemKind::Dram, descs.iter().copied()).unwrap();
        assert_eq!(merged.runs().len(), 4, "{:?}", merged.runs());
        assert_eq!(merged.runs()[1], Run { addr: 0x10_0000, len: 32, dev: 0, stride: 32, count: 50 });
        assert_eq!((merged.len(), merged.total_bytes()), (plain.len(), plain.total_bytes()));
        assert!(merged.iter().eq(plain.iter()));
        for i in [0, 99, 100, 149, 150, 151, 152] {
            assert_eq!(merged.get(i), plain.get(i), "{i}");
        }
        // Going backwards or overlapping starts a new run; so does appending after.
        let mut l = DescList::new(MemKind::Dram);
        l.extend_merging([d(100, 10), d(95, 10), d(100, 10)]).unwrap();
        assert_eq!(l.runs().len(), 3);
        l.push(d(0, 1)).unwrap();
        assert_eq!(l.get(3), Some(d(0, 1)));
        // Bad descriptors: an error, the ones before it kept.
        let mut l = DescList::new(MemKind::Dram);
        let e = l.extend_merging([d(0, 8), d(8, 0)]).unwrap_err();
        assert!(e.to_string().contains("zero length"), "{e}");
        assert_eq!(l.len(), 1);
        assert!(l.extend_merging([d(u64::MAX - 2, 8)]).unwrap_err().to_string().contains("wraps around"));
    }

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
    fn lists_of_single_descriptors_index_directly_and_clones_are_independent() {
        let mut l =
            DescList::from_descs(MemKind::Dram, (0..4).map(|i| Desc { addr: i * 100, len: 10, dev: 0 })).unwrap();
        assert_eq!(l.get(3).unwrap().addr, 300);
        let snapshot = l.clone();
        l.push_strided(1000, 8, 0, 16, 3).unwrap();
        l.push(Desc { addr: 5000, len: 1, dev: 0 }).unwrap();
        assert_eq!(l.get(3).unwrap().addr, 300);
        assert_eq!(l.get(5).unwrap().addr, 1016);
        assert_eq!(l.get(7).unwrap().addr, 5000);
        assert!(l.get(8).is_none());
        assert_eq!((snapshot.len(), snapshot.runs().len()), (4, 4));

        let mut s = DescList::new(MemKind::Dram);
        s.push_strided(0, 8, 0, 100, 3).unwrap();
        s.push(Desc { addr: 7, len: 1, dev: 0 }).unwrap();
        let got: Vec<u64> = (0..4).map(|i| s.get(i).unwrap().addr).collect();
        assert_eq!(got, vec![0, 100, 200, 7]);
        assert_eq!(got, s.iter().map(|d| d.addr).collect::<Vec<_>>());
    }

    proptest::proptest! {
        #[test]
        fn indexing_agrees_with_iteration(runs in proptest::collection::vec((1u64..4, 1u64..5), 0..12)) {
            let mut l = DescList::new(MemKind::Dram);
            for (k, &(count, len)) in runs.iter().enumerate() {
                l.push_strided(k as u64 * 1000, len, 0, 10, count).unwrap();
            }
            let all: Vec<Desc> = l.iter().collect();
            proptest::prop_assert_eq!(all.len() as u64, l.len());
            for (i, d) in all.iter().enumerate() {
                proptest::prop_assert_eq!(l.get(i as u64), Some(*d));
            }
            proptest::prop_assert_eq!(l.get(l.len()), None);
        }
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
