//! What the two ends of a pipe tell each other. Every message travels in an engine
//! notification, so a `Data` message reaches the receiver only after the bytes of the
//! write that carried it are visible there.
//!
//! A message is `MAGIC` followed by its postcard encoding; notifications without the
//! magic are not the pipe's and are left alone.

use freight_core::{Error, MemKind, Result};
use serde::{Deserialize, Serialize};

use crate::window::Slot;

/// Marks a notification as a pipe message of this format.
pub const MAGIC: &[u8; 4] = b"FPS1";

/// The receiver's buffer, as the sender needs it to address writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferInfo {
    pub kind: MemKind,
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
}

/// One message. `pipe` is chosen by the sender at random and names the pipe within the
/// pair of agents (two agents may share several pipes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Sender -> receiver: please take a pipe; answer me at these addresses.
    Open { pipe: u64, addresses: Vec<String> },
    /// Receiver -> sender: write into this buffer; credits come every `credit_batch` bytes.
    Accept { pipe: u64, buffer: BufferInfo, credit_batch: u64 },
    /// Receiver -> sender: no pipe, because...
    Refuse { pipe: u64, reason: String },
    /// Sender -> receiver, carried by the write itself: a message of `len` bytes now
    /// lies at the start of `slot` (which may be longer: slots are aligned).
    Data { pipe: u64, slot: WireSlot, len: u64, tag: Vec<u8> },
    /// Receiver -> sender: everything before stream position `upto` is free again.
    Credit { pipe: u64, upto: u64 },
    /// Sender -> receiver: no more messages after the first `messages`.
    Close { pipe: u64, messages: u64 },
    /// Either way: the pipe is broken, and why.
    Abort { pipe: u64, reason: String },
    /// Sender -> receiver: credit as soon as everything before stream position `upto`
    /// is released, however few bytes that frees (the sender waits for that point).
    Sync { pipe: u64, upto: u64 },
}

/// [`Slot`] on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSlot {
    pub seq: u64,
    pub start: u64,
    pub len: u64,
}

impl From<Slot> for WireSlot {
    fn from(s: Slot) -> Self {
        WireSlot { seq: s.seq, start: s.start, len: s.len }
    }
}

impl From<WireSlot> for Slot {
    fn from(s: WireSlot) -> Self {
        Slot { seq: s.seq, start: s.start, len: s.len }
    }
}

impl Msg {
    pub fn pipe(&self) -> u64 {
        match self {
            Msg::Open { pipe, .. }
            | Msg::Accept { pipe, .. }
            | Msg::Refuse { pipe, .. }
            | Msg::Data { pipe, .. }
            | Msg::Credit { pipe, .. }
            | Msg::Close { pipe, .. }
            | Msg::Abort { pipe, .. }
            | Msg::Sync { pipe, .. } => *pipe,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        // Encoding into a Vec cannot fail for these types.
        out.extend(postcard::to_allocvec(self).expect("pipe messages always encode"));
        out
    }

    /// `None` for a notification that is not a pipe message at all.
    pub fn decode(bytes: &[u8]) -> Option<Result<Msg>> {
        let body = bytes.strip_prefix(MAGIC.as_slice())?;
        Some(postcard::from_bytes(body).map_err(|e| Error::Protocol(format!("malformed pipe message: {e}"))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_foreign_bytes_are_not_ours() {
        let msgs = [
            Msg::Open { pipe: 7, addresses: vec!["127.0.0.1:9".into()] },
            Msg::Accept {
                pipe: 7,
                buffer: BufferInfo { kind: MemKind::Vram, addr: 1 << 40, len: 4 << 30, dev: 1 },
                credit_batch: 1 << 30,
            },
            Msg::Data { pipe: 7, slot: WireSlot { seq: 3, start: 4096, len: 256 }, len: 10, tag: b"k".to_vec() },
            Msg::Credit { pipe: 7, upto: 4106 },
            Msg::Close { pipe: 7, messages: 4 },
            Msg::Abort { pipe: 7, reason: "gone".into() },
            Msg::Sync { pipe: 7, upto: 4106 },
        ];
        for m in msgs {
            assert_eq!(Msg::decode(&m.encode()).unwrap().unwrap(), m);
            assert_eq!(m.pipe(), 7);
        }
        assert!(Msg::decode(b"hello").is_none());
        let mut broken = Msg::Credit { pipe: 1, upto: 2 }.encode();
        broken.truncate(5);
        assert!(matches!(Msg::decode(&broken), Some(Err(Error::Protocol(_)))));
    }
}
