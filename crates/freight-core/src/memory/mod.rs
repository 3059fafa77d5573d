//! Memory the engine may touch: shared segments that same-host peers map
//! ([`segment`]), and the registry of the regions this agent registered ([`registry`]).
//! What a region is, as peers are told, is [`freight_proto::region`]'s.

mod maps;
pub mod registry;
pub mod segment;

pub use registry::{Region, Registry};
pub use segment::SharedSegment;
