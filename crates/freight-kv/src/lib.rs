//! freight's KV cache server.
//!
//! Values live in one memory pool that the server registers with the freight engine
//! ([`pool`]); an index maps keys to their slots, with TTLs, LRU eviction and readers'
//! pins, so that a value is either wholly old or wholly new to every reader
//! ([`index`]). Both are bookkeeping only, tested without sockets.

pub mod index;
pub mod pool;
