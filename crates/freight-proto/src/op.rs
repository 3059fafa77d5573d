//! The direction of a transfer.

use crate::error::{invalid, Result};

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Local memory to remote memory.
    Write,
    /// Remote memory to local memory.
    Read,
}

impl OpKind {
    /// `"WRITE"` or `"READ"`, in any case.
    pub fn parse(s: &str) -> Result<OpKind> {
        match s.to_ascii_uppercase().as_str() {
            "WRITE" => Ok(OpKind::Write),
            "READ" => Ok(OpKind::Read),
            other => Err(invalid(format!("unknown operation '{other}' (expected READ or WRITE)"))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Write => "WRITE",
            OpKind::Read => "READ",
        }
    }
}
