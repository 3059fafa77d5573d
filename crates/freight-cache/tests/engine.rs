//! The cache engine in host memory: chunks stored and retrieved through contiguous and
//! paged KV memory, shared prefixes found, LRU eviction that keeps prefixes, a remote
//! peer over real sockets (shm and tcp), namespaces and unusable remote chunks, and bad
//! input refused.

use std::sync::Arc;
use std::time::Duration;

use freight_cache::{CacheConfig, CacheEngine, KvLayout, KvMemory, KvShape, Place};
use freight_core::{Agent, Desc, Error, MemKind, TransportKind};
use freight_stream::{Outgoing, StoreReceiver, StoreSender};

mod support;
use support::agent;

const SHAPE: KvShape = KvShape { layers: 3, heads: 2, head_dim: 8, elem_bytes: 2 };
const CHUNK: u64 = 16;

fn engine(agent: &Arc<Agent>, host_chunks: u64) -> CacheEngine {
    let config = CacheConfig {
        chunk_tokens: CHUNK,
        shape: SHAPE,
        gpu: None,
        gpu_bytes: 0,
        host_bytes: host_chunks * SHAPE.chunk_bytes(CHUNK),
    };
    CacheEngine::new(agent, config).unwrap()
}

/// Contiguous KV memory for `tokens` tokens; row (layer, kv, t) filled from `tag`.
struct Kv {
    bytes: Vec<u8>,
    layout: KvLayout,
}

impl Kv {
    fn contiguous(tokens: u64) -> Kv {
        let layout = KvLayout::Contiguous { tokens };
        Kv { bytes: vec![0; layout.bytes(&SHAPE) as usize], layout }
    }

    fn paged(block_size: u64, num_blocks: u64, block_table: Vec<u64>) -> Kv {
        let layout = KvLayout::Paged { block_size, num_blocks, block_table };
        Kv { bytes: vec![0; layout.bytes(&SHAPE) as usize], layout }
    }

    fn memory(&mut self) -> KvMemory {
        KvMemory {
            place: Place::host(self.bytes.as_mut_ptr() as u64),
            len: self.bytes.len() as u64,
            layout: self.layout.clone(),
        }
    }

    /// The row of token `t` (its position in the request) in (layer, kv).
    fn row(&self, layer: u64, kv: u64, t: u64) -> &[u8] {
        let row = SHAPE.row_bytes();
        let index = match &self.layout {
            KvLayout::Contiguous { tokens } => (layer * 2 + kv) * tokens + t,
            KvLayout::Paged { block_size, num_blocks, block_table } => {
                ((layer * 2 + kv) * num_blocks + block_table[(t / block_size) as usize]) * block_size + t % block_size
            }
        };
        &self.bytes[(index * row) as usize..((index + 1) * row) as usize]
    }

    fn fill(&mut self, tokens: &[u32]) {
        let row = SHAPE.row_bytes() as usize;
        for layer in 0..SHAPE.layers {
            for kv in 0..2 {
                for (t, &tok) in tokens.iter().enumerate() {
                    let want = expected_row(layer, kv, tok, t as u64, row);
                    let KvLayout::Contiguous { tokens: cap } = self.layout else { unreachable!() };
                    let at = (((layer * 2 + kv) * cap + t as u64) * row as u64) as usize;
                    self.bytes[at..at + row].copy_from_slice(&want);
                }
            }
        }
    }

    /// Tokens whose every row holds what `fill` put there for the same prompt.
    fn matching_prefix(&self, tokens: &[u32]) -> usize {
        let row = SHAPE.row_bytes() as usize;
        (0..tokens.len())
            .take_while(|&t| {
                (0..SHAPE.layers).all(|l| {
                    (0..2).all(|kv| self.row(l, kv, t as u64) == expected_row(l, kv, tokens[t], t as u64, row))
                })
            })
            .count()
    }
}

fn expected_row(layer: u64, kv: u64, token: u32, t: u64, row: usize) -> Vec<u8> {
    let seed = (token as u64).wrapping_mul(2654435761) ^ (layer << 40) ^ (kv << 48) ^ (t << 20);
    (0..row as u64).map(|i| (seed.wrapping_add(i * 131) >> 3) as u8).collect()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(7919) ^ salt).collect()
}

#[test]
fn a_stored_prompt_comes_back_whole_and_shared_prefixes_are_found() {
    let a = agent("ce-local", None);
    let mut engine = engine(&a, 64);
    let tokens = prompt(100, 1);
    let mut source = Kv::contiguous(128);
    source.fill(&tokens);
    let report = engine.store(&tokens, &source.memory()).unwrap();
    assert_eq!((report.chunks, report.new_chunks), (7, 7), "6 full chunks and a partial one");
    assert_eq!(report.bytes, SHAPE.chunk_bytes(100));
    assert_eq!(engine.store(&tokens, &source.memory()).unwrap().new_chunks, 0, "stored already");

    let mut out = Kv::contiguous(100);
    assert_eq!(engine.retrieve(&tokens, &out.memory()).unwrap(), 100);
    assert_eq!(out.matching_prefix(&tokens), 100);

    // A prompt that parts from the stored one at token 70 shares its first 4 chunks.
    let mut other = tokens.clone();
    other[70] = 424242;
    other.extend([1, 2, 3]);
    assert_eq!(engine.lookup(&other), 64);
    let mut out = Kv::contiguous(128);
    assert_eq!(engine.retrieve(&other, &out.memory()).unwrap(), 64);
    assert_eq!(out.matching_prefix(&tokens), 64, "the prefix is there and nothing after it");
    assert!(out.row(0, 0, 64).iter().all(|&b| b == 0));
    assert_eq!(engine.lookup(&prompt(100, 2)), 0);
    assert_eq!(engine.lookup(&[]), 0);
}

#[test]
fn paged_kv_memory_is_gathered_and_scattered_through_its_block_table() {
    let a = agent("ce-paged", None);
    let mut engine = engine(&a, 64);
    let tokens = prompt(45, 3);
    let mut source = Kv::contiguous(48);
    source.fill(&tokens);
    engine.store(&tokens, &source.memory()).unwrap();
    // Blocks of 4 tokens scattered over a pool of 20.
    let table = vec![17, 3, 4, 9, 0, 12, 13, 14, 2, 19, 5, 7];
    let mut paged = Kv::paged(4, 20, table.clone());
    assert_eq!(engine.retrieve(&tokens, &paged.memory()).unwrap(), 45);
    assert_eq!(paged.matching_prefix(&tokens), 45);
    // And stored from paged memory under another prompt, back out to contiguous memory.
    let mut renamed = tokens.clone();
    renamed[0] = 77;
    let mut from_paged = Kv::paged(4, 20, table);
    from_paged.bytes.copy_from_slice(&paged.bytes);
    engine.store(&renamed, &from_paged.memory()).unwrap();
    let mut out = Kv::contiguous(48);
    assert_eq!(engine.retrieve(&renamed, &out.memory()).unwrap(), 45);
    assert_eq!(out.matching_prefix(&tokens), 45, "the same rows, under the other prompt's keys");
}

#[test]
fn a_full_host_tier_evicts_the_least_recently_used_chunks() {
    let a = agent("ce-lru", None);
    let mut engine = engine(&a, 4);
    let (p, q) = (prompt(32, 10), prompt(32, 20));
    let mut kv = Kv::contiguous(32);
    kv.fill(&p);
    engine.store(&p, &kv.memory()).unwrap();
    kv.fill(&q);
    engine.store(&q, &kv.memory()).unwrap();
    assert_eq!((engine.lookup(&p), engine.lookup(&q)), (32, 32));
    let mut out = Kv::contiguous(32);
    engine.retrieve(&p, &out.memory()).unwrap(); // p is now the most recently used
    let r = prompt(16, 30);
    engine.store(&r, &kv.memory()).unwrap();
    assert_eq!(engine.lookup(&p), 32);
    assert_eq!(engine.lookup(&q), 16, "q's last chunk was the least recently used; its first is still found");
    assert_eq!(engine.occupancy(), vec![("host", 4)]);
}

#[test]
fn a_prompt_longer_than_the_tier_keeps_its_prefix() {
    let a = agent("ce-prefix", None);
    let mut engine = engine(&a, 4);
    // Six chunks into four slots: the two that go must be the last two, or the four
    // left behind are never found.
    let tokens = prompt(96, 40);
    let mut kv = Kv::contiguous(96);
    kv.fill(&tokens);
    assert_eq!(engine.store(&tokens, &kv.memory()).unwrap().new_chunks, 6);
    assert_eq!(engine.occupancy(), vec![("host", 4)]);
    assert_eq!(engine.lookup(&tokens), 64);
    let mut out = Kv::contiguous(96);
    assert_eq!(engine.retrieve(&tokens, &out.memory()).unwrap(), 64);
    assert_eq!(out.matching_prefix(&tokens), 64);
    // Stored again, the chunks that went would only push out its prefix: none is
    // gathered.
    assert_eq!(engine.store(&tokens, &kv.memory()).unwrap().new_chunks, 0);
    assert_eq!(engine.lookup(&tokens), 64);
}

#[test]
fn lookups_and_skipped_stores_keep_a_prompt_in_use() {
    let a = agent("ce-touch", None);
    let mut engine = engine(&a, 4);
    let (p, q, r, s) = (prompt(32, 50), prompt(32, 51), prompt(16, 52), prompt(16, 53));
    let mut kv = Kv::contiguous(32);
    kv.fill(&p);
    engine.store(&p, &kv.memory()).unwrap();
    kv.fill(&q);
    engine.store(&q, &kv.memory()).unwrap();
    // p was stored first: storing it again (every chunk skipped) makes it the most recent.
    kv.fill(&p);
    assert_eq!(engine.store(&p, &kv.memory()).unwrap().new_chunks, 0);
    engine.store(&r, &kv.memory()).unwrap();
    assert_eq!(engine.lookup(&p), 32, "q's last chunk went, not p's");
    // Left: q's first chunk, then r, then p. A lookup of q makes its chunk the most
    // recent, so s takes r's slot.
    assert_eq!(engine.lookup(&q), 16);
    engine.store(&s, &kv.memory()).unwrap();
    assert_eq!(engine.lookup(&r), 0);
    assert_eq!((engine.lookup(&q), engine.lookup(&p), engine.lookup(&s)), (16, 32, 16));
}

/// A store sender on `tx`, and the store it feeds on `rx` (a pipe buffer of three
/// chunks).
fn store_pair(tx: &Arc<Agent>, rx: &Arc<Agent>) -> (StoreSender, StoreReceiver) {
    support::store_pair(tx, rx, 3 * SHAPE.chunk_bytes(CHUNK))
}

/// A prefill engine that puts into a decode engine's store, over `require`, with
/// `in_flight` commits allowed to await the decode side.
fn prefill_to_decode(require: TransportKind, host_chunks: u64, in_flight: usize) {
    let (pa, da) = (agent("ce-prefill", Some(require)), agent("ce-decode", Some(require)));
    let (sink, store) = store_pair(&pa, &da);
    let mut prefill = engine(&pa, host_chunks).with_remote_sink(sink).unwrap().with_commits_in_flight(in_flight);
    let mut decode = engine(&da, 2).with_remote_source(store);

    let tokens = prompt(150, 5);
    let mut kv = Kv::contiguous(160);
    kv.fill(&tokens);
    let started = std::time::Instant::now();
    let times = prefill.store(&tokens, &kv.memory()).unwrap().times;
    let whole = started.elapsed();
    // It gathered, sent and waited for the peer, and those parts fit in the whole.
    assert!(!times.gathering.is_zero() && !times.sending.is_zero() && !times.waiting_for_peer.is_zero(), "{times:?}");
    assert!(times.gathering + times.sending + times.waiting_for_peer <= whole, "{times:?} in {whole:?}");
    // `store` returns once the peer holds every chunk.
    assert_eq!(decode.lookup(&tokens), 150);
    let mut out = Kv::paged(8, 24, (0..19).rev().collect());
    assert_eq!(decode.retrieve(&tokens, &out.memory()).unwrap(), 150);
    assert_eq!(out.matching_prefix(&tokens), 150);
    // Every slot is free again for the next prompt's chunks.
    let next = prompt(90, 6);
    kv.fill(&next);
    assert_eq!(prefill.store(&next, &kv.memory()).unwrap().new_chunks, 6);
    let mut out = Kv::contiguous(96);
    assert_eq!(decode.retrieve(&next, &out.memory()).unwrap(), 90);
    assert_eq!(out.matching_prefix(&next), 90);
    prefill.close().unwrap();
    decode.remote_source().unwrap().wait_closed(Duration::from_secs(10)).unwrap();
}

#[test]
fn a_decode_engine_retrieves_what_a_prefill_engine_stored_over_shm() {
    prefill_to_decode(TransportKind::Shm, 64, 1);
}

#[test]
fn a_decode_engine_retrieves_what_a_prefill_engine_stored_over_tcp() {
    // A host tier smaller than the prompt: slots waiting for a put are held by the peer
    // before they are reused.
    prefill_to_decode(TransportKind::Tcp, 3, 1);
}

#[test]
fn commits_waited_for_at_once_or_several_in_flight_lose_nothing() {
    // Each commit waited for as soon as it is sealed (commits of 3 chunks) ...
    prefill_to_decode(TransportKind::Tcp, 3, 0);
    // ... and two in flight beside the one filling (commits of 2 chunks).
    prefill_to_decode(TransportKind::Shm, 7, 2);
}

#[test]
fn bad_input_is_refused() {
    let a = agent("ce-bad", None);
    let mut engine = engine(&a, 8);
    let tokens = prompt(40, 9);
    let mut small = Kv::contiguous(32);
    let e = engine.store(&tokens, &small.memory()).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    let mut kv = Kv::contiguous(48);
    let mut short = kv.memory();
    short.len -= 1;
    assert!(engine.store(&tokens, &short).unwrap_err().to_string().contains("needs"));
    let mut bad_table = Kv::paged(4, 4, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert!(engine.retrieve(&tokens, &bad_table.memory()).unwrap_err().to_string().contains("names block"));
    // One block for two token ranges: a retrieve would write both into it.
    let mut twice = Kv::paged(4, 12, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 3]);
    let e = engine.retrieve(&tokens, &twice.memory()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("block 3 twice"), "{e}");
    assert!(engine.store(&tokens, &twice.memory()).is_err());
    // Sizes whose bytes overflow 64 bits are refused, not wrapped into a small size
    // that would pass the bounds check.
    let mut huge = Kv::paged(4, 10, (0..10).collect());
    let mut memory = huge.memory();
    memory.layout = KvLayout::Paged { block_size: 1 << 62, num_blocks: 8, block_table: vec![0] };
    let e = engine.store(&tokens, &memory).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("2^64"), "{e}");
    // A file's "address" is no pointer to copy from or to.
    let file = KvMemory { place: Place { kind: MemKind::File, ..kv.memory().place }, ..kv.memory() };
    for e in [engine.store(&tokens, &file).unwrap_err(), engine.retrieve(&tokens, &file).unwrap_err()] {
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("FILE"), "{e}");
    }
    assert_eq!(engine.store(&tokens, &kv.memory()).unwrap().new_chunks, 3, "still usable");
    let base = CacheConfig { chunk_tokens: CHUNK, shape: SHAPE, gpu: None, gpu_bytes: 0, host_bytes: 1 << 20 };
    let no_tier = CacheConfig { host_bytes: 0, ..base.clone() };
    let gpu_without_gpu = CacheConfig { gpu_bytes: 1 << 20, ..base.clone() };
    let zero_chunk = CacheConfig { chunk_tokens: 0, ..base.clone() };
    let tiny = CacheConfig { host_bytes: 10, ..base.clone() };
    let no_heads = CacheConfig { shape: KvShape { heads: 0, ..SHAPE }, ..base.clone() };
    let overflowing = CacheConfig { chunk_tokens: 1 << 60, ..base };
    for c in [no_tier, gpu_without_gpu, zero_chunk, tiny, no_heads, overflowing] {
        assert!(matches!(CacheEngine::new(&a, c.clone()), Err(Error::InvalidArgument(_))), "{c:?}");
    }
}

#[test]
fn a_remote_sink_with_objects_not_committed_is_refused() {
    let (pa, da) = (agent("ce-busy-sink-tx", None), agent("ce-busy-sink-rx", None));
    let full = SHAPE.chunk_bytes(CHUNK);
    let seg = pa.alloc(full as usize).unwrap();
    pa.register(MemKind::Dram, seg.addr(), full, 0).unwrap();
    let object = || Outgoing {
        key: "not-the-engines".into(),
        kind: MemKind::Dram,
        local: Desc { addr: seg.addr(), len: full, dev: 0 },
        meta: Vec::new(),
    };
    // Its commits would not be the engine's: the engine would unpin its own chunks
    // when the sink's commit is held.
    let (mut queued, _store) = store_pair(&pa, &da);
    queued.queue(object()).unwrap();
    let (mut sealed, _other) = store_pair(&pa, &da);
    sealed.queue(object()).unwrap();
    assert!(sealed.seal().unwrap());
    for sink in [queued, sealed] {
        let e = engine(&pa, 8).with_remote_sink(sink).err().expect("refused");
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("not committed"), "{e}");
    }
}

/// A prefill engine in `prefill_ns` stores a prompt into the store of a decode engine
/// in `decode_ns`; returns the tokens the decode engine finds and retrieves.
fn found_across(prefill_ns: &[u8], decode_ns: &[u8]) -> (usize, usize) {
    let (pa, da) = (agent("ce-ns-prefill", None), agent("ce-ns-decode", None));
    let (sink, store) = store_pair(&pa, &da);
    let mut prefill = engine(&pa, 8).with_namespace(prefill_ns).with_remote_sink(sink).unwrap();
    let mut decode = engine(&da, 2).with_namespace(decode_ns).with_remote_source(store);
    let tokens = prompt(40, 60);
    let mut kv = Kv::contiguous(48);
    kv.fill(&tokens);
    prefill.store(&tokens, &kv.memory()).unwrap();
    assert_eq!(decode.remote_source().unwrap().len(), 3, "every chunk reached the store");
    let mut out = Kv::contiguous(48);
    let found = (decode.lookup(&tokens), decode.retrieve(&tokens, &out.memory()).unwrap());
    assert_eq!(out.matching_prefix(&tokens), found.1);
    prefill.close().unwrap();
    found
}

#[test]
fn engines_in_other_namespaces_never_take_each_others_chunks() {
    assert_eq!(found_across(b"llama-8b/tp0", b"llama-8b/tp0"), (40, 40));
    assert_eq!(found_across(b"llama-8b/tp0", b"llama-8b/tp1"), (0, 0), "another TP rank's KV under the same tokens");
    assert_eq!(found_across(b"", b"adapter-7"), (0, 0));
}

#[test]
fn a_remote_chunk_that_does_not_fit_its_key_ends_the_prefix_for_lookup_and_retrieve() {
    let (pa, da) = (agent("ce-bad-remote-tx", None), agent("ce-bad-remote-rx", None));
    let (mut sink, store) = store_pair(&pa, &da);
    let mut decode = engine(&da, 2).with_remote_source(store);
    let tokens = prompt(40, 70);
    let keys = decode.keys(&tokens);
    // Objects put by hand under the chunks' names: bytes of the right length and the
    // right meta for the first two, then a last chunk as long as a full one.
    let full = SHAPE.chunk_bytes(CHUNK);
    let seg = pa.alloc(4 * full as usize).unwrap();
    pa.register(MemKind::Dram, seg.addr(), 4 * full, 0).unwrap();
    let put = |sink: &mut StoreSender, i: usize, len: u64, meta: Vec<u8>| {
        let local = Desc { addr: seg.addr() + i as u64 * full, len, dev: 0 };
        sink.put(Outgoing { key: keys[i].name(), kind: MemKind::Dram, local, meta }).unwrap();
        sink.commit().unwrap();
    };
    put(&mut sink, 0, full, keys[0].meta());
    put(&mut sink, 1, full, keys[1].meta());
    put(&mut sink, 2, full, keys[2].meta());
    let mut out = Kv::contiguous(48);
    assert_eq!(decode.lookup(&tokens), 32, "the last chunk holds 8 tokens, not 16");
    assert_eq!(decode.retrieve(&tokens, &out.memory()).unwrap(), 32);
    // The second chunk's meta claims it is the first.
    put(&mut sink, 1, full, keys[0].meta());
    assert_eq!(decode.lookup(&tokens), 16);
    assert_eq!(decode.retrieve(&tokens, &out.memory()).unwrap(), 16);
    put(&mut sink, 1, full, keys[1].meta());
    let last = SHAPE.chunk_bytes(8);
    put(&mut sink, 2, last, keys[2].meta());
    assert_eq!((decode.lookup(&tokens), decode.retrieve(&tokens, &out.memory()).unwrap()), (40, 40));
    sink.close().unwrap();
}
