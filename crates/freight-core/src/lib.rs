//! freight's transfer engine: agents that register memory, exchange metadata, and move
//! bytes between each other's registered memory with prepared, batched, notified
//! transfers over pluggable transports.
//!
//! The layers, bottom up: [`memory`] (what may be touched), [`desc`] and [`plan`] (which
//! bytes go where), [`tracker`] (completion bookkeeping), [`wire`] and [`metadata`]
//! (formats), [`transport`] (moving bytes), and [`agent`] (the public face).

pub mod agent;
pub mod cuda;
pub mod desc;
pub mod error;
pub mod exchange;
pub mod interrupt;
mod maps;
pub mod memcopy;
pub mod memory;
pub mod metadata;
pub mod notify;
pub mod path;
pub mod pci;
pub mod plan;
pub mod tracker;
pub mod transport;
pub mod wire;

mod doorbell;
mod fault;
mod inbox;
mod net;
pub mod nic;
pub mod outbox;
mod peer;
pub mod poll;
mod server;

pub use agent::{Agent, AgentConfig, RemoteList, Request};
pub use cuda::completion::CompletionMode;
pub use cuda::kernel::{KernelMode, LaunchShape};
pub use desc::{Desc, DescList};
pub use error::{Error, Result};
pub use memory::{MemKind, SharedSegment};
pub use net::same_secret;
pub use nic::Pinning;
pub use notify::{Notification, Waker};
pub use path::{Path, TransportKind};
pub use peer::ConnectionStats;
pub use plan::PreparedList;
pub use tracker::Status;
pub use transport::cuda::CudaConfig;
pub use transport::fabric::FabricConfig;
pub use transport::shm::ShmConfig;
pub use transport::tcp::TcpConfig;
pub use transport::OpKind;
