//! Keys to value slots, with TTLs, LRU eviction, readers' pins and two-phase writes.
//!
//! Peers write and read values in place in the pool's memory, so a slot must not be
//! reused while anyone may still be copying it. Hence:
//! - a write first reserves a fresh slot ([`Index::begin_put`]), the peer fills it, and
//!   only [`Index::commit_put`] makes it the key's value: readers see the old value or
//!   the new one, never a mix;
//! - a read pins the slot it was given ([`Index::begin_get`]) until
//!   [`Index::end_get`]; a value that is overwritten, deleted, expired or evicted
//!   meanwhile leaves the index at once but keeps its slot until its last reader is done.
//!
//! Every slot live in the pool is owned by exactly one of:
//! - a committed value (at most one per key);
//! - a pending reservation;
//! - a retired value: one no longer in the index that readers still pin.
//!
//! Those slots never overlap (the pool hands out disjoint slots and nothing here frees a
//! slot that another of them still uses), and each one goes back to the pool exactly
//! once: when its value leaves the index unpinned, when its last pin is released after
//! it left, or when its reservation is aborted. Committing moves a slot
//! from reservation to value without freeing it. The tests check this after every
//! operation: the owned slots are exactly the pool's live slots.
//!
//! Time is whatever the caller passes as `now_ms`; it is assumed not to go backwards.
//! A value with a TTL of `t` ms committed at `c` is visible while `now_ms < c + t`.
//!
//! The capacity bounds more than the pool's slots: each entry (a committed value or a
//! reservation) also keeps its key, and the index's own bookkeeping, on the heap. Those
//! count against the capacity too, at the key's length plus [`ENTRY_OVERHEAD`], so that
//! many small values under long keys make room or are refused like large values do.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use freight_core::{Error, Result};

use crate::pool::{Pool, Slot, ALIGN};

/// Heap bytes that an entry of the index takes besides its key's bytes, counted with
/// them against the capacity: a value's slot in the map of values (a key pointer and a
/// `Value`, at a load factor of 7/8 and up to twice the entries just after the table
/// grew), its entries in the LRU order and, with a TTL, in the expiry order (B-tree
/// nodes about two-thirds full), the key's `Arc` header and the allocator's rounding.
/// `tests/index_overhead.rs` measures it with a counting allocator: 240 to 340 bytes
/// for 1,000 to 229,377 values with a TTL under keys of 8 to 300 bytes, the most just
/// after the maps grew. A reservation's entry is smaller and counts the same.
pub const ENTRY_OVERHEAD: u64 = 384;

/// How the index behaves when the pool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexConfig {
    /// Size of the value pool in bytes.
    pub capacity: u64,
    /// Make room by evicting least recently used values. Off, a full pool rejects writes:
    /// for deployments that treat the store as the only copy of their values.
    pub evict: bool,
}

/// A reservation from [`Index::begin_put`]: the writer fills `slot`, then commits `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub id: u64,
    pub slot: Slot,
}

/// A reader's hold on a value's slot, from [`Index::begin_get`].
///
/// Not `Clone`: each pin is released exactly once, by moving it into [`Index::end_get`].
/// A pin that is dropped instead keeps its slot allocated for the life of the index.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pin that is never released with Index::end_get keeps its slot allocated forever"]
pub struct ReadPin {
    pub slot: Slot,
    pub len: u64,
    pub version: u64,
    pin: u64,
}

impl ReadPin {
    /// This pin's id, unique within its index: for the server's own tables and logs.
    pub fn id(&self) -> u64 {
        self.pin
    }
}

/// Counters for monitoring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Committed values, including expired ones not yet swept.
    pub keys: u64,
    /// Bytes of committed values as written, without alignment padding.
    pub bytes: u64,
    /// Bytes the pool has handed out: values, reservations, retired values still pinned,
    /// and padding.
    pub pool_used: u64,
    pub capacity: u64,
    /// Bytes counted against the capacity for the index's entries: each value's and
    /// reservation's key, plus [`ENTRY_OVERHEAD`].
    pub index_bytes: u64,
    /// Values that reached their reader: reads released with [`Index::end_get_served`].
    pub hits: u64,
    /// Reads of a key without a value (or with an expired one): [`Index::begin_get`]
    /// that found none.
    pub misses: u64,
    pub evictions: u64,
    pub expirations: u64,
    /// Values reserved by [`Index::begin_put`] and not yet committed or aborted (one per
    /// item of a batch).
    pub pending_puts: u64,
}

impl Stats {
    /// The counters by name (the names `stats()` dicts and the control plane use).
    pub fn named(&self) -> [(&'static str, u64); 10] {
        [
            ("keys", self.keys),
            ("bytes", self.bytes),
            ("pool_used", self.pool_used),
            ("capacity", self.capacity),
            ("index_bytes", self.index_bytes),
            ("hits", self.hits),
            ("misses", self.misses),
            ("evictions", self.evictions),
            ("expirations", self.expirations),
            ("pending_puts", self.pending_puts),
        ]
    }
}

/// A committed value.
#[derive(Debug, Clone, Copy)]
struct Value {
    slot: Slot,
    version: u64,
    expires_at: Option<u64>,
    /// Position in the LRU order: the key of this value in `Index::lru`.
    tick: u64,
}

impl Value {
    fn expired(&self, now_ms: u64) -> bool {
        self.expires_at.is_some_and(|at| now_ms >= at)
    }
}

#[derive(Debug)]
struct Pending {
    key: Vec<u8>,
    slot: Slot,
    ttl_ms: u64,
}

/// Readers of one slot.
#[derive(Debug)]
struct Pinned {
    slot: Slot,
    readers: u64,
    /// The value has left the index: the last reader frees the slot.
    retired: bool,
    /// What its value's entry counts against the capacity while in the index.
    entry: u64,
}

/// Keys to committed values in a [`Pool`]. See the module docs for the rules and the
/// invariants.
#[derive(Debug)]
pub struct Index {
    config: IndexConfig,
    pool: Pool,
    /// Keys are shared with `lru` and `expiry` rather than copied into each.
    values: HashMap<Arc<[u8]>, Value>,
    /// Tick of last use to key: the first entry is the least recently used value.
    lru: BTreeMap<u64, Arc<[u8]>>,
    /// `(expires_at, key)` of values with a TTL, so a sweep only visits expired ones.
    expiry: BTreeSet<(u64, Arc<[u8]>)>,
    pending: HashMap<u64, Pending>,
    /// Pinned slots by offset. Offsets identify slots because a pinned slot stays live
    /// in the pool, so no other slot can start there.
    pinned: HashMap<u64, Pinned>,
    /// Pin id to the offset of the slot it pins.
    pins: HashMap<u64, u64>,
    last_grant: u64,
    last_pin: u64,
    last_tick: u64,
    /// Versions count commits across all keys, so a key that is deleted and written
    /// again never repeats a version a reader may have cached.
    last_version: u64,
    bytes: u64,
    /// What the entries of values and reservations count against the capacity.
    entry_bytes: u64,
    /// Whether entries count at all: off only for tests of the slots' arithmetic alone.
    charge_entries: bool,
    hits: u64,
    misses: u64,
    evictions: u64,
    expirations: u64,
}

impl Index {
    pub fn new(config: IndexConfig) -> Index {
        Index {
            config,
            pool: Pool::new(config.capacity),
            values: HashMap::new(),
            lru: BTreeMap::new(),
            expiry: BTreeSet::new(),
            pending: HashMap::new(),
            pinned: HashMap::new(),
            pins: HashMap::new(),
            last_grant: 0,
            last_pin: 0,
            last_tick: 0,
            last_version: 0,
            bytes: 0,
            entry_bytes: 0,
            charge_entries: true,
            hits: 0,
            misses: 0,
            evictions: 0,
            expirations: 0,
        }
    }

    /// An index whose entries count nothing against the capacity, for tests that check
    /// the pool's arithmetic alone, in slots of a few bytes.
    #[cfg(test)]
    pub(crate) fn slots_only(config: IndexConfig) -> Index {
        Index { charge_entries: false, ..Index::new(config) }
    }

    pub fn config(&self) -> IndexConfig {
        self.config
    }

    /// What an entry with a key of `key_len` bytes counts against the capacity.
    fn entry_cost(&self, key_len: usize) -> u64 {
        if self.charge_entries {
            key_len as u64 + ENTRY_OVERHEAD
        } else {
            0
        }
    }

    /// The allocator, read-only: all allocation goes through the index so that every
    /// slot has exactly one owner.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Committed values, including expired ones that no read or sweep has removed yet.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Keys of committed values in no particular order, expired ones not yet swept
    /// included.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.values.keys().map(|key| &**key)
    }

    pub fn stats(&self) -> Stats {
        Stats {
            keys: self.values.len() as u64,
            bytes: self.bytes,
            pool_used: self.pool.used(),
            capacity: self.pool.capacity(),
            index_bytes: self.entry_bytes,
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            expirations: self.expirations,
            pending_puts: self.pending.len() as u64,
        }
    }

    /// Reserves a fresh slot of `len` bytes for a new value of `key`, to be filled by the
    /// writer and then committed with [`Index::commit_put`] or given up with
    /// [`Index::abort_put`]. The current value, if any, stays readable meanwhile: the
    /// slot is never the current value's.
    ///
    /// The slot and the entry (the key's length plus [`ENTRY_OVERHEAD`]) both count
    /// against the capacity. When there is no room for them, expired values are swept
    /// first; then, with eviction on, unpinned values are evicted least recently used
    /// first until both fit. A value that would not fit even with every unpinned value
    /// evicted (pinned and pending slots split the pool too finely, or take too much of
    /// it) fails before anything is evicted.
    ///
    /// # Errors
    ///
    /// `InvalidArgument` for `len == 0`; `NoSpace` for `len` and its entry together
    /// larger than the pool, or when no room can be made (eviction off, or what remains
    /// is pinned by readers or reserved by pending writes).
    pub fn begin_put(&mut self, key: &[u8], len: u64, ttl_ms: u64, now_ms: u64) -> Result<Grant> {
        let capacity = self.pool.capacity();
        if len == 0 {
            return Err(Error::InvalidArgument(format!(
                "empty value for key {}: values take 1 to {capacity} bytes (the pool size)",
                show(key)
            )));
        }
        let entry = self.entry_cost(key.len());
        if len.saturating_add(entry) > capacity {
            return Err(Error::NoSpace(format!(
                "a value of {len} bytes for key {} ({entry} bytes more for its key in the index) can never fit in \
                 the pool of {capacity} bytes",
                show(key)
            )));
        }
        let slot = self.reserve(key, len, entry, now_ms)?;
        self.entry_bytes += entry;
        self.last_grant += 1;
        let id = self.last_grant;
        self.pending.insert(id, Pending { key: key.to_vec(), slot, ttl_ms });
        Ok(Grant { id, slot })
    }

    /// Makes reservation `id` its key's value, with a new version and, for a nonzero
    /// TTL, an expiry `ttl_ms` after `now_ms`. The value it replaces leaves the index
    /// now; its slot is freed now, or by its last reader. Returns the new version.
    ///
    /// # Errors
    ///
    /// `InvalidArgument` if `id` is not pending: never granted, or already committed,
    /// aborted.
    pub fn commit_put(&mut self, id: u64, now_ms: u64) -> Result<u64> {
        let Some(put) = self.pending.remove(&id) else {
            return Err(Error::InvalidArgument(format!(
                "no pending put with id {id}: it was never granted, or was already committed or aborted"
            )));
        };
        let key: Arc<[u8]> = match self.remove_value(&put.key) {
            Some((key, _)) => key,
            None => put.key.into(),
        };
        self.last_version += 1;
        self.last_tick += 1;
        let expires_at = (put.ttl_ms > 0).then(|| now_ms.saturating_add(put.ttl_ms));
        let value = Value { slot: put.slot, version: self.last_version, expires_at, tick: self.last_tick };
        if let Some(at) = expires_at {
            self.expiry.insert((at, key.clone()));
        }
        self.lru.insert(value.tick, key.clone());
        self.bytes += value.slot.len;
        self.values.insert(key, value);
        Ok(self.last_version)
    }

    /// Gives up reservation `id` and frees its slot. Returns whether it was pending, so
    /// that a late abort after a commit is harmless.
    pub fn abort_put(&mut self, id: u64) -> bool {
        match self.pending.remove(&id) {
            Some(put) => {
                self.pool.free(put.slot);
                self.entry_bytes -= self.entry_cost(put.key.len());
                true
            }
            None => false,
        }
    }

    /// The current value of `key`, pinned until [`Index::end_get`] (or
    /// [`Index::end_get_served`]), and marked most recently used. An expired value is a
    /// miss and is removed. A value found is a hit only once served.
    #[must_use = "a pin that is never released with Index::end_get keeps its slot allocated forever"]
    pub fn begin_get(&mut self, key: &[u8], now_ms: u64) -> Option<ReadPin> {
        let Some(value) = self.values.get(key).copied() else {
            self.misses += 1;
            return None;
        };
        if value.expired(now_ms) {
            self.remove_value(key);
            self.expirations += 1;
            self.misses += 1;
            return None;
        }
        self.last_tick += 1;
        let tick = self.last_tick;
        let shared = self.lru.remove(&value.tick).expect("every value is in the LRU order");
        self.lru.insert(tick, shared);
        if let Some(value) = self.values.get_mut(key) {
            value.tick = tick;
        }

        self.last_pin += 1;
        let pin = self.last_pin;
        let slot = value.slot;
        let entry = self.entry_cost(key.len());
        self.pinned.entry(slot.offset).or_insert(Pinned { slot, readers: 0, retired: false, entry }).readers += 1;
        self.pins.insert(pin, slot.offset);
        Some(ReadPin { slot, len: slot.len, version: value.version, pin })
    }

    /// Releases a read whose value reached its reader: a hit.
    pub fn end_get_served(&mut self, pin: ReadPin) {
        self.hits += 1;
        self.end_get(pin);
    }

    /// Releases a read, served or not (see [`Index::end_get_served`]). The slot is freed
    /// here if its value left the index meanwhile and this was its last reader.
    ///
    /// # Panics
    ///
    /// If `pin` was not issued by this index. Guessing would risk releasing another
    /// reader's pin and freeing a slot that is still being read.
    pub fn end_get(&mut self, pin: ReadPin) {
        let Some(offset) = self.pins.remove(&pin.pin) else {
            panic!("index: read pin {} on slot {:?} was not issued by this index", pin.pin, pin.slot);
        };
        let MapEntry::Occupied(mut slot) = self.pinned.entry(offset) else {
            unreachable!("pin {} names slot {offset}, which has no readers", pin.pin);
        };
        slot.get_mut().readers -= 1;
        if slot.get().readers == 0 {
            let slot = slot.remove();
            if slot.retired {
                self.pool.free(slot.slot);
            }
        }
    }

    /// Whether `key` has a live value, without making it more recently used: a probe is
    /// not a use. An expired value is removed.
    pub fn exists(&mut self, key: &[u8], now_ms: u64) -> bool {
        match self.values.get(key) {
            Some(value) if value.expired(now_ms) => {
                self.remove_value(key);
                self.expirations += 1;
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Removes `key`'s value; readers holding it keep their copy until they release it.
    /// Returns whether there was one, counting an expired value not yet swept.
    pub fn delete(&mut self, key: &[u8]) -> bool {
        self.remove_value(key).is_some()
    }

    /// Removes every value whose TTL has run out at `now_ms` and returns how many. Costs
    /// O(log n) per expired value and nothing for the others, so it can run every few ms.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut swept = 0;
        while let Some((at, _)) = self.expiry.first() {
            if *at > now_ms {
                break;
            }
            let Some((_, key)) = self.expiry.pop_first() else { break };
            self.remove_value(&key);
            swept += 1;
        }
        self.expirations += swept as u64;
        swept
    }

    /// A slot of `len` bytes for an entry that counts `entry`, making room as
    /// [`Index::begin_put`] describes.
    fn reserve(&mut self, key: &[u8], len: u64, entry: u64, now_ms: u64) -> Result<Slot> {
        if let Some(slot) = self.alloc(len, entry) {
            return Ok(slot);
        }
        // Expired values are dead already: reclaiming them is not eviction, whatever the
        // configuration.
        if self.expire(now_ms) > 0 {
            if let Some(slot) = self.alloc(len, entry) {
                return Ok(slot);
            }
        }
        if !self.config.evict {
            return Err(self.no_space(key, len, "eviction is off"));
        }
        if !self.room_by_evicting(len, entry) {
            return Err(self.no_space(
                key,
                len,
                "pinned and pending values split the pool so finely, or take so much of it with their keys, that \
                 even evicting every other value leaves no room that large",
            ));
        }
        // Pins cannot change during this loop, so values skipped as pinned stay skipped
        // and the scan resumes after the last victim instead of from the coldest.
        let mut from = 0;
        loop {
            let victim = self
                .lru
                .range(from..)
                .find(|(_, candidate)| {
                    self.values.get(*candidate).is_some_and(|value| !self.pinned.contains_key(&value.slot.offset))
                })
                .map(|(&tick, candidate)| (tick, candidate.clone()));
            let Some((tick, victim)) = victim else {
                return Err(self.no_space(key, len, "every remaining value is pinned by a reader or pending"));
            };
            from = tick + 1;
            self.remove_value(&victim);
            self.evictions += 1;
            if let Some(slot) = self.alloc(len, entry) {
                return Ok(slot);
            }
        }
    }

    /// A slot of `len` bytes from the pool, where the slots and the entries, one more
    /// that counts `entry` included, stay within the capacity.
    fn alloc(&mut self, len: u64, entry: u64) -> Option<Slot> {
        let slot = self.pool.alloc(len)?;
        if self.pool.used() + self.entry_bytes + entry <= self.pool.capacity() {
            return Some(slot);
        }
        self.pool.free(slot);
        None
    }

    /// Whether evicting every unpinned value would leave a free extent that holds `len`
    /// bytes, with room in the capacity for it and an entry that counts `entry`. Only
    /// pinned and pending slots and entries stay, so the stretches between them are
    /// what the pool would have free; they are few (one per request in flight), unlike
    /// the values.
    fn room_by_evicting(&self, len: u64, entry: u64) -> bool {
        let capacity = self.pool.capacity();
        // Rounded as the pool rounds (`len <= capacity` is checked, so no overflow).
        let rounded = |len: u64| len.div_ceil(ALIGN) * ALIGN;
        let need = rounded(len);
        let mut kept: Vec<(u64, u64)> = self
            .pending
            .values()
            .map(|put| put.slot)
            .chain(self.pinned.values().map(|pinned| pinned.slot))
            .map(|slot| (slot.offset, (slot.offset + rounded(slot.len)).min(capacity)))
            .collect();
        kept.sort_unstable();
        let kept_slots: u64 = kept.iter().map(|(start, end)| end - start).sum();
        let kept_entries: u64 = self.pending.values().map(|put| self.entry_cost(put.key.len())).sum::<u64>()
            + self.pinned.values().filter(|pinned| !pinned.retired).map(|pinned| pinned.entry).sum::<u64>();
        let within_capacity = |size: u64| kept_slots + kept_entries + entry + size <= capacity;
        // The pool's tail extent may hold a value up to its own size, unrounded.
        let fits = |start: u64, end: u64| {
            let room = end.saturating_sub(start);
            (room >= need && within_capacity(need)) || (end == capacity && room >= len && within_capacity(room))
        };
        let mut start = 0;
        for (offset, end) in kept {
            if fits(start, offset) {
                return true;
            }
            start = start.max(end);
        }
        fits(start, capacity)
    }

    fn no_space(&self, key: &[u8], len: u64, why: &str) -> Error {
        Error::NoSpace(format!(
            "out of memory: the value pool of {} bytes has {} bytes free (largest free extent {} bytes; its keys \
             count {} bytes more) and cannot hold a value of {len} bytes for key {}; {why} ({} values, {} pinned \
             slots, {} pending puts)",
            self.pool.capacity(),
            self.pool.free_bytes(),
            self.pool.largest_free(),
            self.entry_bytes,
            show(key),
            self.values.len(),
            self.pinned.len(),
            self.pending.len(),
        ))
    }

    /// Takes `key`'s value out of the index and lets its slot go: to the pool now, or to
    /// its last reader. Returns the shared key for reuse by a new value.
    fn remove_value(&mut self, key: &[u8]) -> Option<(Arc<[u8]>, Value)> {
        let (key, value) = self.values.remove_entry(key)?;
        self.lru.remove(&value.tick);
        if let Some(at) = value.expires_at {
            self.expiry.remove(&(at, key.clone()));
        }
        self.bytes -= value.slot.len;
        self.entry_bytes -= self.entry_cost(key.len());
        match self.pinned.get_mut(&value.slot.offset) {
            Some(pinned) => pinned.retired = true,
            None => self.pool.free(value.slot),
        }
        Some((key, value))
    }

    /// Whether `len` bytes could be allocated once every value no reader pins were
    /// evicted, found by freeing them in a copy of the pool.
    #[cfg(test)]
    fn fits_after_evicting_all(&self, len: u64) -> bool {
        let mut pool = self.pool.clone();
        for value in self.values.values().filter(|value| !self.pinned.contains_key(&value.slot.offset)) {
            pool.free(value.slot);
        }
        pool.alloc(len).is_some()
    }

    /// Panics unless every invariant of the module docs holds.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        self.pool.check_invariants();
        fn own(owned: &mut HashMap<u64, Slot>, slot: Slot, what: &str) {
            assert!(owned.insert(slot.offset, slot).is_none(), "{what} slot {slot:?} has another owner");
        }
        let mut owned: HashMap<u64, Slot> = HashMap::new();
        let mut bytes = 0;
        for (key, value) in &self.values {
            own(&mut owned, value.slot, "value");
            bytes += value.slot.len;
            assert_eq!(self.lru.get(&value.tick), Some(key), "LRU order lost a value");
            if let Some(at) = value.expires_at {
                assert!(self.expiry.contains(&(at, key.clone())), "expiry lost a value");
            }
        }
        assert_eq!(self.lru.len(), self.values.len());
        assert_eq!(self.expiry.len(), self.values.values().filter(|v| v.expires_at.is_some()).count());
        assert_eq!(bytes, self.bytes);
        for put in self.pending.values() {
            own(&mut owned, put.slot, "reservation");
        }
        let lens = self.values.keys().map(|key| key.len()).chain(self.pending.values().map(|put| put.key.len()));
        let entries: u64 = lens.map(|len| self.entry_cost(len)).sum();
        assert_eq!(entries, self.entry_bytes, "the entries' count against the capacity drifted");
        assert!(self.pool.used() + self.entry_bytes <= self.pool.capacity(), "slots and entries past the capacity");
        let mut readers: HashMap<u64, u64> = HashMap::new();
        for offset in self.pins.values() {
            *readers.entry(*offset).or_default() += 1;
        }
        for (offset, pinned) in &self.pinned {
            assert_eq!(*offset, pinned.slot.offset);
            assert!(pinned.readers > 0, "pinned slot {offset} without readers");
            assert_eq!(readers.get(offset), Some(&pinned.readers));
            if pinned.retired {
                own(&mut owned, pinned.slot, "retired");
            } else {
                assert_eq!(owned.get(offset), Some(&pinned.slot), "pinned slot {offset} is no value's");
            }
        }
        assert_eq!(readers.len(), self.pinned.len());
        let mut live = self.pool.live_slots();
        live.sort_by_key(|slot| slot.offset);
        let mut mine: Vec<Slot> = owned.into_values().collect();
        mine.sort_by_key(|slot| slot.offset);
        assert_eq!(mine, live, "the pool's live slots are not exactly the owned ones");
    }
}

/// A key for messages: keys are arbitrary bytes and may be long.
fn show(key: &[u8]) -> String {
    const MAX: usize = 64;
    let shown = &key[..key.len().min(MAX)];
    let more = if key.len() > MAX { format!("... ({} bytes)", key.len()) } else { String::new() };
    format!("\"{}\"{more}", shown.escape_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An index for tests of the slots: its keys count nothing against `capacity`, so
    /// that a capacity of a few slots holds exactly those (the entries' count has tests
    /// of its own).
    fn index(capacity: u64, evict: bool) -> Index {
        Index::slots_only(IndexConfig { capacity, evict })
    }

    /// Writes and commits `key` with no TTL.
    fn put(index: &mut Index, key: &[u8], len: u64, now: u64) -> Slot {
        let grant = index.begin_put(key, len, 0, now).unwrap();
        index.commit_put(grant.id, now).unwrap();
        index.check_invariants();
        grant.slot
    }

    /// A read that is served.
    fn read(index: &mut Index, key: &[u8], now: u64) -> Option<(Slot, u64)> {
        let pin = index.begin_get(key, now)?;
        let got = (pin.slot, pin.version);
        index.end_get_served(pin);
        Some(got)
    }

    #[test]
    fn put_then_get() {
        let mut ix = index(4096, false);
        let grant = ix.begin_put(b"k", 100, 0, 0).unwrap();
        assert_eq!(grant.slot.len, 100);
        assert!(ix.begin_get(b"k", 0).is_none(), "a pending put is invisible");
        assert!(!ix.exists(b"k", 0));
        ix.commit_put(grant.id, 0).unwrap();
        let pin = ix.begin_get(b"k", 0).unwrap();
        assert_eq!((pin.slot, pin.len, pin.version), (grant.slot, 100, 1));
        ix.end_get_served(pin);
        assert!(ix.exists(b"k", 0));
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.keys().collect::<Vec<_>>(), vec![b"k".as_slice()]);
        let stats = ix.stats();
        assert_eq!((stats.keys, stats.bytes, stats.pool_used, stats.capacity), (1, 100, 128, 4096));
        assert_eq!((stats.hits, stats.misses, stats.pending_puts), (1, 1, 0));
        ix.check_invariants();
    }

    #[test]
    fn grant_ids_increase_and_versions_count_commits() {
        let mut ix = index(4096, false);
        let a = ix.begin_put(b"a", 10, 0, 0).unwrap();
        let b = ix.begin_put(b"b", 10, 0, 0).unwrap();
        let c = ix.begin_put(b"a", 10, 0, 0).unwrap();
        assert!(a.id < b.id && b.id < c.id);
        ix.commit_put(a.id, 0).unwrap();
        ix.commit_put(b.id, 0).unwrap();
        ix.commit_put(c.id, 0).unwrap();
        assert_eq!(read(&mut ix, b"a", 0).unwrap(), (c.slot, 3));
        assert_eq!(read(&mut ix, b"b", 0).unwrap(), (b.slot, 2));
        assert!(ix.delete(b"a"));
        put(&mut ix, b"a", 10, 0);
        assert_eq!(read(&mut ix, b"a", 0).unwrap().1, 4, "a rewritten key never repeats a version");
    }

    #[test]
    fn begin_put_never_reuses_the_current_slot() {
        let mut ix = index(128, false);
        let old = put(&mut ix, b"k", 64, 0);
        let grant = ix.begin_put(b"k", 64, 0, 0).unwrap();
        assert_ne!(grant.slot.offset, old.offset);
        assert_eq!(read(&mut ix, b"k", 0).unwrap().0, old, "the old value stays readable");
        assert!(ix.begin_put(b"k", 64, 0, 0).is_err(), "both slots are taken");
        ix.commit_put(grant.id, 0).unwrap();
        assert_eq!(ix.pool().used(), 64, "the old slot was freed on commit");
        ix.check_invariants();
    }

    #[test]
    fn overwrite_while_a_reader_holds_the_old_value() {
        let mut ix = index(1024, false);
        let old = put(&mut ix, b"k", 100, 0);
        let pin = ix.begin_get(b"k", 0).unwrap();
        let new = put(&mut ix, b"k", 100, 0);
        assert_ne!(new.offset, old.offset);
        assert_eq!(ix.pool().used(), 256, "the old slot is held by its reader");
        // The held slot is not handed out again while pinned.
        let other = ix.begin_put(b"x", 768, 0, 0).unwrap();
        assert!(other.slot.offset >= 256);
        assert!(ix.begin_put(b"y", 1, 0, 0).is_err());
        ix.abort_put(other.id);
        assert_eq!((pin.slot, pin.version), (old, 1));
        assert_eq!(read(&mut ix, b"k", 0).unwrap(), (new, 2), "new readers get the new value");
        ix.end_get(pin);
        assert_eq!(ix.pool().used(), 128, "the last reader freed the old slot");
        ix.check_invariants();
    }

    #[test]
    fn two_readers_release_in_any_order() {
        let mut ix = index(1024, false);
        put(&mut ix, b"k", 100, 0);
        let first = ix.begin_get(b"k", 0).unwrap();
        let second = ix.begin_get(b"k", 0).unwrap();
        assert_ne!(first.id(), second.id());
        assert!(ix.delete(b"k"));
        ix.end_get(second);
        assert_eq!(ix.pool().used(), 128, "one reader left");
        ix.check_invariants();
        ix.end_get(first);
        assert_eq!(ix.pool().used(), 0);
        ix.check_invariants();
    }

    #[test]
    fn delete_while_pinned() {
        let mut ix = index(1024, false);
        let slot = put(&mut ix, b"k", 1000, 0);
        let pin = ix.begin_get(b"k", 0).unwrap();
        assert!(ix.delete(b"k"));
        assert!(!ix.delete(b"k"));
        assert!(ix.begin_get(b"k", 0).is_none());
        assert_eq!(ix.stats().bytes, 0);
        assert_eq!(ix.pool().used(), 1024, "the deleted value's slot is still pinned");
        assert!(ix.begin_put(b"k", 1, 0, 0).is_err());
        assert_eq!(pin.slot, slot);
        ix.end_get(pin);
        assert_eq!(ix.pool().used(), 0);
        put(&mut ix, b"k", 1000, 0);
    }

    #[test]
    fn expiry_at_the_boundary() {
        let mut ix = index(4096, false);
        let grant = ix.begin_put(b"k", 10, 10, 0).unwrap();
        ix.commit_put(grant.id, 100).unwrap();
        let forever = ix.begin_put(b"f", 10, 0, 100).unwrap();
        ix.commit_put(forever.id, 100).unwrap();
        assert!(read(&mut ix, b"k", 109).is_some(), "the TTL counts from the commit");
        assert!(ix.exists(b"k", 109));
        assert_eq!(ix.expire(109), 0);
        assert!(read(&mut ix, b"k", 110).is_none(), "gone exactly ttl_ms after commit");
        assert_eq!(ix.len(), 1, "a read of an expired value removes it");
        assert!(read(&mut ix, b"f", u64::MAX).is_some(), "ttl 0 never expires");
        let stats = ix.stats();
        assert_eq!((stats.hits, stats.misses, stats.expirations), (2, 1, 1));
        ix.check_invariants();
    }

    #[test]
    fn expire_sweeps_in_time_order() {
        let mut ix = index(4096, false);
        for (i, ttl) in [30u64, 10, 20, 0].iter().enumerate() {
            let grant = ix.begin_put(&[i as u8], 10, *ttl, 0).unwrap();
            ix.commit_put(grant.id, 0).unwrap();
        }
        assert_eq!(ix.expire(9), 0);
        assert_eq!(ix.expire(10), 1);
        assert!(!ix.exists(&[1], 10));
        assert_eq!(ix.expire(25), 1);
        assert!(!ix.exists(&[0], 30), "exists removes an expired value");
        assert_eq!(ix.expire(1000), 0);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.stats().expirations, 3);
        ix.check_invariants();
    }

    #[test]
    fn expiry_while_pinned() {
        let mut ix = index(256, false);
        let grant = ix.begin_put(b"k", 200, 5, 0).unwrap();
        ix.commit_put(grant.id, 0).unwrap();
        let pin = ix.begin_get(b"k", 4).unwrap();
        assert_eq!(ix.expire(5), 1);
        assert!(ix.begin_get(b"k", 5).is_none());
        assert_eq!(ix.pool().used(), 256);
        ix.check_invariants();
        ix.end_get(pin);
        assert_eq!(ix.pool().used(), 0);
        ix.check_invariants();
    }

    #[test]
    fn eviction_order_is_lru() {
        let mut ix = index(3 * ALIGN, true);
        put(&mut ix, b"a", 64, 0);
        put(&mut ix, b"b", 64, 0);
        put(&mut ix, b"c", 64, 0);
        assert!(read(&mut ix, b"a", 0).is_some(), "a becomes most recently used");
        assert!(ix.exists(b"b", 0), "a probe does not make b recent");
        put(&mut ix, b"d", 64, 0);
        assert!(!ix.exists(b"b", 0), "b was least recently used");
        put(&mut ix, b"e", 64, 0);
        assert!(!ix.exists(b"c", 0));
        assert!(ix.exists(b"a", 0) && ix.exists(b"d", 0) && ix.exists(b"e", 0));
        assert_eq!(ix.stats().evictions, 2);
        // A large value evicts as many as it needs, oldest first.
        put(&mut ix, b"big", 128, 0);
        assert!(!ix.exists(b"a", 0) && !ix.exists(b"d", 0) && ix.exists(b"e", 0));
        assert_eq!(ix.stats().evictions, 4);
        ix.check_invariants();
    }

    #[test]
    fn eviction_takes_expired_values_first() {
        let mut ix = index(3 * ALIGN, true);
        put(&mut ix, b"old", 64, 0);
        let grant = ix.begin_put(b"short", 64, 10, 0).unwrap();
        ix.commit_put(grant.id, 0).unwrap();
        put(&mut ix, b"new", 64, 0);
        put(&mut ix, b"more", 64, 10);
        assert!(ix.exists(b"old", 10), "the expired value made room instead");
        assert!(!ix.exists(b"short", 10));
        let stats = ix.stats();
        assert_eq!((stats.evictions, stats.expirations), (0, 1));
    }

    #[test]
    fn a_full_pool_without_eviction_still_reclaims_expired_values() {
        let mut ix = index(64, false);
        let grant = ix.begin_put(b"short", 64, 10, 0).unwrap();
        ix.commit_put(grant.id, 0).unwrap();
        assert!(ix.begin_put(b"k", 64, 0, 9).is_err());
        assert!(ix.begin_put(b"k", 64, 0, 10).is_ok());
        assert_eq!(ix.stats().evictions, 0);
    }

    #[test]
    fn eviction_skips_pinned_values() {
        let mut ix = index(3 * ALIGN, true);
        put(&mut ix, b"a", 64, 0);
        put(&mut ix, b"b", 64, 0);
        put(&mut ix, b"c", 64, 0);
        let pin = ix.begin_get(b"a", 0).unwrap();
        let _ = read(&mut ix, b"b", 0);
        let _ = read(&mut ix, b"c", 0);
        // a is least recently used but pinned.
        put(&mut ix, b"d", 64, 0);
        assert!(ix.exists(b"a", 0) && !ix.exists(b"b", 0));
        assert_eq!(pin.version, 1);
        // Released, the least recently used value is the next victim.
        ix.end_get(pin);
        put(&mut ix, b"e", 64, 0);
        assert!(!ix.exists(b"a", 0) && ix.exists(b"c", 0));
        assert_eq!(ix.stats().evictions, 2);
        ix.check_invariants();
    }

    #[test]
    fn eviction_fails_when_everything_is_pinned_or_pending() {
        let mut ix = index(2 * ALIGN, true);
        put(&mut ix, b"a", 64, 0);
        let pin = ix.begin_get(b"a", 0).unwrap();
        let grant = ix.begin_put(b"b", 64, 0, 0).unwrap();
        match ix.begin_put(b"c", 64, 0, 0) {
            Err(Error::NoSpace(msg)) => {
                assert!(msg.contains("out of memory") && msg.contains("128 bytes") && msg.contains("64 bytes"), "{msg}")
            }
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(ix.exists(b"a", 0), "a pinned value is not evicted");
        ix.end_get(pin);
        ix.abort_put(grant.id);
        ix.check_invariants();
    }

    #[test]
    fn a_value_that_cannot_fit_between_pinned_slots_evicts_nothing() {
        let mut ix = index(4 * ALIGN, true);
        for key in [b"a", b"b", b"c", b"d"] {
            put(&mut ix, key, 64, 0);
        }
        // b and d pinned: the stretches left are a's and c's, one slot each.
        let b = ix.begin_get(b"b", 0).unwrap();
        let d = ix.begin_get(b"d", 0).unwrap();
        match ix.begin_put(b"big", 128, 0, 0) {
            Err(Error::NoSpace(msg)) => assert!(msg.contains("out of memory") && msg.contains("pinned"), "{msg}"),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(ix.exists(b"a", 0) && ix.exists(b"c", 0), "nothing was evicted for a write that cannot fit");
        assert_eq!(ix.stats().evictions, 0);
        // One that fits a stretch evicts only as much as it needs.
        put(&mut ix, b"small", 64, 0);
        assert_eq!(ix.stats().evictions, 1);
        ix.end_get(b);
        ix.end_get(d);
        // Unpinned, b's and c's slots (or a's) make a stretch of 128 again.
        put(&mut ix, b"big", 128, 0);
        ix.check_invariants();
    }

    #[test]
    fn the_pools_unaligned_tail_counts_as_room_by_evicting() {
        let mut ix = index(ALIGN + 100, true);
        put(&mut ix, b"head", 64, 0);
        put(&mut ix, b"tail", 100, 0);
        let pin = ix.begin_get(b"head", 0).unwrap();
        put(&mut ix, b"new-tail", 100, 0);
        assert!(!ix.exists(b"tail", 0));
        ix.end_get(pin);
        ix.check_invariants();
    }

    #[test]
    fn no_eviction_error_names_the_pool_size() {
        let mut ix = index(1024, false);
        put(&mut ix, b"a", 1000, 0);
        match ix.begin_put(b"b", 100, 0, 0) {
            Err(Error::NoSpace(msg)) => {
                assert!(msg.contains("out of memory"), "{msg}");
                assert!(msg.contains("1024 bytes"), "{msg}");
                assert!(msg.contains("100 bytes"), "{msg}");
            }
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(ix.exists(b"a", 0), "nothing is evicted with eviction off");
        ix.check_invariants();
    }

    #[test]
    fn bad_lengths() {
        let mut ix = index(1024, true);
        match ix.begin_put(b"k", 0, 0, 0) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("1024"), "{msg}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        put(&mut ix, b"a", 10, 0);
        match ix.begin_put(b"k", 1025, 0, 0) {
            Err(Error::NoSpace(msg)) => assert!(msg.contains("1025 bytes") && msg.contains("1024 bytes"), "{msg}"),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(ix.exists(b"a", 0), "a value that can never fit evicts nothing");
        assert!(ix.begin_put(b"k", u64::MAX, 0, 0).is_err());
        assert!(ix.begin_put(b"k", 1024, 0, 0).is_ok(), "exactly the pool size fits after eviction");
        ix.check_invariants();
    }

    /// A key of `len` bytes that starts with `i`.
    fn long_key(i: u32, len: usize) -> Vec<u8> {
        let mut key = vec![b'k'; len];
        key[..4].copy_from_slice(&i.to_le_bytes());
        key
    }

    #[test]
    fn keys_count_against_the_capacity_so_small_values_under_long_keys_fill_it() {
        const KEY: usize = 4000;
        let entry = KEY as u64 + ENTRY_OVERHEAD;
        // Room in the pool for a thousand slots of one-byte values, but not for their keys.
        let config = IndexConfig { capacity: 1000 * ALIGN, evict: false };
        let fit = config.capacity / (ALIGN + entry);
        let mut ix = Index::new(config);
        for i in 0..fit as u32 {
            put(&mut ix, &long_key(i, KEY), 1, 0);
        }
        let stats = ix.stats();
        assert_eq!((stats.keys, stats.pool_used, stats.index_bytes), (fit, fit * ALIGN, fit * entry));
        match ix.begin_put(&long_key(u32::MAX, KEY), 1, 0, 0) {
            Err(Error::NoSpace(msg)) => assert!(msg.contains(&format!("keys count {} bytes", fit * entry)), "{msg}"),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        // A reservation counts its key too, and gives it back when aborted; a delete too.
        assert!(ix.delete(&long_key(0, KEY)));
        let grant = ix.begin_put(&long_key(u32::MAX, KEY), 1, 0, 0).unwrap();
        assert_eq!(ix.stats().index_bytes, fit * entry);
        assert!(ix.begin_put(&long_key(u32::MAX - 1, KEY), 1, 0, 0).is_err(), "the reservation's key takes the room");
        ix.abort_put(grant.id);
        assert_eq!(ix.stats().index_bytes, (fit - 1) * entry);
        put(&mut ix, &long_key(u32::MAX - 1, KEY), 1, 0);
        // With eviction on, long keys make room as large values do.
        let mut ix = Index::new(IndexConfig { evict: true, ..config });
        for i in 0..100 {
            put(&mut ix, &long_key(i, KEY), 1, 0);
        }
        assert_eq!((ix.len() as u64, ix.stats().evictions), (fit, 100 - fit));
    }

    #[test]
    fn a_value_and_key_larger_than_the_pool_together_can_never_fit() {
        let mut ix = Index::new(IndexConfig { capacity: 4096, evict: true });
        match ix.begin_put(&[b'k'; 300], 4000, 0, 0) {
            Err(Error::NoSpace(msg)) => assert!(msg.contains("can never fit") && msg.contains("4096"), "{msg}"),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        let largest = (4096 - 300 - ENTRY_OVERHEAD) / ALIGN * ALIGN;
        assert!(ix.begin_put(&[b'k'; 300], largest, 0, 0).is_ok());
    }

    #[test]
    fn a_write_whose_key_would_not_fit_beside_the_pinned_entries_evicts_nothing() {
        let entry = 1 + ENTRY_OVERHEAD;
        let mut ix = Index::new(IndexConfig { capacity: 3 * (ALIGN + entry), evict: true });
        for key in [b"a", b"b", b"c"] {
            put(&mut ix, key, 64, 0);
        }
        let pins = [ix.begin_get(b"a", 0).unwrap(), ix.begin_get(b"b", 0).unwrap()];
        // Evicting c would free a slot, but too little of the capacity for this key.
        let long = vec![b'k'; 2 * entry as usize];
        match ix.begin_put(&long, 1, 0, 0) {
            Err(Error::NoSpace(msg)) => assert!(msg.contains("out of memory"), "{msg}"),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(ix.exists(b"c", 0), "nothing was evicted for a write that cannot fit");
        assert_eq!(ix.stats().evictions, 0);
        // One whose key fits once c is gone evicts c.
        put(&mut ix, b"d", 64, 0);
        assert!(!ix.exists(b"c", 0));
        for pin in pins {
            ix.end_get(pin);
        }
        ix.check_invariants();
    }

    #[test]
    fn commit_of_an_unknown_or_finished_id() {
        let mut ix = index(4096, false);
        match ix.commit_put(42, 0) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("42"), "{msg}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        let aborted = ix.begin_put(b"k", 10, 0, 0).unwrap();
        assert!(ix.abort_put(aborted.id));
        assert!(!ix.abort_put(aborted.id));
        assert!(matches!(ix.commit_put(aborted.id, 0), Err(Error::InvalidArgument(_))));
        let committed = ix.begin_put(b"k", 10, 0, 0).unwrap();
        ix.commit_put(committed.id, 0).unwrap();
        assert!(matches!(ix.commit_put(committed.id, 0), Err(Error::InvalidArgument(_))));
        assert!(!ix.abort_put(committed.id), "a late abort leaves the committed value alone");
        assert!(ix.exists(b"k", 0));
        assert_eq!(ix.pool().used(), 64);
        ix.check_invariants();
    }

    #[test]
    #[should_panic(expected = "not issued by this index")]
    fn a_foreign_pin_panics() {
        let mut a = index(1024, false);
        let mut b = index(1024, false);
        put(&mut a, b"k", 1, 0);
        let pin = a.begin_get(b"k", 0).unwrap();
        b.end_get(pin);
    }

    #[test]
    fn long_keys_are_shortened_in_messages() {
        let shown = show(&[b'x'; 100]);
        assert!(shown.len() < 100 && shown.contains("100 bytes"), "{shown}");
        assert_eq!(show(b"a\n"), "\"a\\n\"");
    }

    // The model test: random operations against a plain map, with a simulated memory in
    // which each grant writes its id over its slot, so a reader that gets bytes of any
    // other write (a reused or overlapping slot) is caught.

    #[derive(Debug, Clone)]
    enum Op {
        Put {
            client: u64,
            key: u8,
            len: u64,
            ttl: u64,
        },
        Commit(prop::sample::Index),
        Abort(prop::sample::Index),
        /// Commit or abort an id that is no longer (or never was) pending.
        Stale(prop::sample::Index, bool),
        Get(u8),
        EndGet(prop::sample::Index),
        Exists(u8),
        Delete(u8),
        Expire,
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let pick = any::<prop::sample::Index>;
        prop_oneof![
            6 => (0..3u64, 0..6u8, 1..300u64, prop_oneof![Just(0u64), 1..40u64])
                .prop_map(|(client, key, len, ttl)| Op::Put { client, key, len, ttl }),
            5 => pick().prop_map(Op::Commit),
            1 => pick().prop_map(Op::Abort),
            1 => (pick(), any::<bool>()).prop_map(|(i, commit)| Op::Stale(i, commit)),
            4 => (0..6u8).prop_map(Op::Get),
            3 => pick().prop_map(Op::EndGet),
            1 => (0..6u8).prop_map(Op::Exists),
            1 => (0..6u8).prop_map(Op::Delete),
            1 => Just(Op::Expire),
            2 => (0..15u64).prop_map(Op::Advance),
        ]
    }

    #[derive(Debug, Clone, Copy)]
    struct ModelValue {
        version: u64,
        grant: u64,
        len: u64,
        expires_at: Option<u64>,
    }

    impl ModelValue {
        fn expired(&self, now: u64) -> bool {
            self.expires_at.is_some_and(|at| now >= at)
        }
    }

    struct Harness {
        ix: Index,
        exact: bool,
        now: u64,
        /// Grant id that last wrote each byte of the pool.
        mem: Vec<u64>,
        values: HashMap<u8, ModelValue>,
        pending: Vec<(Grant, u64, u8, u64)>,
        finished: Vec<u64>,
        pins: Vec<(ReadPin, u64)>,
        last_grant: u64,
        commits: u64,
        hits: u64,
        misses: u64,
        expirations: u64,
    }

    impl Harness {
        fn new(capacity: u64, evict: bool) -> Harness {
            Harness {
                ix: index(capacity, evict),
                exact: !evict,
                now: 0,
                mem: vec![0; capacity as usize],
                values: HashMap::new(),
                pending: Vec::new(),
                finished: Vec::new(),
                pins: Vec::new(),
                last_grant: 0,
                commits: 0,
                hits: 0,
                misses: 0,
                expirations: 0,
            }
        }

        fn bytes(&self, slot: Slot) -> &[u64] {
            &self.mem[slot.offset as usize..slot.end() as usize]
        }

        /// Removes the model's value of `key` if it expired; whether it did.
        fn model_expire(&mut self, key: u8) -> bool {
            if self.values.get(&key).is_some_and(|v| v.expired(self.now)) {
                self.values.remove(&key);
                true
            } else {
                false
            }
        }

        fn step(&mut self, op: Op) {
            let now = self.now;
            let evictions = self.ix.stats().evictions;
            match op {
                Op::Put { client, key, len, ttl } => match self.ix.begin_put(&[key], len, ttl, now) {
                    Err(Error::NoSpace(msg)) if !self.exact => {
                        assert!(msg.contains("out of memory"), "{msg}");
                        assert!(!self.ix.fits_after_evicting_all(len), "NoSpace where evicting would make room: {msg}");
                        assert_eq!(self.ix.stats().evictions, evictions, "a write that cannot fit evicts nothing");
                    }
                    Ok(grant) => {
                        assert!(grant.id > self.last_grant, "grant ids increase");
                        self.last_grant = grant.id;
                        assert_eq!(grant.slot.len, len);
                        let (start, end) = (grant.slot.offset as usize, grant.slot.end() as usize);
                        self.mem[start..end].fill(grant.id);
                        self.pending.push((grant, client, key, ttl));
                    }
                    Err(e) => panic!("begin_put failed: {e}"),
                },
                Op::Commit(i) if !self.pending.is_empty() => {
                    let (grant, _, key, ttl) = self.pending.swap_remove(i.index(self.pending.len()));
                    self.ix.commit_put(grant.id, now).unwrap();
                    self.finished.push(grant.id);
                    self.commits += 1;
                    let expires_at = (ttl > 0).then_some(now + ttl);
                    let value = ModelValue { version: self.commits, grant: grant.id, len: grant.slot.len, expires_at };
                    self.values.insert(key, value);
                }
                Op::Abort(i) if !self.pending.is_empty() => {
                    let (grant, ..) = self.pending.swap_remove(i.index(self.pending.len()));
                    assert!(self.ix.abort_put(grant.id));
                    self.finished.push(grant.id);
                }
                Op::Commit(_) | Op::Abort(_) => {}
                Op::Stale(i, commit) => {
                    let id =
                        if self.finished.is_empty() { u64::MAX } else { self.finished[i.index(self.finished.len())] };
                    if commit {
                        assert!(matches!(self.ix.commit_put(id, now), Err(Error::InvalidArgument(_))));
                    } else {
                        assert!(!self.ix.abort_put(id));
                    }
                }
                Op::Get(key) => {
                    let expired = self.model_expire(key);
                    let got = self.ix.begin_get(&[key], now);
                    match (&got, self.values.get(&key)) {
                        (Some(pin), Some(want)) => {
                            assert_eq!((pin.version, pin.len, pin.slot.len), (want.version, want.len, want.len));
                            assert!(self.bytes(pin.slot).iter().all(|&g| g == want.grant), "torn or reused slot");
                        }
                        (Some(pin), None) => panic!("hit on {key} v{} that the model does not have", pin.version),
                        (None, Some(want)) if self.exact => panic!("miss on {key}, model has {want:?}"),
                        (None, _) => {}
                    }
                    if self.exact {
                        self.expirations += u64::from(expired);
                    }
                    match got {
                        Some(pin) => {
                            let grant = self.values[&key].grant;
                            self.pins.push((pin, grant));
                        }
                        None => self.misses += 1,
                    }
                }
                Op::EndGet(i) if !self.pins.is_empty() => {
                    let (pin, grant) = self.pins.swap_remove(i.index(self.pins.len()));
                    assert!(self.bytes(pin.slot).iter().all(|&g| g == grant), "a pinned slot was reused");
                    self.ix.end_get_served(pin);
                    self.hits += 1;
                }
                Op::EndGet(_) => {}
                Op::Exists(key) => {
                    let expired = self.model_expire(key);
                    let real = self.ix.exists(&[key], now);
                    if self.exact {
                        assert_eq!(real, self.values.contains_key(&key));
                        self.expirations += u64::from(expired);
                    } else {
                        assert!(!real || self.values.contains_key(&key));
                    }
                }
                Op::Delete(key) => {
                    let real = self.ix.delete(&[key]);
                    let model = self.values.remove(&key).is_some();
                    if self.exact {
                        assert_eq!(real, model);
                    } else {
                        assert!(!real || model);
                    }
                }
                Op::Expire => {
                    let before = self.values.len();
                    self.values.retain(|_, v| !v.expired(now));
                    let model = before - self.values.len();
                    let real = self.ix.expire(now);
                    if self.exact {
                        assert_eq!(real, model);
                        self.expirations += model as u64;
                    } else {
                        assert!(real <= model);
                    }
                }
                Op::Advance(ms) => self.now += ms,
            }
            self.check();
        }

        fn check(&self) {
            self.ix.check_invariants();
            let stats = self.ix.stats();
            assert_eq!(stats.keys, self.ix.len() as u64);
            assert_eq!(stats.pending_puts, self.pending.len() as u64);
            assert_eq!(stats.pool_used, self.ix.pool().used());
            assert_eq!(stats.pool_used + self.ix.pool().free_bytes(), stats.capacity);
            assert_eq!(stats.hits, self.hits);
            assert_eq!(stats.misses, self.misses);
            if self.exact {
                assert_eq!(stats.keys, self.values.len() as u64);
                assert_eq!(stats.bytes, self.values.values().map(|v| v.len).sum::<u64>());
                assert_eq!(stats.expirations, self.expirations);
                assert_eq!(stats.evictions, 0);
            } else {
                for key in self.ix.keys() {
                    assert!(self.values.contains_key(&key[0]), "the index has {key:?}, the model does not");
                }
            }
        }

        /// Releases everything still held: the pool must be exactly as full as the
        /// committed values make it.
        fn finish(mut self) {
            for (pin, _) in std::mem::take(&mut self.pins) {
                self.ix.end_get(pin);
            }
            for (grant, ..) in std::mem::take(&mut self.pending) {
                assert!(self.ix.abort_put(grant.id));
            }
            self.ix.check_invariants();
            let keys: Vec<Vec<u8>> = self.ix.keys().map(<[u8]>::to_vec).collect();
            for key in keys {
                assert!(self.ix.delete(&key));
            }
            assert_eq!(self.ix.pool().used(), 0);
            assert_eq!(self.ix.pool().largest_free(), self.ix.pool().capacity());
        }
    }

    proptest! {
        #[test]
        fn matches_a_map_without_eviction(ops in prop::collection::vec(op(), 1..150)) {
            // Room for every put of the run at its largest, pins and all.
            let mut harness = Harness::new(150 * 320, false);
            for op in ops {
                harness.step(op);
            }
            harness.finish();
        }

        #[test]
        fn hits_are_the_latest_commit_with_eviction(
            capacity in 300u64..2000,
            ops in prop::collection::vec(op(), 1..200),
        ) {
            let mut harness = Harness::new(capacity, true);
            for op in ops {
                harness.step(op);
            }
            harness.finish();
        }
    }
}
