//! freight's KV cache server.
//!
//! Values live in one memory pool that the server registers with the freight engine
//! ([`pool`]); an index maps keys to their slots, with TTLs, LRU eviction and readers'
//! pins, so that a value is either wholly old or wholly new to every reader
//! ([`index`]). Clients send GET and PUT requests as engine notifications ([`wire`]),
//! or, where the server reaches them over tcp, on a [`direct`] connection of their own;
//! what the server does with each, apart from moving the bytes, is [`service`]. These
//! are bookkeeping only, tested without sockets.
//!
//! Around them: the [`server`] (the pool, the clients' sessions, the data-plane worker
//! that moves every value as one engine transfer per request, the gRPC control plane)
//! and the [`client`], which speak the [`control`] protocol; servers share a key space
//! through etcd ([`cluster`]). docs/kv.md
//! describes the whole.

pub mod client;
pub mod cluster;
pub mod control;
pub mod direct;
pub mod index;
mod notif_wait;
pub mod pool;
mod pool_memory;
pub mod reach;
pub mod server;
pub mod service;
pub mod wire;

pub use client::{Client, ClientConfig};
pub use cluster::{ClusterClient, ClusterConfig, EtcdConfig};
pub use server::{Server, ServerConfig, TlsIdentity};
