//! freight's stream products: a pipe (an ordered stream of messages from one sender to
//! one receiver through a bounded buffer registered in the receiver's memory) and, on
//! top of it, a channel of keyed objects.
//!
//! The sender writes each message straight into free space of the receiver's buffer
//! (one copy end to end) and tells the receiver where it is; the receiver consumes
//! messages in order and hands space back with credits. Everything is built on the
//! engine's public API ([`freight_core::Agent`]).
//!
//! - [`window`]: where the next message goes in the buffer, which space is free, and
//!   when the receiver owes the sender a credit (pure bookkeeping, property-tested).
//! - [`proto`]: what the two ends tell each other, in engine notifications.
//! - [`router`]: sorts an agent's notifications by pipe.
//! - [`pipe`]: the two ends of a pipe.
//! - [`next`]: what a bounded wait for a stream's next item came to.
//! - [`layout`]: how a batch of keyed objects fills pipe messages (pure, property-tested).
//! - [`channel`]: keyed objects over pipes, many senders to one receiver.
//! - [`owned`]: memory objects are kept in once out of a pipe buffer, pooled for reuse.
//! - [`storage`]: a keyed store over the channel: puts committed in batches, gets by key.
//! - [`recency`]: which of a store's keys were used least recently (pure, for eviction).

pub mod channel;
pub mod layout;
pub mod next;
pub mod owned;
pub mod pipe;
pub mod proto;
pub mod recency;
pub mod router;
pub mod storage;
pub mod window;

pub use channel::{ChannelReceiver, ChannelSender, Outgoing, Received};
pub use next::Next;
pub use owned::Owned;
pub use pipe::{Buffer, BufferInfo, Message, PipeConfig, PipeListener, PipeReceiver, PipeSender};
pub use storage::{CommitStats, Committed, StoreReceiver, StoreSender, StoredObject, DEFAULT_COMMIT_SIZE};
