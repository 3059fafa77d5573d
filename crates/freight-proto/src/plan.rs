//! From prepared descriptor lists to a copy plan: pure bookkeeping, no I/O.
//!
//! A transfer moves the concatenation of the local descriptors to (WRITE) or from (READ)
//! the concatenation of the remote ones; both must have the same total length but need
//! not cut it at the same places. The plan is the list of copies that does that, with
//! neighbours merged wherever both sides are contiguous in the same regions.

use crate::desc::{DescList, Run};
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
    fn get(&self, i: u64) -> Option<(crate::desc::Desc, u64)> {
        let (r, k) = self.list.locate(i)?;
        Some((self.list.runs()[r].get(k), self.region_of_run(r)))
    }

    /// Every run, whole, as pieces: a plan pairs runs with runs, a step per run.
    fn runs_as_pieces(&self) -> RunPieces<'_> {
        RunPieces { runs: self.list.runs(), run_region: &self.run_region, keys: &self.keys, at: 0 }
    }

    /// The descriptors `indices` pick, as pieces: one per descriptor, except that
    /// descriptors of one dense run (members back to back: `stride == len`) picked one
    /// after the other make one piece. A KV cache load picks long stretches of
    /// consecutive blocks out of a run per layer; so its plan costs a step per stretch,
    /// not per block.
    fn picked<'a>(&'a self, indices: &'a [u64]) -> Picked<'a> {
        Picked { list: self, indices, at: 0, bad: None }
    }

    /// Resolves against a peer's advertised regions.
    pub fn remote(list: &DescList, regions: &RemoteRegions) -> Result<Self> {
        Self::resolve(list, |addr, len, dev| {
            let r = regions.find(list.kind(), addr, len, dev)?;
            Ok(RegionSpan { key: r.key, start: r.addr, end: r.end() })
        })
    }
}

/// A strided piece of a selection: `count` members of `len` bytes, `stride` apart, in
/// one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    addr: u64,
    len: u64,
    stride: u64,
    count: u64,
    region: u64,
}

impl Piece {
    fn dense(&self) -> bool {
        self.stride == self.len || self.count == 1
    }

    /// Bytes from `off` into the first member that lie back to back.
    fn contiguous(&self, off: u64) -> u64 {
        if self.dense() {
            self.len * self.count - off
        } else {
            self.len - off
        }
    }

    /// Moves `n` bytes on from `off` into the first member; false once nothing is left.
    fn consume(&mut self, off: &mut u64, n: u64) -> bool {
        let at = *off + n;
        let members = at / self.len;
        *off = at % self.len;
        self.skip(members)
    }

    /// Drops the first `members` members; false once nothing is left.
    fn skip(&mut self, members: u64) -> bool {
        self.count -= members;
        // The address past the last member is never used, and may not exist.
        self.addr = self.addr.wrapping_add(members.wrapping_mul(self.stride));
        self.count > 0
    }
}

/// Where one side's pieces come from, in order.
trait Source {
    /// The next piece; `None` at the end, or after an error, which [`Source::error`]
    /// then holds (no `Result` on the hot path of planning).
    fn next_piece(&mut self) -> Option<Piece>;
    fn error(&mut self) -> Option<Error>;
}

/// A prepared list's runs, whole ([`PreparedList::runs_as_pieces`]).
struct RunPieces<'a> {
    runs: &'a [Run],
    run_region: &'a [u32],
    keys: &'a [u64],
    at: usize,
}

impl Source for RunPieces<'_> {
    #[inline(always)]
    fn next_piece(&mut self) -> Option<Piece> {
        let run = self.runs.get(self.at)?;
        let region = self.keys[self.run_region[self.at] as usize];
        self.at += 1;
        Some(Piece { addr: run.addr, len: run.len, stride: run.stride, count: run.count, region })
    }

    fn error(&mut self) -> Option<Error> {
        None
    }
}

/// The descriptors of an index list ([`PreparedList::picked`]).
struct Picked<'a> {
    list: &'a PreparedList,
    indices: &'a [u64],
    /// The next index.
    at: usize,
    /// An index out of range, once met.
    bad: Option<u64>,
}

impl Source for Picked<'_> {
    fn next_piece(&mut self) -> Option<Piece> {
        let idx = self.indices;
        let &i = idx.get(self.at)?;
        self.at += 1;
        let Some((r, k)) = self.list.list.locate(i) else {
            self.bad = Some(i);
            return None;
        };
        let run = &self.list.list.runs()[r];
        let d = run.get(k);
        let mut len = d.len;
        if run.stride == run.len {
            // The members after k in this run, for as long as the indices go on by one.
            let room = (run.count - 1 - k) as usize;
            let tail = &idx[self.at..];
            let stretch = tail.iter().take(room).zip(i + 1..).take_while(|(&next, want)| next == *want).count();
            len += run.len * stretch as u64;
            self.at += stretch;
        }
        Some(Piece { addr: d.addr, len, stride: len, count: 1, region: self.list.region_of_run(r) })
    }

    fn error(&mut self) -> Option<Error> {
        let i = self.bad.take()?;
        Some(invalid(format!("index {i} out of range for a list of {} descriptors", self.list.len())))
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

impl Op {
    /// Whether `next` carries on where this copy ends, on both sides and in the same
    /// regions: the two are one copy.
    fn continued_by(&self, next: &Op) -> bool {
        self.local_region == next.local_region
            && self.remote_region == next.remote_region
            && self.local_addr + self.len == next.local_addr
            && self.remote_addr + self.len == next.remote_addr
    }
}

/// `count` copies of `len` bytes: the i-th between `local_addr + i * local_stride` and
/// `remote_addr + i * remote_stride`. A plan keeps strided families of blocks (a layer
/// of a paged KV cache) as one run each; transports expand them when they compile.
///
/// Invariants (kept by [`Plan::build`]): `count >= 1`; a run of one copy has strides
/// equal to `len`; no run has both strides equal to `len` and `count > 1` (such a run
/// is one longer copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    pub local_addr: u64,
    pub remote_addr: u64,
    pub len: u64,
    pub count: u64,
    pub local_stride: u64,
    pub remote_stride: u64,
    pub local_region: u64,
    pub remote_region: u64,
}

impl CopyRun {
    /// The i-th copy of the run.
    pub fn get(&self, i: u64) -> Op {
        Op {
            local_addr: self.local_addr + i * self.local_stride,
            local_region: self.local_region,
            remote_addr: self.remote_addr + i * self.remote_stride,
            remote_region: self.remote_region,
            len: self.len,
        }
    }
}

/// The copies a request performs, as runs (see [`CopyRun`]), plus the regions it must
/// hold while in flight.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    runs: Vec<CopyRun>,
    /// Copies the runs expand to, with neighbours that continue each other merged.
    copies: usize,
    pub bytes: u64,
    pub local_regions: Vec<u64>,
    pub remote_regions: Vec<u64>,
}

impl Plan {
    /// Pairs the selected local and remote descriptors byte for byte. Runs of the same
    /// member length on both sides pair member for member in one step, so a plan of
    /// strided runs costs a step per run; where the cuts differ, byte ranges pair one
    /// at a time.
    pub fn build(
        local: &PreparedList,
        local_idx: Option<&[u64]>,
        remote: &PreparedList,
        remote_idx: Option<&[u64]>,
    ) -> Result<Plan> {
        // Every index in order (what callers pass for "all", e.g. np.arange) is no
        // selection at all: the list run by run, a step per run instead of per index.
        match (selection(local, local_idx), selection(remote, remote_idx)) {
            (None, None) => match zip_members(local, remote) {
                Some(plan) => Ok(plan),
                None => pair(local.runs_as_pieces(), remote.runs_as_pieces()),
            },
            (None, Some(r)) => pair(local.runs_as_pieces(), remote.picked(r)),
            (Some(l), None) => pair(local.picked(l), remote.runs_as_pieces()),
            (Some(l), Some(r)) => pair(local.picked(l), remote.picked(r)),
        }
    }

    /// The runs of copies, in order.
    pub fn runs(&self) -> &[CopyRun] {
        &self.runs
    }

    /// The plan's copies, one by one, each run expanded and copies that continue each
    /// other merged: the list a transport works through.
    pub fn copies(&self) -> Copies<'_> {
        Copies { runs: self.runs.iter(), run: None, next: 0, pending: None }
    }

    /// How many copies [`Plan::copies`] yields.
    pub fn copy_count(&self) -> usize {
        self.copies
    }
}

/// The pairing behind [`Plan::build`], for each kind of source on each side.
fn pair(mut locals: impl Source, mut remotes: impl Source) -> Result<Plan> {
    let mut plan = Builder::default();
    // The piece being consumed on each side, and how far into its first member.
    let (mut l, mut r): (Option<Piece>, Option<Piece>) = (None, None);
    let (mut loff, mut roff) = (0u64, 0u64);
    let (mut lbytes, mut rbytes) = (0u64, 0u64);
    let (mut local_regions, mut remote_regions) = (Vec::new(), Vec::new());
    loop {
        if l.is_none() {
            l = fetch(&mut locals, &mut lbytes, &mut local_regions);
        }
        if r.is_none() {
            r = fetch(&mut remotes, &mut rbytes, &mut remote_regions);
        }
        let (Some(lp), Some(rp)) = (l.as_mut(), r.as_mut()) else { break };
        if loff == 0 && roff == 0 && lp.len == rp.len {
            // Member for member, as many as both sides have.
            let count = lp.count.min(rp.count);
            plan.push(CopyRun {
                local_addr: lp.addr,
                remote_addr: rp.addr,
                len: lp.len,
                count,
                local_stride: lp.stride,
                remote_stride: rp.stride,
                local_region: lp.region,
                remote_region: rp.region,
            });
            if !lp.skip(count) {
                l = None;
            }
            if !rp.skip(count) {
                r = None;
            }
        } else {
            let n = lp.contiguous(loff).min(rp.contiguous(roff));
            plan.push(CopyRun {
                local_addr: lp.addr + loff,
                remote_addr: rp.addr + roff,
                len: n,
                count: 1,
                local_stride: n,
                remote_stride: n,
                local_region: lp.region,
                remote_region: rp.region,
            });
            if !lp.consume(&mut loff, n) {
                l = None;
            }
            if !rp.consume(&mut roff, n) {
                r = None;
            }
        }
    }
    // Drain whichever side is longer to report both totals.
    while let Some(p) = locals.next_piece() {
        lbytes += p.len * p.count;
    }
    while let Some(p) = remotes.next_piece() {
        rbytes += p.len * p.count;
    }
    if let Some(e) = locals.error().or_else(|| remotes.error()) {
        return Err(e);
    }
    if l.is_some() || r.is_some() || lbytes != rbytes {
        return Err(Error::InvalidArgument(format!(
            "local descriptors total {lbytes} bytes but remote descriptors total {rbytes}; they must match"
        )));
    }
    if lbytes == 0 {
        return Err(invalid("a transfer needs at least one descriptor on each side"));
    }
    for regions in [&mut local_regions, &mut remote_regions] {
        regions.sort_unstable();
        regions.dedup();
    }
    Ok(Plan { runs: plan.runs, copies: plan.copies, bytes: lbytes, local_regions, remote_regions })
}

/// [`pair`] for lists whose runs meet member for member (what lists of KV cache
/// blocks, all of one length, do): the runs of both sides zipped without cutting any,
/// in one pass that gives up (`None`) at the first pair of members of different
/// lengths, or where one side runs out first or both are empty; [`pair`] takes those.
fn zip_members(local: &PreparedList, remote: &PreparedList) -> Option<Plan> {
    let (lruns, rruns) = (local.list.runs(), remote.list.runs());
    let mut plan = Builder { runs: Vec::with_capacity(lruns.len().max(rruns.len())), ..Builder::default() };
    let (mut i, mut j) = (0, 0);
    // Members of runs i and j already paired.
    let (mut li, mut rj) = (0u64, 0u64);
    // The last push made the last run three members long or longer: what follows may
    // well carry it on. (Two is no sign: a run of one takes any later copy of its length
    // as its second, which in a scrambled list happens at random, and a branch taken at
    // random costs more than the pass saves.)
    let mut striding = false;
    while let (Some(l), Some(r)) = (lruns.get(i), rruns.get(j)) {
        if l.len != r.len {
            return None;
        }
        if striding && li == 0 && rj == 0 {
            // Single descriptors on both sides (a list pushed one by one) that carry the
            // last run's strides on: taken in one pass, not a push each.
            striding = false;
            let n = plan.carry_on(
                &lruns[i..],
                &rruns[j..],
                |k| local.region_of_run(i + k),
                |k| remote.region_of_run(j + k),
            );
            if n > 0 {
                (i, j) = (i + n, j + n);
                continue;
            }
        }
        let count = (l.count - li).min(r.count - rj);
        let joined = plan.push(CopyRun {
            local_addr: l.addr + li * l.stride,
            remote_addr: r.addr + rj * r.stride,
            len: l.len,
            count,
            local_stride: l.stride,
            remote_stride: r.stride,
            local_region: local.region_of_run(i),
            remote_region: remote.region_of_run(j),
        });
        striding = joined >= 3;
        li += count;
        rj += count;
        if li == l.count {
            (i, li) = (i + 1, 0);
        }
        if rj == r.count {
            (j, rj) = (j + 1, 0);
        }
    }
    if i < lruns.len() || j < rruns.len() || plan.runs.is_empty() {
        return None;
    }
    Some(Plan {
        runs: plan.runs,
        copies: plan.copies,
        bytes: local.total_bytes(),
        local_regions: local.regions().to_vec(),
        remote_regions: remote.regions().to_vec(),
    })
}

/// A plan's runs as they are appended, with where the last copy ends on each side.
#[derive(Default)]
struct Builder {
    runs: Vec<CopyRun>,
    copies: usize,
    /// The end of the last run's last copy, local and remote.
    end: (u64, u64),
}

impl Builder {
    /// Appends a run: one copy where its members lie back to back on both sides, else
    /// into the last copy where it continues it, else into the last run where it
    /// carries it on, else on its own.
    /// Returns how many members the last run has where `run` joined it as its next
    /// members, else 0.
    #[inline(always)]
    fn push(&mut self, mut run: CopyRun) -> u64 {
        if run.count > 1 && run.local_stride == run.len && run.remote_stride == run.len {
            // Fits: the members' bytes are part of the list's total.
            (run.len, run.count) = (run.len * run.count, 1);
        }
        if run.count == 1 {
            (run.local_stride, run.remote_stride) = (run.len, run.len);
        }
        let end_of = |run: &CopyRun| {
            let last = run.count - 1;
            (run.local_addr + last * run.local_stride + run.len, run.remote_addr + last * run.remote_stride + run.len)
        };
        let Some(last) = self.runs.last_mut() else {
            self.copies = run.count as usize;
            self.end = end_of(&run);
            self.runs.push(run);
            return 0;
        };
        let same_regions = last.local_region == run.local_region && last.remote_region == run.remote_region;
        let touches = same_regions && self.end == (run.local_addr, run.remote_addr);
        if touches && last.count == 1 && run.count == 1 {
            last.len += run.len;
            (last.local_stride, last.remote_stride) = (last.len, last.len);
            self.end = (self.end.0 + run.len, self.end.1 + run.len);
            return 0;
        }
        if !touches && same_regions && run.len == last.len {
            // The next member of the last run's strides (a run of one takes any later
            // copy of its length that does not overlap it as its second).
            let (ls, rs) = if last.count == 1 {
                (run.local_addr.wrapping_sub(last.local_addr), run.remote_addr.wrapping_sub(last.remote_addr))
            } else {
                (last.local_stride, last.remote_stride)
            };
            let apart = last.count > 1 || (run.local_addr >= self.end.0 && run.remote_addr >= self.end.1);
            let first = (self.end.0 - last.len, self.end.1 - last.len);
            let follows = apart
                && first.0.checked_add(ls) == Some(run.local_addr)
                && first.1.checked_add(rs) == Some(run.remote_addr)
                && (run.count == 1 || (run.local_stride == ls && run.remote_stride == rs));
            if follows {
                (last.local_stride, last.remote_stride) = (ls, rs);
                last.count += run.count;
                self.copies += run.count as usize;
                self.end = end_of(&run);
                return last.count;
            }
        }
        // Expanding merges the two runs' touching copies into one (see `Plan::copies`).
        self.copies += run.count as usize - usize::from(touches);
        self.end = end_of(&run);
        self.runs.push(run);
        0
    }

    /// Appends the leading pairs of single descriptors (`local[k]` with `remote[k]`,
    /// in regions `local_region(k)` and `remote_region(k)`) that are the next members of
    /// the last run, with its strides, length and regions; returns how many. The same
    /// as a [`Builder::push`] of each, in a loop that only compares: a list of 65,536
    /// blocks pushed one by one plans in a pass over its runs.
    fn carry_on(
        &mut self,
        local: &[Run],
        remote: &[Run],
        local_region: impl Fn(usize) -> u64,
        remote_region: impl Fn(usize) -> u64,
    ) -> usize {
        let Some(last) = self.runs.last_mut() else { return 0 };
        let (len, ls, rs) = (last.len, last.local_stride, last.remote_stride);
        // A run of one has no strides yet (`push` gives it its second member); members
        // back to back on both sides are one copy, which `push` lengthens instead.
        if last.count < 2 || (ls == len && rs == len) {
            return 0;
        }
        // Where the last member starts on each side.
        let (mut la, mut ra) = (self.end.0 - len, self.end.1 - len);
        let mut n = 0;
        for (l, r) in local.iter().zip(remote) {
            let next = l.count == 1
                && r.count == 1
                && l.len == len
                && r.len == len
                && la.checked_add(ls) == Some(l.addr)
                && ra.checked_add(rs) == Some(r.addr)
                && local_region(n) == last.local_region
                && remote_region(n) == last.remote_region;
            if !next {
                break;
            }
            (la, ra) = (l.addr, r.addr);
            n += 1;
        }
        last.count += n as u64;
        self.copies += n;
        self.end = (la + len, ra + len);
        n
    }
}

/// The next piece of a side, counted into its bytes and its regions.
#[inline(always)]
fn fetch(pieces: &mut impl Source, bytes: &mut u64, regions: &mut Vec<u64>) -> Option<Piece> {
    let piece = pieces.next_piece()?;
    *bytes += piece.len * piece.count;
    if regions.last() != Some(&piece.region) {
        regions.push(piece.region);
    }
    Some(piece)
}

/// The iterator of [`Plan::copies`].
#[derive(Clone)]
pub struct Copies<'a> {
    runs: std::slice::Iter<'a, CopyRun>,
    run: Option<&'a CopyRun>,
    /// The next member of `run`.
    next: u64,
    /// A copy not yet handed out: the next may continue it.
    pending: Option<Op>,
}

impl Iterator for Copies<'_> {
    type Item = Op;

    fn next(&mut self) -> Option<Op> {
        loop {
            let member = match self.run {
                Some(run) if self.next < run.count => {
                    self.next += 1;
                    run.get(self.next - 1)
                }
                _ => match self.runs.next() {
                    Some(run) => {
                        (self.run, self.next) = (Some(run), 1);
                        run.get(0)
                    }
                    None => return self.pending.take(),
                },
            };
            match self.pending.as_mut() {
                Some(p) if p.continued_by(&member) => p.len += member.len,
                Some(p) => return Some(std::mem::replace(p, member)),
                None => self.pending = Some(member),
            }
        }
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
pub fn chunk_ops(ops: impl IntoIterator<Item = Op>, chunk_size: u64, max_segs: usize) -> Vec<Chunk> {
    assert!(chunk_size > 0 && max_segs > 0);
    let mut chunks = Vec::new();
    let mut cur = Chunk { segs: Vec::new(), bytes: 0 };
    for mut op in ops {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::Desc;
    use proptest::prelude::*;

    /// The plan's copies, checked against its count of them.
    fn ops(p: &Plan) -> Vec<Op> {
        let v: Vec<Op> = p.copies().collect();
        assert_eq!(v.len(), p.copy_count(), "copy_count agrees with the copies");
        v
    }

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

    /// Single descriptors that carry a stride on join one run, a pass over them; a
    /// change of stride, length or region starts another. The same plan as pushing
    /// each pair on its own (the general pairing).
    #[test]
    fn singles_carrying_a_stride_on_zip_into_runs() {
        let mut local: Vec<(u64, u64)> = (0..1000).map(|i| (i * 8192, 4096)).collect();
        let mut remote: Vec<(u64, u64)> = (0..1000).map(|i| ((1 << 30) + i * 12288, 4096)).collect();
        let plan = Plan::build(&prep(&local, 1), None, &prep(&remote, 2), None).unwrap();
        assert_eq!(plan.runs().len(), 1);
        let run = plan.runs()[0];
        assert_eq!((run.count, run.local_stride, run.remote_stride, run.len), (1000, 8192, 12288, 4096));
        assert_eq!(plan.copy_count(), 1000);
        // A break in the middle: a shorter member, then the stride again; a jump.
        local[500].1 = 2048;
        remote[500].1 = 2048;
        remote[700].0 += 4096 * 1000;
        let (l, r) = (prep(&local, 1), prep(&remote, 2));
        let zipped = zip_members(&l, &r).expect("members meet one for one");
        let paired = pair(l.runs_as_pieces(), r.runs_as_pieces()).unwrap();
        assert_eq!(ops(&zipped), ops(&paired));
        assert_eq!(zipped.runs(), paired.runs());
        let counts: Vec<u64> = zipped.runs().iter().map(|r| r.count).collect();
        assert_eq!(counts, vec![500, 1, 199, 1, 299]);
        // The same blocks in another region from 800 on: a run of their own.
        let split = PreparedList::resolve(
            &DescList::from_descs(MemKind::Dram, local.iter().map(|&(addr, len)| Desc { addr, len, dev: 0 })).unwrap(),
            |addr, _, _| {
                Ok(if addr < 800 * 8192 {
                    RegionSpan { key: 1, start: 0, end: 800 * 8192 }
                } else {
                    RegionSpan { key: 3, start: 800 * 8192, end: u64::MAX }
                })
            },
        )
        .unwrap();
        let zipped = zip_members(&split, &r).unwrap();
        assert_eq!(zipped.runs(), pair(split.runs_as_pieces(), r.runs_as_pieces()).unwrap().runs());
        assert_eq!(zipped.runs().last().unwrap().local_region, 3);
    }

    /// Two empty lists are of one total (zero) and of no length at all: neither the
    /// member-for-member zip nor the general pairing may take them for a transfer.
    #[test]
    fn two_empty_lists_are_refused_with_or_without_a_selection() {
        let (l, r) = (prep(&[], 1), prep(&[], 2));
        for (li, ri) in [(None, None), (Some(&[][..]), None), (None, Some(&[][..])), (Some(&[][..]), Some(&[][..]))] {
            match Plan::build(&l, li, &r, ri) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("at least one descriptor"), "{m}"),
                other => panic!("{li:?} {ri:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn contiguous_neighbours_merge() {
        let l = prep(&[(0, 4), (4, 4), (8, 4)], 1);
        let r = prep(&[(100, 8), (108, 4)], 2);
        let p = Plan::build(&l, None, &r, None).unwrap();
        assert_eq!(ops(&p), vec![Op { local_addr: 0, local_region: 1, remote_addr: 100, remote_region: 2, len: 12 }]);
    }

    #[test]
    fn strided_runs_stay_runs_until_expanded() {
        // 65536 blocks of 4 KiB, every other one, on both sides: one run, not 65536 copies.
        let strided = |base: u64| {
            let mut list = DescList::new(MemKind::Dram);
            list.push_strided(base, 4096, 0, 8192, 65536).unwrap();
            PreparedList::resolve(&list, |_, _, _| Ok(RegionSpan { key: base, start: 0, end: u64::MAX })).unwrap()
        };
        let (l, r) = (strided(0), strided(1 << 40));
        let p = Plan::build(&l, None, &r, None).unwrap();
        assert_eq!(p.runs().len(), 1);
        assert_eq!(p.copy_count(), 65536);
        assert_eq!(p.bytes, 65536 * 4096);
        let copies = ops(&p);
        assert_eq!(
            copies[1],
            Op { local_addr: 8192, local_region: 0, remote_addr: (1 << 40) + 8192, remote_region: 1 << 40, len: 4096 }
        );
        // The same blocks given one by one become the same run.
        let singles = |base: u64| prep(&(0..65536).map(|i| (base + i * 8192, 4096)).collect::<Vec<_>>(), 7);
        let p = Plan::build(&singles(0), None, &singles(1 << 40), None).unwrap();
        assert_eq!((p.runs().len(), p.copy_count()), (1, 65536));
        // Dense on both sides: one copy.
        let dense = |base: u64| prep(&(0..1000).map(|i| (base + i * 16, 16)).collect::<Vec<_>>(), 7);
        let p = Plan::build(&dense(0), None, &dense(1 << 30), None).unwrap();
        assert_eq!(
            ops(&p),
            vec![Op { local_addr: 0, local_region: 7, remote_addr: 1 << 30, remote_region: 7, len: 16_000 }]
        );
    }

    #[test]
    fn different_cuts_pair_byte_for_byte() {
        let l = prep(&[(0, 6), (50, 6)], 1);
        let r = prep(&[(100, 4), (200, 8)], 2);
        let p = Plan::build(&l, None, &r, None).unwrap();
        let got: Vec<_> = ops(&p).iter().map(|o| (o.local_addr, o.remote_addr, o.len)).collect();
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
        let got: Vec<_> = ops(&p).iter().map(|o| (o.local_addr, o.remote_addr, o.len)).collect();
        assert_eq!(got, vec![(8, 100, 4), (0, 104, 4)]);
        // Every index in order plans as no selection; a prefix of them does not.
        let all = Plan::build(&l, Some(&[0, 1, 2]), &r, Some(&[0, 1, 2])).unwrap();
        assert_eq!(ops(&all), ops(&Plan::build(&l, None, &r, None).unwrap()));
        assert_eq!(ops(&all).len(), 1);
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
        let drain = |mut source: Box<dyn Source + '_>| -> Result<Vec<Piece>> {
            let mut all = Vec::new();
            while let Some(x) = source.next_piece() {
                all.push(x);
            }
            source.error().map_or(Ok(all), Err)
        };
        let pieces = |idx: &[u64]| -> Vec<(u64, u64, u64)> {
            let all = drain(Box::new(p.picked(idx))).unwrap();
            assert!(all.iter().all(|x| x.count == 1 && x.stride == x.len), "one stretch a piece");
            all.iter().map(|x| (x.addr, x.len, x.region)).collect()
        };
        // 1..4 of the dense run: one piece; on into the next run: a new piece.
        assert_eq!(pieces(&[1, 2, 3, 7, 8]), vec![(16, 48, 1), (112, 16, 1), (1000, 8, 1)]);
        // The sparse run: member by member even when consecutive; repeats stay apart.
        assert_eq!(pieces(&[9, 10, 10]), vec![(1032, 8, 1), (1064, 8, 1), (1064, 8, 1)]);
        // Without indices: every run whole, dense or sparse.
        let all = drain(Box::new(p.runs_as_pieces())).unwrap();
        let runs: Vec<_> = all.iter().map(|x| (x.addr, x.len, x.stride, x.count, x.region)).collect();
        assert_eq!(runs, vec![(0, 16, 16, 8, 1), (1000, 8, 32, 6, 1), (128, 16, 16, 1, 1), (5000, 4, 4, 10, 2)]);
        let e = drain(Box::new(p.picked(&[0, 1, 25]))).unwrap_err();
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
                    prop_assert_eq!(ops(&a), ops(&b));
                    prop_assert_eq!(a.bytes, b.bytes);
                    prop_assert_eq!(a.local_regions, b.local_regions);
                    prop_assert_eq!(a.remote_regions, b.remote_regions);
                }
                (a, b) => prop_assert!(false, "{:?} / {:?}", a.map(|p| ops(&p)), b.map(|p| ops(&p))),
            }
            let whole = Plan::build(&l, None, &l, None).unwrap();
            prop_assert_eq!(ops(&whole), ops(&one_by_one(&l, None, &l, None).unwrap()));
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
            for op in &ops(&p) { for k in 0..op.len { pairs.push((op.local_addr + k, op.remote_addr + k)); } }
            let expect: Vec<_> = lbytes.into_iter().zip(rbytes).collect();
            prop_assert_eq!(pairs, expect);
        }

        /// Lists of strided runs, cut differently on each side: the plan still maps
        /// local byte i to remote byte i exactly once, keeps its runs' invariants, and
        /// expands to copies no two neighbours of which continue each other.
        #[test]
        fn runs_pair_byte_for_byte(
            lruns in prop::collection::vec((1u64..12, 0u64..6, 1u64..7), 1..8),
            rruns in prop::collection::vec((1u64..12, 0u64..6, 1u64..7), 1..8),
        ) {
            // Each side: runs laid out one after another, with gaps of `gap` bytes
            // between members; the shorter side ends with one descriptor making up the
            // difference.
            let build = |runs: &[(u64, u64, u64)], base: u64, pad: u64| {
                let mut list = DescList::new(MemKind::Dram);
                let mut at = base;
                for &(len, gap, count) in runs {
                    list.push_strided(at, len, 0, len + gap, count).unwrap();
                    at += (len + gap) * count + 5;
                }
                if pad > 0 {
                    list.push(Desc { addr: at, len: pad, dev: 0 }).unwrap();
                }
                list
            };
            let total = |runs: &[(u64, u64, u64)]| runs.iter().map(|&(len, _, count)| len * count).sum::<u64>();
            let (lt, rt) = (total(&lruns), total(&rruns));
            let l = build(&lruns, 0, rt.saturating_sub(lt));
            let r = build(&rruns, 1 << 20, lt.saturating_sub(rt));
            let region = |key| move |_: u64, _: u64, _: u64| Ok(RegionSpan { key, start: 0, end: u64::MAX });
            let lp = PreparedList::resolve(&l, region(1)).unwrap();
            let rp = PreparedList::resolve(&r, region(2)).unwrap();
            let p = Plan::build(&lp, None, &rp, None).unwrap();
            for run in p.runs() {
                prop_assert!(run.count >= 1);
                if run.count == 1 {
                    prop_assert_eq!((run.local_stride, run.remote_stride), (run.len, run.len));
                } else {
                    prop_assert!(!(run.local_stride == run.len && run.remote_stride == run.len), "{:?}", run);
                }
            }
            let copies = ops(&p);
            for w in copies.windows(2) {
                prop_assert!(!w[0].continued_by(&w[1]), "{:?} then {:?}", w[0], w[1]);
            }
            let mut pairs = Vec::new();
            for op in &copies { for k in 0..op.len { pairs.push((op.local_addr + k, op.remote_addr + k)); } }
            let bytes = |list: &DescList| list.iter().flat_map(|d| d.addr..d.addr + d.len).collect::<Vec<_>>();
            let expect: Vec<_> = bytes(&l).into_iter().zip(bytes(&r)).collect();
            prop_assert_eq!(pairs, expect);
            prop_assert_eq!(p.bytes, lt.max(rt));
        }

        /// Lists of one descriptor length take the zipping path; it plans the copies the
        /// general pairing plans, in the same runs.
        #[test]
        fn uniform_lists_zip_as_the_general_pairing_pairs(
            lruns in prop::collection::vec((0u64..3, 1u64..7), 1..8),
            rruns in prop::collection::vec((0u64..3, 1u64..7), 1..8),
            shuffled in any::<bool>(),
        ) {
            let count = |runs: &[(u64, u64)]| runs.iter().map(|r| r.1).sum::<u64>();
            let build = |runs: &[(u64, u64)], base: u64, pad: u64, key: u64| {
                let mut list = DescList::new(MemKind::Dram);
                let mut at = base;
                for &(gap, n) in runs {
                    list.push_strided(at, 4, 0, 4 + 4 * gap, n).unwrap();
                    at += (4 + 4 * gap) * n + 8;
                }
                if pad > 0 {
                    list.push_strided(at, 4, 0, 12, pad).unwrap();
                }
                if shuffled {
                    // Singles in a scrambled order: nothing strided left to find.
                    let mut descs: Vec<Desc> = list.iter().collect();
                    let n = descs.len();
                    for i in 0..n { descs.swap(i, (i * 7 + 3) % n); }
                    list = DescList::from_descs(MemKind::Dram, descs).unwrap();
                }
                PreparedList::resolve(&list, |_, _, _| Ok(RegionSpan { key, start: 0, end: u64::MAX })).unwrap()
            };
            let (lc, rc) = (count(&lruns), count(&rruns));
            let l = build(&lruns, 0, rc.saturating_sub(lc), 1);
            let r = build(&rruns, 1 << 20, lc.saturating_sub(rc), 2);
            let zipped = zip_members(&l, &r).expect("lists of one length and total zip");
            let paired = pair(l.runs_as_pieces(), r.runs_as_pieces()).unwrap();
            prop_assert_eq!(zipped.runs(), paired.runs());
            prop_assert_eq!(ops(&zipped), ops(&paired));
            prop_assert_eq!((zipped.bytes, &zipped.local_regions, &zipped.remote_regions), (paired.bytes, &paired.local_regions, &paired.remote_regions));
        }

        /// Lists of mixed lengths: the zip gives up, or plans what the general pairing
        /// plans; it never plans something else.
        #[test]
        fn zipping_gives_up_or_agrees_with_the_general_pairing(
            llens in prop::collection::vec((1u64..3, 1u64..4), 1..8),
            rlens in prop::collection::vec((1u64..3, 1u64..4), 1..8),
        ) {
            let build = |runs: &[(u64, u64)], base: u64, key: u64| {
                let mut list = DescList::new(MemKind::Dram);
                let mut at = base;
                for &(len, n) in runs {
                    list.push_strided(at, 4 * len, 0, 4 * len + 4, n).unwrap();
                    at += (4 * len + 4) * n + 8;
                }
                PreparedList::resolve(&list, |_, _, _| Ok(RegionSpan { key, start: 0, end: u64::MAX })).unwrap()
            };
            let (l, r) = (build(&llens, 0, 1), build(&rlens, 1 << 20, 2));
            let paired = pair(l.runs_as_pieces(), r.runs_as_pieces());
            match zip_members(&l, &r) {
                None => {}
                Some(zipped) => {
                    let paired = paired.expect("what zips pairs");
                    prop_assert_eq!(ops(&zipped), ops(&paired));
                    prop_assert_eq!((zipped.bytes, &zipped.local_regions, &zipped.remote_regions), (paired.bytes, &paired.local_regions, &paired.remote_regions));
                }
            }
        }

        #[test]
        fn chunks_cover_every_byte_once(lens in prop::collection::vec(1u64..10_000, 1..50), chunk in 1u64..5000, max_segs in 1usize..8) {
            let mut a = 0;
            let ops: Vec<Op> = lens.iter().map(|&n| { let o = Op { local_addr: a, local_region: 1, remote_addr: a + 1_000_000, remote_region: 2, len: n }; a += n + 7; o }).collect();
            let chunks = chunk_ops(ops.iter().copied(), chunk, max_segs);
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
