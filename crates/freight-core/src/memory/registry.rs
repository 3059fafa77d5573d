//! The registry of regions an agent registered.
//!
//! A peer may read or write only memory its owner registered. The registry answers two
//! questions fast: "which region holds this address range?" (descriptor preparation,
//! remote-access checks) and "is anybody using this region?" (deregistration).
//!
//! A region is either public (listed in the agent's metadata, so every peer may target
//! it) or private (see [`Registry::register_private`]): usable only as the local side of
//! the owner's own transfers, never listed, never served to a peer.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use freight_proto::desc::DescList;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::plan::{PreparedList, RegionSpan};
use freight_proto::region::{Access, GpuLocation, MemKind, RegionInfo, SharedLocation};

use super::segment::SharedSegment;

/// A registered region. In-flight transfers hold an `Arc<Region>` (a "guard"): while any
/// exists, deregistration fails with [`Error::RegionBusy`].
#[derive(Debug)]
pub struct Region {
    /// What a peer would be told about the region (never told for a private one).
    pub info: RegionInfo,
    /// Private: local side of the owner's own transfers only. Kept here, not in the
    /// serialized [`RegionInfo`], which is what goes to peers.
    private: bool,
    /// Keeps a shared segment alive while it is registered.
    _segment: Option<Arc<SharedSegment>>,
}

impl Region {
    /// Whether the region is private (see [`Registry::register_private`]).
    pub fn is_private(&self) -> bool {
        self.private
    }
}

/// How many public and private regions a shared segment holds.
#[derive(Default, Clone, Copy)]
struct SegmentUse {
    public: usize,
    private: usize,
}

impl SegmentUse {
    fn count(&mut self, private: bool) -> &mut usize {
        if private {
            &mut self.private
        } else {
            &mut self.public
        }
    }
}

/// Lookup index: (kind, dev) -> start address -> region.
type Index = HashMap<(MemKind, u64), BTreeMap<u64, Arc<Region>>>;

/// The regions an agent registered. Reads (lookups) vastly outnumber writes.
#[derive(Default)]
pub struct Registry {
    inner: RwLock<RegistryInner>,
    next_key: AtomicU64,
}

#[derive(Default)]
struct RegistryInner {
    index: Index,
    by_key: HashMap<u64, Arc<Region>>,
    /// Regions registered in each shared segment, public and private (by segment id):
    /// answers "does this segment mix private and public regions?" without walking the
    /// segment's regions on every registration.
    in_segment: HashMap<u64, SegmentUse>,
    /// Bumped on every change to the public regions (what [`Registry::snapshot`] lists)
    /// so that metadata snapshots can be cached. Private regions never change the
    /// snapshot, so registering or removing one leaves it as it is.
    generation: u64,
}

impl Registry {
    pub fn new() -> Self {
        Registry { inner: RwLock::default(), next_key: AtomicU64::new(1) }
    }

    /// Registers `[addr, addr+len)` of `kind` on `dev` and returns its key.
    pub fn register(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<u64> {
        self.register_gpu(kind, addr, len, dev, None, Access::Shared)
    }

    /// Registers a private region: memory this agent uses only as the local side of its
    /// own transfers (say, a server's pool that it writes into clients' buffers and reads
    /// clients' buffers into, but that no client may touch). It is left out of
    /// [`Registry::snapshot`], so peers never learn its key, address, shared segment or
    /// GPU allocation, and [`Registry::get_checked`] refuses it exactly as a key that
    /// does not exist, so that a peer that forges or guesses its key cannot even tell
    /// that it exists. Local lookups ([`Registry::find`], [`Registry::get`]) see it as
    /// any other region.
    ///
    /// This is a protocol guarantee, not an OS sandbox: on one host, processes of the
    /// same user can still open a shared segment by its OS name (`/proc/<pid>/fd/<n>`),
    /// and a CUDA IPC handle names a whole allocation. A private region should therefore
    /// live in a segment (or GPU allocation) of its own, never next to public regions
    /// whose metadata hands out the segment.
    pub fn register_private(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<u64> {
        self.register_gpu(kind, addr, len, dev, None, Access::Private)
    }

    /// [`Registry::register`], with the IPC export of GPU memory when there is one, and
    /// who may use the region how (private regions: [`Registry::register_private`]).
    pub fn register_gpu(
        &self,
        kind: MemKind,
        addr: u64,
        len: u64,
        dev: u64,
        gpu: Option<GpuLocation>,
        access: Access,
    ) -> Result<u64> {
        let private = access == Access::Private;
        if len == 0 {
            return Err(invalid("cannot register a zero-length region"));
        }
        if addr.checked_add(len).is_none() {
            return Err(invalid(format!("region [{addr:#x}, +{len}) wraps around the address space")));
        }
        if kind == MemKind::Dram && addr == 0 {
            return Err(invalid("cannot register host memory at address 0"));
        }
        let dev = if kind == MemKind::Dram { 0 } else { dev };
        let segment = (kind == MemKind::Dram).then(|| SharedSegment::containing(addr, len)).flatten();
        let mut inner = self.inner.write();
        if let Some(existing) = inner.index.get(&(kind, dev)).and_then(|tree| overlapping(tree, addr, len)) {
            return Err(Error::Overlap { addr, len, existing });
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let shared = segment.as_ref().map(|s| SharedLocation {
            segment: s.id(),
            fd: s.fd(),
            segment_len: s.len() as u64,
            offset: addr - s.addr(),
        });
        if let Some(s) = &segment {
            // Peers told about a public region in the segment can map all of it.
            let counts = inner.in_segment.get(&s.id()).copied().unwrap_or_default();
            let others = if private { counts.public } else { counts.private };
            if others > 0 {
                let (start, end) = (s.addr(), s.addr() + s.len() as u64);
                let other = inner.index.get(&(kind, dev)).and_then(|tree| {
                    tree.range(start..end)
                        .find(|(_, r)| r.private != private && r.info.shared.is_some_and(|l| l.segment == s.id()))
                        .map(|(_, r)| r.info.key)
                });
                tracing::warn!(
                    key,
                    other,
                    segment = s.id(),
                    "a private and a public region share a shared segment: peers that may map the \
                     public one can map the private one too; give private memory a segment of its own"
                );
            }
            *inner.in_segment.entry(s.id()).or_default().count(private) += 1;
        }
        let region = Arc::new(Region {
            info: RegionInfo { key, kind, addr, len, dev, shared, gpu, read_only: access == Access::ReadOnly },
            private,
            _segment: segment,
        });
        inner.index.entry((kind, dev)).or_default().insert(addr, region.clone());
        inner.by_key.insert(key, region);
        if !private {
            inner.generation += 1;
        }
        tracing::debug!(key, %kind, addr, len, dev, private, "registered region");
        Ok(key)
    }

    /// Removes a region. Fails with [`Error::RegionBusy`] while a transfer holds it.
    pub fn deregister(&self, key: u64) -> Result<()> {
        let mut inner = self.inner.write();
        let region = inner.by_key.get(&key).ok_or(Error::UnknownRegion(key))?;
        // The registry holds two references (index and by_key); anything more is a guard.
        let users = Arc::strong_count(region) - 2;
        if users > 0 {
            return Err(Error::RegionBusy { key, users });
        }
        let (info, private) = (region.info.clone(), region.private);
        inner.by_key.remove(&key);
        if let Some(tree) = inner.index.get_mut(&(info.kind, info.dev)) {
            tree.remove(&info.addr);
        }
        if let Some(segment) = info.shared.map(|l| l.segment) {
            let counts = inner.in_segment.entry(segment).or_default();
            *counts.count(private) -= 1;
            if counts.public + counts.private == 0 {
                inner.in_segment.remove(&segment);
            }
        }
        if !private {
            inner.generation += 1;
        }
        tracing::debug!(key, "deregistered region");
        Ok(())
    }

    /// The region that wholly contains `[addr, addr+len)`, private ones included: for
    /// the local side of this agent's own transfers only.
    pub fn find(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<Arc<Region>> {
        let dev = if kind == MemKind::Dram { 0 } else { dev };
        let inner = self.inner.read();
        let region = inner
            .index
            .get(&(kind, dev))
            .and_then(|tree| tree.range(..=addr).next_back())
            .map(|(_, r)| r)
            .filter(|r| addr < r.info.end())
            .ok_or_else(|| Error::NotRegistered { kind: kind.to_string(), addr, len, dev })?;
        region.info.check_contains(addr, len)?;
        Ok(region.clone())
    }

    /// The public region with `key`, checked to contain `[addr, addr+len)` and, where
    /// the peer would `write` it, to be writable: the check on an access a peer asks
    /// for. A private region is refused exactly as a key that does not exist (same
    /// error, before any bounds check, which would reveal its range).
    pub fn get_checked(&self, key: u64, addr: u64, len: u64, write: bool) -> Result<Arc<Region>> {
        let inner = self.inner.read();
        let region = inner.by_key.get(&key).filter(|r| !r.private).ok_or(Error::UnknownRegion(key))?;
        region.info.check_contains(addr, len)?;
        if write {
            region.info.check_writable()?;
        }
        Ok(region.clone())
    }

    /// The region with `key`, private ones included: for this agent's own use (guards
    /// of its own transfers, deregistration), never to serve a peer (see
    /// [`Registry::get_checked`]).
    pub fn get(&self, key: u64) -> Option<Arc<Region>> {
        self.inner.read().by_key.get(&key).cloned()
    }

    /// The public regions, sorted by key, and the generation they are at: what the
    /// agent's metadata tells peers. Private regions are left out.
    pub fn snapshot(&self) -> (u64, Vec<RegionInfo>) {
        let inner = self.inner.read();
        let mut regions: Vec<RegionInfo> =
            inner.by_key.values().filter(|r| !r.private).map(|r| r.info.clone()).collect();
        regions.sort_by_key(|r| r.key);
        (inner.generation, regions)
    }

    /// The keys of the public regions: those peers may know of.
    pub fn public_keys(&self) -> Vec<u64> {
        self.inner.read().by_key.values().filter(|r| !r.private).map(|r| r.info.key).collect()
    }

    /// Every region, private ones included, sorted by key: for local decisions (which
    /// memory this agent's transfers may start from), never for peers.
    pub fn local_regions(&self) -> Vec<RegionInfo> {
        let inner = self.inner.read();
        let mut regions: Vec<RegionInfo> = inner.by_key.values().map(|r| r.info.clone()).collect();
        regions.sort_by_key(|r| r.key);
        regions
    }

    /// Resolves a list of this agent's memory, private regions included: the local side
    /// of its transfers.
    pub fn prepare(&self, list: &DescList) -> Result<PreparedList> {
        PreparedList::resolve(list, |addr, len, dev| {
            let r = self.find(list.kind(), addr, len, dev)?;
            Ok(RegionSpan { key: r.info.key, start: r.info.addr, end: r.info.end() })
        })
    }

    /// Whether shared segment `segment` holds both public and private regions (which
    /// exposes the private ones to peers that map the segment: registration warns).
    pub fn segment_mixes_access(&self, segment: u64) -> bool {
        self.inner.read().in_segment.get(&segment).is_some_and(|u| u.public > 0 && u.private > 0)
    }

    /// Checks what the registry keeps twice: `by_key` and `index` list the same regions,
    /// and `in_segment` counts exactly the registered regions of each segment (no entry
    /// for a segment without any).
    #[cfg(test)]
    fn check_invariants(&self) {
        let inner = self.inner.read();
        let indexed: usize = inner.index.values().map(BTreeMap::len).sum();
        assert_eq!(indexed, inner.by_key.len());
        let mut counted: HashMap<u64, (usize, usize)> = HashMap::new();
        for r in inner.by_key.values() {
            assert!(Arc::ptr_eq(&inner.index[&(r.info.kind, r.info.dev)][&r.info.addr], r));
            if let Some(l) = r.info.shared {
                let c = counted.entry(l.segment).or_default();
                if r.private {
                    c.1 += 1
                } else {
                    c.0 += 1
                }
            }
        }
        let kept: HashMap<u64, (usize, usize)> =
            inner.in_segment.iter().map(|(&s, u)| (s, (u.public, u.private))).collect();
        assert_eq!(kept, counted);
    }

    pub fn len(&self) -> usize {
        self.inner.read().by_key.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn overlapping(tree: &BTreeMap<u64, Arc<Region>>, addr: u64, len: u64) -> Option<u64> {
    let end = addr + len;
    if let Some((_, before)) = tree.range(..=addr).next_back() {
        if before.info.end() > addr {
            return Some(before.info.key);
        }
    }
    tree.range(addr..end).next().map(|(_, r)| r.info.key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_find_and_bounds() {
        let reg = Registry::new();
        let k = reg.register(MemKind::Dram, 0x1000, 0x1000, 0).unwrap();
        assert_eq!(reg.find(MemKind::Dram, 0x1800, 0x100, 0).unwrap().info.key, k);
        assert!(matches!(reg.find(MemKind::Dram, 0x1f00, 0x200, 0), Err(Error::OutOfBounds { .. })));
        assert!(matches!(reg.find(MemKind::Dram, 0x3000, 1, 0), Err(Error::NotRegistered { .. })));
        assert!(matches!(reg.find(MemKind::Vram, 0x1800, 1, 0), Err(Error::NotRegistered { .. })));
    }

    #[test]
    fn overlaps_are_rejected() {
        let reg = Registry::new();
        reg.register(MemKind::Dram, 0x1000, 0x1000, 0).unwrap();
        assert!(matches!(reg.register(MemKind::Dram, 0x1800, 0x1000, 0), Err(Error::Overlap { .. })));
        assert!(matches!(reg.register(MemKind::Dram, 0x800, 0x1000, 0), Err(Error::Overlap { .. })));
        reg.register(MemKind::Dram, 0x2000, 0x10, 0).unwrap();
        // The same addresses on another GPU are a different region.
        reg.register(MemKind::Vram, 0x1000, 0x1000, 1).unwrap();
    }

    #[test]
    fn busy_region_cannot_be_deregistered() {
        let reg = Registry::new();
        let k = reg.register(MemKind::Dram, 0x1000, 0x1000, 0).unwrap();
        let guard = reg.find(MemKind::Dram, 0x1000, 8, 0).unwrap();
        assert!(matches!(reg.deregister(k), Err(Error::RegionBusy { users: 1, .. })));
        drop(guard);
        reg.deregister(k).unwrap();
        assert!(matches!(reg.deregister(k), Err(Error::UnknownRegion(_))));
        assert!(reg.find(MemKind::Dram, 0x1000, 8, 0).is_err());
    }

    #[test]
    fn bad_registrations() {
        let reg = Registry::new();
        assert!(reg.register(MemKind::Dram, 0x1000, 0, 0).is_err());
        assert!(reg.register(MemKind::Dram, u64::MAX - 4, 16, 0).is_err());
        assert!(reg.register(MemKind::Dram, 0, 16, 0).is_err());
    }

    #[test]
    fn segments_count_their_regions_through_register_and_deregister_cycles() {
        let seg = SharedSegment::allocate(1 << 20).unwrap();
        let reg = Registry::new();
        let public = reg.register(MemKind::Dram, seg.addr(), 4096, 0).unwrap();
        assert!(!reg.segment_mixes_access(seg.id()));
        let private = reg.register_private(MemKind::Dram, seg.addr() + 4096, 4096, 0).unwrap();
        assert!(reg.segment_mixes_access(seg.id()), "a private region beside a public one");
        reg.deregister(public).unwrap();
        assert!(!reg.segment_mixes_access(seg.id()));
        reg.deregister(private).unwrap();
        reg.check_invariants();
        // Many cycles, public and private, in and out of the segment: counts stay exact,
        // and nothing is left once every region is gone.
        let mut keys = Vec::new();
        for i in 0..2000u64 {
            let addr = seg.addr() + (i % 256) * 4096;
            if keys.len() == 256 || (i % 3 == 2 && !keys.is_empty()) {
                let k = keys.swap_remove((i as usize * 7) % keys.len());
                reg.deregister(k).unwrap();
            }
            let k = if i % 5 == 0 {
                reg.register_private(MemKind::Dram, addr, 4096, 0)
            } else {
                reg.register(MemKind::Dram, addr, 4096, 0)
            };
            match k {
                Ok(k) => keys.push(k),
                Err(Error::Overlap { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            reg.check_invariants();
        }
        for k in keys {
            reg.deregister(k).unwrap();
        }
        reg.check_invariants();
        assert!(reg.is_empty() && reg.inner.read().in_segment.is_empty());
    }

    #[test]
    fn shared_segments_are_detected() {
        let seg = SharedSegment::allocate(1 << 16).unwrap();
        let reg = Registry::new();
        let k = reg.register(MemKind::Dram, seg.addr() + 4096, 4096, 0).unwrap();
        let info = reg.get(k).unwrap().info.clone();
        let loc = info.shared.expect("inside a shared segment");
        assert_eq!(loc.offset, 4096);
        assert_eq!(loc.segment, seg.id());
    }

    #[test]
    fn read_only_regions_are_read_but_never_written() {
        let reg = Registry::new();
        let ro = reg.register_gpu(MemKind::Dram, 0x1000, 0x1000, 0, None, Access::ReadOnly).unwrap();
        let rw = reg.register(MemKind::Dram, 0x4000, 0x1000, 0).unwrap();
        // Peers learn it, so that they refuse a WRITE before sending one.
        let (_, listed) = reg.snapshot();
        assert_eq!(listed.iter().map(|r| (r.key, r.read_only)).collect::<Vec<_>>(), vec![(ro, true), (rw, false)]);
        assert!(reg.get_checked(ro, 0x1000, 16, false).is_ok());
        let err = reg.get_checked(ro, 0x1000, 16, true).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("read-only")), "{err}");
        assert!(reg.get_checked(rw, 0x4000, 16, true).is_ok());
    }

    #[test]
    fn private_regions_are_local_only() {
        let reg = Registry::new();
        let public = reg.register(MemKind::Dram, 0x1000, 0x1000, 0).unwrap();
        let (gen, listed) = reg.snapshot();
        let private = reg.register_private(MemKind::Dram, 0x4000, 0x1000, 0).unwrap();
        assert_ne!(public, private);
        // Peers' view: unchanged, generation included (a cached metadata blob stays right).
        assert_eq!(reg.snapshot(), (gen, listed.clone()));
        assert_eq!(listed.iter().map(|r| r.key).collect::<Vec<_>>(), vec![public]);
        // Remote accesses: refused exactly like a key that does not exist, even out of bounds.
        assert_eq!(reg.get_checked(private, 0x4000, 16, false).unwrap_err(), Error::UnknownRegion(private));
        assert_eq!(reg.get_checked(private, 0x9000, 1 << 20, false).unwrap_err(), Error::UnknownRegion(private));
        assert_eq!(reg.get_checked(999, 0x4000, 16, false).unwrap_err(), Error::UnknownRegion(999));
        assert!(reg.get_checked(public, 0x1000, 16, false).is_ok());
        // Local use: found like any region, and overlaps are still refused.
        let found = reg.find(MemKind::Dram, 0x4800, 16, 0).unwrap();
        assert_eq!(found.info.key, private);
        assert!(found.is_private() && !reg.get(public).unwrap().is_private());
        drop(found);
        assert!(matches!(reg.register(MemKind::Dram, 0x4800, 0x1000, 0), Err(Error::Overlap { .. })));
        assert!(matches!(reg.register_private(MemKind::Dram, 0x1800, 16, 0), Err(Error::Overlap { .. })));
        assert_eq!(reg.local_regions().iter().map(|r| r.key).collect::<Vec<_>>(), vec![public, private]);
        assert_eq!(reg.len(), 2);
        // Deregistration as usual (busy while guarded), and the peers' view never moved.
        let guard = reg.find(MemKind::Dram, 0x4000, 8, 0).unwrap();
        assert!(matches!(reg.deregister(private), Err(Error::RegionBusy { users: 1, .. })));
        drop(guard);
        reg.deregister(private).unwrap();
        assert_eq!(reg.snapshot(), (gen, listed));
        assert!(reg.find(MemKind::Dram, 0x4000, 8, 0).is_err());
        assert!(matches!(reg.deregister(private), Err(Error::UnknownRegion(_))));
        // Public changes still move the generation.
        reg.deregister(public).unwrap();
        assert!(reg.snapshot().0 > gen);
    }
}
