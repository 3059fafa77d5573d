//! The cache engine: stores a request's KV cache in chunks keyed by their token prefix,
//! and gives back the longest stored prefix of another request.
//!
//! Tiers, searched in this order: the local GPU, local host memory (pinned when a GPU is
//! used), and a remote peer. Each local tier evicts its least recently used chunks; the
//! GPU tier's go down to the host tier, the host tier's are dropped. A chunk is used
//! when a store finds or puts it, and when a lookup or a retrieve finds it; a prompt's
//! chunks are used last to first, so that its prefix is the most recent part of it: a
//! chunk is found only after every chunk before it, and a full tier evicts the tails of
//! prompts before their starts.
//!
//! With a remote sink (the prefill side), every new chunk is also put to the peer's
//! store, committed in batches; with a remote source (the decode side), chunks the peer
//! put are found there, where they are usable (see [`CacheEngine::lookup`]). The engine
//! never removes anything from its remote source: a long-running one needs a source
//! that evicts ([`StoreReceiver::evicting`]), and marks the remote chunks it uses last
//! to first too, so that source lets go of the ends of prompts before their starts.
//!
//! A sink whose stream broke (its peer restarted, or ran out of space) fails every put
//! from then on: the store that finds it broken fails (the peer lacks its chunks), and
//! the engine lets go of the sink and goes on caching locally.
//!
//! A chunk's slot stays pinned until the peer holds the commit that carries it. Commits
//! are sealed (sent whole) without waiting for the peer, and waited for only when a
//! slot is needed (in the first tier, or in the host tier for a chunk the GPU tier
//! evicts) or more of them are in flight than allowed: gathering the next chunks and
//! sending them overlaps the peer taking in the last ones. So that a full tier never
//! waits for a commit still being filled, a commit takes at most the smallest tier's
//! slots shared among the commits allowed in flight and the one filling (a chunk is put
//! from whichever tier holds it, so any tier may hold a commit's pins). A chunk leaves
//! the GPU tier only once its copy is in the host tier: a failure on the way loses it
//! from neither.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_core::{Agent, Error, MemKind, Result};
use freight_stream::{Outgoing, StoreReceiver, StoreSender, StoredObject};

use crate::chunk_bytes::{copy, move_runs, staged_on};
use crate::gpu_scratch;
use crate::key::{self, chunk_keys, ChunkKey};
use crate::layout::{runs_of_valid, KvLayout, KvShape, Run};
use crate::place::{Direction, Place};
use crate::tier::Tier;

/// What an engine is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Tokens per chunk (the seed's engines use 256).
    pub chunk_tokens: u64,
    pub shape: KvShape,
    /// The GPU of the GPU tier, and the GPU that host memory is pinned for. A remote
    /// chunk in GPU memory is used only when it is on this GPU (never without one).
    pub gpu: Option<usize>,
    /// Bytes of the GPU tier (0: none; needs `gpu`).
    pub gpu_bytes: u64,
    /// Bytes of the host tier (0: none).
    pub host_bytes: u64,
}

/// The caller's KV memory for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvMemory {
    /// Host (DRAM) or GPU (VRAM) memory; other kinds are refused.
    pub place: Place,
    /// Bytes the caller owns at `place` (checked against the layout).
    pub len: u64,
    pub layout: KvLayout,
}

/// What a `store` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreReport {
    /// Chunks of the request.
    pub chunks: usize,
    /// Chunks that were new (the others were stored already).
    pub new_chunks: usize,
    /// Bytes copied out of the KV memory.
    pub bytes: u64,
    /// Where the store's time went.
    pub times: StoreTimes,
}

/// A store's time in its three parts (together, about all of it): what to tune follows
/// from which one is large.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreTimes {
    /// Copying chunks out of the KV memory into the tiers, and waiting for those copies.
    pub gathering: Duration,
    /// Handing chunks to the remote sink and sending full batches and sealed commits.
    pub sending: Duration,
    /// Waiting for the remote peer to hold commits.
    pub waiting_for_peer: Duration,
}

pub struct CacheEngine {
    config: CacheConfig,
    /// The key every prompt's chunk chain starts from ([`key::root`]).
    root: u128,
    /// Dropped before the tiers (fields drop in order): its writes read their slots.
    remote_out: Option<StoreSender>,
    tiers: Vec<Tier>,
    /// GPUs this engine queued moves on that it has not waited for yet.
    queued_on: Vec<usize>,
    /// Chunks of the first tier whose gather is among those moves: their slots hold
    /// their bytes only once the moves are done.
    landing: Vec<u128>,
    /// Chunks put to the remote peer (so that they are not sent twice).
    sent: HashSet<u128>,
    /// Chunks whose slot a put still reads, as (tier, key): those not sealed into a
    /// commit yet, then those of each sealed commit, oldest first.
    unsealed: Vec<(usize, u128)>,
    sealed: VecDeque<Vec<(usize, u128)>>,
    /// Sealed commits that may await the peer while the engine goes on.
    commits_in_flight: usize,
    remote_in: Option<StoreReceiver>,
    /// The time of the store under way, so far.
    times: StoreTimes,
}

/// Which part of a store's time a call on the sink counts in.
enum Part {
    Sending,
    Waiting,
}

/// Sealed commits allowed to await the peer, unless told otherwise.
pub const DEFAULT_COMMITS_IN_FLIGHT: usize = 1;

/// Where a chunk that can be copied into KV memory is.
enum Found {
    Local(Place),
    /// Held by the remote source's store (kept alive while a move reads it).
    Remote(Arc<StoredObject>, Place),
}

impl CacheEngine {
    /// An engine whose tiers are memory of `agent` (registered, so that chunks can be
    /// sent from where they are).
    pub fn new(agent: &Arc<Agent>, config: CacheConfig) -> Result<CacheEngine> {
        config.shape.validate()?;
        if config.chunk_tokens == 0 {
            return Err(Error::InvalidArgument("chunks hold at least one token".into()));
        }
        let slot = config.shape.checked_chunk_bytes(config.chunk_tokens)?;
        let mut tiers = Vec::new();
        if config.gpu_bytes > 0 {
            let gpu = config.gpu.ok_or_else(|| Error::InvalidArgument("a GPU tier needs a GPU".into()))?;
            tiers.push(Tier::new(agent, config.gpu_bytes, slot, Some(gpu), None)?);
        }
        if config.host_bytes > 0 {
            tiers.push(Tier::new(agent, config.host_bytes, slot, None, config.gpu)?);
        }
        if tiers.is_empty() {
            return Err(Error::InvalidArgument("a cache engine needs a GPU or a host tier".into()));
        }
        tracing::info!(
            chunk_tokens = config.chunk_tokens,
            chunk_bytes = slot,
            tiers = ?tiers.iter().map(|t| t.name).collect::<Vec<_>>(),
            "cache engine ready"
        );
        Ok(CacheEngine {
            root: key::root(&[], &config.shape, config.chunk_tokens),
            config,
            tiers,
            queued_on: Vec::new(),
            landing: Vec::new(),
            remote_out: None,
            sent: HashSet::new(),
            unsealed: Vec::new(),
            sealed: VecDeque::new(),
            commits_in_flight: DEFAULT_COMMITS_IN_FLIGHT,
            times: StoreTimes::default(),
            remote_in: None,
        })
    }

    /// Keys chunks in `namespace` as well as by their tokens, KV shape and chunk size:
    /// what else the KV of a prompt depends on (model, adapter, TP rank, dtype...), so
    /// that engines that differ in it never take each other's chunks, also through one
    /// store. Empty unless set. Set it before the first store: chunks stored before are
    /// not found after.
    pub fn with_namespace(mut self, namespace: &[u8]) -> CacheEngine {
        self.root = key::root(namespace, &self.config.shape, self.config.chunk_tokens);
        self
    }

    /// Also puts every new chunk to a remote store (the prefill side).
    /// Chunks count as sent once this sink's peer holds them; a chunk the peer dropped
    /// since is not put again (the engine remembers the chunks it sent, 16 bytes each).
    /// A sink whose stream breaks is let go of (see [`CacheEngine::store`]).
    ///
    /// A sink with objects queued or sealed and not yet committed is refused (and
    /// dropped, which breaks its stream as for any sender dropped so): the engine
    /// unpins a commit's slots when the sink says its oldest commit is held, so the
    /// sink's commits must be the engine's own.
    pub fn with_remote_sink(mut self, sink: StoreSender) -> Result<CacheEngine> {
        let uncommitted = sink.pending();
        if uncommitted > 0 {
            return Err(Error::InvalidArgument(format!(
                "the remote sink has {uncommitted} objects not committed; commit them before giving it to a cache engine"
            )));
        }
        self.remote_out = Some(sink);
        self.sent.clear();
        Ok(self)
    }

    /// How many sealed commits may await the remote sink's peer while the engine goes
    /// on (0: each commit is waited for as soon as it is sealed).
    pub fn with_commits_in_flight(mut self, commits: usize) -> CacheEngine {
        self.commits_in_flight = commits;
        self
    }

    /// Also finds chunks in a remote peer's puts (the decode side). The engine only
    /// reads the source and never removes a chunk from it: give a long-running engine
    /// one that evicts ([`StoreReceiver::evicting`]), which a plain source with a
    /// capacity is not (it stops for good once full, and one without keeps everything).
    pub fn with_remote_source(mut self, source: StoreReceiver) -> CacheEngine {
        self.remote_in = Some(source);
        self
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The chunk keys of `tokens`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<ChunkKey> {
        chunk_keys(self.root, tokens, self.config.chunk_tokens as usize)
    }

    /// Chunks held in each local tier, by name.
    pub fn occupancy(&self) -> Vec<(&'static str, usize)> {
        self.tiers.iter().map(|t| (t.name, t.len())).collect()
    }

    /// The remote store this engine reads, if any.
    pub fn remote_source(&self) -> Option<&StoreReceiver> {
        self.remote_in.as_ref()
    }

    /// Checks `kv` for `tokens` once per call: its chunks' runs are then computed
    /// without checking the layout again ([`runs_of_valid`]).
    fn check_kv(&self, tokens: &[u32], kv: &KvMemory) -> Result<()> {
        // Anything but GPU memory is copied as host memory: another kind's address
        // would be taken for a pointer.
        if !matches!(kv.place.kind, MemKind::Dram | MemKind::Vram) {
            return Err(Error::InvalidArgument(format!(
                "KV memory must be host (DRAM) or GPU (VRAM) memory, not {}",
                kv.place.kind.as_str()
            )));
        }
        kv.layout.validate(tokens.len() as u64)?;
        let need = kv.layout.checked_bytes(&self.config.shape)?;
        if kv.len < need {
            return Err(Error::InvalidArgument(format!("the KV memory has {} bytes; its layout needs {need}", kv.len)));
        }
        let capacity = kv.layout.capacity()?;
        if tokens.len() as u64 > capacity {
            return Err(Error::InvalidArgument(format!(
                "{} tokens do not fit KV memory that holds {capacity}",
                tokens.len()
            )));
        }
        if let (Some(gpu), MemKind::Vram) = (self.config.gpu, kv.place.kind) {
            if kv.place.dev != gpu as u64 {
                return Err(Error::InvalidArgument(format!(
                    "the KV memory is on GPU {} but the cache engine works on GPU {gpu}",
                    kv.place.dev
                )));
            }
        }
        Ok(())
    }

    /// Stores the KV cache of `tokens` (token `i` at position `i` of `kv`). Chunks
    /// stored already are skipped. Returns once any remote peer holds every new chunk.
    /// On failure nothing stays queued for the remote peer or pinned: chunks it may
    /// lack are put again by a later store. A failure that broke the remote sink's
    /// stream (its peer aborted it: restarted, out of space) is returned all the same,
    /// as the peer lacks chunks, but the engine lets go of the sink: later stores cache
    /// locally only, instead of failing (and, putting last chunk first, keeping only the
    /// tails of prompts).
    pub fn store(&mut self, tokens: &[u32], kv: &KvMemory) -> Result<StoreReport> {
        self.times = StoreTimes::default();
        let stored = self.store_queued(tokens, kv);
        let stored = self.settled(stored);
        let mut report = self.or_forget(stored)?;
        report.times = self.times;
        Ok(report)
    }

    /// [`CacheEngine::store`], but moves into host memory may still be in flight.
    fn store_queued(&mut self, tokens: &[u32], kv: &KvMemory) -> Result<StoreReport> {
        self.check_kv(tokens, kv)?;
        let keys = self.keys(tokens);
        let mut report = StoreReport { chunks: keys.len(), ..StoreReport::default() };
        // Last to first: the prefix is used last, so a tier too small for the prompt
        // keeps its start (see the module's doc).
        let position: HashMap<u128, usize> = keys.iter().enumerate().map(|(i, k)| (k.hash, i)).collect();
        for (i, key) in keys.iter().enumerate().rev() {
            let local = self.tiers.iter_mut().any(|t| t.touch(key.hash));
            let remote = self.remote_out.is_none() || self.sent.contains(&key.hash);
            if local && remote {
                continue;
            }
            // A chunk that would push one before it in the prompt out of the cache is
            // not worth gathering: the next step gathers that one again, pushing out
            // the one before it, and a prompt longer than the tiers together would be
            // gathered whole at every store.
            let pushes_out_prefix = || self.leaving().and_then(|v| position.get(&v)).is_some_and(|&at| at < i);
            if !local && remote && pushes_out_prefix() {
                continue;
            }
            if !local {
                self.release_held()?;
                let len = self.config.shape.chunk_bytes(key.tokens as u64);
                let r = runs_of_valid(&self.config.shape, &kv.layout, key.start as u64, key.tokens as u64)?;
                let place = self.make_room(key.hash, len)?;
                match self.move_chunk(kv.place, place, &r, Direction::Gather) {
                    Ok(true) => self.landing.push(key.hash),
                    Ok(false) => {}
                    Err(e) => {
                        self.tiers[0].remove(key.hash);
                        return Err(e);
                    }
                }
                report.new_chunks += 1;
                report.bytes += len;
            }
            if !remote {
                // The put reads the chunk: it must have landed.
                self.wait_moves()?;
                self.put_remote(key)?;
            }
        }
        self.commit_remote()?;
        Ok(report)
    }

    /// [`move_runs`], remembering the GPU of a move still in flight when it returns
    /// (true then).
    fn move_chunk(&mut self, kv: Place, chunk: Place, runs: &[Run], direction: Direction) -> Result<bool> {
        let staged = staged_on(kv, chunk);
        if let Some(gpu) = staged.filter(|g| !self.queued_on.contains(g)) {
            self.queued_on.push(gpu);
        }
        let started = Instant::now();
        let moved = move_runs(kv, chunk, runs, direction);
        self.times.gathering += started.elapsed();
        moved?;
        Ok(staged.is_some())
    }

    /// Waits for the moves this engine queued. When one failed, the chunks they were
    /// gathering are forgotten: their slots may hold other bytes.
    fn wait_moves(&mut self) -> Result<()> {
        let started = Instant::now();
        let mut waited = Ok(());
        for gpu in std::mem::take(&mut self.queued_on) {
            let r = gpu_scratch::wait(gpu);
            waited = waited.and(r);
        }
        self.times.gathering += started.elapsed();
        let landing = std::mem::take(&mut self.landing);
        if let Err(e) = &waited {
            tracing::warn!(error = %e, chunks = landing.len(), "moves into the cache failed; their chunks are dropped");
            for key in landing {
                self.tiers[0].remove(key);
            }
        }
        waited
    }

    /// `result`, once every move it queued has landed (also when it failed: nothing may
    /// be in flight after a public method returns).
    fn settled<T>(&mut self, result: Result<T>) -> Result<T> {
        let waited = self.wait_moves();
        let value = result?;
        waited?;
        Ok(value)
    }

    /// The chunk that a new one in the first tier would push out of the cache, if any:
    /// each tier's victim moves down to the next tier, and the last tier's is dropped.
    fn leaving(&self) -> Option<u128> {
        let mut leaving = self.tiers[0].victim()?;
        for below in &self.tiers[1..] {
            if below.contains(leaving) {
                return None;
            }
            leaving = below.victim()?;
        }
        Some(leaving)
    }

    /// A slot in the first tier for a new chunk. The chunk it evicts is copied down a
    /// tier first, and evicted only once that copy is done: a failure on the way
    /// leaves it where it was.
    fn make_room(&mut self, key: u128, len: u64) -> Result<Place> {
        loop {
            // Waits on the way may unpin chunks and so change the victim: look again
            // until the one the insert evicts has a copy below (or no tier below).
            if let Some(victim) = self.tiers[0].victim() {
                if self.demote(victim)? {
                    continue;
                }
            }
            match self.tiers[0].insert(key, len) {
                Ok((place, evicted)) => {
                    if let Some((gone, _)) = evicted {
                        tracing::debug!(tier = self.tiers[0].name, chunk = %format_args!("{:032x}", gone.key), "evicted");
                    }
                    return Ok(place);
                }
                Err(Error::NoSpace(_)) if self.pinned() > 0 => self.wait_for_room()?,
                Err(e) => return Err(e),
            }
        }
    }

    /// Copies the first tier's chunk `key` into the second tier, unless there is none or
    /// it holds the chunk already; true when it copied. The chunk stays in the first tier.
    fn demote(&mut self, key: u128) -> Result<bool> {
        if self.tiers.get(1).is_none_or(|t| t.contains(key)) {
            return Ok(false);
        }
        let (from, len) = self.tiers[0].peek(key).expect("a victim is held");
        // The slot it gets may be one that a move still in flight writes to.
        self.wait_moves()?;
        let place = loop {
            match self.tiers[1].insert(key, len) {
                Ok((place, evicted)) => {
                    if let Some((gone, _)) = evicted {
                        tracing::debug!(tier = self.tiers[1].name, chunk = %format_args!("{:032x}", gone.key), "evicted");
                    }
                    break place;
                }
                // Full of chunks put from it: the oldest commit frees some once held.
                Err(Error::NoSpace(_)) if self.pinned() > 0 => self.wait_for_room()?,
                Err(e) => return Err(e),
            }
        };
        let copied = copy(from, place, &[(from.addr, place.addr, len)]);
        if copied.is_err() {
            self.tiers[1].remove(key);
        }
        copied.map(|()| true)
    }

    /// Chunks whose slot a put still reads.
    fn pinned(&self) -> usize {
        self.unsealed.len() + self.sealed.iter().map(Vec::len).sum::<usize>()
    }

    /// Waits until the peer holds the oldest commit (sealing the one filling first when
    /// none is sealed), which unpins its chunks.
    fn wait_for_room(&mut self) -> Result<()> {
        let before = self.pinned();
        if self.sealed.is_empty() {
            self.seal_remote()?;
        }
        self.wait_oldest_remote()?;
        // Each call unpins a commit's chunks (the sink and the engine seal the same
        // commits), so the callers' loops end; a slip would spin, so it fails.
        if self.pinned() >= before {
            return Err(Error::InvalidState("the remote sink held no commit to free slots with".into()));
        }
        Ok(())
    }

    fn put_remote(&mut self, key: &ChunkKey) -> Result<()> {
        let (tier, desc) = self
            .tiers
            .iter()
            .enumerate()
            .find_map(|(i, t)| t.desc(key.hash).map(|d| (i, d)))
            .expect("a chunk is stored locally before it is sent");
        let object = Outgoing { key: key.name(), kind: self.tiers[tier].kind(), local: desc, meta: key.meta() };
        // A commit's objects share one memory kind: a chunk put from another tier
        // (one demoted since a failed commit) starts a commit of its own.
        if self.unsealed.first().is_some_and(|&(t, _)| self.tiers[t].kind() != object.kind) {
            self.seal_remote()?;
        }
        self.tiers[tier].pin(key.hash);
        self.unsealed.push((tier, key.hash));
        self.sent.insert(key.hash);
        let queued = self.timed(Part::Sending, |sink| sink.queue(object));
        self.or_forget(queued)?;
        if self.unsealed.len() >= self.seal_every() {
            self.seal_remote()?;
        }
        Ok(())
    }

    fn sink(&mut self) -> &mut StoreSender {
        self.remote_out.as_mut().expect("only called with a sink")
    }

    /// `f` on the sink, its time counted as `part` of the store's.
    fn timed<T>(&mut self, part: Part, f: impl FnOnce(&mut StoreSender) -> T) -> T {
        let started = Instant::now();
        let out = f(self.sink());
        let spent = started.elapsed();
        match part {
            Part::Sending => self.times.sending += spent,
            Part::Waiting => self.times.waiting_for_peer += spent,
        }
        out
    }

    /// Chunks per commit: the sink's commit size, or fewer, so that the commits in
    /// flight and the one filling fit together in any tier (each may hold all their
    /// chunks: a chunk is put from the tier that holds it).
    fn seal_every(&self) -> usize {
        let sink = self.remote_out.as_ref().map_or(usize::MAX, |s| s.commit_size());
        let smallest = self.tiers.iter().map(Tier::slots).min().unwrap_or(0);
        let share = smallest / self.commits_in_flight.saturating_add(1);
        sink.min(share.max(1))
    }

    /// Sends the chunks put since the last commit as one, then waits for the oldest
    /// commits while more than allowed are in flight.
    fn seal_remote(&mut self) -> Result<()> {
        let sealed = self.timed(Part::Sending, StoreSender::seal);
        if self.or_forget(sealed)? {
            self.sealed.push_back(std::mem::take(&mut self.unsealed));
        }
        while self.sealed.len() > self.commits_in_flight {
            self.wait_oldest_remote()?;
        }
        Ok(())
    }

    fn wait_oldest_remote(&mut self) -> Result<()> {
        let held = self.timed(Part::Waiting, StoreSender::wait_oldest);
        if self.or_forget(held)?.is_some() {
            self.unpin_oldest();
        }
        Ok(())
    }

    /// Unpins the chunks of every commit the peer holds by now.
    fn release_held(&mut self) -> Result<()> {
        if self.sealed.is_empty() {
            return Ok(());
        }
        let held = self.timed(Part::Waiting, StoreSender::poll);
        for _ in 0..self.or_forget(held)?.len() {
            self.unpin_oldest();
        }
        Ok(())
    }

    fn unpin_oldest(&mut self) {
        let chunks = self.sealed.pop_front().expect("the sink and the engine seal the same commits");
        for (tier, key) in chunks {
            self.tiers[tier].unpin(key);
        }
    }

    /// Sends whatever is not committed and waits until the peer holds every chunk put.
    fn commit_remote(&mut self) -> Result<()> {
        if self.remote_out.is_none() {
            return Ok(());
        }
        // It sends what is left too, but mostly waits.
        let committed = self.timed(Part::Waiting, StoreSender::commit);
        self.or_forget(committed)?;
        self.unpin_all();
        Ok(())
    }

    /// `result`; when it is a failure, the chunks not known to be held are forgotten
    /// first. What the peer may lack is not "sent", so a later store puts it again (from
    /// its slot where it is still held locally, else from a new gather). The sink
    /// forgets those puts, whose slots are reused from here on: a retried commit must
    /// not send their new contents.
    fn or_forget<T>(&mut self, result: Result<T>) -> Result<T> {
        let e = match result {
            Ok(value) => return Ok(value),
            Err(e) => e,
        };
        if !self.sealed.is_empty() || !self.unsealed.is_empty() {
            for (_, key) in self.sealed.iter().flatten().chain(&self.unsealed) {
                self.sent.remove(key);
            }
            if let Some(sink) = self.remote_out.as_mut() {
                let dropped = sink.discard_pending();
                tracing::warn!(error = %e, chunks = dropped.len(), "the remote store may lack chunks put since its last commit; they will be put again");
            }
            self.unpin_all();
        }
        self.let_go_of_broken_sink(&e);
        Err(e)
    }

    /// Drops the remote sink when its stream is broken: every put would fail from here
    /// on. Nothing of it is pinned or queued any more ([`CacheEngine::or_forget`] saw to
    /// that), and the chunks sent to its peer say nothing about a sink given later.
    fn let_go_of_broken_sink(&mut self, e: &Error) {
        if !self.remote_out.as_ref().is_some_and(StoreSender::broken) {
            return;
        }
        debug_assert_eq!(self.pinned(), 0, "a sink is let go of with nothing of it pinned");
        tracing::warn!(error = %e, "the remote sink's stream broke; the cache engine lets go of it and caches locally only");
        self.remote_out = None;
        self.sent.clear();
    }

    fn unpin_all(&mut self) {
        for (tier, key) in self.sealed.drain(..).flatten().chain(self.unsealed.drain(..)) {
            self.tiers[tier].unpin(key);
        }
    }

    /// Tokens of the longest prefix of `tokens` whose chunks are stored (in any tier)
    /// and can be retrieved into KV memory on the engine's GPU (or in host memory):
    /// what [`CacheEngine::retrieve`] would copy. Marks those chunks used.
    pub fn lookup(&mut self, tokens: &[u32]) -> usize {
        let keys = self.keys(tokens);
        let found = keys.iter().take_while(|k| self.find(k).is_some()).count();
        self.touch(&keys[..found]);
        keys[..found].last().map_or(0, ChunkKey::end)
    }

    /// Copies the longest stored prefix of `tokens` into `kv` (token `i` at position
    /// `i`) and returns its length in tokens; positions after it are left as they were.
    /// A chunk that cannot be copied (a remote one with the wrong length or meta, or in
    /// GPU memory of another GPU than the engine's, or of any GPU when the engine has
    /// none) ends the prefix, as in [`CacheEngine::lookup`].
    pub fn retrieve(&mut self, tokens: &[u32], kv: &KvMemory) -> Result<usize> {
        // Remote chunks read by moves in flight stay alive until those are done.
        let mut reading = Vec::new();
        let found = self.retrieve_queued(tokens, kv, &mut reading);
        self.settled(found)
    }

    /// [`CacheEngine::retrieve`], but moves out of host memory may still be in flight;
    /// the remote chunks they read are kept in `reading`.
    fn retrieve_queued(
        &mut self,
        tokens: &[u32],
        kv: &KvMemory,
        reading: &mut Vec<Arc<StoredObject>>,
    ) -> Result<usize> {
        self.check_kv(tokens, kv)?;
        let keys = self.keys(tokens);
        let mut found = 0;
        for key in &keys {
            let place = match self.find(key) {
                None => break,
                Some(Found::Local(place)) => place,
                Some(Found::Remote(object, place)) => {
                    reading.push(object);
                    place
                }
            };
            let r = runs_of_valid(&self.config.shape, &kv.layout, key.start as u64, key.tokens as u64)?;
            self.move_chunk(kv.place, place, &r, Direction::Scatter)?;
            found += 1;
        }
        self.touch(&keys[..found]);
        Ok(keys[..found].last().map_or(0, ChunkKey::end))
    }

    /// Where chunk `key` can be copied from into KV memory. A chunk whose bytes do not
    /// fit its key, or a remote one the engine cannot reach ([`out_of_reach`]), is not
    /// found: the prefix ends before it.
    fn find(&self, key: &ChunkKey) -> Option<Found> {
        let len = self.config.shape.chunk_bytes(key.tokens as u64);
        if let Some((place, stored)) = self.tiers.iter().find_map(|t| t.peek(key.hash)) {
            if stored == len {
                return Some(Found::Local(place));
            }
            tracing::warn!(chunk = %key.name(), bytes = stored, want = len, "a local chunk has the wrong length; taken for a miss");
            return None;
        }
        let object = self.remote_in.as_ref()?.get(&key.name())?;
        let (kind, addr, dev) = object.data.location();
        let place = match kind {
            MemKind::Vram => Place::gpu(addr, dev),
            _ => Place::host(addr),
        };
        let unusable = if object.len() != len {
            Some(format!("{} bytes where {} tokens take {len}", object.len(), key.tokens))
        } else if object.meta != key.meta() {
            Some("its meta names another chunk".to_string())
        } else {
            out_of_reach(self.config.gpu, kind, dev)
        };
        match unusable {
            None => Some(Found::Remote(object, place)),
            Some(why) => {
                tracing::warn!(chunk = %key.name(), why = %why, "a remote chunk cannot be used; taken for a miss");
                None
            }
        }
    }

    /// Marks `keys` (a prompt's prefix) used, last to first; those found in the remote
    /// source there too (`find` got them first to last, the wrong order to evict in).
    fn touch(&mut self, keys: &[ChunkKey]) {
        for key in keys.iter().rev() {
            let mut local = false;
            for tier in &mut self.tiers {
                local |= tier.touch(key.hash);
            }
            if let (false, Some(source)) = (local, &self.remote_in) {
                source.touch(&key.name());
            }
        }
    }

    /// Ends the stream to the remote peer (after committing what is pending).
    pub fn close(mut self) -> Result<()> {
        self.commit_remote()?;
        match self.remote_out.take() {
            Some(sink) => sink.close(),
            None => Ok(()),
        }
    }
}

/// Why an engine on GPU `gpu` cannot copy a remote chunk in memory of `kind` (on GPU
/// `dev`) into KV memory, if it cannot. KV memory is on the engine's GPU or in host
/// memory; `lookup` has no KV memory to ask, so both it and `retrieve` go by the
/// engine's GPU alone, and an engine with none takes no chunk in GPU memory: `lookup`
/// could not tell which GPU the KV memory of the next `retrieve` is on.
fn out_of_reach(gpu: Option<usize>, kind: MemKind, dev: u64) -> Option<String> {
    match (kind, gpu) {
        (MemKind::Vram, None) => Some(format!("it is on GPU {dev} and the cache engine has no GPU")),
        (MemKind::Vram, Some(g)) if g as u64 != dev => Some(format!("it is on GPU {dev}, not GPU {g}")),
        _ => None,
    }
}

#[cfg(test)]
#[path = "../tests/support/mod.rs"]
mod support;

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape { layers: 1, heads: 1, head_dim: 4, elem_bytes: 2 };
    const CHUNK: u64 = 4;

    fn engine(agent: &Arc<Agent>) -> CacheEngine {
        let config = CacheConfig {
            chunk_tokens: CHUNK,
            shape: SHAPE,
            gpu: None,
            gpu_bytes: 0,
            host_bytes: 8 * SHAPE.chunk_bytes(CHUNK),
        };
        CacheEngine::new(agent, config).unwrap()
    }

    /// Host KV memory for 16 tokens.
    fn host_kv(bytes: &mut [u8]) -> KvMemory {
        KvMemory {
            place: Place::host(bytes.as_mut_ptr() as u64),
            len: bytes.len() as u64,
            layout: KvLayout::Contiguous { tokens: bytes.len() as u64 / SHAPE.chunk_bytes(1) },
        }
    }

    /// An engine with two tiers of host memory, of `first` and `second` chunks: the
    /// first stands in for a GPU tier (the engine moves chunks by tier, not by kind).
    fn two_tiers(agent: &Arc<Agent>, first: u64, second: u64) -> CacheEngine {
        let slot = SHAPE.chunk_bytes(CHUNK);
        let config =
            CacheConfig { chunk_tokens: CHUNK, shape: SHAPE, gpu: None, gpu_bytes: 0, host_bytes: second * slot };
        let mut engine = CacheEngine::new(agent, config).unwrap();
        engine.tiers.insert(0, Tier::new(agent, first * slot, slot, None, None).unwrap());
        engine
    }

    fn held(engine: &CacheEngine, tier: usize, keys: &[ChunkKey]) -> Vec<usize> {
        (0..keys.len()).filter(|&i| engine.tiers[tier].contains(keys[i].hash)).collect()
    }

    #[test]
    fn a_chunk_evicted_into_a_full_second_tier_waits_for_a_commit_and_is_never_lost() {
        let (pa, da) = (support::agent("ce-unit-demote-tx", None), support::agent("ce-unit-demote-rx", None));
        let (sink, store) = support::store_pair(&pa, &da, 4 * SHAPE.chunk_bytes(CHUNK));
        let mut bytes = vec![7u8; SHAPE.chunk_bytes(16) as usize];
        let kv = host_kv(&mut bytes);
        let tokens: Vec<u32> = (0..12).collect();
        let mut engine = two_tiers(&pa, 2, 1);
        engine.store(&tokens, &kv).unwrap();
        let keys = engine.keys(&tokens);
        assert_eq!((held(&engine, 0, &keys), held(&engine, 1, &keys)), (vec![0, 1], vec![2]));
        // A pin no commit will lift: the second tier has no room, and the store fails ...
        engine.tiers[1].pin(keys[2].hash);
        let other: Vec<u32> = (100..104).collect();
        assert!(matches!(engine.store(&other, &kv), Err(Error::NoSpace(_))));
        // ... with the chunk it would have evicted from the first tier still there.
        assert_eq!(engine.lookup(&tokens), 12, "no chunk is lost");
        engine.tiers[1].unpin(keys[2].hash);
        // The last chunk put to the peer from the second tier pins it, in a commit
        // sealed and not yet known to be held: room there waits for that commit.
        let mut engine = engine.with_remote_sink(sink).unwrap();
        engine.put_remote(&keys[2]).unwrap();
        assert_eq!((engine.sealed.len(), engine.unsealed.len()), (1, 0));
        let place = engine.make_room(0xfeed, SHAPE.chunk_bytes(CHUNK)).unwrap();
        assert!(engine.sealed.is_empty(), "the commit was waited for");
        assert_eq!((held(&engine, 0, &keys), held(&engine, 1, &keys)), (vec![0], vec![1]));
        assert_eq!(engine.tiers[0].peek(0xfeed).unwrap().0, place);
        store.wait_for(&[keys[2].name().as_str()], support::WAIT).unwrap();
        engine.close().unwrap();
    }

    #[test]
    fn commits_fit_the_smallest_tier() {
        let (pa, da) = (support::agent("ce-unit-seal-tx", None), support::agent("ce-unit-seal-rx", None));
        let (sink, _store) = support::store_pair(&pa, &da, 4 * SHAPE.chunk_bytes(CHUNK));
        // Commits of up to 4; one in flight beside the one filling: 2 chunks each fit
        // the first tier, and only 1 the second.
        let engine = two_tiers(&pa, 4, 2).with_remote_sink(sink).unwrap().with_commits_in_flight(1);
        assert_eq!(engine.seal_every(), 1);
        engine.close().unwrap();
    }

    #[test]
    fn a_prompt_longer_than_both_tiers_keeps_its_prefix_and_is_not_gathered_again() {
        let a = support::agent("ce-unit-two-prefix", None);
        let mut engine = two_tiers(&a, 2, 2);
        let mut bytes = vec![7u8; SHAPE.chunk_bytes(24) as usize];
        let kv = host_kv(&mut bytes);
        // Six chunks into two tiers of two: the first four stay.
        let tokens: Vec<u32> = (0..24).collect();
        assert_eq!(engine.store(&tokens, &kv).unwrap().new_chunks, 6);
        assert_eq!(engine.lookup(&tokens), 16);
        assert_eq!(engine.store(&tokens, &kv).unwrap().new_chunks, 0, "the last two would only push out the first");
        assert_eq!(engine.lookup(&tokens), 16);
    }

    #[test]
    fn an_engine_takes_remote_chunks_on_its_own_gpu_or_in_host_memory_only() {
        assert_eq!(out_of_reach(None, MemKind::Dram, 0), None);
        assert_eq!(out_of_reach(Some(1), MemKind::Dram, 0), None);
        assert_eq!(out_of_reach(Some(1), MemKind::Vram, 1), None);
        assert!(out_of_reach(Some(1), MemKind::Vram, 0).is_some());
        // With no GPU, lookup cannot know the GPU of the KV memory retrieve will get.
        assert!(out_of_reach(None, MemKind::Vram, 0).is_some());
    }

    #[test]
    fn a_local_chunk_of_the_wrong_length_is_a_miss() {
        let a = support::agent("ce-unit-len", None);
        let mut engine = engine(&a);
        let mut bytes = vec![7u8; SHAPE.chunk_bytes(16) as usize];
        let kv = host_kv(&mut bytes);
        let tokens: Vec<u32> = (0..12).collect();
        engine.store(&tokens, &kv).unwrap();
        // What a key that named both a partial and a full chunk would leave behind.
        let second = engine.keys(&tokens)[1].hash;
        engine.tiers[0].remove(second);
        engine.tiers[0].insert(second, SHAPE.chunk_bytes(1)).unwrap();
        assert_eq!(engine.lookup(&tokens), 4);
        assert_eq!(engine.retrieve(&tokens, &kv).unwrap(), 4);
    }

    #[test]
    fn a_sink_whose_stream_broke_is_let_go_of_and_later_stores_cache_locally() {
        let (pa, da) = (support::agent("ce-unit-broken-tx", None), support::agent("ce-unit-broken-rx", None));
        let (sink, store) = support::store_pair(&pa, &da, 4 * SHAPE.chunk_bytes(CHUNK));
        let mut bytes = vec![7u8; SHAPE.chunk_bytes(16) as usize];
        let kv = host_kv(&mut bytes);
        let mut engine = engine(&pa).with_remote_sink(sink).unwrap();
        let first: Vec<u32> = (0..4).collect();
        engine.store(&first, &kv).unwrap();
        assert!(store.contains(&engine.keys(&first)[0].name()));
        // The decode side goes away (restarted, say): its end aborts the stream.
        drop(store);
        let second: Vec<u32> = (100..108).collect();
        assert!(engine.store(&second, &kv).is_err(), "the peer lacks these chunks: the caller hears of it");
        assert!(engine.remote_out.is_none(), "the broken sink is let go of");
        assert!(engine.sent.is_empty() && engine.unsealed.is_empty() && engine.sealed.is_empty());
        // Later stores work, locally, and keep whole prompts.
        let third: Vec<u32> = (200..216).collect();
        assert_eq!(engine.store(&third, &kv).unwrap().new_chunks, 4);
        assert_eq!(engine.lookup(&third), 16);
        engine.store(&second, &kv).unwrap();
        assert_eq!(engine.lookup(&second), 8);
        assert_eq!(engine.lookup(&first), 4);
        engine.close().unwrap();
    }

    #[test]
    fn a_store_that_fails_part_way_leaves_nothing_queued_or_pinned() {
        let (pa, da) = (support::agent("ce-unit-fail-tx", None), support::agent("ce-unit-fail-rx", None));
        let (sink, store) = support::store_pair(&pa, &da, 4 * SHAPE.chunk_bytes(CHUNK));
        let mut bytes = vec![7u8; SHAPE.chunk_bytes(16) as usize];
        let kv = host_kv(&mut bytes);
        let tokens: Vec<u32> = (0..12).collect();
        let mut engine = engine(&pa);
        engine.store(&tokens, &kv).unwrap();
        // Stored before the sink came: none of its chunks is sent yet. Two are put, as a
        // store does before it gathers the chunks in front of them ...
        let mut engine = engine.with_remote_sink(sink).unwrap();
        let keys = engine.keys(&tokens);
        engine.put_remote(&keys[2]).unwrap();
        engine.put_remote(&keys[1]).unwrap();
        // ... and then a gather fails: this KV memory is on a GPU there is none of.
        let longer: Vec<u32> = (0..16).collect();
        let nowhere = KvMemory { place: Place::gpu(0x1000, 999), ..kv.clone() };
        assert!(engine.store(&longer, &nowhere).is_err());
        assert!(engine.unsealed.is_empty() && engine.sealed.is_empty(), "nothing is left pinned");
        assert_eq!(engine.sink().pending(), 0, "nothing is left queued");
        assert!(engine.sent.is_empty(), "what the peer may lack is not taken for sent");
        // The next store puts every chunk again.
        engine.store(&tokens, &kv).unwrap();
        let names: Vec<String> = keys.iter().map(ChunkKey::name).collect();
        store.wait_for(&names.iter().map(String::as_str).collect::<Vec<_>>(), support::WAIT).unwrap();
        engine.close().unwrap();
    }
}
