//! The thread that drives one rail: it alone posts operations to the rail's endpoint
//! and reaps its completion queue, in batches, so the hot path takes no lock of ours
//! (requests hand work over through a channel). While the rail is idle the thread sleeps
//! on the completion queue's wait object, which also lets the provider serve peers'
//! one-sided operations on this endpoint (providers with manual progress need someone
//! to call into them for that).

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};

use super::ffi::{FiCqEntry, FI_EAGAIN, FI_EAVAIL, FI_ECANCELED, FI_ETIMEDOUT};
use super::rail::Rail;
use super::rail_staging::Staging;
use super::relay;
use crate::tracker::Tracker;
use freight_cuda::driver::Device;
use freight_proto::error::{Error, Result};
use freight_proto::fabric::backlog::{Addressed, Backlog, Offer};

/// One one-sided operation, ready to post: every address and key resolved.
pub struct Work {
    pub read: bool,
    pub local: u64,
    pub len: u64,
    /// The local registration's descriptor (a pointer, kept as an integer to be `Send`).
    pub desc: usize,
    /// The peer's endpoint, as this rail's address vector knows it.
    pub dest: u64,
    pub remote: u64,
    pub key: u64,
    pub done: Done,
    pub peer: Arc<str>,
    /// The GPU holding the local bytes, which then pass through a staging buffer.
    pub gpu: Option<&'static Device>,
}

impl Work {
    fn finish(self, result: Result<()>) {
        self.done.report(result)
    }
}

impl Addressed for Work {
    fn dest(&self) -> u64 {
        self.dest
    }
}

/// Who hears of an operation's end.
pub enum Done {
    /// It is one part of a request.
    Request(Arc<Tracker>),
    /// It is a wire step of a chunk staged through the peer's docks: its relay goes on.
    Relay { events: Sender<relay::Event>, token: u64 },
}

impl Done {
    fn report(&self, result: Result<()>) {
        match self {
            Done::Request(tracker) => tracker.finish_part(result),
            Done::Relay { events, token } => {
                let _ = events.send(relay::Event::Wire { token: *token, result });
            }
        }
    }
}

/// An operation the provider holds. The first 64 bytes are the provider's (the
/// `FI_CONTEXT`/`FI_CONTEXT2` modes let it keep state there); their address is the
/// operation's context, which comes back in its completion.
#[repr(C)]
struct InFlight {
    scratch: [usize; 8],
    work: Work,
    /// Its request was already failed (the peer died): the completion, if it ever
    /// comes, only frees it.
    abandoned: bool,
    /// The staging buffer it reads or writes instead of GPU memory.
    slot: Option<usize>,
}

/// Where an operation's local bytes go on the wire from.
enum Stage {
    /// Registered host memory.
    InPlace,
    /// A staging buffer (GPU memory).
    Buffer(usize),
    /// GPU memory, but every staging buffer is in use.
    AllBuffersOut,
}

/// What a rail's thread is told.
enum Command {
    Run(Vec<Work>),
    /// Fail everything queued or in flight to `dest`: the peer is gone.
    Abandon {
        dest: u64,
        reason: String,
    },
}

/// Errors that mean the peer (or the way to it) is gone rather than that it refused.
fn completion_error(peer: &str, errno: i32, reason: String) -> Error {
    let reason = format!("fabric: {reason}");
    match errno {
        libc::ECONNREFUSED
        | libc::ECONNRESET
        | libc::ECONNABORTED
        | libc::ENOTCONN
        | libc::EHOSTUNREACH
        | libc::ETIMEDOUT
        | libc::EPIPE => Error::PeerDisconnected { peer: peer.to_string(), reason },
        _ => Error::RemoteRejected { peer: peer.to_string(), reason },
    }
}

/// A rail and the thread that drives it.
pub struct Worker {
    pub rail: Arc<Rail>,
    queue: Sender<Command>,
    sleeping: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts rail `index`'s thread; `largest` is the longest operation it will get.
    pub fn start(rail: Arc<Rail>, index: usize, largest: u64) -> Result<Worker> {
        let (queue, jobs) = unbounded::<Command>();
        let sleeping = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let staging = RefCell::new(Staging::new(rail.clone(), largest));
        let driver = Driver { rail: rail.clone(), jobs, sleeping: sleeping.clone(), stop: stop.clone(), staging };
        let thread = thread::Builder::new().name(format!("freight-fabric{index}")).spawn(move || driver.run())?;
        Ok(Worker { rail, queue, sleeping, stop, thread: Some(thread) })
    }

    /// Hands operations to the rail's thread (waking it if it sleeps).
    pub fn submit(&self, batch: Vec<Work>) {
        if let Err(e) = self.queue.send(Command::Run(batch)) {
            if let Command::Run(batch) = e.0 {
                for w in batch {
                    let peer = w.peer.to_string();
                    w.finish(Err(Error::PeerDisconnected { peer, reason: "the fabric transport stopped".into() }));
                }
            }
            return;
        }
        self.wake();
    }

    /// Fails the operations to `dest` (a peer that died) now rather than when, or if,
    /// the provider gives up on them.
    pub fn abandon(&self, dest: u64, reason: String) {
        if self.queue.send(Command::Abandon { dest, reason }).is_ok() {
            self.wake();
        }
    }

    fn wake(&self) {
        // The queued command must be visible before we look at the flag, or a thread
        // that just decided to sleep could miss both (it sets the flag, then looks).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.rail.wake();
        }
    }
}

/// Whether a sleeping completion-queue read returned as a queue that can be waited on
/// does: entries, an error entry to read, nothing (within the time, or woken by a
/// signal). Anything else means the provider cannot sleep on it.
fn sleep_went_as_asked(n: isize) -> bool {
    n >= 0 || [FI_EAGAIN, FI_EAVAIL, FI_ETIMEDOUT, FI_ECANCELED].contains(&-n)
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.rail.wake();
        if let Some(t) = self.thread.take() {
            // A request's hook run on the rail's thread may drop the last handle on the
            // fabric there: that thread must not wait for itself (it ends on `stop`).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

struct Driver {
    rail: Arc<Rail>,
    jobs: Receiver<Command>,
    sleeping: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    /// Buffers for GPU memory (this thread's alone).
    staging: RefCell<Staging>,
}

/// How long an idle rail sleeps before looking at its queue on its own (a safety net:
/// submitters wake it).
const IDLE_WAIT_MS: i32 = 100;
/// How long a busy rail waits for a completion before posting what arrived meanwhile.
const BUSY_WAIT_MS: i32 = 1;

impl Driver {
    fn run(self) {
        let mut waiting: Backlog<Work> = Backlog::default();
        let mut held: HashSet<usize> = HashSet::new();
        let mut entries = [FiCqEntry { op_context: std::ptr::null_mut() }; 64];
        let mut waitable = self.rail.waitable;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                self.shut_down(waiting, held, &mut entries);
                return;
            }
            loop {
                match self.jobs.try_recv() {
                    Ok(command) => self.obey(command, &mut waiting, &held),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.stop.store(true, Ordering::SeqCst);
                        break;
                    }
                }
            }
            self.post(&mut waiting, &mut held);
            let n = if waitable {
                let timeout = if held.is_empty() { IDLE_WAIT_MS } else { BUSY_WAIT_MS };
                self.sleeping.store(true, Ordering::SeqCst);
                let n = if self.jobs.is_empty() && !self.stop.load(Ordering::SeqCst) {
                    self.rail.reap_waiting(&mut entries, timeout)
                } else {
                    self.rail.reap(&mut entries)
                };
                self.sleeping.store(false, Ordering::SeqCst);
                if !sleep_went_as_asked(n) {
                    tracing::warn!(domain = %self.rail.info.domain, code = n, "the completion queue cannot be waited on; polling it instead");
                    waitable = false;
                }
                n
            } else {
                let n = self.rail.reap(&mut entries);
                if n == -FI_EAGAIN {
                    self.pause(held.is_empty(), &mut waiting, &held);
                }
                n
            };
            self.settle(n, &entries, &mut held);
        }
    }

    /// Without a wait object: spin briefly while operations are out, else sleep on the
    /// queue of new work (the provider still gets called every millisecond).
    fn pause(&self, idle: bool, waiting: &mut Backlog<Work>, held: &HashSet<usize>) {
        if idle {
            if let Ok(command) = self.jobs.recv_timeout(Duration::from_millis(1)) {
                self.obey(command, waiting, held);
            }
        } else {
            thread::yield_now();
        }
    }

    fn obey(&self, command: Command, waiting: &mut Backlog<Work>, held: &HashSet<usize>) {
        match command {
            Command::Run(batch) => batch.into_iter().for_each(|w| waiting.push(w)),
            Command::Abandon { dest, reason } => {
                let gone = |w: &Work| Error::PeerDisconnected { peer: w.peer.to_string(), reason: reason.clone() };
                for w in waiting.take_dest(dest) {
                    let e = gone(&w);
                    w.finish(Err(e));
                }
                for &context in held {
                    // SAFETY: a held operation is allocated until settled, which only
                    // this thread does; the provider touches only its scratch bytes.
                    let op = unsafe { &mut *(context as *mut InFlight) };
                    if op.work.dest == dest && !op.abandoned {
                        op.abandoned = true;
                        op.work.done.report(Err(gone(&op.work)));
                    }
                }
            }
        }
    }

    /// Where `work`'s local bytes go on the wire from: themselves (host memory), or a
    /// staging buffer, filled already for a write (GPU memory).
    fn stage(&self, work: &Work) -> Result<Stage> {
        let Some(device) = work.gpu else { return Ok(Stage::InPlace) };
        let mut staging = self.staging.borrow_mut();
        let Some(slot) = staging.take(device)? else { return Ok(Stage::AllBuffersOut) };
        if !work.read {
            if let Err(e) = staging.gather(slot, device, work.local, work.len) {
                staging.give_back(slot);
                return Err(e);
            }
        }
        Ok(Stage::Buffer(slot))
    }

    /// Posts what waits, destinations in turn ([`Backlog`]): one whose operations the
    /// provider cannot take now (`FI_EAGAIN`), or that waits for a staging buffer, sits
    /// out until the next round without holding up the others.
    fn post(&self, waiting: &mut Backlog<Work>, held: &mut HashSet<usize>) {
        waiting.serve(|work| self.post_one(work, held));
    }

    fn post_one(&self, work: Work, held: &mut HashSet<usize>) -> Offer<Work> {
        let slot = match self.stage(&work) {
            Ok(Stage::InPlace) => None,
            Ok(Stage::Buffer(slot)) => Some(slot),
            // A completion frees one.
            Ok(Stage::AllBuffersOut) => return Offer::Busy(work),
            Err(e) => {
                work.finish(Err(e));
                return Offer::Taken;
            }
        };
        let (local, desc) = match slot {
            Some(s) => self.staging.borrow_mut().target(s),
            None => (work.local, work.desc as *mut c_void),
        };
        let op = Box::into_raw(Box::new(InFlight { scratch: [0; 8], work, abandoned: false, slot }));
        // SAFETY: `op` stays allocated until its completion is reaped (`settle`); the
        // local memory is held registered by the request's guards, or is a staging
        // buffer this thread keeps, until then.
        let rc = unsafe {
            let w = &(*op).work;
            self.rail.post(w.read, local, w.len, desc, w.dest, w.remote, w.key, op.cast())
        };
        if rc == 0 {
            held.insert(op as usize);
            return Offer::Taken;
        }
        if let Some(s) = slot {
            self.staging.borrow_mut().give_back(s);
        }
        // SAFETY: the provider refused the operation, so it never saw `op`.
        let work = unsafe { Box::from_raw(op) }.work;
        if rc == -FI_EAGAIN {
            return Offer::Busy(work);
        }
        let what = if work.read { "fi_read" } else { "fi_write" };
        let reason = format!("{what} failed: {}", self.rail.error_text(rc));
        let peer = work.peer.to_string();
        work.finish(Err(completion_error(&peer, (-rc) as i32, reason)));
        Offer::Taken
    }

    /// Finishes the operations a reap returned.
    fn settle(&self, n: isize, entries: &[FiCqEntry], held: &mut HashSet<usize>) {
        if n > 0 {
            for e in &entries[..n as usize] {
                self.complete(e.op_context, Ok(()), held);
            }
        } else if n == -FI_EAVAIL {
            if let Some((context, errno, reason)) = self.rail.read_error() {
                self.complete(context, Err((errno, reason)), held);
            }
        }
    }

    fn complete(
        &self,
        context: *mut c_void,
        result: std::result::Result<(), (i32, String)>,
        held: &mut HashSet<usize>,
    ) {
        if !held.remove(&(context as usize)) {
            tracing::warn!(domain = %self.rail.info.domain, "a completion for an operation this rail does not hold");
            return;
        }
        // SAFETY: `context` is an `InFlight` this thread posted and has not freed.
        let op = unsafe { Box::from_raw(context.cast::<InFlight>()) };
        let mut result = result.map_err(|(errno, reason)| completion_error(&op.work.peer, errno, reason));
        if let Some(slot) = op.slot {
            let mut staging = self.staging.borrow_mut();
            if let (Ok(()), true, false, Some(device)) = (&result, op.work.read, op.abandoned, op.work.gpu) {
                result = staging.scatter(slot, device, op.work.local, op.work.len);
            }
            staging.give_back(slot);
        }
        if !op.abandoned {
            op.work.finish(result);
        }
    }

    /// Fails queued work, and gives operations in flight a moment to complete; those
    /// that do not are failed too, and their contexts leaked (the provider may still
    /// write to them until the endpoint closes).
    fn shut_down(&self, mut waiting: Backlog<Work>, mut held: HashSet<usize>, entries: &mut [FiCqEntry]) {
        let closed =
            |peer: &str| Error::PeerDisconnected { peer: peer.to_string(), reason: "the local agent closed".into() };
        for w in waiting.drain() {
            let e = closed(&w.peer);
            w.finish(Err(e));
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while !held.is_empty() && Instant::now() < deadline {
            let n = self.rail.reap(entries);
            if n == -FI_EAGAIN {
                thread::yield_now();
            }
            self.settle(n, entries, &mut held);
        }
        for context in held {
            // SAFETY: still allocated (never settled); we only read the work's tracker.
            let op = unsafe { &*(context as *const InFlight) };
            if !op.abandoned {
                op.work.done.report(Err(closed(&op.work.peer)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_woken_by_a_signal_can_still_be_slept_on() {
        // fi_cq_signal makes the sleeping read of the common queue code return
        // -FI_ECANCELED: the rail must go on sleeping, not fall back to spinning.
        for n in [3, 0, -FI_EAGAIN, -FI_EAVAIL, -FI_ETIMEDOUT, -FI_ECANCELED] {
            assert!(sleep_went_as_asked(n), "{n}");
        }
        // FI_ENOSYS: the provider has no wait object for it.
        assert!(!sleep_went_as_asked(-38));
    }
}
