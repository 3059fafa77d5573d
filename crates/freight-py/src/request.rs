//! Requests: post, poll, wait.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_core::{Error, Request, Status};
use pyo3::prelude::*;

use crate::errors::{to_py_err, OrRaise};
use crate::util::timeout_arg;

/// Longest stretch spent blocked in the engine before checking for Ctrl-C.
pub(crate) const SIGNAL_SLICE: Duration = Duration::from_millis(100);

/// A transfer between local memory and a peer's memory: post it, poll it, wait for it,
/// post it again. Created by `Agent.make_request` (idle) or `Agent.transfer` (posted).
///
/// A request keeps its agent (and the memory the agent registered) alive.
#[pyclass(frozen, name = "Request", module = "freight")]
pub struct PyRequest {
    pub(crate) inner: Request,
    pub(crate) peer: String,
    /// The agent's Python object, kept alive while the request is.
    pub(crate) _owner: Py<PyAny>,
    /// The agent's count of request objects, which this one is among until dropped.
    pub(crate) counted: Arc<AtomicUsize>,
}

fn status_str(s: &Status) -> &'static str {
    match s {
        Status::Idle => "IDLE",
        Status::Pending => "PENDING",
        Status::Done => "DONE",
        Status::Error(_) => "ERROR",
    }
}

#[pymethods]
impl PyRequest {
    /// Starts the transfer (non-blocking; small shm transfers complete before it returns).
    /// Raises InvalidStateError while the request is still pending, PeerDisconnectedError
    /// if the peer is known to be gone. A finished request may be posted again.
    ///
    /// ``notif`` (bytes), when given, is this round's notification in place of the one
    /// the request was made with; later posts without it send the request's own.
    ///
    /// Returns True when the round is already done as the call returns (so a caller that
    /// polls can skip its first `status()`), False while it runs or if it failed at once.
    #[pyo3(signature = (notif = None))]
    fn post(&self, py: Python<'_>, notif: Option<Vec<u8>>) -> PyResult<bool> {
        match notif {
            None => py.detach(|| self.inner.post()).or_raise()?,
            Some(msg) => py.detach(|| self.inner.post_with_notif(Some(msg))).or_raise()?,
        }
        Ok(matches!(self.inner.status(), Status::Done))
    }

    /// "IDLE" (never posted), "PENDING", "DONE" or "ERROR" (see `error`).
    fn status(&self) -> &'static str {
        status_str(&self.inner.status())
    }

    /// Seconds the last round took, from posting it to its status becoming final
    /// ("DONE" or "ERROR"); None while it is pending or before it was first posted.
    #[getter]
    fn duration(&self) -> Option<f64> {
        self.inner.duration().map(|d| d.as_secs_f64())
    }

    /// The exception that failed the last round, or None.
    #[getter]
    fn error(&self) -> Option<PyErr> {
        match self.inner.status() {
            Status::Error(e) => Some(to_py_err(e)),
            _ => None,
        }
    }

    /// Blocks until the request is done (returns None) or failed
    /// (raises its exception, e.g. PeerDisconnectedError). With a timeout in seconds,
    /// raises freight.TimeoutError if the request is still pending then (the request
    /// carries on; wait again or poll `status()`). Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout_arg(timeout)?;
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_SLICE),
                None => SIGNAL_SLICE,
            };
            match py.detach(|| self.inner.wait(Some(slice))) {
                Status::Done => return Ok(()),
                Status::Error(e) => return Err(to_py_err(e)),
                Status::Idle => return Err(to_py_err(Error::InvalidState("the request was never posted".into()))),
                Status::Pending => {}
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(to_py_err(Error::Timeout(format!(
                    "request to '{}' still pending after {:.3} s",
                    self.peer,
                    timeout.unwrap_or_default().as_secs_f64()
                ))));
            }
        }
    }

    /// The transport that serves this request: "cuda", "shm", "fabric" or "tcp".
    #[getter]
    fn transport(&self) -> &'static str {
        self.inner.path().transport.as_str()
    }

    /// Why that transport was chosen (and why the others were not).
    #[getter]
    fn path_reason(&self) -> &str {
        &self.inner.path().reason
    }

    /// Bytes moved per post.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.bytes()
    }

    /// Copies per post, after merging neighbouring descriptors.
    #[getter]
    fn copies(&self) -> usize {
        self.inner.copies()
    }

    /// "READ" or "WRITE".
    #[getter]
    fn op(&self) -> &'static str {
        self.inner.op().as_str()
    }

    /// Name of the remote agent.
    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    fn __repr__(&self) -> String {
        format!(
            "<freight.Request {} {} bytes {} '{}' via {} [{}]>",
            self.inner.op().as_str(),
            self.inner.bytes(),
            if self.inner.op() == freight_core::OpKind::Write { "to" } else { "from" },
            self.peer,
            self.inner.path().transport,
            status_str(&self.inner.status())
        )
    }
}

impl Drop for PyRequest {
    fn drop(&mut self) {
        self.counted.fetch_sub(1, Ordering::AcqRel);
    }
}
