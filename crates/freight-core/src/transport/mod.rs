//! Transports move the bytes of a plan. Each owns its per-peer connection state; the
//! agent decides which one serves a request (see [`freight_proto::path_choice`]).

pub mod cuda;
pub mod fabric;
pub mod gpu_bounce;
pub mod pool;
pub mod shm;
pub mod tcp;
pub mod zerocopy;
