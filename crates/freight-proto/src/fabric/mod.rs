//! The fabric transport's bookkeeping, apart from libfabric and its threads: how
//! operations wait for a rail ([`backlog`]) and how chunks pass through a peer's
//! landing buffers where one-sided access cannot reach its memory ([`pipeline`]).

pub mod backlog;
pub mod pipeline;
