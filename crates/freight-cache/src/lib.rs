//! freight's chunked KV cache engine.
//!
//! A request's KV cache is stored in chunks of a fixed number of tokens, each keyed by a
//! rolling hash of the token prefix it ends, seeded with the KV shape, the chunk size
//! and the caller's namespace ([`key`]), so a prompt that shares a prefix with a stored
//! one finds that prefix's chunks, and never those of another namespace or KV shape.
//! The caller's KV memory may be contiguous or paged like vLLM's ([`layout`]); chunks
//! move in and out of it with one batched gather or scatter per chunk ([`chunk_bytes`]),
//! pipelined with the copy engine against host memory ([`gpu_scratch`]). Chunks live in
//! tiers: the local GPU, local host memory with LRU eviction ([`slots`], [`tier`]), and
//! a remote peer through the storage backend of `freight-stream` ([`engine`]).

pub mod chunk_bytes;
pub mod engine;
pub mod gpu_scratch;
pub mod key;
pub mod layout;
mod per_gpu;
mod place;
pub mod slots;
pub mod tier;

pub use engine::{CacheConfig, CacheEngine, KvMemory, StoreReport, StoreTimes, DEFAULT_COMMITS_IN_FLIGHT};
pub use key::{chunk_keys, ChunkKey};
pub use layout::{KvLayout, KvShape, Run};
pub use place::Place;
