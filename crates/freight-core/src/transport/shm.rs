//! The shm transport: a same-host peer's shared segments are mapped into this process
//! once (their pages mapped ahead of use by a thread of their own), and a transfer is
//! plain memcpy between local memory and those mappings (large requests with stores
//! that bypass the caches, [`crate::memcopy`]), on the caller's thread for small
//! requests and split over a pool of copy threads for large ones.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::thread;

use parking_lot::Mutex;

use crate::fault::Guard;
use crate::memory::SharedSegment;
use crate::tracker::{Finisher, Tracker};
use crate::transport::pool::{CopyPool, Task};
use freight_proto::error::{Error, Result};
use freight_proto::op::OpKind;
use freight_proto::plan::Plan;
use freight_proto::region::{RegionInfo, SharedLocation};

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
        let inline_bytes = if freight_host::poll::polling_pays() { 512 << 10 } else { 4 << 20 };
        ShmConfig { threads: cores.clamp(1, 8), inline_bytes, min_piece: 256 << 10 }
    }
}

/// A peer's segment mapped into this process, watched for faults (see [`crate::fault`]).
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    guard: Guard,
    /// The thread mapping its pages ahead, where one was started.
    populating: std::sync::OnceLock<Arc<Populating>>,
}

unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // The populating thread leaves the range before it is unmapped (at most one
        // chunk's wait): what is mapped there next is not its to fault in.
        if let Some(p) = self.populating.get() {
            p.stop();
        }
        // Unwatched before it is unmapped: what is mapped there next is not the peer's.
        self.guard.release();
        if freight_cuda::pinned::any() {
            freight_cuda::pinned::release(freight_cuda::pinned::Owner::Memory(self.addr()));
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

    /// Whether an access to the mapping faulted (the peer's memory went away under it):
    /// since then it holds zeros, and whatever used it must fail (see [`crate::fault`]).
    pub fn faulted(&self) -> bool {
        self.guard.faulted()
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
        // Seals first: once they hold, the size read next stays what it is.
        check_sealed(file.as_raw_fd()).map_err(unavailable)?;
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
        Mapping::map_file(&file, len as usize).map_err(|e| unavailable(e.to_string()))
    }

    /// Maps `len` bytes of `file`, shared, read/write, watched for faults. The mapping
    /// outlives the descriptor.
    fn map_file(file: &impl std::os::fd::AsRawFd, len: usize) -> std::io::Result<Mapping> {
        // SAFETY: maps a file the caller holds open; the result is checked.
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
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr as *mut u8,
            len,
            guard: Guard::watch(ptr as *mut u8, len),
            populating: std::sync::OnceLock::new(),
        })
    }
}

/// Maps every page of a fresh mapping of a peer's segment, on a thread of its own: the
/// pages are in memory already (the peer's), but this process has no page table entries
/// for them until it touches each, and a copy that touches them first takes a fault
/// per page (a 32 MiB load of blocks read for the first time took 5.9 ms on a 2-CPU VM,
/// 4.3 ms once read before). `madvise` maps them in a fraction of that, from a thread
/// that holds nobody up (2 GiB in about 0.15 s there), chunk by chunk. The thread holds
/// no reference to the mapping: dropping the mapping stops it between two chunks and
/// waits for the chunk in progress, so it is unmapped with its last holder, as before,
/// and the thread never touches the range after. On kernels before 5.14 (no
/// `MADV_POPULATE_READ`) pages are mapped at first touch, as before.
fn populate_in_background(mapping: &Mapping) {
    let state = Arc::new(Populating::default());
    if mapping.populating.set(state.clone()).is_err() {
        return; // started already
    }
    let (start, len) = (mapping.ptr as usize, mapping.len);
    let spawned = std::thread::Builder::new().name("freight-populate".into()).spawn(move || {
        let started = std::time::Instant::now();
        let mut error = None;
        let mut at = 0;
        while at < len {
            let _inside = state.busy.lock();
            if state.stopped.load(Ordering::Acquire) {
                break;
            }
            let n = (len - at).min(POPULATE_CHUNK);
            // SAFETY: a range of the mapping, which cannot be unmapped while this thread
            // holds `busy` without having seen `stopped`; POPULATE_READ only faults pages
            // in (shared memory: no copy, no new page).
            if unsafe { libc::madvise((start + at) as *mut libc::c_void, n, libc::MADV_POPULATE_READ) } != 0 {
                error = Some(std::io::Error::last_os_error().to_string());
                break;
            }
            at += n;
        }
        tracing::debug!(
            len,
            populated = at,
            us = started.elapsed().as_micros() as u64,
            error,
            "populated a peer mapping"
        );
    });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "no thread to populate a peer mapping: its pages map at first touch");
    }
}

/// Bytes populated at a time: the longest a mapping's drop waits for the thread.
const POPULATE_CHUNK: usize = 32 << 20;

/// What a mapping and the thread populating it share.
#[derive(Default)]
struct Populating {
    stopped: std::sync::atomic::AtomicBool,
    /// Held by the thread while it works on a chunk.
    busy: Mutex<()>,
}

impl Populating {
    /// Once this returns the thread no longer touches the mapping.
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        drop(self.busy.lock());
    }
}

/// Refuses a peer's file unless it is shared memory (tmpfs: not hugetlbfs, whose pages
/// may run out at a fault, nor any other file system) sealed at its size
/// ([`crate::memory::segment::SEALS`]): otherwise its owner could shrink it while this process
/// maps it, and the next access here would fault.
fn check_sealed(fd: libc::c_int) -> std::result::Result<(), String> {
    // SAFETY: fstatfs into a zeroed struct and fcntl, on a descriptor the caller owns.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatfs(fd, &mut fs) } != 0 {
        return Err(format!("fstatfs: {}", std::io::Error::last_os_error()));
    }
    // The field's type differs between libc targets; the magic number fits any of them.
    #[allow(clippy::unnecessary_cast)]
    let tmpfs = fs.f_type as i64 == libc::TMPFS_MAGIC as i64;
    if !tmpfs {
        return Err(format!("it is not plain shared memory (file system type {:#x})", fs.f_type));
    }
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(format!("its seals cannot be read: {}", std::io::Error::last_os_error()));
    }
    if seals & crate::memory::segment::SEALS != crate::memory::segment::SEALS {
        return Err("it is not sealed against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW), so its \
                    owner could pull its pages from under this mapping: refused"
            .into());
    }
    Ok(())
}

/// The shm view of one peer: its segments, mapped on first use and cached.
pub struct ShmPeer {
    /// The peer's name, for errors.
    name: String,
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
    /// Large enough to copy with stores that bypass the caches ([`crate::memcopy`]).
    stream: bool,
    /// The peer's segments the copies go to or come from: kept mapped, and looked at
    /// for faults after each piece.
    maps: Vec<Arc<Mapping>>,
    bytes: u64,
    peer: String,
}

/// (local pointer, remote pointer, length).
type Copy = (usize, usize, usize);

impl ShmPeer {
    pub fn new(name: &str, pid: u32) -> ShmPeer {
        ShmPeer { name: name.to_string(), pid, maps: Mutex::new(HashMap::new()) }
    }

    fn mapping(&self, loc: &SharedLocation) -> Result<Arc<Mapping>> {
        let mut maps = self.maps.lock();
        // A mapping that faulted holds zeros, not the peer's memory: map it afresh (and
        // be refused, where the peer's file is no longer what it was).
        maps.retain(|_, m| !m.faulted());
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
        populate_in_background(&m);
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

    /// Translates a plan's copies, given the peer's regions by key, into pieces of
    /// about equal bytes for the copy threads (one piece where the request is copied on
    /// the posting thread), in one pass.
    pub fn compile(
        &self,
        plan: &Plan,
        region: impl Fn(u64) -> Option<RegionInfo>,
        cfg: &ShmConfig,
    ) -> Result<ShmProgram> {
        let bytes = plan.bytes;
        let inline = bytes <= cfg.inline_bytes;
        let n = if inline { 1 } else { (bytes / cfg.min_piece.max(1)).clamp(1, cfg.threads.max(1) as u64) as usize };
        let target = bytes.div_ceil(n as u64).max(1);
        let mut pieces: Vec<Arc<[Copy]>> = Vec::with_capacity(n);
        let mut piece: Vec<Copy> = Vec::with_capacity(plan.copy_count().div_ceil(n) + 1);
        let mut filled = 0u64;
        let mut maps: Vec<Arc<Mapping>> = Vec::new();
        // The region of the copies before: its key, its range in the peer's addresses,
        // and the base that turns them into ours.
        let mut cached: Option<(u64, std::ops::Range<u64>, usize)> = None;
        for op in plan.copies() {
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
            let (mut local, mut remote, mut len) =
                (op.local_addr as usize, base.wrapping_add(op.remote_addr as usize), op.len);
            // A copy that straddles a piece's end is cut there.
            while len > 0 {
                let take = len.min(target - filled);
                piece.push((local, remote, take as usize));
                (local, remote, len, filled) =
                    (local + take as usize, remote + take as usize, len - take, filled + take);
                if filled == target {
                    pieces.push(Arc::from(std::mem::take(&mut piece)));
                    filled = 0;
                }
            }
        }
        if !piece.is_empty() {
            pieces.push(Arc::from(piece));
        }
        let stream = bytes >= crate::memcopy::STREAM_MIN_BYTES;
        Ok(ShmProgram { pieces, inline, stream, maps, bytes, peer: self.name.clone() })
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

    /// Runs one piece, then fails it where the peer's memory faulted under it (its
    /// bytes were not the peer's: see [`crate::fault`]).
    fn run(&self, copies: &[Copy], op: OpKind) -> Result<()> {
        ShmProgram::copy(copies, op, self.stream);
        match self.maps.iter().find(|m| m.faulted()) {
            None => Ok(()),
            Some(m) => {
                tracing::error!(peer = %self.peer, bytes = m.len(), "the peer's shared memory faulted under a copy");
                Err(Error::PeerDisconnected {
                    peer: self.peer.clone(),
                    reason: format!(
                        "its shared memory ({} bytes mapped) faulted during a copy: the peer took its pages away \
                         (a file shrunk under the mapping?); nothing it held was trusted",
                        m.len()
                    ),
                })
            }
        }
    }

    fn copy(copies: &[Copy], op: OpKind, stream: bool) {
        for &(local, remote, len) in copies {
            let (src, dst) = match op {
                OpKind::Write => (local, remote),
                OpKind::Read => (remote, local),
            };
            // SAFETY: local memory is registered and guarded by the request; remote
            // memory is inside a mapping that this program keeps alive; both ranges were
            // bounds-checked when the plan was prepared.
            unsafe {
                if stream {
                    crate::memcopy::stream(dst as *mut u8, src as *const u8, len)
                } else {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len)
                }
            }
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
            let done = program.run(&program.pieces[0], op);
            fence(Ordering::SeqCst);
            tracker.finish_part(done);
            return Ok(());
        }
        self.submit(program.pieces.iter().map(|piece| {
            let (t, piece, program) = (tracker.clone(), piece.clone(), program.clone());
            Box::new(move || {
                let done = program.run(&piece, op);
                fence(Ordering::SeqCst);
                drop(program);
                t.finish_part(done);
            }) as Task
        }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::time::Duration;

    /// A memfd without seals, as a hostile peer would offer one, filled with `byte`.
    fn unsealed(len: usize, byte: u8) -> OwnedFd {
        // SAFETY: plain syscalls, checked; the descriptor is owned from here.
        unsafe {
            let fd = libc::memfd_create(c"hostile".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            assert!(fd >= 0);
            let file = OwnedFd::from_raw_fd(fd);
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            let fill = vec![byte; len];
            assert_eq!(libc::pwrite(fd, fill.as_ptr().cast(), len, 0), len as isize);
            file
        }
    }

    fn shrink(file: &OwnedFd) {
        // SAFETY: the file is ours.
        assert_eq!(unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(file), 0) }, 0);
    }

    /// The peer's memory vanishes under a copy that the pool runs (inline, and spread
    /// over threads): the request fails naming the peer, and this process lives on.
    #[test]
    fn a_copy_from_peer_memory_that_went_away_fails_that_request_only() {
        for (len, inline) in [(64 << 10, true), (4 << 20, false)] {
            let file = unsealed(len, 9);
            let m = Arc::new(Mapping::map_file(&file, len).unwrap());
            let mut local = vec![0u8; len];
            let pieces: Vec<Arc<[Copy]>> = if inline {
                vec![Arc::from(vec![(local.as_mut_ptr() as usize, m.addr() as usize, len)])]
            } else {
                let half = len / 2;
                let (l, r) = (local.as_mut_ptr() as usize, m.addr() as usize);
                vec![Arc::from(vec![(l, r, half)]), Arc::from(vec![(l + half, r + half, half)])]
            };
            let program = Arc::new(ShmProgram {
                pieces,
                inline,
                stream: !inline,
                maps: vec![m.clone()],
                bytes: len as u64,
                peer: "hostile".into(),
            });
            let pool = CopyPool::new(2).unwrap();
            let run = |program: &Arc<ShmProgram>| {
                let tracker = Arc::new(Tracker::new());
                pool.execute(program, OpKind::Read, &tracker, Box::new(|r| r)).unwrap();
                tracker.wait(Some(Duration::from_secs(20)))
            };
            assert_eq!(run(&program), crate::tracker::Status::Done, "the peer's memory, whole");
            assert!(local.iter().all(|&b| b == 9));
            shrink(&file);
            match run(&program) {
                crate::tracker::Status::Error(Error::PeerDisconnected { peer, reason }) => {
                    assert_eq!(peer, "hostile");
                    assert!(reason.contains("faulted"), "{reason}");
                }
                other => panic!("a copy from vanished memory ended as {other:?}"),
            }
            assert!(m.faulted());
        }
    }

    /// Resident bytes of the mapping at `addr` in this process (its page table entries),
    /// from /proc/self/smaps.
    fn resident(addr: u64) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(line) = lines.next() {
            let start = line.split('-').next().and_then(|a| u64::from_str_radix(a, 16).ok());
            if start != Some(addr) {
                continue;
            }
            for field in lines.by_ref() {
                if let Some(kb) = field.strip_prefix("Rss:") {
                    return kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() << 10;
                }
            }
        }
        panic!("no mapping at {addr:#x} in /proc/self/smaps")
    }

    /// A fresh mapping of a peer's segment gets its page table entries in the background
    /// (a copy that touched each page first would fault on every one); one left alone
    /// has none until touched. A mapping dropped while it is populated is unmapped at
    /// once.
    #[test]
    fn a_fresh_peer_mapping_is_populated_in_the_background() {
        let big = 256 << 20;
        let file = unsealed(big, 1);
        let dropped = Mapping::map_file(&file, big).unwrap();
        populate_in_background(&dropped);
        let at = dropped.addr();
        drop(dropped);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(!maps.lines().any(|l| l.starts_with(&format!("{at:x}-"))), "unmapped with its last holder");

        let len = 8 << 20;
        let file = unsealed(len, 3);
        let untouched = Arc::new(Mapping::map_file(&file, len).unwrap());
        let populated = Arc::new(Mapping::map_file(&file, len).unwrap());
        populate_in_background(&populated);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while resident(populated.addr()) < len as u64 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(resident(populated.addr()), len as u64, "every page of the populated mapping is mapped");
        assert_eq!(resident(untouched.addr()), 0, "the other mapping of the same file maps pages at first touch");
    }

    #[test]
    fn a_faulted_mapping_leaves_the_cache_and_is_not_mapped_again_unsealed() {
        let file = unsealed(1 << 20, 1);
        let m = Arc::new(Mapping::map_file(&file, 1 << 20).unwrap());
        let peer = ShmPeer::new("hostile", std::process::id());
        peer.maps.lock().insert(7, m.clone());
        shrink(&file);
        // SAFETY: the mapping is live; the fault is what is tested.
        unsafe { std::ptr::read_volatile(m.as_ptr().add(4096)) };
        assert!(m.faulted());
        let loc =
            SharedLocation { segment: 7, fd: std::os::fd::AsRawFd::as_raw_fd(&file), segment_len: 1 << 20, offset: 0 };
        assert!(peer.mapping(&loc).is_err(), "the file is not a sealed segment: refused, not cached again");
        assert_eq!(peer.mapped_segments(), 0);
    }

    #[test]
    fn files_without_seals_or_not_in_shared_memory_are_refused() {
        let file = unsealed(4096, 0);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        let e = Mapping::open_fd(std::process::id(), fd, 4096).err().expect("refused");
        assert!(e.to_string().contains("not sealed against shrinking"), "{e}");
        // Sealed against shrinking only: the size may still grow, and segments never do.
        // SAFETY: fcntl on our own descriptor.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        assert!(Mapping::open_fd(std::process::id(), fd, 4096).is_err());
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_GROW) }, 0);
        Mapping::open_fd(std::process::id(), fd, 4096).expect("sealed shared memory maps");
        // A regular file, sealed or not, is no shared memory.
        let path = std::env::temp_dir().join(format!("freight-not-shm-{}", std::process::id()));
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let regular = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let e = Mapping::open_fd(std::process::id(), std::os::fd::AsRawFd::as_raw_fd(&regular), 4096).err().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("not plain shared memory") || e.to_string().contains("sealed"), "{e}");
    }

    #[test]
    fn segments_are_sealed_at_their_size() {
        let seg = SharedSegment::allocate(8192).unwrap();
        // SAFETY: fcntl and ftruncate on the segment's own descriptor.
        let seals = unsafe { libc::fcntl(seg.fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & crate::memory::segment::SEALS, crate::memory::segment::SEALS);
        assert_ne!(seals & libc::F_SEAL_SEAL, 0, "no seal can be added (nor taken) later");
        assert_ne!(unsafe { libc::ftruncate(seg.fd(), 0) }, 0, "a segment cannot shrink");
        assert_ne!(unsafe { libc::ftruncate(seg.fd(), 1 << 20) }, 0, "nor grow");
    }
}
