//! freight's stream products: a pipe (an ordered stream of messages from one sender to
//! one receiver through a bounded buffer registered in the receiver's memory) and, on
//! top of it, a channel of keyed objects.
//!
//! The sender writes each message straight into free space of the receiver's buffer
//! (one copy end to end) and tells the receiver where it is; the receiver consumes
//! messages in order and hands space back with credits. This crate starts with that
//! bookkeeping, kept apart from I/O so that it is tested on its own:
//!
//! - [`window`]: where the next message goes in the buffer, which space is free, and
//!   when the receiver owes the sender a credit.

pub mod window;
