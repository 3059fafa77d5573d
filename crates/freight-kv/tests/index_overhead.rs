//! What the index's entries take on the heap, measured with a counting allocator (in a
//! test binary of its own, so that no other test allocates meanwhile), against what
//! the index counts for them: their keys plus `ENTRY_OVERHEAD` each.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use freight_kv::index::{Index, IndexConfig, ENTRY_OVERHEAD};

/// Bytes allocated and not yet freed, through [`Counting`], as the allocator's chunks.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The bytes that an allocation of `size` takes from glibc's malloc: a chunk with an
/// 8-byte header, 16-byte aligned, of 32 bytes at least.
fn chunk(size: usize) -> usize {
    ((size + 8).div_ceil(16) * 16).max(32)
}

struct Counting;

// SAFETY: every call goes to the system allocator unchanged; only the sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            LIVE.fetch_add(chunk(layout.size()), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        System.dealloc(p, layout);
        LIVE.fetch_sub(chunk(layout.size()), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = System.realloc(p, layout, new_size);
        if !q.is_null() {
            LIVE.fetch_add(chunk(new_size), Ordering::Relaxed);
            LIVE.fetch_sub(chunk(layout.size()), Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap bytes per entry beyond its key, for `n` values with a TTL under keys of
/// `key_len` bytes (committed, as reservations take less).
fn heap_per_entry(n: u32, key_len: usize) -> u64 {
    let before = LIVE.load(Ordering::Relaxed);
    let mut index = Index::new(IndexConfig { capacity: 1 << 40, evict: false });
    let mut key = vec![b'k'; key_len];
    for i in 0..n {
        key[..4].copy_from_slice(&i.to_le_bytes());
        let grant = index.begin_put(&key, 1, 60_000, 0).unwrap();
        index.commit_put(grant.id, 0).unwrap();
    }
    let heap = (LIVE.load(Ordering::Relaxed) - before) as u64;
    let per_entry = heap / u64::from(n) - key_len as u64;
    assert_eq!(index.stats().index_bytes, u64::from(n) * (key_len as u64 + ENTRY_OVERHEAD));
    per_entry
}

#[test]
fn an_entry_takes_no_more_heap_than_the_index_counts_for_it() {
    // The maps grow by doubling, so right after they grew (past 7/8 of a power of two)
    // each entry has the most room to itself.
    let mut over = Vec::new();
    for n in [1_000, 57_345, 100_000, 229_377] {
        for key_len in [8, 61, 300] {
            let per_entry = heap_per_entry(n, key_len);
            over.push((n, key_len, per_entry));
        }
    }
    assert!(
        over.iter().all(|o| o.2 <= ENTRY_OVERHEAD),
        "(entries, key bytes, heap bytes each beyond the key): {over:?}"
    );
}
