//! freight's protocol, without I/O: the vocabulary both ends of a transfer speak and
//! the state machines of its exchanges, with no sockets, threads or clocks. The engine
//! (`freight-core`) drives these with its sockets and threads; here they are driven by
//! tests, two ends at a time where an exchange has two ([`pair`]).
//!
//! - [`error`]: the one error type every layer returns.
//! - [`region`]: kinds of memory, what a peer is told of a registered region, and the
//!   index a peer's regions are looked up in.
//! - [`desc`] and [`plan`]: which bytes a transfer touches, resolved against regions,
//!   and the copies that move them; [`op`] is a transfer's direction.
//! - [`path_choice`]: which transport serves a peer and memory kind, and why.
//! - [`round`]: the bookkeeping of one posted round of a request.
//! - [`frame`] and [`metadata`]: the formats on the wire and of an agent's metadata.
//! - [`hello`]: how a connection is introduced, and what the listener makes of it.
//! - [`data_stream`]: one tcp data stream's exchange, at the initiator and the target.
//! - [`notif_ring`]: the same-host notification ring over raw shared memory.
//! - [`fabric`]: the fabric transport's backlog and landing-buffer pipeline.

pub mod data_stream;
pub mod desc;
pub mod error;
pub mod fabric;
pub mod frame;
pub mod hello;
pub mod metadata;
pub mod notif_ring;
pub mod op;
pub mod path_choice;
pub mod plan;
pub mod region;
pub mod round;

#[cfg(test)]
mod pair;

pub use desc::{Desc, DescList};
pub use error::{Error, Result};
pub use op::OpKind;
pub use path_choice::{TransferPath, TransportKind};
pub use plan::PreparedList;
pub use region::{MemKind, RegionInfo};
pub use round::Status;
