//! From prepared descriptor lists to a copy plan: pure bookkeeping, no I/O.
//!
//! A transfer moves the concatenation of the local descriptors to (WRITE) or from (READ)
//! the concatenation of the remote ones; both must have the same total length but need
//! not cut it at the same places. The plan is the list of copies that does that, with
//! neighbours merged wherever both sides are contiguous in the same regions.

use crate::desc::{Desc, DescList, Run};
use crate::error::{invalid, Error, Result};
use crate::region::{MemKind, RemoteRegions};

/// A descriptor list checked against registered memory, ready to build requests from.
/// It shares the list's runs and adds, per run, which region holds it.
#[derive(Debug, Clone)]
pub struct PreparedList {
    list: DescList,
    /// Per run, an index into `keys`.
    run_region: Vec<u32>,
    /// Region keys in the order first met.
    keys: Vec<u64>,
    /// The same keys, sorted.
    regions: Vec<u64>,
}

/// A registered region as far as resolving descriptors goes: its key and byte range.
#[derive(Debug, Clone, Copy)]
pub struct RegionSpan {
    pub key: u64,
    pub start: u64,
    pub end: u64,
}

impl RegionSpan {
    fn holds(&self, lo: u64, hi: u64) -> bool {
        self.start <= lo && hi <= self.end
    }
}

impl PreparedList {
    /// Resolves every run of `list` with `find(addr, len, dev) -> region`. A strided run
    /// whose span lies in one region resolves in one lookup; otherwise each member is
    /// resolved on its own. Descriptors usually cluster in a few large regions, so the
    /// region of the previous lookup is tried first and most descriptors cost two
    /// comparisons instead of a registry lookup.
    pub fn resolve(list: &DescList, mut find: impl FnMut(u64, u64, u64) -> Result<RegionSpan>) -> Result<Self> {
        let mut run_region = Vec::with_capacity(list.runs().len());
        let mut keys: Vec<u64> = Vec::new();
        let mut last: Option<(u64, RegionSpan)> = None;
        let mut cached_find = |addr: u64, len: u64, dev: u64| -> Result<RegionSpan> {
            match last {
                Some((d, span)) if d == dev && span.holds(addr, addr + len) => Ok(span),
                _ => {
                    let span = find(addr, len, dev)?;
                    last = Some((dev, span));
                    Ok(span)
                }
            }
        };
        let mut slot = 0usize;
        let mut note = |region: u64, run_region: &mut Vec<u32>| -> Result<()> {
            if keys.get(slot) != Some(&region) {
                slot = match keys.iter().position(|&k| k == region) {
                    Some(i) => i,
                    None => {
                        keys.push(region);
                        keys.len() - 1
                    }
                };
            }
            let index = u32::try_from(slot).map_err(|_| invalid("a descriptor list may touch at most 2^32 regions"))?;
            run_region.push(index);
            Ok(())
        };
        // The list as prepared: `list` itself, unless a run's members lie in several
        // regions; then that run is cut into stretches of one region each (same
        // descriptors, same order), and the prepared list holds the cut runs.
        let mut cut: Option<DescList> = None;
        for (i, run) in list.runs().iter().enumerate() {
            match resolve_run(&mut cached_find, run)? {
                Stretches::One(region) => {
                    if let Some(c) = cut.as_mut() {
                        c.push_strided(run.addr, run.len, run.dev, run.stride, run.count)?;
                    }
                    note(region, &mut run_region)?;
                }
                Stretches::Several(parts) => {
                    let c = cut.get_or_insert_with(|| {
                        let mut c = DescList::new(list.kind());
                        for r in &list.runs()[..i] {
                            c.push_strided(r.addr, r.len, r.dev, r.stride, r.count).expect("a valid run stays valid");
                        }
                        c
                    });
                    let mut start = 0u64;
                    for (end, region) in parts {
                        let first = run.get(start);
                        c.push_strided(first.addr, run.len, run.dev, run.stride, end - start)?;
                        note(region, &mut run_region)?;
                        start = end;
                    }
                }
            }
        }
        let mut regions = keys.clone();
        regions.sort_unstable();
        Ok(PreparedList { list: cut.unwrap_or_else(|| list.clone()), run_region, keys, regions })
    }

    pub fn kind(&self) -> MemKind {
        self.list.kind()
    }
    pub fn len(&self) -> u64 {
        self.list.len()
    }
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
    pub fn total_bytes(&self) -> u64 {
        self.list.total_bytes()
    }
    /// Distinct region keys the list touches, sorted.
    pub fn regions(&self) -> &[u64] {
        &self.regions
    }
    /// The descriptor list this was prepared from.
    pub fn list(&self) -> &DescList {
        &self.list
    }

    fn region_of_run(&self, r: usize) -> u64 {
        self.keys[self.run_region[r] as usize]
    }

    #[cfg(test)]
    fn get(&self, i: u64) -> Option<(Desc, u64)> {
        let (r, k) = self.list.locate(i)?;
        Some((self.list.runs()[r].get(k), self.region_of_run(r)))
    }

    /// The bytes selected by `indices` (all, in order, when `None`), as pieces with
    /// their region: one piece per descriptor, except that descriptors of one dense run
    /// (members back to back: `stride == len`) that are selected one after the other
    /// make one piece. A KV cache load picks long stretches of consecutive blocks out
    /// of a run per layer; so its plan costs a step per stretch, not per block (the
    /// copies are the same: the plan merges contiguous neighbours anyway).
    fn select<'a>(&'a self, indices: Option<&'a [u64]>) -> Pieces<'a> {
        Pieces { list: self, indices, at: 0, member: 0 }
    }

    /// Resolves against a peer's advertised regions.
    pub fn remote(list: &DescList, regions: &RemoteRegions) -> Result<Self> {
        Self::resolve(list, |addr, len, dev| {
            let r = regions.find(list.kind(), addr, len, dev)?;
            Ok(RegionSpan { key: r.key, start: r.addr, end: r.end() })
        })
    }
}

/// The iterator of [`PreparedList::select`].
struct Pieces<'a> {
    list: &'a PreparedList,
    /// `None`: every descriptor, run by run.
    indices: Option<&'a [u64]>,
    /// The next index (with indices) or run (without).
    at: usize,
    /// Without indices: the next member of run `at` (a sparse run goes member by member).
    member: u64,
}

impl Iterator for Pieces<'_> {
    type Item = Result<(Desc, u64)>;

    fn next(&mut self) -> Option<Self::Item> {
        let runs = self.list.list.runs();
        let Some(idx) = self.indices else {
            let run = runs.get(self.at)?;
            let region = self.list.region_of_run(self.at);
            if run.stride == run.len {
                // Dense: the whole run at once (its bytes fit: the list's total does).
                self.at += 1;
                return Some(Ok((Desc { addr: run.addr, len: run.len * run.count, dev: run.dev }, region)));
            }
            let d = run.get(self.member);
            self.member += 1;
            if self.member == run.count {
                (self.at, self.member) = (self.at + 1, 0);
            }
            return Some(Ok((d, region)));
        };
        let &i = idx.get(self.at)?;
        self.at += 1;
        let Some((r, k)) = self.list.list.locate(i) else {
            return Some(Err(invalid(format!("index {i} out of range for a list of {} descriptors", self.list.len()))));
        };
        let run = &runs[r];
        let mut d = run.get(k);
        if run.stride == run.len {
            // The members after k in this run, for as long as the indices go on by one.
            let room = (run.count - 1 - k) as usize;
            let tail = &idx[self.at..];
            let stretch = tail.iter().take(room).zip(i + 1..).take_while(|(&next, want)| next == *want).count();
            d.len += run.len * stretch as u64;
            self.at += stretch;
        }
        Some(Ok((d, self.list.region_of_run(r))))
    }
}

/// `indices`, or None where they are every index in order (what callers pass for "all",
/// e.g. np.arange): no selection at all plans run by run, a step per run, not per index.
fn selection<'a>(list: &PreparedList, indices: Option<&'a [u64]>) -> Option<&'a [u64]> {
    indices.filter(|ix| !(ix.len() as u64 == list.len() && ix.iter().zip(0u64..).all(|(&i, k)| i == k)))
}

/// Where a run's members lie: all in one region, or in stretches of one region each
/// (the end of each stretch, as a member number, with its region).
enum Stretches {
    One(u64),
    Several(Vec<(u64, u64)>),
}

/// Resolves a run: the whole span in one lookup when it lies in one region, else member
/// by member (consecutive members in one region make one stretch).
fn resolve_run(find: &mut impl FnMut(u64, u64, u64) -> Result<RegionSpan>, run: &Run) -> Result<Stretches> {
    if run.count == 1 {
        return Ok(Stretches::One(find(run.addr, run.len, run.dev)?.key));
    }
    let (lo, hi) = run.span();
    if let Ok(r) = find(lo, hi - lo, run.dev) {
        return Ok(Stretches::One(r.key));
    }
    let mut parts: Vec<(u64, u64)> = Vec::new();
    let mut current = find(run.addr, run.len, run.dev)?.key;
    for k in 1..run.count {
        let d = run.get(k);
        let key = find(d.addr, d.len, d.dev)?.key;
        if key != current {
            parts.push((k, current));
            current = key;
        }
    }
    if parts.is_empty() {
        return Ok(Stretches::One(current));
    }
    parts.push((run.count, current));
    Ok(Stretches::Several(parts))
}

/// One copy between local and remote memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub local_addr: u64,
    pub local_region: u64,
    pub remote_addr: u64,
    pub remote_region: u64,
    pub len: u64,
}

/// The copies a request performs, plus the regions it must hold while in flight.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub ops: Vec<Op>,
    pub bytes: u64,
    pub local_regions: Vec<u64>,
    pub remote_regions: Vec<u64>,
}

impl Plan {
    /// Pairs the selected local and remote descriptors byte for byte.
    pub fn build(
        local: &PreparedList,
        local_idx: Option<&[u64]>,
        remote: &PreparedList,
        remote_idx: Option<&[u64]>,
    ) -> Result<Plan> {
        let mut ops: Vec<Op> = Vec::new();
        // Every index in order (what callers pass for "all", e.g. np.arange) is no
        // selection at all: the list run by run, a step per run instead of per index.
        let mut locals = local.select(selection(local, local_idx));
        let mut remotes = remote.select(selection(remote, remote_idx));
        // The descriptor being consumed on each side, with its region key.
        let mut l: Option<(Desc, u64)> = None;
        let mut r: Option<(Desc, u64)> = None;
        let (mut lbytes, mut rbytes) = (0u64, 0u64);
        let mut local_regions = Vec::new();
        let mut remote_regions = Vec::new();
        loop {
            if l.is_none() {
                l = locals.next().transpose()?;
                if let Some((d, k)) = l {
                    lbytes += d.len;
                    if local_regions.last() != Some(&k) {
                        local_regions.push(k);
                    }
                }
            }
            if r.is_none() {
                r = remotes.next().transpose()?;
                if let Some((d, k)) = r {
                    rbytes += d.len;
                    if remote_regions.last() != Some(&k) {
                        remote_regions.push(k);
                    }
                }
            }
            let (Some((ld, lk)), Some((rd, rk))) = (l.as_mut(), r.as_mut()) else { break };
            let n = ld.len.min(rd.len);
            let op = Op { local_addr: ld.addr, local_region: *lk, remote_addr: rd.addr, remote_region: *rk, len: n };
            match ops.last_mut() {
                Some(prev)
                    if prev.local_region == op.local_region
                        && prev.remote_region == op.remote_region
                        && prev.local_addr + prev.len == op.local_addr
                        && prev.remote_addr + prev.len == op.remote_addr =>
                {
                    prev.len += n
                }
                _ => ops.push(op),
            }
            ld.addr += n;
            ld.len -= n;
            rd.addr += n;
            rd.len -= n;
            if ld.len == 0 {
                l = None;
            }
            if rd.len == 0 {
                r = None;
            }
        }
        // Drain whichever side is longer to report both totals.
        for x in locals {
            lbytes += x?.0.len;
        }
        for x in remotes {
            rbytes += x?.0.len;
        }
        if l.is_some() || r.is_some() || lbytes != rbytes {
            return Err(Error::InvalidArgument(format!(
                "local descriptors total {lbytes} bytes but remote descriptors total {rbytes}; they must match"
            )));
        }
        if lbytes == 0 {
            return Err(invalid("a transfer needs at least one descriptor on each side"));
        }
        local_regions.sort_unstable();
        local_regions.dedup();
        remote_regions.sort_unstable();
        remote_regions.dedup();
        Ok(Plan { ops, bytes: lbytes, local_regions, remote_regions })
    }
}

/// A batch of copies sent as one unit over a stream transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub segs: Vec<Op>,
    pub bytes: u64,
}

/// Cuts a plan into chunks of at most `chunk_size` bytes and `max_segs` copies: large
/// copies are split (so they can be striped across streams), small ones are batched
/// (so 4 KiB blocks do not each pay a message).
pub fn chunk_ops(ops: &[Op], chunk_size: u64, max_segs: usize) -> Vec<Chunk> {
    assert!(chunk_size > 0 && max_segs > 0);
    let mut chunks = Vec::new();
    let mut cur = Chunk { segs: Vec::new(), bytes: 0 };
    for op in ops {
        let mut op = *op;
        while op.len > 0 {
            let room = chunk_size - cur.bytes;
            let n = op.len.min(room);
            cur.segs.push(Op { len: n, ..op });
            cur.bytes += n;
            op.local_addr += n;
            op.remote_addr += n;
            op.len -= n;
            if cur.bytes == chunk_size || cur.segs.len() == max_segs {
                chunks.push(std::mem::replace(&mut cur, Chunk { segs: Vec::new(), bytes: 0 }));
            }
        }
    }
    if !cur.segs.is_empty() {
        chunks.push(cur);
    }
    chunks
}

/// Splits a plan into `parts` groups of roughly equal bytes (for parallel copying).
pub fn split_by_bytes(ops: &[Op], parts: usize) -> Vec<Vec<Op>> {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let parts = parts.max(1) as u64;
    let target = total.div_ceil(parts).max(1);
    chunk_ops(ops, target, usize::MAX).into_iter().map(|c| c.segs).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn prep(descs: &[(u64, u64)], region: u64) -> PreparedList {
        let list =
            DescList::from_descs(MemKind::Dram, descs.iter().map(|&(addr, len)| Desc { addr, len, dev: 0 })).unwrap();
        PreparedList::resolve(&list, |_, _, _| Ok(RegionSpan { key: region, start: 0, end: u64::MAX })).unwrap()
    }

    #[test]
    fn resolving_switches_regions_when_a_descriptor_leaves_the_last_one() {
        let find = |addr: u64, len: u64, _dev: u64| -> Result<RegionSpan> {
            let span = if addr < 100 {
                RegionSpan { key: 1, start: 0, end: 100 }
            } else {
                RegionSpan { key: 2, start: 100, end: 200 }
            };
            if addr + len > span.end {
                return Err(invalid("crosses a region boundary"));
            }
            Ok(span)
        };
        let descs = [(10, 8), (20, 8), (150, 8), (30, 8), (96, 8)];
        let list =
            DescList::from_descs(MemKind::Dram, descs[..4].iter().map(|&(addr, len)| Desc { addr, len, dev: 0 }))
                .unwrap();
        let p = PreparedList::resolve(&list, find).unwrap();
        let keys: Vec<u64> = (0..4).map(|i| p.get(i).unwrap().1).collect();
        assert_eq!(keys, vec![1, 1, 2, 1]);
        assert_eq!(p.regions(), &[1, 2]);
        // A descriptor that starts in the cached region but runs past its end is looked up.
        let list =
            DescList::from_descs(MemKind::Dram, descs.iter().map(|&(addr, len)| Desc { addr, len, dev: 0 })).unwrap();
        assert!(PreparedList::resolve(&list, find).is_err());
    }

    #[test]
    fn contiguous_neighbours_merge() {
        let l = prep(&[(0, 4), (4, 4), (8, 4)], 1);
        let r = prep(&[(100, 8), (108, 4)], 2);
        let p = Plan::build(&l, None, &r, None).unwrap();
        assert_eq!(p.ops, vec![Op { local_addr: 0, local_region: 1, remote_addr: 100, remote_region: 2, len: 12 }]);
    }

    #[test]
    fn different_cuts_pair_byte_for_byte() {
        let l = prep(&[(0, 6), (50, 6)], 1);
        let r = prep(&[(100, 4), (200, 8)], 2);
        let p = Plan::build(&l, None, &r, None).unwrap();
        let got: Vec<_> = p.ops.iter().map(|o| (o.local_addr, o.remote_addr, o.len)).collect();
        assert_eq!(got, vec![(0, 100, 4), (4, 200, 2), (50, 202, 6)]);
    }

    #[test]
    fn mismatched_totals_and_bad_indices_are_errors() {
        let l = prep(&[(0, 6)], 1);
        let r = prep(&[(100, 4)], 2);
        assert!(Plan::build(&l, None, &r, None).is_err());
        let r = prep(&[(100, 6)], 2);
        assert!(Plan::build(&l, Some(&[1]), &r, None).is_err());
        assert!(Plan::build(&l, Some(&[]), &r, Some(&[])).is_err());
    }

    #[test]
    fn indices_select_and_reorder() {
        let l = prep(&[(0, 4), (4, 4), (8, 4)], 1);
        let r = prep(&[(100, 4), (104, 4), (108, 4)], 2);
        let p = Plan::build(&l, Some(&[2, 0]), &r, Some(&[0, 1])).unwrap();
        let got: Vec<_> = p.ops.iter().map(|o| (o.local_addr, o.remote_addr, o.len)).collect();
        assert_eq!(got, vec![(8, 100, 4), (0, 104, 4)]);
        // Every index in order plans as no selection; a prefix of them does not.
        let all = Plan::build(&l, Some(&[0, 1, 2]), &r, Some(&[0, 1, 2])).unwrap();
        assert_eq!(all.ops, Plan::build(&l, None, &r, None).unwrap().ops);
        assert_eq!(all.ops.len(), 1);
        assert!(Plan::build(&l, Some(&[0, 1]), &r, None).is_err(), "8 bytes against 12");
    }

    #[test]
    fn a_run_over_several_regions_is_cut_into_stretches_of_one_region() {
        // Regions of 100 bytes: [0, 100) key 1, [100, 200) key 2, ...
        let find = |addr: u64, len: u64, _dev: u64| -> Result<RegionSpan> {
            let key = addr / 100 + 1;
            let span = RegionSpan { key, start: (key - 1) * 100, end: key * 100 };
            if addr + len > span.end {
                return Err(invalid("crosses a region boundary"));
            }
            Ok(span)
        };
        let mut list = DescList::new(MemKind::Dram);
        list.push(Desc { addr: 500, len: 4, dev: 0 }).unwrap();
        list.push_strided(0, 10, 0, 25, 12).unwrap(); // members at 0, 25, ..., 275: regions 1, 2, 3
        list.push(Desc { addr: 510, len: 4, dev: 0 }).unwrap();
        let p = PreparedList::resolve(&list, find).unwrap();
        assert_eq!(p.list().runs().len(), 1 + 3 + 1);
        assert!(p.list().iter().eq(list.iter()), "the same descriptors, in order");
        let keys: Vec<u64> = (0..list.len()).map(|i| p.get(i).unwrap().1).collect();
        assert_eq!(keys, vec![6, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 6]);
        assert_eq!(p.regions(), &[1, 2, 3, 6]);
        // A member that crosses a boundary is still an error.
        let mut bad = DescList::new(MemKind::Dram);
        bad.push_strided(0, 30, 0, 45, 3).unwrap(); // the third member: 90..120
        assert!(PreparedList::resolve(&bad, find).is_err());
    }

    /// A list of dense and sparse strided runs and singles, in regions 1 and 2 by address.
    fn mixed() -> PreparedList {
        let mut list = DescList::new(MemKind::Dram);
        list.push_strided(0, 16, 0, 16, 8).unwrap(); // dense: 0..128
        list.push_strided(1000, 8, 0, 32, 6).unwrap(); // sparse
        list.push(Desc { addr: 128, len: 16, dev: 0 }).unwrap(); // right after the dense run
        list.push_strided(5000, 4, 0, 4, 10).unwrap(); // dense, region 2
        PreparedList::resolve(&list, |addr, _, _| {
            Ok(if addr < 5000 {
                RegionSpan { key: 1, start: 0, end: 5000 }
            } else {
                RegionSpan { key: 2, start: 5000, end: u64::MAX }
            })
        })
        .unwrap()
    }

    /// The plan of the same selection, built from one single descriptor per selected
    /// index: what the stretches of dense runs must not change.
    fn one_by_one(l: &PreparedList, li: Option<&[u64]>, r: &PreparedList, ri: Option<&[u64]>) -> Result<Plan> {
        fn singles(p: &PreparedList, idx: Option<&[u64]>) -> Result<PreparedList> {
            let all: Vec<u64> = (0..p.len()).collect();
            let picked = idx.unwrap_or(&all).iter().map(|&i| p.get(i).ok_or_else(|| invalid("out of range")));
            let picked: Vec<(Desc, u64)> = picked.collect::<Result<_>>()?;
            // A run per descriptor, each in the region its original was in.
            let list = DescList::from_descs(p.kind(), picked.iter().map(|x| x.0))?;
            let mut keys: Vec<u64> = Vec::new();
            let mut run_region = Vec::new();
            for &(_, k) in &picked {
                let slot = keys.iter().position(|&x| x == k).unwrap_or_else(|| {
                    keys.push(k);
                    keys.len() - 1
                });
                run_region.push(slot as u32);
            }
            let mut regions = keys.clone();
            regions.sort_unstable();
            Ok(PreparedList { list, run_region, keys, regions })
        }
        Plan::build(&singles(l, li)?, None, &singles(r, ri)?, None)
    }

    #[test]
    fn consecutive_indices_of_a_dense_run_are_one_piece_and_others_are_not() {
        let p = mixed();
        let pieces = |idx: Option<&[u64]>| -> Vec<(u64, u64, u64)> {
            p.select(idx).map(|x| x.map(|(d, k)| (d.addr, d.len, k))).collect::<Result<_>>().unwrap()
        };
        // 1..4 of the dense run: one piece; on into the next run: a new piece.
        assert_eq!(pieces(Some(&[1, 2, 3, 7, 8])), vec![(16, 48, 1), (112, 16, 1), (1000, 8, 1)]);
        // The sparse run: member by member even when consecutive; repeats stay apart.
        assert_eq!(pieces(Some(&[9, 10, 10])), vec![(1032, 8, 1), (1064, 8, 1), (1064, 8, 1)]);
        // Without indices: dense runs whole, the sparse one member by member.
        let all = pieces(None);
        assert_eq!(all.len(), 1 + 6 + 1 + 1);
        assert_eq!((all[0], all[7], all[8]), ((0, 128, 1), (128, 16, 1), (5000, 40, 2)));
        let e = p.select(Some(&[0, 1, 25])).map(|x| x.map(|_| ())).collect::<Result<Vec<_>>>().unwrap_err();
        assert!(e.to_string().contains("index 25 out of range"), "{e}");
    }

    proptest! {
        /// Picking stretches of dense runs whole plans exactly the copies that picking
        /// every descriptor on its own plans.
        #[test]
        fn stretches_plan_what_single_descriptors_plan(
            picks in prop::collection::vec((0u64..25, 1u64..6), 1..8),
            remote_first in 0u64..140,
        ) {
            let l = mixed();
            // The remote side: 4-byte members, a dense run then a sparse one, picked
            // consecutively from remote_first for as many bytes as the local side.
            let mut list = DescList::new(MemKind::Dram);
            list.push_strided(20_000, 4, 0, 4, 150).unwrap();
            list.push_strided(30_000, 4, 0, 12, 150).unwrap();
            let r = PreparedList::resolve(&list, |_, _, _| Ok(RegionSpan { key: 3, start: 0, end: u64::MAX })).unwrap();
            let li: Vec<u64> = picks.iter().flat_map(|&(s, n)| (s..s + n).map(|i| i % 25)).collect();
            let bytes: u64 = li.iter().map(|&i| l.get(i).unwrap().0.len).sum();
            let ri: Vec<u64> = (remote_first..remote_first + bytes / 4).collect();
            let fast = Plan::build(&l, Some(&li), &r, Some(&ri));
            let slow = one_by_one(&l, Some(&li), &r, Some(&ri));
            match (fast, slow) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(a.ops, b.ops);
                    prop_assert_eq!(a.bytes, b.bytes);
                    prop_assert_eq!(a.local_regions, b.local_regions);
                    prop_assert_eq!(a.remote_regions, b.remote_regions);
                }
                (a, b) => prop_assert!(false, "{:?} / {:?}", a.map(|p| p.ops), b.map(|p| p.ops)),
            }
            let whole = Plan::build(&l, None, &l, None).unwrap();
            prop_assert_eq!(whole.ops, one_by_one(&l, None, &l, None).unwrap().ops);
        }

        /// Whatever the cuts, the plan maps local byte i to remote byte i exactly once.
        #[test]
        fn plan_is_a_bijection(lens_l in prop::collection::vec(1u64..50, 1..20), seed in 0u64..1000) {
            let total: u64 = lens_l.iter().sum();
            // Cut the same total differently on the remote side.
            let mut lens_r = Vec::new();
            let mut left = total;
            let mut s = seed;
            while left > 0 {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let n = 1 + (s >> 33) % left.min(40);
                lens_r.push(n);
                left -= n;
            }
            let mut a = 0; let ld: Vec<_> = lens_l.iter().map(|&n| { let d = (a, n); a += n + 3; d }).collect();
            let mut b = 10_000; let rd: Vec<_> = lens_r.iter().map(|&n| { let d = (b, n); b += n + 1; d }).collect();
            let p = Plan::build(&prep(&ld, 1), None, &prep(&rd, 2), None).unwrap();
            let flat = |v: &[(u64, u64)]| v.iter().flat_map(|&(s, n)| s..s + n).collect::<Vec<_>>();
            let lbytes = flat(&ld);
            let rbytes = flat(&rd);
            let mut pairs = Vec::new();
            for op in &p.ops { for k in 0..op.len { pairs.push((op.local_addr + k, op.remote_addr + k)); } }
            let expect: Vec<_> = lbytes.into_iter().zip(rbytes).collect();
            prop_assert_eq!(pairs, expect);
        }

        #[test]
        fn chunks_cover_every_byte_once(lens in prop::collection::vec(1u64..10_000, 1..50), chunk in 1u64..5000, max_segs in 1usize..8) {
            let mut a = 0;
            let ops: Vec<Op> = lens.iter().map(|&n| { let o = Op { local_addr: a, local_region: 1, remote_addr: a + 1_000_000, remote_region: 2, len: n }; a += n + 7; o }).collect();
            let chunks = chunk_ops(&ops, chunk, max_segs);
            let mut covered = Vec::new();
            for c in &chunks {
                prop_assert!(c.bytes <= chunk && c.segs.len() <= max_segs && c.bytes > 0);
                prop_assert_eq!(c.bytes, c.segs.iter().map(|s| s.len).sum::<u64>());
                for s in &c.segs {
                    prop_assert_eq!(s.remote_addr, s.local_addr + 1_000_000);
                    covered.extend(s.local_addr..s.local_addr + s.len);
                }
            }
            let expect: Vec<_> = ops.iter().flat_map(|o| o.local_addr..o.local_addr + o.len).collect();
            prop_assert_eq!(covered, expect);
        }
    }
}
