//! freight's transfer engine: agents that register memory, exchange metadata, and move
//! bytes between each other's registered memory with prepared, batched, notified
//! transfers over pluggable transports.
//!
//! The engine is the runtime over three crates below it: [`freight_proto`] (the
//! protocol without I/O: descriptors, plans, path choice, request rounds, frames,
//! metadata, the transports' state machines), [`freight_host`] (the machine: identity,
//! cores, NICs, PCI) and [`freight_cuda`] (GPUs, loaded at run time). Here, bottom up:
//! [`memory`] (what may be touched: shared segments and the registry), [`frame_io`]
//! (frames on sockets), [`transport`] (moving bytes), the connections to peers and the
//! listener, and [`agent`] (the public face).

pub mod agent;
pub mod config;
pub mod exchange;
pub mod frame_io;
pub mod interrupt;
pub mod memcopy;
pub mod memory;
pub mod notify;
pub mod tracker;
pub mod transport;

mod doorbell;
mod fault;
mod inbox;
mod net;
mod peer;
mod server;

pub use agent::{Agent, RemoteList, Request};
pub use config::AgentConfig;
pub use freight_cuda::completion::CompletionMode;
pub use freight_cuda::kernel::{KernelMode, LaunchShape};
pub use freight_host::nic::Pinning;
pub use freight_proto::hello::same_secret;
pub use freight_proto::{
    Desc, DescList, Error, MemKind, OpKind, PreparedList, RegionInfo, Result, Status, TransferPath, TransportKind,
};
pub use memory::SharedSegment;
pub use notify::{Notification, Waker};
pub use peer::ConnectionStats;
pub use transport::cuda::CudaConfig;
pub use transport::fabric::FabricConfig;
pub use transport::shm::ShmConfig;
pub use transport::tcp::TcpConfig;
