//! The cache engine: stores a request's KV cache in chunks keyed by their token prefix,
//! and gives back the longest stored prefix of another request.
//!
//! Tiers, searched in this order: the local GPU, local host memory (pinned when a GPU is
//! used), and a remote peer. Each local tier evicts its least recently used chunks; the
//! GPU tier's go down to the host tier, the host tier's are dropped. With a remote sink
//! (the prefill side), every new chunk is also put to the peer's store, committed in
//! batches; with a remote source (the decode side), chunks the peer put are found there.
//!
//! A chunk's slot stays pinned until the peer holds the commit that carries it. Commits
//! are sealed (sent whole) without waiting for the peer, and waited for only when a
//! slot is needed or more of them are in flight than allowed: gathering the next
//! chunks and sending them overlaps the peer taking in the last ones. So that a
//! full tier never waits for a commit still being filled, a commit takes at most the
//! first tier's slots shared among the commits allowed in flight and the one filling.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use freight_core::{Agent, Error, MemKind, Result};
use freight_stream::{Outgoing, StoreReceiver, StoreSender, StoredObject};

use crate::key::{chunk_keys, ChunkKey};
use crate::layout::{runs, KvLayout, KvShape};
use crate::memory::{copy, move_runs, Direction, Place};
use crate::staging;
use crate::tier::Tier;

/// What an engine is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Tokens per chunk (the seed's engines use 256).
    pub chunk_tokens: u64,
    pub shape: KvShape,
    /// The GPU of the GPU tier, and the GPU that host memory is pinned for.
    pub gpu: Option<usize>,
    /// Bytes of the GPU tier (0: none; needs `gpu`).
    pub gpu_bytes: u64,
    /// Bytes of the host tier (0: none).
    pub host_bytes: u64,
}

/// The caller's KV memory for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvMemory {
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
}

pub struct CacheEngine {
    config: CacheConfig,
    /// Dropped before the tiers (fields drop in order): its writes read their slots.
    remote_out: Option<StoreSender>,
    tiers: Vec<Tier>,
    /// Chunks put to the remote peer (so that they are not sent twice).
    sent: HashSet<u64>,
    /// Chunks whose slot a put still reads, as (tier, key): those not sealed into a
    /// commit yet, then those of each sealed commit, oldest first.
    unsealed: Vec<(usize, u64)>,
    sealed: VecDeque<Vec<(usize, u64)>>,
    /// Sealed commits that may await the peer while the engine goes on.
    commits_in_flight: usize,
    remote_in: Option<StoreReceiver>,
}

/// Sealed commits allowed to await the peer, unless told otherwise.
pub const DEFAULT_COMMITS_IN_FLIGHT: usize = 1;

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
            config,
            tiers,
            remote_out: None,
            sent: HashSet::new(),
            unsealed: Vec::new(),
            sealed: VecDeque::new(),
            commits_in_flight: DEFAULT_COMMITS_IN_FLIGHT,
            remote_in: None,
        })
    }

    /// Also puts every new chunk to a remote store (the prefill side).
    /// Chunks count as sent once this sink's peer holds them; a chunk the peer dropped
    /// since is not put again (the engine remembers the chunks it sent, 8 bytes each).
    pub fn with_remote_sink(mut self, sink: StoreSender) -> CacheEngine {
        self.remote_out = Some(sink);
        self.sent.clear();
        self
    }

    /// How many sealed commits may await the remote sink's peer while the engine goes
    /// on (0: each commit is waited for as soon as it is sealed).
    pub fn with_commits_in_flight(mut self, commits: usize) -> CacheEngine {
        self.commits_in_flight = commits;
        self
    }

    /// Also finds chunks in a remote peer's puts (the decode side).
    pub fn with_remote_source(mut self, source: StoreReceiver) -> CacheEngine {
        self.remote_in = Some(source);
        self
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The chunk keys of `tokens`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<ChunkKey> {
        chunk_keys(tokens, self.config.chunk_tokens as usize)
    }

    /// Chunks held in each local tier, by name.
    pub fn occupancy(&self) -> Vec<(&'static str, usize)> {
        self.tiers.iter().map(|t| (t.name, t.len())).collect()
    }

    /// The remote store this engine reads, if any.
    pub fn remote_source(&self) -> Option<&StoreReceiver> {
        self.remote_in.as_ref()
    }

    fn check_kv(&self, tokens: &[u32], kv: &KvMemory) -> Result<()> {
        kv.layout.validate()?;
        let need = kv.layout.checked_bytes(&self.config.shape)?;
        if kv.len < need {
            return Err(Error::InvalidArgument(format!("the KV memory has {} bytes; its layout needs {need}", kv.len)));
        }
        if tokens.len() as u64 > kv.layout.capacity() {
            return Err(Error::InvalidArgument(format!(
                "{} tokens do not fit KV memory that holds {}",
                tokens.len(),
                kv.layout.capacity()
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
    pub fn store(&mut self, tokens: &[u32], kv: &KvMemory) -> Result<StoreReport> {
        let stored = self.store_queued(tokens, kv);
        settled(stored)
    }

    /// [`CacheEngine::store`], but moves into host memory may still be in flight.
    fn store_queued(&mut self, tokens: &[u32], kv: &KvMemory) -> Result<StoreReport> {
        self.check_kv(tokens, kv)?;
        let mut report = StoreReport::default();
        for key in self.keys(tokens) {
            report.chunks += 1;
            let local = self.tiers.iter().any(|t| t.contains(key.hash));
            let remote = self.remote_out.is_none() || self.sent.contains(&key.hash);
            if local && remote {
                continue;
            }
            if !local {
                self.release_held()?;
                let len = self.config.shape.chunk_bytes(key.tokens as u64);
                let place = self.make_room(key.hash, len)?;
                let r = runs(&self.config.shape, &kv.layout, key.start as u64, key.tokens as u64)?;
                if let Err(e) = move_runs(kv.place, place, &r, Direction::Gather) {
                    self.tiers[0].remove(key.hash);
                    return Err(e);
                }
                report.new_chunks += 1;
                report.bytes += len;
            }
            if !remote {
                // The put reads the chunk: it must have landed.
                staging::wait_all()?;
                self.put_remote(&key)?;
            }
        }
        self.commit_remote()?;
        Ok(report)
    }

    /// A slot in the first tier for a new chunk, moving what it evicts down a tier.
    fn make_room(&mut self, key: u64, len: u64) -> Result<Place> {
        let (place, evicted) = loop {
            match self.tiers[0].insert(key, len) {
                // Every slot waits for a put: the oldest commit frees some once held.
                Err(Error::NoSpace(_)) if !self.sealed.is_empty() || !self.unsealed.is_empty() => {
                    if self.sealed.is_empty() {
                        self.seal_remote()?;
                    }
                    // Each pass frees a commit's slots (the sink and the engine seal the
                    // same commits), so this loop ends; a slip would spin, so it fails.
                    let before = self.sealed.len();
                    self.wait_oldest_remote()?;
                    if self.sealed.len() >= before {
                        return Err(Error::InvalidState("the remote sink held no commit to free slots with".into()));
                    }
                }
                other => break other?,
            }
        };
        if let Some((gone, from)) = evicted {
            // The slot holds the evicted chunk's bytes until the gather: the new key
            // must not name them if the move fails.
            if let Err(e) = self.demote(1, gone.key, from, gone.len) {
                self.tiers[0].remove(key);
                return Err(e);
            }
        }
        Ok(place)
    }

    /// Moves an evicted chunk into tier `to` (dropped when there is no such tier).
    fn demote(&mut self, to: usize, key: u64, from: Place, len: u64) -> Result<()> {
        let Some(tier) = self.tiers.get_mut(to) else { return Ok(()) };
        if tier.contains(key) {
            return Ok(());
        }
        // The slot it gets may be one that a move still in flight writes to.
        staging::wait_all()?;
        let (place, evicted) = tier.insert(key, len)?;
        if let Some((gone, _)) = evicted {
            tracing::debug!(tier = tier.name, chunk = gone.key, "evicted");
        }
        let copied = copy(from, place, &[(from.addr, place.addr, len)]);
        if copied.is_err() {
            tier.remove(key);
        }
        copied
    }

    fn put_remote(&mut self, key: &ChunkKey) -> Result<()> {
        let (tier, desc) = self
            .tiers
            .iter()
            .enumerate()
            .find_map(|(i, t)| t.desc(key.hash).map(|d| (i, d)))
            .expect("a chunk is stored locally before it is sent");
        let object = Outgoing {
            key: key.name(),
            kind: self.tiers[tier].kind(),
            local: desc,
            meta: (key.tokens as u64).to_le_bytes().to_vec(),
        };
        // A commit's objects share one memory kind: a chunk put from another tier
        // (one demoted since a failed commit) starts a commit of its own.
        if self.unsealed.first().is_some_and(|&(t, _)| self.tiers[t].kind() != object.kind) {
            self.seal_remote()?;
        }
        self.tiers[tier].pin(key.hash);
        self.unsealed.push((tier, key.hash));
        self.sent.insert(key.hash);
        let queued = self.sink().queue(object);
        self.or_forget(queued)?;
        if self.unsealed.len() >= self.seal_every() {
            self.seal_remote()?;
        }
        Ok(())
    }

    fn sink(&mut self) -> &mut StoreSender {
        self.remote_out.as_mut().expect("only called with a sink")
    }

    /// Chunks per commit: the sink's commit size, or fewer, so that the commits in
    /// flight and the one filling fit in the first tier together.
    fn seal_every(&self) -> usize {
        let sink = self.remote_out.as_ref().map_or(usize::MAX, |s| s.commit_size());
        let share = self.tiers[0].slots() / self.commits_in_flight.saturating_add(1);
        sink.min(share.max(1))
    }

    /// Sends the chunks put since the last commit as one, then waits for the oldest
    /// commits while more than allowed are in flight.
    fn seal_remote(&mut self) -> Result<()> {
        let sealed = self.sink().seal();
        if self.or_forget(sealed)? {
            self.sealed.push_back(std::mem::take(&mut self.unsealed));
        }
        while self.sealed.len() > self.commits_in_flight {
            self.wait_oldest_remote()?;
        }
        Ok(())
    }

    fn wait_oldest_remote(&mut self) -> Result<()> {
        let held = self.sink().wait_oldest();
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
        let held = self.sink().poll();
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
        let Some(sink) = self.remote_out.as_mut() else { return Ok(()) };
        let committed = sink.commit();
        self.or_forget(committed)?;
        self.unpin_all();
        Ok(())
    }

    /// `result`; when it is a failure, the chunks not known to be held are forgotten
    /// first. What the peer may lack is not "sent", so a later store gathers and puts
    /// it again. The sink forgets those puts, whose slots are reused from here on: a
    /// retried commit must not send their new contents.
    fn or_forget<T>(&mut self, result: Result<T>) -> Result<T> {
        let e = match result {
            Ok(value) => return Ok(value),
            Err(e) => e,
        };
        for (_, key) in self.sealed.iter().flatten().chain(&self.unsealed) {
            self.sent.remove(key);
        }
        if let Some(sink) = self.remote_out.as_mut() {
            let dropped = sink.discard_pending();
            tracing::warn!(error = %e, chunks = dropped.len(), "a commit to the remote store failed; its chunks will be put again");
        }
        self.unpin_all();
        Err(e)
    }

    fn unpin_all(&mut self) {
        for (tier, key) in self.sealed.drain(..).flatten().chain(self.unsealed.drain(..)) {
            self.tiers[tier].unpin(key);
        }
    }

    /// Tokens of the longest prefix of `tokens` whose chunks are stored (in any tier).
    pub fn lookup(&self, tokens: &[u32]) -> usize {
        self.keys(tokens)
            .iter()
            .take_while(|k| {
                self.tiers.iter().any(|t| t.contains(k.hash))
                    || self.remote_in.as_ref().is_some_and(|r| r.contains(&k.name()))
            })
            .last()
            .map_or(0, |k| k.end())
    }

    /// Copies the longest stored prefix of `tokens` into `kv` (token `i` at position
    /// `i`) and returns its length in tokens; positions after it are left as they were.
    pub fn retrieve(&mut self, tokens: &[u32], kv: &KvMemory) -> Result<usize> {
        // Remote chunks read by moves in flight stay alive until those are done.
        let mut reading = Vec::new();
        let found = self.retrieve_queued(tokens, kv, &mut reading);
        settled(found)
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
        let mut found = 0;
        for key in self.keys(tokens) {
            let len = self.config.shape.chunk_bytes(key.tokens as u64);
            let local = self.tiers.iter_mut().find_map(|t| t.get(key.hash));
            let r = runs(&self.config.shape, &kv.layout, key.start as u64, key.tokens as u64)?;
            match local {
                Some((place, stored)) => {
                    debug_assert_eq!(stored, len);
                    move_runs(kv.place, place, &r, Direction::Scatter)?;
                }
                None => {
                    let Some(object) = self.remote_in.as_ref().and_then(|s| s.get(&key.name())) else { break };
                    if object.len() != len {
                        return Err(Error::Protocol(format!(
                            "remote chunk {} has {} bytes; {} tokens of this model take {len}",
                            key.name(),
                            object.len(),
                            key.tokens
                        )));
                    }
                    let (kind, addr, dev) = object.data.location();
                    let place = match kind {
                        MemKind::Vram => Place::gpu(addr, dev),
                        _ => Place::host(addr),
                    };
                    move_runs(kv.place, place, &r, Direction::Scatter)?;
                    reading.push(object);
                }
            }
            found = key.end();
        }
        Ok(found)
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

/// `result`, once every move it queued has landed (also when it failed: nothing may be
/// in flight after a public method returns).
fn settled<T>(result: Result<T>) -> Result<T> {
    let waited = staging::wait_all();
    let value = result?;
    waited?;
    Ok(value)
}
