//! Transports move the bytes of a plan. Each owns its per-peer connection state; the
//! agent decides which one serves a request (see [`crate::path`]).

pub mod cuda;
pub mod fabric;
pub mod pool;
pub mod shm;
pub mod staged;
pub mod tcp;
pub mod zerocopy;

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Local memory to remote memory.
    Write,
    /// Remote memory to local memory.
    Read,
}

impl OpKind {
    pub fn parse(s: &str) -> crate::Result<OpKind> {
        match s.to_ascii_uppercase().as_str() {
            "WRITE" => Ok(OpKind::Write),
            "READ" => Ok(OpKind::Read),
            other => {
                Err(crate::Error::InvalidArgument(format!("unknown operation '{other}' (expected READ or WRITE)")))
            }
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Write => "WRITE",
            OpKind::Read => "READ",
        }
    }
}
