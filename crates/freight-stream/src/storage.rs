//! The storage backend: a keyed store on top of the channel.
//!
//! A sender `put`s objects for one receiver. Puts are committed in batches (128 objects
//! by default, as the prefill side of a disaggregated server hands KV chunks over); a
//! commit returns once the receiver holds every object in it, so a decode instance told
//! "done" by the prefill instance finds every key. The receiver copies each object out
//! of its pipe buffer into memory of its own (the same kind: GPU objects stay on the
//! GPU; a batch's copies are queued together and waited for once), which frees the
//! buffer for the next objects at once; `get`, `contains` and
//! `remove` work on that store while more objects stream in.
//!
//! A full batch of puts (the channel's batch size) goes out at once, without waiting
//! for the commit: while the caller prepares the next objects (a cache engine gathering
//! the next KV chunks) the last ones are already on their way. The commit sends the
//! rest and waits.
//!
//! A caller that must not stall while the receiver catches up seals commits instead:
//! `seal` sends a commit whole and returns, `poll` and `wait_oldest` report the sealed
//! commits the receiver holds, oldest first. A commit is held once the receiver has
//! released the pipe's stream up to its last message, so later commits keep the link
//! busy meanwhile.
//!
//! Each commit is timed in two parts: the transfer proper, and the time spent waiting
//! for the receiver (for room in its buffer while sending, and for it to take the last
//! objects). Pure transfer throughput is the commit's bytes over the first.
//!
//! A receiver may hold at most a capacity of bytes. A plain one stops for good at a batch
//! that does not fit; an evicting one ([`StoreReceiver::evicting`]) first drops its least
//! recently used objects that nobody else holds (an object is used when it arrives and
//! when `get` hands it out; [`crate::recency`] keeps the order), and stops only when even
//! that leaves no room: what a long-running consumer that never removes anything (a
//! cache engine's remote source) needs.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use freight_core::{interrupt, Error, Result};
use freight_cuda::driver::CopyBatch;
use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use crate::channel::{ChannelReceiver, ChannelSender, Outgoing, Received};
use crate::next::Next;
use crate::owned::Owned;
use crate::pipe::{deadline_after, PipeSender};
use crate::recency::Recency;

/// Objects per commit, unless told otherwise.
pub const DEFAULT_COMMIT_SIZE: usize = 128;

/// How one commit went.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CommitStats {
    pub objects: usize,
    pub bytes: u64,
    /// From posting the first writes (an early batch's, see the module) to seeing the
    /// last land, less the waits for room.
    pub transfer: Duration,
    /// Waiting for room in the receiver's buffer, then for it to take the last objects.
    pub wait_receiver: Duration,
}

impl CommitStats {
    pub fn total(&self) -> Duration {
        self.transfer + self.wait_receiver
    }

    /// Bytes over transfer time, in GB/s (1e9 bytes).
    pub fn transfer_gbps(&self) -> f64 {
        self.bytes as f64 / self.transfer.as_secs_f64().max(1e-9) / 1e9
    }
}

/// The putting side.
pub struct StoreSender {
    channel: ChannelSender,
    commit_size: usize,
    /// Objects not sealed into a commit yet; the first `sent` of them went out already.
    pending: Vec<Outgoing>,
    pending_keys: HashSet<String>,
    sent: usize,
    /// When the first of `pending` went out, and the pipe's wait for room until then.
    first_send: Option<(Instant, Duration)>,
    /// Commits sent whole, oldest first, that the receiver may not hold yet.
    sealed: VecDeque<Sealed>,
}

/// A commit whose objects all went out, waiting for the receiver to hold them.
struct Sealed {
    objects: Vec<Outgoing>,
    bytes: u64,
    /// The pipe's stream position after its last message: the receiver holds the
    /// commit once it has released everything before it.
    end: u64,
    started: Instant,
    /// Waits for room in the receiver's buffer while it was being sent.
    room_wait: Duration,
    /// When its last write was seen done.
    written: Option<Instant>,
}

impl Sealed {
    fn held(self, now: Instant) -> Committed {
        let written = self.written.unwrap_or(now);
        let stats = CommitStats {
            objects: self.objects.len(),
            bytes: self.bytes,
            transfer: (written - self.started).saturating_sub(self.room_wait),
            wait_receiver: self.room_wait + (now - written),
        };
        tracing::info!(
            objects = stats.objects,
            mb = stats.bytes as f64 / 1e6,
            total_ms = stats.total().as_secs_f64() * 1e3,
            transfer_ms = stats.transfer.as_secs_f64() * 1e3,
            wait_receiver_ms = stats.wait_receiver.as_secs_f64() * 1e3,
            transfer_gbps = stats.transfer_gbps(),
            "commit done"
        );
        Committed { keys: self.objects.into_iter().map(|o| o.key).collect(), stats }
    }
}

/// A commit the receiver holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    pub keys: Vec<String>,
    pub stats: CommitStats,
}

impl StoreSender {
    /// Puts through `channel`, committing every `commit_size` objects.
    pub fn new(channel: ChannelSender, commit_size: usize) -> Result<StoreSender> {
        if commit_size == 0 {
            return Err(Error::InvalidArgument("the commit size must be at least 1".into()));
        }
        Ok(StoreSender {
            channel,
            commit_size,
            pending: Vec::new(),
            pending_keys: HashSet::new(),
            sent: 0,
            first_send: None,
            sealed: VecDeque::new(),
        })
    }

    /// Objects per commit.
    pub fn commit_size(&self) -> usize {
        self.commit_size
    }

    /// Queues `object` for the receiver and commits once `commit_size` objects are
    /// queued (returning that commit's figures). The object's memory must stay unchanged
    /// until the commit that carries it returns. A key already queued, an empty key or
    /// object, or memory of another kind than the queued objects' is refused, and
    /// nothing queued is lost. A put that fails after that (sending a full batch early,
    /// or its commit) leaves the object queued, as a failed commit leaves its objects:
    /// the next commit sends it, [`StoreSender::pending_keys`] lists it, and putting
    /// its key again is refused until then ([`StoreSender::discard_pending`] drops it).
    pub fn put(&mut self, object: Outgoing) -> Result<Option<CommitStats>> {
        self.queue(object)?;
        if self.pending.len() >= self.commit_size {
            return self.commit();
        }
        Ok(None)
    }

    /// [`StoreSender::put`] without the commit: for a caller that seals commits itself
    /// ([`StoreSender::seal`]). A full batch still goes out at once; when sending it
    /// fails, the object stays queued all the same (see [`StoreSender::put`]).
    pub fn queue(&mut self, object: Outgoing) -> Result<()> {
        if object.key.is_empty() {
            return Err(Error::InvalidArgument("object keys must not be empty".into()));
        }
        if object.local.len == 0 {
            return Err(Error::InvalidArgument(format!("object '{}' is empty; put at least one byte", object.key)));
        }
        if self.pending_keys.contains(&object.key) {
            return Err(Error::InvalidArgument(format!("key '{}' is already waiting for this commit", object.key)));
        }
        if let Some(first) = self.pending.first() {
            if first.kind != object.kind {
                return Err(Error::InvalidArgument(format!(
                    "object '{}' is in {} memory but this commit's objects are in {}; commit first",
                    object.key,
                    object.kind.as_str(),
                    first.kind.as_str()
                )));
            }
        }
        self.pending_keys.insert(object.key.clone());
        self.pending.push(object);
        if self.pending.len() - self.sent >= self.channel.batch_size() {
            self.send_unsent()?;
        }
        Ok(())
    }

    /// Hands every queued object not sent yet to the channel (without waiting for it).
    fn send_unsent(&mut self) -> Result<()> {
        if self.sent == self.pending.len() {
            return Ok(());
        }
        self.first_send.get_or_insert_with(|| (Instant::now(), self.channel.pipe().credit_wait()));
        self.channel.send(&self.pending[self.sent..])?;
        self.sent = self.pending.len();
        Ok(())
    }

    /// Sends every queued object as one commit and returns without waiting for the
    /// receiver: [`StoreSender::poll`] and [`StoreSender::wait_oldest`] tell when it
    /// holds them. Their memory must stay unchanged until then. `false` when nothing
    /// was queued. On failure the objects stay queued.
    pub fn seal(&mut self) -> Result<bool> {
        if self.pending.is_empty() {
            return Ok(false);
        }
        let (started, waited_before) =
            self.first_send.unwrap_or_else(|| (Instant::now(), self.channel.pipe().credit_wait()));
        if let Err(e) = self.send_unsent() {
            // A commit tried again sends every object again.
            self.sent = 0;
            self.first_send = None;
            return Err(e);
        }
        let end = self.channel.pipe().position();
        // Its sender waits for this point: the receiver must not hold back the credit.
        if let Err(e) = self.channel.pipe().want_released(end) {
            self.sent = 0;
            self.first_send = None;
            return Err(e);
        }
        let objects = std::mem::take(&mut self.pending);
        let bytes = objects.iter().map(|o| o.local.len).sum();
        tracing::debug!(objects = objects.len(), bytes, "commit sealed");
        self.sealed.push_back(Sealed {
            objects,
            bytes,
            end,
            started,
            room_wait: self.channel.pipe().credit_wait().saturating_sub(waited_before),
            written: None,
        });
        self.pending_keys.clear();
        self.sent = 0;
        self.first_send = None;
        Ok(true)
    }

    /// Commits sealed and not yet known to be held.
    pub fn sealed(&self) -> usize {
        self.sealed.len()
    }

    /// The sealed commits the receiver holds by now, oldest first, without waiting.
    pub fn poll(&mut self) -> Result<Vec<Committed>> {
        let progress = self.unsealing(|c| c.channel.pipe().progress())?;
        let now = Instant::now();
        let mut held = Vec::new();
        while let Some(oldest) = self.sealed.front_mut() {
            if progress.written >= oldest.end {
                oldest.written.get_or_insert(now);
            }
            if progress.released < oldest.end {
                break;
            }
            held.push(self.sealed.pop_front().expect("looked at").held(now));
        }
        // A later commit's writes may be done while an older one waits for its receiver.
        for later in self.sealed.iter_mut().filter(|c| progress.written >= c.end) {
            later.written.get_or_insert(now);
        }
        Ok(held)
    }

    /// Waits until the receiver holds the oldest sealed commit. `None` when no commit is
    /// sealed.
    pub fn wait_oldest(&mut self) -> Result<Option<Committed>> {
        let Some(end) = self.sealed.front().map(|c| c.end) else { return Ok(None) };
        self.unsealing(|c| c.channel.pipe().wait_written(end))?;
        let written = Instant::now();
        self.sealed.front_mut().expect("looked at").written.get_or_insert(written);
        self.unsealing(|c| c.channel.pipe().wait_released(end))?;
        Ok(Some(self.sealed.pop_front().expect("looked at").held(Instant::now())))
    }

    /// Runs `f`; when it fails, every sealed commit is queued again in front of what is
    /// pending (a commit tried again sends every object again). An interrupted wait
    /// leaves them sealed: they are still on their way, and waiting again goes on.
    fn unsealing<T>(&mut self, f: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        let result = f(self);
        let failed = matches!(&result, Err(e) if !matches!(e, Error::Interrupted(_)));
        if failed && !self.sealed.is_empty() {
            let mut queued: Vec<Outgoing> = self.sealed.drain(..).flat_map(|c| c.objects).collect();
            queued.append(&mut self.pending);
            // A key put again replaces the object put before it.
            let mut seen = HashSet::new();
            queued.reverse();
            queued.retain(|o| seen.insert(o.key.clone()));
            queued.reverse();
            self.pending_keys = seen;
            self.pending = queued;
            self.sent = 0;
            self.first_send = None;
        }
        result
    }

    /// Sends every queued object and waits until the receiver holds them all (and
    /// every commit sealed before). Returns the figures of the last commit; `None` when
    /// nothing was queued or sealed. On failure the objects stay queued
    /// ([`Self::pending_keys`]): the caller knows what the receiver may not have.
    pub fn commit(&mut self) -> Result<Option<CommitStats>> {
        if self.pending.is_empty() && self.sealed.is_empty() {
            return Ok(None);
        }
        tracing::debug!(objects = self.pending.len(), early = self.sent, sealed = self.sealed.len(), "committing");
        self.seal()?;
        let mut last = None;
        while let Some(held) = self.wait_oldest()? {
            last = Some(held.stats);
        }
        Ok(last)
    }

    /// Objects queued and not yet committed (sealed commits included).
    pub fn pending(&self) -> usize {
        self.pending.len() + self.sealed.iter().map(|c| c.objects.len()).sum::<usize>()
    }

    /// Forgets every queued object, sent or not, and every sealed commit, and returns
    /// their keys: for a caller whose commit failed and who will put them again from
    /// memory that may have changed (a retried commit would otherwise send the old
    /// descriptors' current bytes). Returns once no write reads that memory any more
    /// (one that never finishes breaks the stream instead, so its bytes are not taken).
    /// The wait is not interruptible (see [`settle_before_reuse`]).
    pub fn discard_pending(&mut self) -> Vec<String> {
        if let Err(e) = settle_before_reuse(self.channel.pipe(), "objects were discarded") {
            tracing::warn!(error = %e, "writes of discarded objects did not finish; the stream is aborted");
        }
        self.sent = 0;
        self.first_send = None;
        self.pending_keys.clear();
        let sealed = self.sealed.drain(..).flat_map(|c| c.objects);
        sealed.chain(self.pending.drain(..)).map(|o| o.key).collect()
    }

    /// Keys queued and not yet committed, sealed commits' first.
    pub fn pending_keys(&self) -> impl Iterator<Item = &str> {
        let sealed = self.sealed.iter().flat_map(|c| c.objects.iter());
        sealed.chain(self.pending.iter()).map(|o| o.key.as_str())
    }

    /// True once the stream is broken (the receiver aborted it: it restarted, ran out of
    /// space; a write failed; it was aborted here): every later put and commit fails,
    /// and the caller had better let this sender go.
    pub fn broken(&self) -> bool {
        // Reading the pipe's progress fails exactly when the pipe is broken, and takes in
        // an abort the receiver sent meanwhile.
        self.channel.pipe().progress().is_err()
    }

    /// Commits what is queued, then ends the stream.
    pub fn close(mut self) -> Result<()> {
        self.commit()?;
        self.channel.close()
    }
}

impl Drop for StoreSender {
    /// A sender dropped with objects not committed (a commit failed, or nobody called
    /// it) breaks the stream: the receiver must not take its end for a whole one.
    fn drop(&mut self) {
        let uncommitted = self.pending();
        if uncommitted > 0 {
            tracing::warn!(objects = uncommitted, "a store sender was dropped with objects not committed");
            let why = format!("the sender went away with {uncommitted} objects not committed");
            // Its caller frees the objects' memory next.
            let _ = settle_before_reuse(self.channel.pipe(), &why);
            self.channel.pipe().abort(&why);
        }
    }
}

/// What letting a sender's memory go needs of its pipe (a trait, so that the rule in
/// [`settle_before_reuse`] is tested without one).
trait WritesInFlight {
    fn settle_writes(&self) -> Result<()>;
    fn abort(&self, reason: &str);
}

impl WritesInFlight for PipeSender {
    fn settle_writes(&self) -> Result<()> {
        PipeSender::settle_writes(self)
    }

    fn abort(&self, reason: &str) {
        PipeSender::abort(self, reason)
    }
}

/// Waits until no write of `pipe` reads the memory of objects that the caller reuses or
/// frees next (a cache engine gathers other chunks into those slots), and when that
/// cannot be had, aborts the pipe (telling the receiver `why`), so that the receiver
/// never takes what a late write brings.
///
/// The caller's interrupt check (Ctrl-C) is not consulted: an interrupted wait would
/// return with writes in flight on a pipe that goes on, and the receiver would take the
/// new bytes for the old objects. The wait is bounded all the same: a write that does
/// not finish within the pipe's timeout fails it. Aborting on the interrupt instead and
/// then settling would wait as long and would also break a stream whose writes finish
/// (as they nearly always do), so the abort is left to the one case that needs it.
fn settle_before_reuse(pipe: &impl WritesInFlight, why: &str) -> Result<()> {
    let settled = interrupt::interruptible(|| false, || pipe.settle_writes());
    if let Err(e) = &settled {
        pipe.abort(&format!("{why} while their writes were in flight: {e}"));
    }
    settled
}

/// An object the receiver holds.
pub struct StoredObject {
    pub key: String,
    pub meta: Vec<u8>,
    /// Which of the receiver's senders put it.
    pub sender: usize,
    pub data: Owned,
}

impl StoredObject {
    pub fn len(&self) -> u64 {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

#[derive(Default)]
struct StoreState {
    objects: HashMap<String, Arc<StoredObject>>,
    /// The objects' keys by last use (arrival, or `get`): kept by evicting stores only.
    recency: Option<Recency>,
    bytes: u64,
    /// Objects dropped to make room since the start.
    evicted: u64,
    /// Objects taken in since the start (replacements included).
    received: u64,
    /// Every sender closed its stream.
    ended: bool,
    /// Why the store stopped taking objects in.
    failure: Option<Error>,
}

impl StoreState {
    /// Marks `key` used, where the store keeps the order.
    fn touch(&mut self, key: &str) {
        if let Some(recency) = &mut self.recency {
            recency.touch(key);
        }
    }

    /// Lets go of the object held under `key`.
    fn remove(&mut self, key: &str) -> Option<Arc<StoredObject>> {
        let object = self.objects.remove(key)?;
        if let Some(recency) = &mut self.recency {
            recency.forget(key);
        }
        self.bytes -= object.len();
        Some(object)
    }
}

struct Shared {
    state: Mutex<StoreState>,
    changed: Condvar,
    capacity: Option<u64>,
    /// Whether a batch that does not fit evicts objects instead of stopping the store.
    evict: bool,
}

/// The getting side: holds what its senders put, keyed.
pub struct StoreReceiver {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

/// How often the worker looks whether the store was dropped.
const WORKER_SLICE: Duration = Duration::from_millis(200);

impl StoreReceiver {
    /// Takes in every object that arrives on `channel`, holding at most `capacity`
    /// bytes (no limit when `None`). A put that would go past the capacity stops the
    /// store: its waits fail with [`Error::NoSpace`], its senders' commits with
    /// [`Error::PeerDisconnected`] ("the receiver aborted the pipe: out of space: ..."),
    /// and the objects held stay available. A key put again replaces the object held under it.
    pub fn new(channel: ChannelReceiver, capacity: Option<u64>) -> StoreReceiver {
        StoreReceiver::start(channel, capacity, false)
    }

    /// [`StoreReceiver::new`] with a `capacity`, where a batch that does not fit first
    /// evicts the least recently used objects until it fits. An object is used when it
    /// arrives (a key put again included) and when [`StoreReceiver::get`] or
    /// [`StoreReceiver::touch`] hands it out or marks it; `contains`, `keys` and the
    /// waits only look. An object someone else still holds (an `Arc` got from `get` and
    /// not yet dropped) is never evicted: dropping the store's hold would free nothing.
    /// Only a batch that does not fit even with every other object evicted stops the
    /// store, as [`StoreReceiver::new`]'s does (and then nothing is evicted).
    pub fn evicting(channel: ChannelReceiver, capacity: u64) -> StoreReceiver {
        StoreReceiver::start(channel, Some(capacity), true)
    }

    fn start(channel: ChannelReceiver, capacity: Option<u64>, evict: bool) -> StoreReceiver {
        let state = Mutex::new(StoreState { recency: evict.then(Recency::new), ..StoreState::default() });
        let shared = Arc::new(Shared { state, changed: Condvar::new(), capacity, evict });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worker = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("freight-store".into())
                .spawn(move || take_in(channel, &shared, &stop))
                .expect("cannot start the store's thread")
        };
        StoreReceiver { shared, worker: Some(worker), stop }
    }

    /// The object held under `key`, marked used (see [`StoreReceiver::evicting`]): an
    /// evicting store keeps it while the `Arc` lives, and evicts it after the objects
    /// used before it.
    pub fn get(&self, key: &str) -> Option<Arc<StoredObject>> {
        let mut st = self.shared.state.lock();
        let object = st.objects.get(key).cloned()?;
        st.touch(key);
        Some(object)
    }

    /// Marks the object held under `key` used, as [`StoreReceiver::get`] does, without
    /// taking it: for a caller that got several objects and orders their use itself (a
    /// cache engine marks a prompt's chunks last to first, so its prefix goes last).
    /// False when the key is unknown.
    pub fn touch(&self, key: &str) -> bool {
        let mut st = self.shared.state.lock();
        let held = st.objects.contains_key(key);
        if held {
            st.touch(key);
        }
        held
    }

    /// Whether `key` is held (not a use: see [`StoreReceiver::evicting`]).
    pub fn contains(&self, key: &str) -> bool {
        self.shared.state.lock().objects.contains_key(key)
    }

    /// Drops the store's hold on `key` (its memory goes with the last holder). `None`
    /// when the key is unknown.
    pub fn remove(&self, key: &str) -> Option<Arc<StoredObject>> {
        let mut st = self.shared.state.lock();
        st.remove(key)
    }

    pub fn keys(&self) -> Vec<String> {
        self.shared.state.lock().objects.keys().cloned().collect()
    }

    /// Objects held.
    pub fn len(&self) -> usize {
        self.shared.state.lock().objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.shared.state.lock().bytes
    }

    /// Objects taken in since the start.
    pub fn received(&self) -> u64 {
        self.shared.state.lock().received
    }

    /// The most bytes the store holds (`None`: no limit).
    pub fn capacity(&self) -> Option<u64> {
        self.shared.capacity
    }

    /// Whether a batch that does not fit evicts objects ([`StoreReceiver::evicting`]).
    pub fn evicts(&self) -> bool {
        self.shared.evict
    }

    /// Objects evicted since the start.
    pub fn evicted(&self) -> u64 {
        self.shared.state.lock().evicted
    }

    /// Waits until every key in `keys` is held. Fails when the store stopped (a sender
    /// died, the store is full) or every sender closed without putting them, and after
    /// `timeout`.
    pub fn wait_for(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_until(
            timeout,
            |st| keys.iter().all(|k| st.objects.contains_key(*k)),
            || {
                let missing = keys.iter().filter(|k| !self.contains(k)).count();
                format!("{missing} of {} keys", keys.len())
            },
        )
    }

    /// Waits until `count` objects have been taken in since the start.
    pub fn wait_received(&self, count: u64, timeout: Duration) -> Result<()> {
        self.wait_until(timeout, |st| st.received >= count, || format!("{count} objects (got {})", self.received()))
    }

    /// Waits until every sender closed its stream (everything put is then held).
    pub fn wait_closed(&self, timeout: Duration) -> Result<()> {
        self.wait_until(timeout, |st| st.ended, || "the senders to close".into())
    }

    fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&StoreState) -> bool,
        what: impl Fn() -> String,
    ) -> Result<()> {
        let deadline = deadline_after(timeout);
        let mut st = self.shared.state.lock();
        loop {
            if done(&st) {
                return Ok(());
            }
            if let Some(e) = &st.failure {
                return Err(e.clone());
            }
            if st.ended {
                drop(st);
                return Err(Error::InvalidState(format!("every sender closed before the store got {}", what())));
            }
            if Instant::now() >= deadline {
                drop(st);
                return Err(Error::Timeout(format!(
                    "the store did not get {} within {:.1}s",
                    what(),
                    timeout.as_secs_f64()
                )));
            }
            let slice_end = deadline.min(Instant::now() + interrupt::SLICE);
            if self.shared.changed.wait_until(&mut st, slice_end).timed_out() {
                // Unlocked: the check may run the caller's code, which may look at the store.
                drop(st);
                interrupt::check()?;
                st = self.shared.state.lock();
            }
        }
    }
}

impl StoreReceiver {
    /// Stops taking objects in, before the store is dropped (another thread may still
    /// hold it): waits there fail, and the senders are told once the worker sees it.
    /// Objects held stay readable.
    pub fn close(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let mut st = self.shared.state.lock();
        st.failure.get_or_insert_with(|| Error::InvalidState("the store receiver is closed".into()));
        self.shared.changed.notify_all();
    }
}

impl Drop for StoreReceiver {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The store's thread: receives batches and files their objects until the senders
/// are done, something fails, or the store is dropped.
fn take_in(mut channel: ChannelReceiver, shared: &Shared, stop: &std::sync::atomic::AtomicBool) {
    let outcome = loop {
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        match channel.next_within(WORKER_SLICE) {
            Ok(Next::Item(batch)) => {
                let n = batch.len();
                let started = Instant::now();
                // Objects not filed are still held while the senders hear why, so a
                // commit waiting for their space fails instead of seeing it freed.
                let mut batch = batch;
                let filed = make_room(shared, &batch).and_then(|()| file(shared, &mut batch));
                if let Err(e) = filed {
                    channel.abort(&e.to_string());
                    drop(batch);
                    break Err(e);
                }
                tracing::debug!(objects = n, ms = started.elapsed().as_secs_f64() * 1e3, "stored a batch");
            }
            Ok(Next::End) => break Ok(()),
            Ok(Next::NotYet) => continue,
            Err(e) => {
                channel.abort(&e.to_string());
                break Err(e);
            }
        }
    };
    let mut st = shared.state.lock();
    match outcome {
        Ok(()) => st.ended = true,
        Err(e) => {
            tracing::warn!(error = %e, held = st.objects.len(), "the store stopped taking objects in");
            st.failure = Some(e);
        }
    }
    shared.changed.notify_all();
}

/// Makes sure the store has room for the whole batch (replaced objects make room), by
/// evicting objects where the store evicts; fails when it cannot, evicting nothing.
fn make_room(shared: &Shared, batch: &[Received]) -> Result<()> {
    let Some(capacity) = shared.capacity else { return Ok(()) };
    let mut guard = shared.state.lock();
    let st = &mut *guard;
    // A key twice in one batch (only a faulty sender does that) replaces itself.
    let mut in_batch: HashMap<&str, u64> = HashMap::new();
    let mut after = st.bytes;
    for object in batch {
        let replaced = in_batch
            .insert(&object.key, object.len())
            .unwrap_or_else(|| st.objects.get(&object.key).map_or(0, |o| o.len()));
        after = after - replaced + object.len();
    }
    if after <= capacity {
        return Ok(());
    }
    let need = after - capacity;
    // The batch's own keys are counted as replaced already; an object held elsewhere
    // (a reader's `Arc`) would keep its memory.
    let victims = st.recency.as_ref().map(|recency| {
        recency.victims(need, |key| {
            let object = st.objects.get(key).expect("the store orders the keys it holds");
            (!in_batch.contains_key(key) && Arc::strong_count(object) == 1).then(|| object.len())
        })
    });
    let Some(Some(victims)) = victims else {
        let first = batch.first().map_or("", |o| o.key.as_str());
        let held = if shared.evict { ", more than evicting the objects nobody reads frees" } else { "" };
        return Err(Error::NoSpace(format!(
            "the receiver's store holds {} of {capacity} bytes; a batch from '{first}' on needs {} more{held}",
            st.bytes,
            after - st.bytes
        )));
    };
    let mut evicted = Vec::with_capacity(victims.len());
    for key in &victims {
        evicted.push(st.remove(key).expect("victims are held"));
    }
    st.evicted += evicted.len() as u64;
    let (freed, held) = (evicted.iter().map(|o| o.len()).sum::<u64>(), st.objects.len());
    // Their memory goes back (to the pool, or the GPU's allocator) without the lock.
    drop(guard);
    tracing::debug!(objects = evicted.len(), bytes = freed, held, "evicted to make room");
    drop(evicted);
    Ok(())
}

/// Copies a batch's objects out of the pipe buffers into the store, then files them,
/// taking them out of `batch`: on failure, the one that failed and those after it are
/// left. The copies of the whole batch are queued together and waited for once.
fn file(shared: &Shared, batch: &mut Vec<Received>) -> Result<()> {
    let mut copies = CopyBatch::default();
    let mut taken = Vec::with_capacity(batch.len());
    let mut failure = None;
    for object in batch.iter_mut() {
        match object.take_owned_queued(&mut copies) {
            Ok(data) => taken.push(data),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    copies.finish()?;
    let filed = taken.len();
    let mut st = shared.state.lock();
    for (object, data) in batch.iter_mut().zip(taken) {
        let (key, meta) = (std::mem::take(&mut object.key), std::mem::take(&mut object.meta));
        let len = data.len();
        let stored = Arc::new(StoredObject { key: key.clone(), meta, sender: object.sender, data });
        st.touch(&key);
        if let Some(old) = st.objects.insert(key, stored) {
            st.bytes -= old.len();
        }
        st.bytes += len;
        st.received += 1;
    }
    shared.changed.notify_all();
    drop(st);
    // Only now may their pipe space go back: a sender's commit waits for that.
    batch.drain(..filed);
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::thread;

    use freight_core::{Agent, AgentConfig, Desc, MemKind, SharedSegment, TransportKind};

    use super::*;
    use crate::pipe::{Buffer, PipeConfig, PipeListener};

    const WAIT: Duration = Duration::from_secs(10);

    fn agent(name: &str, require: Option<TransportKind>) -> Arc<Agent> {
        Arc::new(Agent::new(name, AgentConfig { require, ..AgentConfig::default() }).unwrap())
    }

    /// A store sender on `tx` (channel batches of one object: each put goes out at once)
    /// feeding what `store` makes of a channel on `rx`, through a host buffer of `buffer`
    /// bytes.
    fn pair(
        (rx, tx): (&Arc<Agent>, &Arc<Agent>),
        buffer: u64,
        commit: usize,
        store: impl FnOnce(ChannelReceiver) -> StoreReceiver,
    ) -> (StoreReceiver, StoreSender) {
        let config = PipeConfig { timeout: WAIT, ..PipeConfig::default() };
        let listener = PipeListener::new(rx);
        let (addr, tx, tx_config) = (rx.addresses()[0].clone(), tx.clone(), config.clone());
        let opener = thread::spawn(move || {
            let pipe = PipeSender::connect(&tx, &addr, &tx_config).unwrap();
            StoreSender::new(ChannelSender::new(pipe, 1, None).unwrap(), commit).unwrap()
        });
        let pipe = listener.accept(Buffer::Host { capacity: buffer }, &config).unwrap();
        (store(ChannelReceiver::new(vec![pipe], WAIT)), opener.join().unwrap())
    }

    /// `count` objects of `len` bytes, keyed `{prefix}{i}`, in one registered segment.
    fn objects(agent: &Agent, prefix: &str, count: usize, len: usize) -> (Arc<SharedSegment>, Vec<Outgoing>) {
        let seg = agent.alloc(count * len).unwrap();
        agent.register(MemKind::Dram, seg.addr(), (count * len) as u64, 0).unwrap();
        let objects = (0..count)
            .map(|i| Outgoing {
                key: format!("{prefix}{i}"),
                kind: MemKind::Dram,
                local: Desc { addr: seg.addr() + (i * len) as u64, len: len as u64, dev: 0 },
                meta: Vec::new(),
            })
            .collect();
        (seg, objects)
    }

    fn held(store: &StoreReceiver) -> Vec<String> {
        let mut keys = store.keys();
        keys.sort();
        keys
    }

    #[test]
    fn an_evicting_store_drops_the_least_recently_used_objects_nobody_holds() {
        let (rx, tx) = (agent("st-evict-rx", None), agent("st-evict-tx", None));
        // Commits of one: each put returns once the store holds its object.
        let (store, mut sender) = pair((&rx, &tx), 64 << 10, 1, |c| StoreReceiver::evicting(c, 4_000));
        assert_eq!((store.capacity(), store.evicts()), (Some(4_000), true));
        let (_seg, objs) = objects(&tx, "e", 8, 1_000);
        for o in &objs[..4] {
            sender.put(o.clone()).unwrap();
        }
        // Use order from here: e2, e3 (arrived), e0 (got, and still read), e1 (touched).
        let reading = store.get("e0").unwrap();
        assert!(store.touch("e1") && !store.touch("never"));
        assert!(store.contains("e2"), "looking is not using");
        sender.put(objs[4].clone()).unwrap();
        sender.put(objs[5].clone()).unwrap();
        assert_eq!(held(&store), ["e0", "e1", "e4", "e5"], "the oldest unused went");
        // The oldest now is e0, but it is being read: e1 goes instead.
        sender.put(objs[6].clone()).unwrap();
        assert_eq!(held(&store), ["e0", "e4", "e5", "e6"]);
        drop(reading);
        sender.put(objs[7].clone()).unwrap();
        assert_eq!(held(&store), ["e4", "e5", "e6", "e7"]);
        assert_eq!((store.evicted(), store.bytes(), store.received()), (4, 4_000, 8));
        // A key put again replaces its object in place: nothing else goes.
        sender.put(objs[4].clone()).unwrap();
        assert_eq!((held(&store).len(), store.evicted()), (4, 4));
        // More than the whole store stops it, as a store that does not evict stops, and
        // evicts nothing on the way.
        let (_big_seg, big) = objects(&tx, "big", 1, 5_000);
        let e = sender.put(big[0].clone()).unwrap_err();
        assert!(e.to_string().contains("out of space"), "{e}");
        let e = store.wait_closed(WAIT).unwrap_err();
        assert!(matches!(e, Error::NoSpace(_)), "{e}");
        assert_eq!(held(&store), ["e4", "e5", "e6", "e7"]);
        assert_eq!(store.evicted(), 4);
    }

    #[test]
    fn a_store_that_does_not_evict_stops_when_full() {
        let (rx, tx) = (agent("st-noevict-rx", None), agent("st-noevict-tx", None));
        let (store, mut sender) = pair((&rx, &tx), 64 << 10, 1, |c| StoreReceiver::new(c, Some(2_000)));
        assert!(!store.evicts());
        let (_seg, objs) = objects(&tx, "n", 3, 1_000);
        sender.put(objs[0].clone()).unwrap();
        sender.put(objs[1].clone()).unwrap();
        assert!(sender.put(objs[2].clone()).is_err());
        assert!(matches!(store.wait_closed(WAIT), Err(Error::NoSpace(_))));
        assert_eq!(held(&store), ["n0", "n1"]);
        assert_eq!(store.evicted(), 0);
    }

    /// Writes that land after `slices` slices of waiting (never, with `never`), checking
    /// the caller's interrupt between slices as a pipe's do.
    #[derive(Default)]
    struct Writes {
        slices: Cell<u32>,
        never: bool,
        aborted: RefCell<Option<String>>,
    }

    impl WritesInFlight for Writes {
        fn settle_writes(&self) -> Result<()> {
            let deadline = if self.never { Instant::now() } else { Instant::now() + WAIT };
            let settled = interrupt::until(deadline, |_| {
                let left = self.slices.get();
                self.slices.set(left.saturating_sub(1));
                Ok((left == 0 && !self.never).then_some(()))
            })?;
            settled.ok_or_else(|| Error::Timeout("a write did not finish".into()))
        }

        fn abort(&self, reason: &str) {
            self.aborted.borrow_mut().get_or_insert_with(|| reason.to_string());
        }
    }

    #[test]
    fn memory_is_let_go_only_once_no_write_reads_it_even_when_the_caller_is_interrupted() {
        let writes = Writes { slices: Cell::new(3), ..Writes::default() };
        let settled = interrupt::interruptible(|| true, || settle_before_reuse(&writes, "discarded"));
        assert!(settled.is_ok(), "{settled:?}");
        assert_eq!(writes.slices.get(), 0, "every write landed first");
        assert!(writes.aborted.borrow().is_none(), "a stream whose writes landed goes on");
    }

    #[test]
    fn writes_that_do_not_land_in_time_abort_the_stream() {
        let writes = Writes { never: true, ..Writes::default() };
        let e = settle_before_reuse(&writes, "objects were discarded").unwrap_err();
        assert!(matches!(e, Error::Timeout(_)), "{e}");
        let reason = writes.aborted.borrow().clone().expect("the receiver is told");
        assert!(reason.contains("objects were discarded while their writes were in flight"), "{reason}");
    }

    #[test]
    fn an_interrupted_discard_returns_with_no_write_in_flight() {
        // Over tcp, where 64 MiB of writes take a while to land.
        let (rx, tx) =
            (agent("st-discard-rx", Some(TransportKind::Tcp)), agent("st-discard-tx", Some(TransportKind::Tcp)));
        const LEN: usize = 16 << 20;
        let (_store, mut sender) = pair((&rx, &tx), 5 * LEN as u64, 100, |c| StoreReceiver::new(c, None));
        let (_seg, objs) = objects(&tx, "d", 4, LEN);
        for o in &objs {
            sender.queue(o.clone()).unwrap();
        }
        let discarded = interrupt::interruptible(|| true, || sender.discard_pending());
        assert_eq!(discarded.len(), 4);
        let pipe = sender.channel.pipe();
        assert_eq!(pipe.progress().unwrap().written, pipe.position(), "a write still reads discarded memory");
    }
}
