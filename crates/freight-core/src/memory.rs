//! Memory the engine may touch: kinds, shared segments, and the registry of regions.
//!
//! A peer may read or write only memory its owner registered. The registry answers two
//! questions fast: "which region holds this address range?" (descriptor preparation,
//! remote-access checks) and "is anybody using this region?" (deregistration).
//!
//! A region is either public (listed in the agent's metadata, so every peer may target
//! it) or private (see [`Registry::register_private`]): usable only as the local side of
//! the owner's own transfers, never listed, never served to a peer.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::error::{invalid, Error, Result};

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemKind {
    /// Host memory. `dev` is ignored (0).
    Dram,
    /// GPU memory. `dev` is the CUDA device ordinal.
    Vram,
    /// A file. `addr` is the file offset and `dev` the file descriptor.
    File,
}

impl MemKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MemKind::Dram => "DRAM",
            MemKind::Vram => "VRAM",
            MemKind::File => "FILE",
        }
    }

    /// A kind by name, case-insensitive, surrounding blanks ignored; "HOST"/"CPU" are
    /// DRAM and "GPU"/"CUDA" VRAM. The only list of these names (Python asks here).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "DRAM" | "HOST" | "CPU" => Ok(MemKind::Dram),
            "VRAM" | "GPU" | "CUDA" => Ok(MemKind::Vram),
            "FILE" => Ok(MemKind::File),
            _ => Err(invalid(format!("unknown memory kind {s:?} (expected DRAM, VRAM or FILE)"))),
        }
    }
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// ---------------------------------------------------------------------------------------
// Shared segments: host memory that same-host peers can map (memfd, MAP_SHARED).
// ---------------------------------------------------------------------------------------

/// Host memory backed by a memfd so that same-host peers can map it and copy with plain
/// loads and stores. Allocate with [`SharedSegment::allocate`]; it is freed when the last
/// handle drops (peers that mapped it keep their mapping, never anyone else's memory).
pub struct SharedSegment {
    id: u64,
    fd: libc::c_int,
    ptr: *mut u8,
    len: usize,
    /// Whether the mapping is this segment's to unmap: false for memory shared in place
    /// ([`SharedSegment::share_in_place`]), whose allocator frees it (and which goes
    /// back to private memory when the segment ends).
    owns_mapping: bool,
}

// The segment owns a plain mapping; concurrent access is the users' contract, as for
// any buffer handed to the engine.
unsafe impl Send for SharedSegment {}

impl fmt::Debug for SharedSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedSegment").field("id", &self.id).field("addr", &self.ptr).field("len", &self.len).finish()
    }
}
unsafe impl Sync for SharedSegment {}

/// Where a region lives inside a shared segment, as a peer needs it to map the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedLocation {
    pub segment: u64,
    pub fd: i32,
    pub segment_len: u64,
    /// Offset of the region's first byte inside the segment.
    pub offset: u64,
}

/// The seals every shared segment carries, and a peer's must carry to be mapped: its
/// size can neither shrink (which would take pages from under a mapping: a fault on the
/// next access) nor grow.
pub const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

fn segment_table() -> &'static Mutex<BTreeMap<u64, std::sync::Weak<SharedSegment>>> {
    static TABLE: OnceLock<Mutex<BTreeMap<u64, std::sync::Weak<SharedSegment>>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// A new memfd of `len` bytes, sealed at that size, and the segment id it is named by.
fn sealed_memfd(len: usize) -> Result<(u64, libc::c_int)> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = std::ffi::CString::new(SharedSegment::memfd_name(id)).expect("no NUL");
    // SAFETY: plain syscalls on a fresh descriptor; every failure is checked.
    unsafe {
        let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        if fd < 0 {
            return Err(Error::Io(format!("memfd_create: {}", std::io::Error::last_os_error())));
        }
        let fail = |what: String| {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            Err(Error::Io(format!("{what}: {e}")))
        };
        if libc::ftruncate(fd, len as libc::off_t) != 0 {
            return fail(format!("ftruncate({len})"));
        }
        if libc::fcntl(fd, libc::F_ADD_SEALS, SEALS | libc::F_SEAL_SEAL) != 0 {
            return fail("sealing a shared segment (fcntl F_ADD_SEALS)".into());
        }
        Ok((id, fd))
    }
}

impl SharedSegment {
    /// Allocates `len` bytes of zeroed, page-aligned, shareable host memory.
    ///
    /// The memfd is sealed at its size (`F_SEAL_SHRINK`, `F_SEAL_GROW`, then
    /// `F_SEAL_SEAL`): a peer that maps it can rely on every page staying there, and
    /// peers refuse to map a segment without those seals (see `transport::shm`), so a
    /// process that would pull its memory away from under a peer's mapping cannot
    /// offer it.
    pub fn allocate(len: usize) -> Result<Arc<SharedSegment>> {
        if len == 0 {
            return Err(invalid("cannot allocate a zero-length shared segment"));
        }
        let (id, fd) = sealed_memfd(len)?;
        // SAFETY: a fresh mapping of a descriptor we own; failure is checked.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: ours, unused.
            unsafe { libc::close(fd) };
            return Err(Error::Io(format!("mmap({len}): {e}")));
        }
        Ok(SharedSegment::publish(SharedSegment { id, fd, ptr: ptr as *mut u8, len, owns_mapping: true }))
    }

    /// Lays a shared segment under memory this process already has, keeping its bytes:
    /// the pages that hold `[addr, addr+len)` become pages of a sealed memfd, mapped at
    /// the same addresses, so every pointer into them (a tensor's, its views') stays
    /// valid and same-host peers can now map them (shm) where before only tcp reached
    /// them. The memory's allocator still owns the range and frees it as before; the
    /// segment never unmaps it.
    ///
    /// When the segment ends (the last handle and registration gone) the pages that
    /// are still its mapping go back to private memory, bytes kept, so that the range is
    /// what it was before (a `fork` copies it again instead of sharing it with the
    /// child); as for the sharing, nothing may write the range meanwhile.
    ///
    /// Whole pages are shared: the bytes before `addr` in its page and after `addr+len`
    /// in its page go with them, and a peer that maps the segment can read and write
    /// them. For a large allocation of its own (glibc and tcmalloc give those their own
    /// pages) that is the allocator's bookkeeping of this very allocation; share only
    /// what owns its pages: the process heap (`[heap]`), where small allocations sit
    /// side by side, is refused (sharing a page of it would race every thread that
    /// allocates beside the range, and hand peers the allocator's bookkeeping). Every
    /// page must be private, writable, anonymous memory of this process
    /// (`/proc/self/maps` is checked); a range already inside a shared
    /// segment gets that segment, one that overlaps a segment partly is refused. Call it
    /// while nothing else writes the range: a write between the copy and the remap
    /// would be lost.
    pub fn share_in_place(addr: u64, len: u64) -> Result<Arc<SharedSegment>> {
        if len == 0 || addr == 0 {
            return Err(invalid("cannot share a zero-length range or address 0 in place"));
        }
        let end = addr.checked_add(len).ok_or_else(|| invalid("the range wraps around the address space"))?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let start = addr & !(page - 1);
        let end = end.div_ceil(page) * page;
        let size = (end - start) as usize;
        if let Some(seg) = SharedSegment::containing(addr, len) {
            return Ok(seg); // shared already: nothing to do
        }
        {
            let table = segment_table().lock();
            if let Some((&at, _)) = table
                .range(..end)
                .next_back()
                .filter(|(_, w)| w.upgrade().is_some_and(|s| s.addr() + s.len() as u64 > start))
            {
                return Err(invalid(format!(
                    "[{addr:#x}, +{len}) overlaps the shared segment at {at:#x} without being inside it: share \
                     memory that meets another shared range inside a page together with it, in one call"
                )));
            }
        }
        let maps = std::fs::read_to_string("/proc/self/maps")
            .map_err(|e| Error::Io(format!("reading /proc/self/maps: {e}")))?;
        let maps = crate::maps::parse(&maps);
        crate::maps::check_private_anonymous(&maps, start, end)?;
        crate::maps::check_outside_heap(&maps, start, end)?;
        let (id, fd) = sealed_memfd(size)?;
        // A piece at a time, so that the copy never holds more than a piece twice.
        const PIECE: usize = 64 << 20;
        let mut off = 0usize;
        while off < size {
            let n = PIECE.min(size - off);
            // SAFETY: the copy goes through a fresh mapping of our own descriptor; the
            // range was just checked to be mapped, readable and writable. MAP_FIXED then
            // replaces exactly those pages, atomically, with the copy. Should it fail
            // halfway, the pages replaced so far hold their bytes still.
            unsafe {
                let fail = |what: String| {
                    let e = std::io::Error::last_os_error();
                    libc::close(fd);
                    Err(Error::Io(format!("{what}: {e}")))
                };
                let copy = libc::mmap(
                    std::ptr::null_mut(),
                    n,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    off as libc::off_t,
                );
                if copy == libc::MAP_FAILED {
                    return fail(format!("mmap({n})"));
                }
                let here = (start as usize + off) as *mut libc::c_void;
                std::ptr::copy_nonoverlapping(here as *const u8, copy as *mut u8, n);
                libc::munmap(copy, n);
                // Populated: the copy allocated every page, and without their page table
                // entries each first access here faults (a KV cache written into blocks
                // it never used before would pay that in every transfer).
                let flags = libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE;
                let at = libc::mmap(here, n, libc::PROT_READ | libc::PROT_WRITE, flags, fd, off as libc::off_t);
                if at == libc::MAP_FAILED {
                    return fail(format!("mmap(MAP_FIXED at {here:p}, {n})"));
                }
            }
            off += n;
        }
        tracing::debug!(addr = start, len = size, segment = id, "host memory shared in place");
        Ok(SharedSegment::publish(SharedSegment { id, fd, ptr: start as *mut u8, len: size, owns_mapping: false }))
    }

    /// Memory shared in place goes back to private pages, bytes kept, where it is still
    /// this segment's mapping (its allocator may have unmapped it, or mapped something
    /// else there since: then it is left alone).
    fn unshare(&self) {
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
        let name = format!("/memfd:{} (deleted)", SharedSegment::memfd_name(self.id));
        let (start, end) = (self.addr(), self.addr() + self.len as u64);
        if crate::maps::check_covered(&crate::maps::parse(&maps), start, end, "this segment", |l| l.path == name)
            .is_err()
        {
            tracing::debug!(segment = self.id, "memory shared in place is not mapped there any more");
            return;
        }
        const PIECE: usize = 64 << 20;
        let mut off = 0usize;
        while off < self.len {
            let n = PIECE.min(self.len - off);
            // SAFETY: [here, here+n) was just seen to be this segment's mapping. The copy
            // goes to fresh private pages, which mremap then moves over it, atomically.
            unsafe {
                let here = self.ptr.add(off) as *mut libc::c_void;
                let prot = libc::PROT_READ | libc::PROT_WRITE;
                let fresh = libc::mmap(std::ptr::null_mut(), n, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
                if fresh == libc::MAP_FAILED {
                    tracing::warn!(segment = self.id, "memory shared in place stays shared: mmap failed");
                    return;
                }
                std::ptr::copy_nonoverlapping(here as *const u8, fresh as *mut u8, n);
                let moved = libc::mremap(fresh, n, n, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, here);
                if moved == libc::MAP_FAILED {
                    libc::munmap(fresh, n);
                    tracing::warn!(segment = self.id, "memory shared in place stays shared: mremap failed");
                    return;
                }
            }
            off += n;
        }
    }

    /// Lists a new segment where [`SharedSegment::containing`] finds it.
    fn publish(seg: SharedSegment) -> Arc<SharedSegment> {
        let seg = Arc::new(seg);
        segment_table().lock().insert(seg.addr(), Arc::downgrade(&seg));
        seg
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The name of segment `id`'s memfd. Ids are never reused within a process, so in
    /// the owner's `/proc/<pid>/fd/` it names exactly one segment: a peer checks it before
    /// mapping a descriptor (see `transport::shm`), whose number the owner may have given
    /// to another segment since.
    pub fn memfd_name(id: u64) -> String {
        format!("freight-seg-{id}")
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// The live segment of this process that contains `[addr, addr+len)`, if any.
    pub fn containing(addr: u64, len: u64) -> Option<Arc<SharedSegment>> {
        let table = segment_table().lock();
        let (_, weak) = table.range(..=addr).next_back()?;
        let seg = weak.upgrade()?;
        (addr + len <= seg.addr() + seg.len as u64).then_some(seg)
    }
}

impl Drop for SharedSegment {
    fn drop(&mut self) {
        let mut table = segment_table().lock();
        if table.get(&self.addr()).is_some_and(|w| w.strong_count() == 0) {
            table.remove(&self.addr());
        }
        drop(table);
        if !self.owns_mapping {
            self.unshare();
        }
        // SAFETY: we own the descriptor, and the mapping where `owns_mapping` says so.
        unsafe {
            if self.owns_mapping {
                libc::munmap(self.ptr as *mut libc::c_void, self.len);
            }
            libc::close(self.fd);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Regions and the registry.
// ---------------------------------------------------------------------------------------

/// What a peer needs to know about one registered region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub key: u64,
    pub kind: MemKind,
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
    /// Present when the region lies in a shared segment that same-host peers can map.
    pub shared: Option<SharedLocation>,
    /// Present for GPU memory exported to same-host peers (CUDA IPC).
    pub gpu: Option<GpuLocation>,
    /// Peers may read it but not write it (see [`Access::ReadOnly`]).
    pub read_only: bool,
}

/// Who may do what with a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Peers read and write it; it is the local side of any transfer.
    #[default]
    Shared,
    /// Peers only read it, and this agent's own READs never land in it: memory that
    /// must not change (an immutable buffer, a read-only mapping, which a write would
    /// fault on). A peer's WRITE into it is refused at the peer, and again here by the
    /// transports that serve remote accesses.
    ReadOnly,
    /// No peer may use it: this agent's local side only (see [`Registry::register_private`]).
    Private,
}

/// What a same-host peer needs to map a registered GPU region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLocation {
    /// PCI bus id of the GPU that holds the memory ("0000:1b:00.0").
    pub bus_id: String,
    /// The allocation the region lies in: the IPC handle names it.
    pub alloc_base: u64,
    pub alloc_len: u64,
    /// `cuIpcGetMemHandle` of the allocation (64 opaque bytes), or empty where the
    /// allocation cannot be exported (see [`GpuLocation::exportable`]).
    pub handle: Vec<u8>,
}

impl GpuLocation {
    /// Whether same-host peers can map the allocation. Memory from a stream-ordered
    /// pool (`cudaMallocAsync`) or the VMM API (PyTorch's expandable segments) has no
    /// IPC handle: peers then reach it through staging (tcp), not the cuda transport.
    pub fn exportable(&self) -> bool {
        !self.handle.is_empty()
    }
}

impl RegionInfo {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// Fails where `[addr, addr+len)` of this region would be written by a transfer
    /// that must not write it.
    pub fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::InvalidArgument(format!(
                "region {} at {:#x} is registered read-only: no transfer may write into it",
                self.key, self.addr
            )));
        }
        Ok(())
    }

    /// Checks that `[addr, addr+len)` lies inside this region.
    pub fn check_contains(&self, addr: u64, len: u64) -> Result<()> {
        match addr.checked_add(len) {
            Some(end) if addr >= self.addr && end <= self.end() => Ok(()),
            _ => Err(Error::OutOfBounds { addr, len, region_addr: self.addr, region_len: self.len }),
        }
    }
}

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
        let tree = inner.index.entry((kind, dev)).or_default();
        if let Some(existing) = overlapping(tree, addr, len) {
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
            let (start, end) = (s.addr(), s.addr() + s.len() as u64);
            if let Some((_, other)) = tree
                .range(start..end)
                .find(|(_, r)| r.private != private && r.info.shared.is_some_and(|l| l.segment == s.id()))
            {
                tracing::warn!(
                    key,
                    other = other.info.key,
                    segment = s.id(),
                    "a private and a public region share a shared segment: peers that may map the \
                     public one can map the private one too; give private memory a segment of its own"
                );
            }
        }
        let region = Arc::new(Region {
            info: RegionInfo { key, kind, addr, len, dev, shared, gpu, read_only: access == Access::ReadOnly },
            private,
            _segment: segment,
        });
        tree.insert(addr, region.clone());
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

/// Read-only index of a peer's regions, built from its metadata.
#[derive(Debug, Default, Clone)]
pub struct RemoteRegions {
    index: HashMap<(MemKind, u64), BTreeMap<u64, RegionInfo>>,
    by_key: HashMap<u64, RegionInfo>,
}

impl RemoteRegions {
    pub fn new(regions: &[RegionInfo]) -> Self {
        let mut index: HashMap<(MemKind, u64), BTreeMap<u64, RegionInfo>> = HashMap::new();
        let mut by_key = HashMap::with_capacity(regions.len());
        for r in regions {
            index.entry((r.kind, r.dev)).or_default().insert(r.addr, r.clone());
            by_key.insert(r.key, r.clone());
        }
        RemoteRegions { index, by_key }
    }

    pub fn find(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<&RegionInfo> {
        let dev = if kind == MemKind::Dram { 0 } else { dev };
        let region = self
            .index
            .get(&(kind, dev))
            .and_then(|tree| tree.range(..=addr).next_back())
            .map(|(_, r)| r)
            .filter(|r| addr < r.end())
            .ok_or_else(|| Error::NotRegistered { kind: kind.to_string(), addr, len, dev })?;
        region.check_contains(addr, len)?;
        Ok(region)
    }

    pub fn get(&self, key: u64) -> Option<&RegionInfo> {
        self.by_key.get(&key)
    }

    pub fn contains(&self, key: u64) -> bool {
        self.by_key.contains_key(&key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &RegionInfo> {
        self.by_key.values()
    }

    /// Forgets a region the owner revoked.
    pub fn remove(&mut self, key: u64) {
        if let Some(r) = self.by_key.remove(&key) {
            if let Some(tree) = self.index.get_mut(&(r.kind, r.dev)) {
                tree.remove(&r.addr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_shared_in_place_keeps_its_bytes_and_addresses_and_a_second_mapping_sees_it() {
        // Larger than a piece of the copy, and starting and ending inside a page.
        let mut v: Vec<u8> = (0..(70u32 << 20) + 77).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let want = v.clone();
        let (addr, len) = (v.as_ptr() as u64 + 5, v.len() as u64 - 9);
        let seg = SharedSegment::share_in_place(addr, len).unwrap();
        assert!(seg.addr() <= addr && seg.addr() + seg.len() as u64 >= addr + len && seg.addr().is_multiple_of(4096));
        assert!(v == want, "bytes changed by sharing in place");
        assert!(Arc::ptr_eq(&SharedSegment::containing(addr, len).unwrap(), &seg));
        // What this process writes is in the memfd that peers map.
        v[12345] ^= 0xff;
        let file = std::fs::File::open(format!("/proc/self/fd/{}", seg.fd())).unwrap();
        let mut byte = [0u8; 1];
        use std::os::unix::fs::FileExt;
        file.read_exact_at(&mut byte, v.as_ptr() as u64 + 12345 - seg.addr()).unwrap();
        assert_eq!(byte[0], v[12345]);
        // Inside it: the same segment; across its end: refused.
        assert!(Arc::ptr_eq(&SharedSegment::share_in_place(addr + 4096, 10).unwrap(), &seg));
        let e = SharedSegment::share_in_place(seg.addr() + seg.len() as u64 - 10, 8192).unwrap_err().to_string();
        assert!(e.contains("overlaps the shared segment"), "{e}");
        let start = seg.addr();
        drop(seg);
        // The allocator still owns the pages: they stay mapped, hold their bytes, and
        // are private memory again.
        assert_eq!(v[12345], want[12345] ^ 0xff);
        v[12345] ^= 0xff;
        assert!(v == want);
        assert!(SharedSegment::containing(addr, len).is_none());
        let maps = crate::maps::parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        crate::maps::check_private_anonymous(&maps, start, addr + len).unwrap();
        // ... which can be shared again.
        drop(SharedSegment::share_in_place(addr, len).unwrap());
        drop(v);
    }

    #[test]
    fn sharing_in_place_refuses_segments_unmapped_and_empty_ranges() {
        let seg = SharedSegment::allocate(1 << 20).unwrap();
        assert!(Arc::ptr_eq(&SharedSegment::share_in_place(seg.addr(), 4096).unwrap(), &seg));
        assert!(SharedSegment::share_in_place(0, 4096).is_err());
        assert!(SharedSegment::share_in_place(0x1000, 0).is_err());
        let e = SharedSegment::share_in_place(0x1000, 4096).unwrap_err().to_string();
        assert!(e.contains("not mapped"), "{e}");
        // A read-only file mapping of this process (its own executable).
        let exe = std::fs::read_to_string("/proc/self/maps").unwrap();
        let line = crate::maps::parse(&exe).into_iter().find(|l| l.perms.starts_with("r--p") && !l.path.is_empty());
        if let Some(l) = line {
            let e = SharedSegment::share_in_place(l.start, 4096).unwrap_err().to_string();
            assert!(e.contains("not private anonymous"), "{e}");
        }
    }

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
