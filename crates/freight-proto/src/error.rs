//! One error type for the whole engine. Every variant names what went wrong precisely
//! enough that the Python layer can map it to its own exception class.

use std::io;

/// Result alias used throughout the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A caller passed something malformed: wrong lengths, bad indices, zero sizes...
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Local memory named by a descriptor is not inside any registered region.
    #[error("memory not registered: {kind} [{addr:#x}, +{len}) on device {dev}")]
    NotRegistered { kind: String, addr: u64, len: u64, dev: u64 },

    /// A descriptor starts inside a registered region but runs past its end.
    #[error("out of bounds: [{addr:#x}, +{len}) exceeds region [{region_addr:#x}, +{region_len})")]
    OutOfBounds { addr: u64, len: u64, region_addr: u64, region_len: u64 },

    /// A new registration overlaps an existing one.
    #[error("region [{addr:#x}, +{len}) overlaps registered region {existing}")]
    Overlap { addr: u64, len: u64, existing: u64 },

    /// Deregistration of memory that an in-flight transfer is using.
    #[error("region {key} is in use by {users} in-flight transfer(s); wait for them before deregistering")]
    RegionBusy { key: u64, users: usize },

    /// A region key that does not (or no longer) exist.
    #[error("unknown region key {0}")]
    UnknownRegion(u64),

    #[error("unknown peer '{0}'")]
    UnknownPeer(String),

    /// No enabled transport can serve this path, or a required transport cannot.
    #[error("transport unavailable: {0}")]
    TransportUnavailable(String),

    /// Metadata bytes that do not decode, come from a newer format, or are inconsistent.
    #[error("malformed metadata: {0}")]
    Metadata(String),

    /// A wire message that does not decode or violates the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// Wrong or missing secret on a connection.
    #[error("authentication failed: {0}")]
    Auth(String),

    /// The remote agent refused an access (unregistered, out of bounds, revoked).
    #[error("remote agent '{peer}' rejected the access: {reason}")]
    RemoteRejected { peer: String, reason: String },

    /// The peer went away or stopped answering.
    #[error("peer '{peer}' disconnected: {reason}")]
    PeerDisconnected { peer: String, reason: String },

    #[error("timed out: {0}")]
    Timeout(String),

    /// The caller's interrupt check stopped a wait (Ctrl-C in Python); what the wait was
    /// for did not happen, and the call may be made again (see `freight_core::interrupt`).
    #[error("interrupted: {0}")]
    Interrupted(String),

    /// The request cannot be used in its current state (posted while pending, released...).
    #[error("invalid state: {0}")]
    InvalidState(String),

    #[error("I/O error: {0}")]
    Io(String),

    /// A pool, store or buffer has no room left for what was asked of it.
    #[error("out of space: {0}")]
    NoSpace(String),

    #[error("etcd: {0}")]
    Etcd(String),

    /// A CUDA driver or NVRTC call failed.
    #[error("CUDA {call} failed: {code}")]
    Cuda { call: String, code: String },
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Timeout(e.to_string()),
            _ => Error::Io(e.to_string()),
        }
    }
}

/// An [`Error::InvalidArgument`] with `msg`.
pub fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
