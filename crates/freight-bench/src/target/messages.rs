//! What the initiator and the target say to each other. Messages travel as engine
//! notifications (JSON), so they need no channel of their own and work the same whether
//! the target is our child process or runs on another host.
//!
//! A WRITE's check request rides on the transfer itself: the engine delivers a
//! request's notification only after its bytes are in the target's memory.

use serde::{Deserialize, Serialize};

/// Initiator to target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Command {
    /// Allocate (or reuse) a buffer of `bytes`, register it as `kind`, connect back to
    /// the initiator at `reply_to` so that replies can be sent, and answer `Ready`.
    Setup { bytes: u64, kind: String, reply_to: Vec<String> },
    /// Overwrite the first `len` bytes with the poison byte.
    Poison { len: u64 },
    /// Write the pattern of `seed` over the first `len` bytes (source of a READ).
    Fill { seed: u64, len: u64 },
    /// Check that the first `len` bytes hold the pattern of `seed`.
    Check { seed: u64, len: u64 },
    /// The session is over; the target exits.
    Bye,
}

/// Target to initiator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// The buffer is registered at `addr` (the target's address space), `len` bytes.
    Ready {
        addr: u64,
        len: u64,
        pid: u32,
    },
    Done,
    Failed {
        error: String,
    },
}

impl Command {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("commands always serialise")
    }
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("replies always serialise")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let c = Command::Setup { bytes: 4096, kind: "DRAM".into(), reply_to: vec!["127.0.0.1:1".into()] };
        assert_eq!(serde_json::from_slice::<Command>(&c.encode()).unwrap(), c);
        let r = Reply::Failed { error: "x".into() };
        assert_eq!(serde_json::from_slice::<Reply>(&r.encode()).unwrap(), r);
        assert!(serde_json::from_slice::<Command>(br#"{"cmd":"format_disk"}"#).is_err());
    }
}
