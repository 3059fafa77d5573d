//! Which chunk lives in which slot of a tier, and which goes when the tier is full.
//!
//! A tier's memory is cut into equal slots of one full chunk each. Chunks are evicted in
//! least-recently-used order; a pinned chunk (one whose bytes a transfer still reads)
//! is never evicted. Pure bookkeeping: the tier moves the bytes.

use freight_core::{Error, Result};
use lru::LruCache;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub slot: u32,
    /// Bytes of the chunk in its slot (a last chunk may be short).
    pub len: u64,
    pins: u32,
}

/// A chunk pushed out to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub key: u128,
    pub slot: u32,
    pub len: u64,
}

pub struct Slots {
    free: Vec<u32>,
    chunks: LruCache<u128, Entry>,
}

impl Slots {
    pub fn new(count: u32) -> Slots {
        Slots { free: (0..count).rev().collect(), chunks: LruCache::unbounded() }
    }

    /// The chunk's place, marking it used just now.
    pub fn get(&mut self, key: u128) -> Option<Entry> {
        self.chunks.get(&key).copied()
    }

    /// Marks the chunk used just now; false when it is not here.
    pub fn touch(&mut self, key: u128) -> bool {
        self.chunks.promote(&key)
    }

    /// The chunk's place, without marking it used.
    pub fn peek(&self, key: u128) -> Option<Entry> {
        self.chunks.peek(&key).copied()
    }

    /// Whether the chunk is here (without marking it used).
    pub fn contains(&self, key: u128) -> bool {
        self.chunks.contains(&key)
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The chunk [`Slots::insert`] would push out now, if any.
    pub fn victim(&self) -> Option<u128> {
        if !self.free.is_empty() {
            return None;
        }
        self.chunks.iter().rev().find(|(_, e)| e.pins == 0).map(|(k, _)| *k)
    }

    /// A slot for a new chunk: a free one, or the least recently used unpinned chunk's,
    /// which is then returned so that its bytes can move elsewhere before they are
    /// overwritten. The key must not be here yet.
    pub fn insert(&mut self, key: u128, len: u64) -> Result<(u32, Option<Evicted>)> {
        if self.chunks.contains(&key) {
            // Its entry would be replaced: the old slot lost, and its pins with it.
            return Err(Error::InvalidState(format!("chunk {key:032x} is in the tier already")));
        }
        let (slot, evicted) = match self.free.pop() {
            Some(slot) => (slot, None),
            None => {
                let victim = self.victim().ok_or_else(|| {
                    Error::NoSpace(format!(
                        "every one of the tier's {} chunks is in use by a transfer",
                        self.chunks.len()
                    ))
                })?;
                let e = self.chunks.pop(&victim).expect("found above");
                (e.slot, Some(Evicted { key: victim, slot: e.slot, len: e.len }))
            }
        };
        self.chunks.put(key, Entry { slot, len, pins: 0 });
        Ok((slot, evicted))
    }

    /// Forgets a chunk and frees its slot (pinned or not: the caller knows why).
    pub fn remove(&mut self, key: u128) -> Option<Entry> {
        let e = self.chunks.pop(&key)?;
        self.free.push(e.slot);
        Some(e)
    }

    /// Keeps the chunk from eviction until as many `unpin`s.
    pub fn pin(&mut self, key: u128) {
        if let Some(e) = self.chunks.peek_mut(&key) {
            e.pins += 1;
        }
    }

    pub fn unpin(&mut self, key: u128) {
        if let Some(e) = self.chunks.peek_mut(&key) {
            e.pins = e.pins.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_unpinned_chunks_go_first() {
        let mut s = Slots::new(3);
        for k in 1..=3 {
            assert_eq!(s.insert(k, 10).unwrap().1, None);
        }
        s.get(1); // 2 is now the least recently used
        assert_eq!(s.victim(), Some(2));
        let (slot, evicted) = s.insert(4, 5).unwrap();
        assert_eq!(evicted, Some(Evicted { key: 2, slot, len: 10 }));
        assert!(!s.contains(2) && s.contains(4));
        s.pin(3);
        s.pin(1);
        s.pin(4);
        assert!(matches!(s.insert(5, 1), Err(Error::NoSpace(_))), "everything pinned");
        s.unpin(1);
        assert_eq!(s.insert(5, 1).unwrap().1.unwrap().key, 1);
        let e = s.remove(3).unwrap();
        assert_eq!(s.insert(6, 1).unwrap(), (e.slot, None), "a removed chunk's slot is free");
        assert_eq!(s.len(), 3);
        // 4 is the least recently used of 4, 5, 6 until touched.
        s.unpin(4);
        assert!(s.touch(4) && !s.touch(99));
        assert_eq!(s.insert(7, 1).unwrap().1.unwrap().key, 5);
    }

    #[test]
    fn a_chunk_inserted_twice_is_refused_and_keeps_its_slot_and_pins() {
        let mut s = Slots::new(2);
        let (slot, _) = s.insert(1, 10).unwrap();
        s.pin(1);
        assert!(matches!(s.insert(1, 10), Err(Error::InvalidState(_))));
        s.insert(2, 10).unwrap();
        assert!(matches!(s.insert(3, 10), Ok((_, Some(Evicted { key: 2, .. })))), "the pinned one stays");
        assert_eq!(s.remove(1).map(|e| e.slot), Some(slot));
    }
}
