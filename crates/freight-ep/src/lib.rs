//! MoE expert parallelism: every rank holds tokens and, for each, the top-k experts that
//! should see it; `dispatch` sends each token once to every rank that owns one of its
//! experts, `combine` brings the experts' outputs back and sums them with the top-k
//! weights.
//!
//! - [`rendezvous`]: how ranks find each other (a small rank server, or etcd), exchange
//!   blobs, and learn that one of them died.
//! - [`layout`]: the workspace each rank shares and the shape the kernels read.
//! - [`kernels`]: the CUDA kernels (kernels.cu) and their typed launchers.
//! - [`buffer`]: one rank's buffer: dispatch and combine queued on the caller's stream.
//! - [`relay`]: ranks reached through the engine's transports instead of CUDA IPC.
//! - [`status`]: why a kernel gave up, as an error.

pub mod buffer;
pub mod engine_relay;
pub mod kernels;
pub mod layout;
pub mod rendezvous;
pub mod status;

pub use buffer::{Buffer, DispatchCounts, Options};
pub use engine_relay::Backend;
pub use kernels::{CombineArgs, DispatchInputs, DispatchOutputs};
pub use layout::Config;
