//! The value pool's allocator: byte offsets in `[0, capacity)` of one memory region.
//!
//! The server registers the region with the engine once and only ever hands out offsets
//! into it, so a value's bytes can be written and read in place by remote peers. This
//! module does the bookkeeping only; it never touches the memory.
//!
//! Values range from one byte to more than a gigabyte, and a cache churns through them
//! constantly, so free space is kept as extents in two ordered maps: by `(size, offset)`
//! for a best fit in O(log n), and by offset to find the neighbours a freed slot merges
//! with in O(log n).
//!
//! Invariants (checked by the tests after every operation):
//! - every live slot and every free extent starts at a multiple of [`ALIGN`];
//! - every live slot's size and every free extent's size is a multiple of [`ALIGN`],
//!   except for the one piece (live or free) that ends at an unaligned `capacity`;
//! - live slots and free extents are pairwise disjoint and together tile `[0, capacity)`
//!   exactly, so `used() + free_bytes() == capacity()`;
//! - no two free extents touch: a freed slot is merged with both neighbours at once, so
//!   once everything is freed there is a single extent of `capacity` bytes;
//! - the two free maps describe the same extents.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Alignment of every slot's offset: a cache line, so that values written by different
/// peers never share one and copy engines get aligned starts.
pub const ALIGN: u64 = 64;

/// Space handed out by [`Pool::alloc`].
///
/// `len` is what the caller asked for, not the rounded size the pool reserved, because
/// that is the number of bytes a value occupies and the number a reader must copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    pub offset: u64,
    pub len: u64,
}

impl Slot {
    /// One past the last byte of the value.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// What the pool remembers of a live slot. The requested length is kept too so that a
/// [`Slot`] that does not match what was handed out is caught instead of freeing a
/// different amount of space than was reserved.
#[derive(Debug, Clone, Copy)]
struct Live {
    len: u64,
    size: u64,
}

/// Best-fit allocator of aligned byte ranges. See the module docs for its invariants.
#[derive(Debug, Clone)]
pub struct Pool {
    capacity: u64,
    used: u64,
    /// Free extents by offset, to size.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same extents as `(size, offset)`: the first entry at or after `(n, 0)` is the
    /// smallest extent that holds `n` bytes, lowest offset first among equals, which
    /// keeps allocations packed towards the start of the region.
    free_by_size: BTreeSet<(u64, u64)>,
    /// Live slots by offset.
    live: HashMap<u64, Live>,
}

impl Pool {
    /// A pool over `[0, capacity)`. `capacity` need not be a multiple of [`ALIGN`]: the
    /// last slot may then be shorter than its rounded size, which still holds the value.
    pub fn new(capacity: u64) -> Pool {
        let mut pool = Pool {
            capacity,
            used: 0,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            live: HashMap::new(),
        };
        pool.insert_free(0, capacity);
        pool
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held by live slots, alignment padding included: that padding is as
    /// unavailable to other values as the value's own bytes.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Bytes not held by any live slot, possibly in many extents; see [`Pool::largest_free`]
    /// for the largest value that can be allocated right now.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used
    }

    /// Size of the largest free extent: an allocation of up to this many bytes succeeds.
    pub fn largest_free(&self) -> u64 {
        self.free_by_size.last().map_or(0, |&(size, _)| size)
    }

    /// Number of live slots.
    pub fn slots(&self) -> usize {
        self.live.len()
    }

    /// A slot of at least `len` bytes at an offset aligned to [`ALIGN`], or `None` when
    /// no free extent is large enough (fragmentation included: see
    /// [`Pool::largest_free`]).
    ///
    /// `len == 0` returns `None`: a zero-length slot would share its offset with the
    /// next allocation and so could not be told apart from it when freed. Callers are
    /// expected to reject empty values before they get here.
    pub fn alloc(&mut self, len: u64) -> Option<Slot> {
        if len == 0 || len > self.free_bytes() {
            return None;
        }
        // Overflow only for lengths near u64::MAX, which exceed any capacity anyway.
        let need = len.checked_add(ALIGN - 1)? & !(ALIGN - 1);
        let (size, offset) = match self.free_by_size.range((need, 0)..).next() {
            Some(&found) => found,
            None => {
                // An unaligned capacity leaves a tail extent shorter than its rounded
                // size; it still holds a value of up to its own size.
                let (&offset, &size) = self.free_by_offset.last_key_value()?;
                if offset + size != self.capacity || size < len {
                    return None;
                }
                (size, offset)
            }
        };
        self.remove_free(offset, size);
        let taken = need.min(size);
        if size > taken {
            self.insert_free(offset + taken, size - taken);
        }
        self.live.insert(offset, Live { len, size: taken });
        self.used += taken;
        Some(Slot { offset, len })
    }

    /// Returns `slot`'s space, merged with any free neighbours.
    ///
    /// # Panics
    ///
    /// If `slot` is not live in this pool exactly as [`Pool::alloc`] returned it. Freeing
    /// twice would let two values share bytes and silently corrupt both, so this is
    /// checked in release builds too.
    pub fn free(&mut self, slot: Slot) {
        let live = match self.live.get(&slot.offset) {
            Some(live) if live.len == slot.len => *live,
            Some(live) => panic!(
                "pool: freeing slot at offset {} with length {}, but it was allocated with length {}",
                slot.offset, slot.len, live.len
            ),
            None => panic!(
                "pool: freeing slot [{}, +{}) that is not allocated (double free, or a slot of another pool)",
                slot.offset, slot.len
            ),
        };
        self.live.remove(&slot.offset);
        self.used -= live.size;

        let mut start = slot.offset;
        let mut size = live.size;
        if let Some((&prev, &prev_size)) = self.free_by_offset.range(..start).next_back() {
            if prev + prev_size == start {
                self.remove_free(prev, prev_size);
                start = prev;
                size += prev_size;
            }
        }
        let end = slot.offset + live.size;
        if let Some(&next_size) = self.free_by_offset.get(&end) {
            self.remove_free(end, next_size);
            size += next_size;
        }
        self.insert_free(start, size);
    }

    fn insert_free(&mut self, offset: u64, size: u64) {
        if size > 0 {
            self.free_by_offset.insert(offset, size);
            self.free_by_size.insert((size, offset));
        }
    }

    fn remove_free(&mut self, offset: u64, size: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(size, offset));
    }

    /// Live slots as handed out, for the index's consistency checks.
    #[cfg(test)]
    pub(crate) fn live_slots(&self) -> Vec<Slot> {
        self.live.iter().map(|(&offset, live)| Slot { offset, len: live.len }).collect()
    }

    /// Panics unless every invariant of the module docs holds.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        assert_eq!(self.free_by_offset.len(), self.free_by_size.len(), "free maps differ in size");
        for (&offset, &size) in &self.free_by_offset {
            assert!(self.free_by_size.contains(&(size, offset)), "free extent {offset}+{size} missing by size");
        }
        // Tile [0, capacity) with live slots and free extents in offset order.
        let mut pieces: Vec<(u64, u64, bool)> = self.free_by_offset.iter().map(|(&o, &s)| (o, s, true)).collect();
        pieces.extend(self.live.iter().map(|(&o, l)| {
            assert!(l.len >= 1 && l.len <= l.size, "live slot at {o}: len {} size {}", l.len, l.size);
            (o, l.size, false)
        }));
        pieces.sort_unstable();
        let mut at = 0;
        let mut last_free = false;
        for &(offset, size, free) in &pieces {
            assert_eq!(offset, at, "gap or overlap at {offset} (expected {at})");
            assert_eq!(offset % ALIGN, 0, "unaligned piece at {offset}");
            assert!(size > 0, "empty piece at {offset}");
            let end = offset + size;
            assert!(end <= self.capacity, "piece {offset}+{size} past capacity {}", self.capacity);
            assert!(size % ALIGN == 0 || end == self.capacity, "piece {offset}+{size} not a multiple of ALIGN");
            assert!(!(free && last_free), "free extents touch at {offset}: not coalesced");
            last_free = free;
            at = end;
        }
        assert_eq!(at, self.capacity, "pieces do not reach capacity");
        let used: u64 = self.live.values().map(|l| l.size).sum();
        assert_eq!(used, self.used, "used() disagrees with live slots");
        let free: u64 = self.free_by_offset.values().sum();
        assert_eq!(used + free, self.capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rounds_to_alignment_and_counts_padding() {
        let mut pool = Pool::new(1024);
        let a = pool.alloc(1).unwrap();
        let b = pool.alloc(65).unwrap();
        let c = pool.alloc(64).unwrap();
        assert_eq!((a.offset, a.len), (0, 1));
        assert_eq!((b.offset, b.len), (64, 65));
        assert_eq!((c.offset, c.len), (192, 64));
        assert_eq!(pool.used(), 256);
        assert_eq!(pool.free_bytes(), 768);
        assert_eq!(pool.largest_free(), 768);
        assert_eq!(pool.slots(), 3);
        pool.check_invariants();
    }

    #[test]
    fn zero_length_and_oversized_requests_fail() {
        let mut pool = Pool::new(1024);
        assert_eq!(pool.alloc(0), None);
        assert_eq!(pool.alloc(1025), None);
        assert_eq!(pool.alloc(u64::MAX), None);
        let all = pool.alloc(1024).unwrap();
        assert_eq!(all.offset, 0);
        assert_eq!(pool.alloc(1), None);
        assert_eq!(pool.largest_free(), 0);
        pool.free(all);
        assert_eq!(pool.largest_free(), 1024);
        assert_eq!(Pool::new(0).alloc(1), None);
    }

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let mut pool = Pool::new(64 * 16);
        let slots: Vec<Slot> = [256, 64, 128, 64, 128, 64].iter().map(|&n| pool.alloc(n).unwrap()).collect();
        // Holes of 256 (at 0), 128 (at 320) and 128 (at 512), separated by live slots.
        pool.free(slots[0]);
        pool.free(slots[2]);
        pool.free(slots[4]);
        let s = pool.alloc(100).unwrap();
        assert_eq!(s.offset, 320, "smallest fitting hole, lowest offset among equals");
        let s = pool.alloc(200).unwrap();
        assert_eq!(s.offset, 0);
        pool.check_invariants();
    }

    #[test]
    fn free_coalesces_with_both_neighbours() {
        let mut pool = Pool::new(64 * 3);
        let a = pool.alloc(64).unwrap();
        let b = pool.alloc(64).unwrap();
        let c = pool.alloc(64).unwrap();
        pool.free(a);
        pool.free(c);
        assert_eq!(pool.largest_free(), 64);
        pool.free(b);
        assert_eq!(pool.largest_free(), 192);
        assert_eq!(pool.free_by_offset.len(), 1);
        pool.check_invariants();
    }

    #[test]
    fn unaligned_capacity_uses_the_tail() {
        let mut pool = Pool::new(100);
        let a = pool.alloc(64).unwrap();
        let tail = pool.alloc(36).unwrap();
        assert_eq!(tail.offset, 64);
        assert_eq!(pool.used(), 100);
        assert_eq!(pool.free_bytes(), 0);
        pool.free(tail);
        assert_eq!(pool.alloc(37), None);
        pool.free(a);
        let all = pool.alloc(100).unwrap();
        assert_eq!(all.offset, 0);
        pool.check_invariants();
    }

    #[test]
    fn huge_values() {
        const GIB: u64 = 1 << 30;
        let mut pool = Pool::new(8 * GIB + 100);
        let a = pool.alloc(3 * GIB + 1).unwrap();
        let b = pool.alloc(GIB).unwrap();
        let c = pool.alloc(4 * GIB - 64).unwrap();
        assert_eq!(b.offset, 3 * GIB + ALIGN);
        assert!(c.end() <= pool.capacity());
        assert_eq!(pool.alloc(GIB), None);
        pool.free(b);
        assert_eq!(pool.alloc(GIB + 1), None, "the hole is one GiB");
        assert_eq!(pool.alloc(GIB).unwrap().offset, 3 * GIB + ALIGN);
        pool.free(a);
        pool.free(c);
        pool.check_invariants();
    }

    #[test]
    #[should_panic(expected = "not allocated")]
    fn double_free_panics() {
        let mut pool = Pool::new(1024);
        let a = pool.alloc(10).unwrap();
        pool.free(a);
        pool.free(a);
    }

    #[test]
    #[should_panic(expected = "allocated with length")]
    fn free_with_another_length_panics() {
        let mut pool = Pool::new(1024);
        let a = pool.alloc(10).unwrap();
        pool.free(Slot { len: 11, ..a });
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(prop::sample::Index),
    }

    /// Pools of both aligned and unaligned sizes, small enough to fill often, with
    /// lengths from one byte to most of the pool.
    fn case() -> impl Strategy<Value = (u64, Vec<Op>)> {
        prop_oneof![1u64..4096, (1u64..64).prop_map(|n| n * ALIGN), Just(1u64 << 34)].prop_flat_map(|capacity| {
            let len = prop_oneof![
                4 => 1u64..=130,
                2 => 1u64..=capacity.min(5000),
                1 => 1u64..=capacity.saturating_mul(2).max(1),
            ];
            let op = prop_oneof![3 => len.prop_map(Op::Alloc), 2 => any::<prop::sample::Index>().prop_map(Op::Free)];
            (Just(capacity), prop::collection::vec(op, 1..200))
        })
    }

    fn check_disjoint(pool: &Pool, live: &[Slot]) {
        let mut sorted = live.to_vec();
        sorted.sort_by_key(|s| s.offset);
        for s in &sorted {
            assert_eq!(s.offset % ALIGN, 0);
            assert!(s.len >= 1 && s.end() <= pool.capacity());
        }
        for pair in sorted.windows(2) {
            assert!(pair[0].end() <= pair[1].offset, "{:?} overlaps {:?}", pair[0], pair[1]);
        }
        assert_eq!(pool.used() + pool.free_bytes(), pool.capacity());
        assert_eq!(pool.slots(), live.len());
    }

    proptest! {
        #[test]
        fn random_alloc_free((capacity, ops) in case(), order in any::<prop::sample::Index>()) {
            let mut pool = Pool::new(capacity);
            let mut live: Vec<Slot> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let largest = pool.largest_free();
                        match pool.alloc(len) {
                            Some(slot) => {
                                prop_assert_eq!(slot.len, len);
                                live.push(slot);
                            }
                            // Only a request larger than every free extent may fail.
                            None => prop_assert!(len > largest, "alloc({}) failed with a free extent of {}", len, largest),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let slot = live.swap_remove(i.index(live.len()));
                        pool.free(slot);
                    }
                    Op::Free(_) => {}
                }
                check_disjoint(&pool, &live);
                pool.check_invariants();
            }
            // Free the rest starting at an arbitrary one, so coalescing sees every order.
            if !live.is_empty() {
                let start = order.index(live.len());
                live.rotate_left(start);
            }
            for slot in live.drain(..) {
                pool.free(slot);
                pool.check_invariants();
            }
            prop_assert_eq!(pool.used(), 0);
            prop_assert_eq!(pool.free_bytes(), capacity);
            prop_assert_eq!(pool.largest_free(), capacity);
        }
    }
}
