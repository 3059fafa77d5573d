//! Faults in memory a peer shares end as an error for that peer, never as a signal
//! that kills this process.
//!
//! A mapping of another process's memory is only as solid as that process lets it be:
//! a file it shrinks takes the pages from under the mapping, and the next load or store
//! there raises SIGBUS, whose default action ends the process. Seals rule that out for
//! the memory freight maps (a peer's segment or outbox must be sealed against shrinking
//! or it is not mapped at all, see `transport::shm`); this module is the backstop for
//! what seals cannot promise (a page the kernel cannot supply).
//!
//! Every mapping of a peer's memory is listed here while it exists ([`Guard`]). On a
//! SIGBUS raised by an access inside one, the handler lays private zero pages over the
//! whole mapping, which lets the faulting copy finish (reading zeros, writing where
//! nobody looks), and marks the guard faulted. The code that copied looks at the mark
//! after its copies and fails that peer's request or connection; the mapping is then
//! dropped. A SIGBUS anywhere else goes on to the handler installed before this one
//! (or to the default action), as if this one were not there.
//!
//! The handler reads a fixed table with atomic loads and makes at most two system
//! calls (`mmap`, or `sigaction` to hand over), all safe in a signal handler. Each slot
//! is a seqlock, so a slot being reused while a fault is handled is skipped, never read
//! half old and half new.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Peer mappings that can be watched at once. More are mapped unwatched (logged once):
/// seals still protect them.
const SLOTS: usize = 1 << 14;

struct Slot {
    /// Even while the slot is stable, odd while it changes.
    seq: AtomicU64,
    start: AtomicUsize,
    /// 0: the slot is free.
    len: AtomicUsize,
    faulted: AtomicBool,
}

impl Slot {
    // A template for the static table's initializer (each element is its own copy).
    #[allow(clippy::declare_interior_mutable_const)]
    const FREE: Slot = Slot {
        seq: AtomicU64::new(0),
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        faulted: AtomicBool::new(false),
    };

    fn set(&self, start: usize, len: usize) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        self.start.store(start, Ordering::Release);
        self.len.store(len, Ordering::Release);
        self.seq.fetch_add(1, Ordering::AcqRel);
    }

    /// The range watched, unless the slot is free or changing.
    fn range(&self) -> Option<(usize, usize)> {
        let before = self.seq.load(Ordering::Acquire);
        let (start, len) = (self.start.load(Ordering::Acquire), self.len.load(Ordering::Acquire));
        let stable = before & 1 == 0 && self.seq.load(Ordering::Acquire) == before;
        (stable && len != 0).then_some((start, len))
    }
}

static TABLE: [Slot; SLOTS] = [Slot::FREE; SLOTS];
/// Slots ever handed out: the handler looks at these only.
static USED: AtomicUsize = AtomicUsize::new(0);
/// Slots given back, for reuse.
static FREED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Held while the handler is installed, so that two threads never both install it.
static INSTALLING: Mutex<()> = Mutex::new(());
/// The SIGBUS disposition found when ours was installed (again, where something had
/// replaced it), which faults outside peer memory go on to: the handler and its flags.
static FORWARD_TO: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static FORWARD_FLAGS: AtomicUsize = AtomicUsize::new(0);

/// A mapping of a peer's memory, watched for faults as long as this lives. Release it
/// ([`Guard::release`]) before unmapping.
#[derive(Debug)]
pub struct Guard {
    slot: Option<usize>,
}

impl Guard {
    /// Watches `[ptr, ptr+len)`, a mapping of memory another process owns.
    pub fn watch(ptr: *mut u8, len: usize) -> Guard {
        install();
        let slot =
            FREED.lock().unwrap_or_else(|e| e.into_inner()).pop().or_else(|| {
                USED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < SLOTS).then_some(n + 1)).ok()
            });
        match slot {
            Some(i) => {
                TABLE[i].faulted.store(false, Ordering::Release);
                TABLE[i].set(ptr as usize, len);
            }
            None => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    tracing::warn!(
                        most = SLOTS,
                        "more peer mappings than can be watched for faults; seals still guard them"
                    )
                });
            }
        }
        Guard { slot }
    }

    /// Whether an access to the mapping faulted: its contents since are zeros, not the
    /// peer's memory, and whatever used it must fail.
    pub fn faulted(&self) -> bool {
        self.slot.is_some_and(|i| TABLE[i].faulted.load(Ordering::Acquire))
    }

    /// Stops watching (before the mapping is unmapped, so that a fault in whatever is
    /// mapped there next is not taken for the peer's). Idempotent.
    pub fn release(&mut self) {
        if let Some(i) = self.slot.take() {
            TABLE[i].set(0, 0);
            FREED.lock().unwrap_or_else(|e| e.into_inner()).push(i);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.release();
    }
}

/// Installs the handler, or installs it again where something replaced it since (an
/// application that set up its own SIGBUS handler later): the one found is chained.
fn install() {
    let _one = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: sigaction with valid pointers; the handler is async-signal-safe.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut current) != 0
            || current.sa_sigaction == handler_address()
        {
            return;
        }
        FORWARD_FLAGS.store(current.sa_flags as usize, Ordering::Release);
        FORWARD_TO.store(current.sa_sigaction, Ordering::Release);
        let mut ours: libc::sigaction = std::mem::zeroed();
        ours.sa_sigaction = handler_address();
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        libc::sigemptyset(&mut ours.sa_mask);
        if libc::sigaction(libc::SIGBUS, &ours, std::ptr::null_mut()) != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "cannot watch peer memory for faults");
        }
    }
}

fn handler_address() -> usize {
    on_sigbus as *const () as usize
}

/// The slot of a watched mapping that holds `addr`, made private zero pages.
fn absorb(addr: usize) -> bool {
    let used = USED.load(Ordering::Acquire).min(SLOTS);
    for slot in &TABLE[..used] {
        let Some((start, len)) = slot.range() else { continue };
        if addr < start || addr - start >= len {
            continue;
        }
        // SAFETY: replaces pages of a mapping this process made of a peer's memory (the
        // access that faulted holds it mapped) with anonymous ones of the same size.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return false;
        }
        slot.faulted.store(true, Ordering::Release);
        return true;
    }
    false
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo. Only a fault the kernel raised (a
    // positive code) has an address; a SIGBUS sent by a process goes on unexamined.
    let fault = unsafe { (*info).si_code > 0 };
    if fault && absorb(unsafe { (*info).si_addr() } as usize) {
        return;
    }
    forward(sig, info, context);
}

/// Hands a SIGBUS that is not ours to the disposition found before ours.
fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let to = FORWARD_TO.load(Ordering::Acquire);
    let flags = FORWARD_FLAGS.load(Ordering::Acquire) as libc::c_int;
    // SAFETY: `to` is a handler that was installed for SIGBUS, called as it asked to be.
    unsafe {
        if to == libc::SIG_DFL || to == libc::SIG_IGN {
            // Back to the default action: the access faults again when this returns, and
            // the process ends as it would have without this handler. (An ignored
            // SIGBUS from a fault cannot be ignored: the kernel forces the default.)
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
            if (*info).si_code <= 0 {
                libc::raise(sig);
            }
        } else if flags & libc::SA_SIGINFO != 0 {
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(to);
            handler(sig, info, context);
        } else {
            let handler: extern "C" fn(libc::c_int) = std::mem::transmute(to);
            handler(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file mapped shared, which the test then shrinks: what a hostile peer does.
    struct Shrinkable {
        fd: libc::c_int,
        ptr: *mut u8,
        len: usize,
    }

    impl Shrinkable {
        fn new(len: usize) -> Shrinkable {
            // SAFETY: plain syscalls, checked.
            unsafe {
                let fd = libc::memfd_create(c"shrinkable".as_ptr(), libc::MFD_CLOEXEC);
                assert!(fd >= 0);
                assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
                let ptr =
                    libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
                assert_ne!(ptr, libc::MAP_FAILED);
                std::ptr::write_bytes(ptr as *mut u8, 7, len);
                Shrinkable { fd, ptr: ptr as *mut u8, len }
            }
        }

        fn shrink(&self) {
            // SAFETY: the file is ours.
            assert_eq!(unsafe { libc::ftruncate(self.fd, 0) }, 0);
        }
    }

    impl Drop for Shrinkable {
        fn drop(&mut self) {
            // SAFETY: ours.
            unsafe {
                libc::munmap(self.ptr.cast(), self.len);
                libc::close(self.fd);
            }
        }
    }

    #[test]
    fn a_read_from_shrunk_peer_memory_sees_zeros_and_marks_the_guard() {
        let m = Shrinkable::new(1 << 20);
        let mut guard = Guard::watch(m.ptr, m.len);
        let mut out = vec![0u8; m.len];
        // SAFETY: the mapping is live; the fault is what is tested.
        unsafe { std::ptr::copy_nonoverlapping(m.ptr, out.as_mut_ptr(), 4096) };
        assert!(out[..4096].iter().all(|&b| b == 7));
        assert!(!guard.faulted());
        m.shrink();
        unsafe { std::ptr::copy_nonoverlapping(m.ptr.add(8192), out.as_mut_ptr(), m.len - 8192) };
        assert!(guard.faulted(), "the fault was seen");
        assert!(out[..m.len - 8192].iter().all(|&b| b == 0), "zeros, not the peer's bytes");
        // Writes after the fault land in private memory, and fault no more.
        unsafe { std::ptr::write_bytes(m.ptr, 1, m.len) };
        guard.release();
        assert!(!guard.faulted());
    }

    #[test]
    fn released_slots_are_reused_and_start_unfaulted() {
        let m = Shrinkable::new(8192);
        let guard = Guard::watch(m.ptr, m.len);
        m.shrink();
        unsafe { std::ptr::write_volatile(m.ptr, 1) };
        assert!(guard.faulted());
        let slot = guard.slot;
        drop(guard);
        let again = Guard::watch(m.ptr, m.len);
        assert!(!again.faulted(), "a new guard on a reused slot starts clean");
        assert!(again.slot.is_some() && slot.is_some());
    }
}
