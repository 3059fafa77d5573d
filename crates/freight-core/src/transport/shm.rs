//! The shm transport: a same-host peer's shared segments are mapped into this process
//! once, and a transfer is plain memcpy between local memory and those mappings, on the
//! caller's thread for small requests and split over a pool of copy threads for large ones.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::thread;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::memory::{RegionInfo, SharedLocation, SharedSegment};
use crate::plan::{split_by_bytes, Op};
use crate::request::{Finisher, Tracker};
use crate::transport::pool::{CopyPool, Task};
use crate::transport::OpKind;

/// Tunables of the shm transport.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Copy threads for large requests.
    pub threads: usize,
    /// Requests up to this size are copied on the posting thread (lowest latency;
    /// default 512 KiB on hosts with 8+ cores, 4 MiB on smaller ones).
    pub inline_bytes: u64,
    /// Pieces handed to copy threads are at least this large.
    pub min_piece: u64,
}

impl Default for ShmConfig {
    fn default() -> Self {
        let cores = thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        // Where copy threads sleep between requests (small hosts, see `crate::poll`),
        // waking one costs as much as copying a few MiB, so more is copied inline there.
        let inline_bytes = if crate::poll::polling_pays() { 512 << 10 } else { 4 << 20 };
        ShmConfig { threads: cores.clamp(1, 8), inline_bytes, min_piece: 256 << 10 }
    }
}

/// A peer's segment mapped into this process.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        if crate::cuda::pinned::any() {
            crate::cuda::pinned::release(crate::cuda::pinned::Owner::Memory(self.addr()));
        }
        // SAFETY: we created this mapping and nobody else unmaps it.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

impl Mapping {
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

    /// Opens the peer's segment through /proc and maps it, once the descriptor it opened
    /// is checked to be exactly that segment's memfd, of exactly its length: the owner
    /// may have freed the segment since its metadata was read and given the descriptor
    /// number to another segment (or file), and a mapping of that would take writes meant
    /// for the old region into unrelated memory. The check is on the file opened, not on
    /// the number, so the owner cannot swap it in between.
    fn open(pid: u32, loc: &SharedLocation) -> Result<Mapping> {
        Mapping::map(pid, loc.fd, loc.segment_len, Some(loc.segment))
    }

    /// Maps the first `len` bytes of the shared segment that process `pid` (of this pid
    /// namespace) holds open as descriptor `fd`, read/write. Whatever file the number
    /// names now is mapped, if it is long enough: callers that know which segment they
    /// expect go through [`ShmPeer`], which checks.
    pub fn open_fd(pid: u32, fd: i32, len: u64) -> Result<Mapping> {
        Mapping::map(pid, fd, len, None)
    }

    /// [`Mapping::open_fd`], refusing a file other than the memfd of `segment` (then of
    /// exactly `len` bytes) where one is given.
    fn map(pid: u32, fd: i32, len: u64, segment: Option<u64>) -> Result<Mapping> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let path = format!("/proc/{pid}/fd/{fd}");
        let unavailable = |why: String| Error::TransportUnavailable(format!("cannot map {path}: {why}"));
        if len == 0 || usize::try_from(len).is_err() {
            return Err(unavailable(format!("{len} bytes cannot be mapped")));
        }
        let cpath = std::ffi::CString::new(path.clone()).expect("no NUL");
        // SAFETY: a plain syscall; the result is checked, and owned (closed) from here.
        let file = unsafe {
            let raw = libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if raw < 0 {
                return Err(unavailable(std::io::Error::last_os_error().to_string()));
            }
            OwnedFd::from_raw_fd(raw)
        };
        if let Some(id) = segment {
            // What this process now holds open, whatever the peer does with its number.
            let ours = format!("/proc/self/fd/{}", file.as_raw_fd());
            let target = std::fs::read_link(&ours).map_err(|e| unavailable(format!("{ours}: {e}")))?;
            let expected = format!("/memfd:{} (deleted)", SharedSegment::memfd_name(id));
            if target.as_os_str() != expected.as_str() {
                return Err(unavailable(format!(
                    "it is '{}', not shared segment {id} ('{expected}'): the peer freed that segment and \
                     its descriptor now names another file, so the metadata naming it is stale",
                    target.display()
                )));
            }
        }
        // SAFETY: fstat into a zeroed struct, on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
            return Err(unavailable(std::io::Error::last_os_error().to_string()));
        }
        let size = st.st_size as u64;
        if size < len {
            return Err(unavailable(format!("file is smaller than the advertised {len} bytes")));
        }
        if segment.is_some() && size != len {
            // A segment never changes size: another length is another file.
            return Err(unavailable(format!("the segment is {size} bytes, not the advertised {len}")));
        }
        let len = len as usize;
        // SAFETY: maps a file we hold open; the result is checked. The mapping outlives
        // the descriptor, which is closed when `file` drops.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(unavailable(std::io::Error::last_os_error().to_string()));
        }
        Ok(Mapping { ptr: ptr as *mut u8, len })
    }
}

/// The shm view of one peer: its segments, mapped on first use and cached.
pub struct ShmPeer {
    pid: u32,
    maps: Mutex<HashMap<u64, Arc<Mapping>>>,
}

/// A request translated into raw copies (local pointer, pointer into a mapping, length),
/// built once and reused by every post. It keeps its mappings alive.
pub struct ShmProgram {
    /// The copies, already split into the pieces that copy threads run in parallel
    /// (one piece: run inline on the posting thread).
    pieces: Vec<Arc<[Copy]>>,
    inline: bool,
    _maps: Vec<Arc<Mapping>>,
    bytes: u64,
}

/// (local pointer, remote pointer, length).
type Copy = (usize, usize, usize);

impl ShmPeer {
    pub fn new(pid: u32) -> ShmPeer {
        ShmPeer { pid, maps: Mutex::new(HashMap::new()) }
    }

    fn mapping(&self, loc: &SharedLocation) -> Result<Arc<Mapping>> {
        let mut maps = self.maps.lock();
        if let Some(m) = maps.get(&loc.segment) {
            // A segment never changes size: metadata that says otherwise is not about
            // the segment mapped, and its offsets must not be taken into this mapping.
            if m.len() as u64 != loc.segment_len {
                return Err(Error::Metadata(format!(
                    "the peer's segment {} is {} bytes as mapped, but its metadata now says {}",
                    loc.segment,
                    m.len(),
                    loc.segment_len
                )));
            }
            return Ok(m.clone());
        }
        let m = Arc::new(Mapping::open(self.pid, loc)?);
        tracing::debug!(pid = self.pid, segment = loc.segment, len = loc.segment_len, "mapped peer segment");
        maps.insert(loc.segment, m.clone());
        Ok(m)
    }

    /// Lets go of the mappings of the peer's segments that none of `live` (the peer's
    /// regions still registered) lies in: the peer freed them, or will. Called when the
    /// peer revokes regions or its metadata is refreshed. Programs built earlier hold
    /// their mappings (`Arc`), so a copy in flight, or a request made before, keeps its
    /// mapping until it is dropped; only the cache forgets it. Returns how many
    /// mappings the cache dropped.
    pub fn forget_unused<'a>(&self, live: impl IntoIterator<Item = &'a RegionInfo>) -> usize {
        let live: HashSet<u64> = live.into_iter().filter_map(|r| r.shared.map(|l| l.segment)).collect();
        let mut gone = Vec::new();
        self.maps.lock().retain(|segment, m| {
            let keep = live.contains(segment);
            if !keep {
                gone.push((*segment, m.clone()));
            }
            keep
        });
        for (segment, m) in &gone {
            tracing::debug!(pid = self.pid, segment, len = m.len(), "forgot the mapping of a revoked peer segment");
        }
        // Unmapped (where nothing else holds them) outside the lock.
        gone.len()
    }

    /// How many of the peer's segments are mapped (cached) now.
    pub fn mapped_segments(&self) -> usize {
        self.maps.lock().len()
    }

    /// Checks that the peer's shared memory can be mapped at all (used for path reports).
    pub fn probe(&self, region: &RegionInfo) -> Result<()> {
        let loc = region.shared.as_ref().ok_or_else(|| not_shared(region.key))?;
        self.mapping(loc).map(|_| ())
    }

    /// The mapping that holds the peer's region `r`, and the value that turns the peer's
    /// addresses in `r` into ours when added (wrapping: the sum lands in the mapping).
    pub fn remote_base(&self, r: &RegionInfo) -> Result<(Arc<Mapping>, usize)> {
        let loc = r.shared.as_ref().ok_or_else(|| not_shared(r.key))?;
        let m = self.mapping(loc)?;
        if loc.offset.checked_add(r.len).is_none_or(|end| end > m.len() as u64) {
            return Err(Error::Metadata(format!(
                "the peer's region {} ({} bytes at offset {}) does not fit its {}-byte segment",
                r.key,
                r.len,
                loc.offset,
                m.len()
            )));
        }
        let base = (m.ptr as usize + loc.offset as usize).wrapping_sub(r.addr as usize);
        Ok((m, base))
    }

    /// Translates a plan's copies, given the peer's regions by key, and splits them into
    /// pieces for the copy threads.
    pub fn compile(
        &self,
        ops: &[Op],
        region: impl Fn(u64) -> Option<RegionInfo>,
        cfg: &ShmConfig,
    ) -> Result<ShmProgram> {
        let mut copies: Vec<Op> = Vec::with_capacity(ops.len());
        let mut maps: Vec<Arc<Mapping>> = Vec::new();
        // The region of the ops before: its key, its range in the peer's addresses, and
        // the base that turns them into ours.
        let mut cached: Option<(u64, std::ops::Range<u64>, usize)> = None;
        let mut bytes = 0;
        for op in ops {
            let (range, base) = match &cached {
                Some((k, range, base)) if *k == op.remote_region => (range.clone(), *base),
                _ => {
                    let r = region(op.remote_region).ok_or(Error::UnknownRegion(op.remote_region))?;
                    let (m, base) = self.remote_base(&r)?;
                    if !maps.iter().any(|x| Arc::ptr_eq(x, &m)) {
                        maps.push(m);
                    }
                    let range = r.addr..r.addr.saturating_add(r.len);
                    cached = Some((op.remote_region, range.clone(), base));
                    (range, base)
                }
            };
            // Checked when the list was prepared, against the region as known then: the
            // peer's metadata may have changed since, so once more against what is mapped.
            if op.remote_addr < range.start || op.remote_addr.checked_add(op.len).is_none_or(|end| end > range.end) {
                return Err(Error::OutOfBounds {
                    addr: op.remote_addr,
                    len: op.len,
                    region_addr: range.start,
                    region_len: range.end - range.start,
                });
            }
            copies.push(Op { remote_addr: base.wrapping_add(op.remote_addr as usize) as u64, ..*op });
            bytes += op.len;
        }
        let inline = bytes <= cfg.inline_bytes;
        let n = if inline { 1 } else { (bytes / cfg.min_piece.max(1)).clamp(1, cfg.threads.max(1) as u64) as usize };
        let to_copies = |ops: &[Op]| -> Arc<[Copy]> {
            ops.iter().map(|o| (o.local_addr as usize, o.remote_addr as usize, o.len as usize)).collect()
        };
        let pieces = if n == 1 {
            vec![to_copies(&copies)]
        } else {
            split_by_bytes(&copies, n).iter().map(|p| to_copies(p)).collect()
        };
        Ok(ShmProgram { pieces, inline, _maps: maps, bytes })
    }
}

fn not_shared(key: u64) -> Error {
    Error::TransportUnavailable(format!(
        "remote region {key} is not in a shared segment (allocate it with Agent.alloc to use shm)"
    ))
}

impl ShmProgram {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn run(copies: &[Copy], op: OpKind) {
        for &(local, remote, len) in copies {
            let (src, dst) = match op {
                OpKind::Write => (local, remote),
                OpKind::Read => (remote, local),
            };
            // SAFETY: local memory is registered and guarded by the request; remote
            // memory is inside a mapping that this program keeps alive; both ranges were
            // bounds-checked when the plan was prepared.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
        }
    }
}

impl CopyPool {
    /// Runs a program: on this thread if small, else over the pool. Begins the
    /// tracker's round with one part per piece.
    pub fn execute(
        &self,
        program: &Arc<ShmProgram>,
        op: OpKind,
        tracker: &Arc<Tracker>,
        finisher: Finisher,
    ) -> Result<()> {
        tracker.begin(program.pieces.len() as u64, finisher)?;
        if program.inline {
            ShmProgram::run(&program.pieces[0], op);
            fence(Ordering::SeqCst);
            tracker.finish_part(Ok(()));
            return Ok(());
        }
        self.submit(program.pieces.iter().map(|piece| {
            let (t, piece, keep) = (tracker.clone(), piece.clone(), program.clone());
            Box::new(move || {
                ShmProgram::run(&piece, op);
                fence(Ordering::SeqCst);
                drop(keep);
                t.finish_part(Ok(()));
            }) as Task
        }));
        Ok(())
    }
}
