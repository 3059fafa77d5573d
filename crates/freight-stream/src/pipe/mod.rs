//! The pipe: an ordered stream of messages from one sender agent to one receiver agent
//! through a bounded buffer registered in the receiver's memory.
//!
//! Setting up: the sender connects to the receiver's listener and asks for a pipe
//! (`Open`); the receiver, in [`PipeListener::accept`], connects back, registers its
//! buffer and answers with where it lies (`Accept`). Then each [`PipeSender::send`]
//! takes the next free slot of that buffer (see [`crate::window`]), writes the message
//! there with one engine WRITE straight from the sender's memory, and announces it in
//! the write's own notification, which the engine delivers only once the bytes are
//! visible. The receiver hands messages out in order as [`Message`]s, views into its
//! buffer; dropping or releasing one frees its space, and credits tell the sender.
//!
//! Nothing waits forever: every wait ends at the configured timeout, a broken
//! connection to the other end ends it early, and an end that goes away on purpose
//! tells the other (`Abort`).

mod receiver;
mod sender;

use std::time::{Duration, Instant};

pub(crate) use freight_core::interrupt::deadline_after;
use freight_core::{interrupt, Agent, Error, MemKind, Result};

pub use receiver::{Message, PipeListener, PipeReceiver};
pub use sender::{PipeSender, Progress};

pub use crate::proto::BufferInfo;
use crate::window::WindowError;

/// Slots start on multiples of this many bytes (GPU copies and views like alignment).
pub const ALIGN: u64 = 256;

/// Default size of a pipe's buffer.
pub const DEFAULT_CAPACITY: u64 = 4 << 30;

/// How long a sender waits for the receiver's word on why a write failed.
const REASON_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct PipeConfig {
    /// Bound on every wait: for a pipe to open, for room in the buffer, for a message,
    /// for writes to finish.
    pub timeout: Duration,
    /// Receiver: the least number of freed bytes worth a credit [a quarter of the buffer].
    pub credit_batch: Option<u64>,
    /// Sender: writes posted and not yet finished before `send` waits for the oldest.
    pub max_in_flight: usize,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig { timeout: Duration::from_secs(30), credit_batch: None, max_in_flight: 16 }
    }
}

impl PipeConfig {
    fn validate(&self) -> Result<()> {
        if self.timeout.is_zero() {
            return Err(Error::InvalidArgument("a pipe's timeout must be positive".into()));
        }
        if self.max_in_flight == 0 {
            return Err(Error::InvalidArgument("a pipe needs at least one write in flight".into()));
        }
        Ok(())
    }
}

/// The receiver's buffer.
#[derive(Debug, Clone)]
pub enum Buffer {
    /// Host memory the pipe allocates in a shared segment (reachable over shm and tcp).
    Host { capacity: u64 },
    /// Memory the caller registered with the agent (GPU memory, say). It must stay
    /// registered while the pipe and its messages live.
    Registered(BufferInfo),
}

fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Window errors as engine errors: a size the caller chose is an invalid argument, a
/// bookkeeping disagreement between the two ends is a protocol error.
fn window_error(peer: &str, e: WindowError) -> Error {
    match e {
        WindowError::NoCapacity | WindowError::Empty | WindowError::TooLarge { .. } => {
            Error::InvalidArgument(e.to_string())
        }
        other => Error::Protocol(format!("pipe with '{peer}': {other}")),
    }
}

/// Waits on `inbox` until `deadline` in slices, checking between slices that `peer` is
/// still connected and that the caller did not interrupt the wait. `Ok(None)` at the
/// deadline.
fn wait_message<T>(
    agent: &Agent,
    peer: &str,
    inbox: &crossbeam_channel::Receiver<T>,
    deadline: Instant,
) -> Result<Option<T>> {
    interrupt::until(deadline, |slice| match inbox.recv_timeout(slice) {
        Ok(m) => Ok(Some(m)),
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => agent.check_peer(peer).map(|()| None),
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
            Err(Error::InvalidState("the pipe's message route closed".into()))
        }
    })
}

fn check_buffer(info: &BufferInfo) -> Result<()> {
    if info.len == 0 {
        return Err(Error::InvalidArgument("a pipe buffer must hold at least one byte".into()));
    }
    if info.kind == MemKind::File {
        return Err(Error::InvalidArgument("a pipe buffer must be host (DRAM) or GPU (VRAM) memory".into()));
    }
    Ok(())
}
