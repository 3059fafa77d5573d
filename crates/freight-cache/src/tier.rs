//! A local tier: memory of its own (GPU or host) cut into chunk slots, with LRU eviction.

use std::sync::Arc;

use freight_core::{Agent, Desc, Error, Result};

use crate::chunk_bytes::Arena;
use crate::place::Place;
use crate::slots::{Evicted, Slots};

pub struct Tier {
    /// "gpu" or "host", for logs and reports.
    pub name: &'static str,
    arena: Arena,
    slots: Slots,
    slot_bytes: u64,
    count: u32,
}

impl Tier {
    /// A tier of `capacity` bytes (whole slots of `slot_bytes`): on GPU `gpu`, or in
    /// host memory (pinned for `pin_for`, when given).
    pub fn new(
        agent: &Arc<Agent>,
        capacity: u64,
        slot_bytes: u64,
        gpu: Option<usize>,
        pin_for: Option<usize>,
    ) -> Result<Tier> {
        let count = capacity / slot_bytes.max(1);
        if count == 0 {
            return Err(Error::InvalidArgument(format!(
                "a tier of {capacity} bytes cannot hold one chunk of {slot_bytes} bytes"
            )));
        }
        let count = u32::try_from(count).map_err(|_| Error::InvalidArgument("too many chunks in one tier".into()))?;
        let len = count as u64 * slot_bytes;
        let (name, arena) = match gpu {
            Some(g) => ("gpu", Arena::gpu(agent, len, g)?),
            None => ("host", Arena::host(agent, len, pin_for)?),
        };
        Ok(Tier { name, arena, slots: Slots::new(count), slot_bytes, count })
    }

    /// Chunks it can hold.
    pub fn slots(&self) -> usize {
        self.count as usize
    }

    fn place_of(&self, slot: u32) -> Place {
        self.arena.place().at(slot as u64 * self.slot_bytes)
    }

    pub fn contains(&self, key: u128) -> bool {
        self.slots.contains(key)
    }

    /// Where the chunk is and its length, without marking it used.
    pub fn peek(&self, key: u128) -> Option<(Place, u64)> {
        self.slots.peek(key).map(|e| (self.place_of(e.slot), e.len))
    }

    /// Marks the chunk used just now; false when it is not here.
    pub fn touch(&mut self, key: u128) -> bool {
        self.slots.touch(key)
    }

    /// The chunk a new one would push out now, if any.
    pub fn victim(&self) -> Option<u128> {
        self.slots.victim()
    }

    /// A slot for a new chunk of `len` bytes, and the chunk that had to leave it (whose
    /// bytes are still there until the new chunk is written).
    pub fn insert(&mut self, key: u128, len: u64) -> Result<(Place, Option<(Evicted, Place)>)> {
        debug_assert!(len <= self.slot_bytes);
        let (slot, evicted) = self.slots.insert(key, len)?;
        Ok((self.place_of(slot), evicted.map(|e| (e, self.place_of(e.slot)))))
    }

    pub fn remove(&mut self, key: u128) {
        self.slots.remove(key);
    }

    /// The chunk's bytes as a descriptor of the engine's agent (for sending).
    pub fn desc(&self, key: u128) -> Option<Desc> {
        let e = self.slots.peek(key)?;
        Some(self.arena.desc(e.slot as u64 * self.slot_bytes, e.len))
    }

    pub fn pin(&mut self, key: u128) {
        self.slots.pin(key)
    }

    pub fn unpin(&mut self, key: u128) {
        self.slots.unpin(key)
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The memory kind of the tier.
    pub fn kind(&self) -> freight_core::MemKind {
        self.arena.place().kind
    }
}
