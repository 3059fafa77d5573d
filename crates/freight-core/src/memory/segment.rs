//! Shared segments: host memory backed by a sealed memfd, which same-host peers map and
//! copy into and out of with plain loads and stores. Memory the process already has can
//! be shared in place ([`SharedSegment::share_in_place`]), checked against
//! `/proc/self/maps` ([`super::maps`]) first.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use freight_proto::error::{invalid, Error, Result};

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
        let maps = crate::memory::maps::parse(&maps);
        crate::memory::maps::check_private_anonymous(&maps, start, end)?;
        crate::memory::maps::check_outside_heap(&maps, start, end)?;
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
        if crate::memory::maps::check_covered(&crate::memory::maps::parse(&maps), start, end, "this segment", |l| {
            l.path == name
        })
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
        let maps = crate::memory::maps::parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        crate::memory::maps::check_private_anonymous(&maps, start, addr + len).unwrap();
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
        let line =
            crate::memory::maps::parse(&exe).into_iter().find(|l| l.perms.starts_with("r--p") && !l.path.is_empty());
        if let Some(l) = line {
            let e = SharedSegment::share_in_place(l.start, 4096).unwrap_err().to_string();
            assert!(e.contains("not private anonymous"), "{e}");
        }
    }
}
