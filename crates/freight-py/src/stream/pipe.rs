//! The pipe's bindings: listener, receiving end and its messages, sending end.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use freight_core::{Error, SharedSegment};
use freight_stream::{BufferInfo, Message, PipeListener, PipeReceiver, PipeSender};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{
    abort_sender, accept_pipe, buffer_arg, close_sender, connect_pipe, drop_detached, drop_taken, lock, pipe_config,
    segment_of, settle_sender, wait_arg, with_sender, Place, Region, SenderCell,
};
use crate::agent::PyAgent;
use crate::descs::PyDescList;
use crate::errors::{to_py_err, OrRaise};
use crate::interrupt;

/// Accepts pipes that senders open to an agent (use `freight.PipeListener`).
#[pyclass(frozen, name = "PipeListener", module = "freight._native")]
pub struct PyPipeListener {
    inner: PipeListener,
}

#[pymethods]
impl PyPipeListener {
    #[new]
    fn new(agent: &Bound<'_, PyAgent>) -> Self {
        let a = agent.get();
        // The agent holds its router first, so that its own notifications survive.
        a.router();
        PyPipeListener { inner: PipeListener::new(&a.inner) }
    }

    /// Waits up to `timeout` seconds for a sender and sets its pipe up, with a host
    /// buffer of `capacity` bytes or the registered `region` (kind, addr, length,
    /// device); `keep` is held while the receiver lives.
    #[pyo3(signature = (capacity = None, region = None, keep = None, timeout = 30.0, credit_batch = None))]
    fn accept(
        &self,
        py: Python<'_>,
        capacity: Option<u64>,
        region: Option<Region>,
        keep: Option<Py<PyAny>>,
        timeout: f64,
        credit_batch: Option<u64>,
    ) -> PyResult<PyPipeReceiver> {
        let buffer = buffer_arg(capacity, region)?;
        let config = pipe_config(timeout, credit_batch, 1)?;
        let rx = accept_pipe(py, &self.inner, buffer, &config)?;
        Ok(PyPipeReceiver::new(rx, config.timeout, keep))
    }
}

/// The receiving end of a pipe (use `freight.PipeReceiver`).
#[pyclass(frozen, name = "PipeReceiver", module = "freight._native")]
pub struct PyPipeReceiver {
    inner: Mutex<Option<Arc<PipeReceiver>>>,
    peer: String,
    buffer: BufferInfo,
    timeout: Duration,
    _keep: Option<Py<PyAny>>,
}

impl PyPipeReceiver {
    fn new(rx: PipeReceiver, timeout: Duration, keep: Option<Py<PyAny>>) -> Self {
        let (peer, buffer) = (rx.peer().to_string(), rx.buffer().clone());
        PyPipeReceiver { inner: Mutex::new(Some(Arc::new(rx))), peer, buffer, timeout, _keep: keep }
    }

    fn get(&self) -> PyResult<Arc<PipeReceiver>> {
        lock(&self.inner).clone().ok_or_else(|| to_py_err(Error::InvalidState("the pipe receiver is closed".into())))
    }
}

#[pymethods]
impl PyPipeReceiver {
    /// The next message, or None once the sender closed the stream and every message
    /// was handed out. Waits up to `timeout` seconds (None: the pipe's timeout).
    #[pyo3(signature = (timeout = None))]
    fn recv(slf: &Bound<'_, Self>, timeout: Option<f64>) -> PyResult<Option<PyMessage>> {
        let py = slf.py();
        let this = slf.get();
        let rx = this.get()?;
        let timeout = wait_arg(timeout, this.timeout)?;
        let got = interrupt::detach(py, || rx.recv(Some(timeout)))?;
        Ok(got.map(|m| PyMessage::new(py, m, slf.clone().unbind())))
    }

    /// Ends this side: a sender still sending is told the receiver went away. Messages
    /// already handed out stay valid until released, and their memory mapped while
    /// they exist.
    fn close(&self, py: Python<'_>) {
        let rx = lock(&self.inner).take();
        py.detach(move || {
            // A `recv` on another thread holds the end too: it must end now.
            if let Some(rx) = &rx {
                rx.close();
            }
            drop(rx)
        });
    }

    /// The sending agent's name.
    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// Size of the pipe's buffer in bytes.
    #[getter]
    fn capacity(&self) -> u64 {
        self.buffer.len
    }

    /// "DRAM" or "VRAM": where the buffer is.
    #[getter]
    fn kind(&self) -> &'static str {
        self.buffer.kind.as_str()
    }

    /// The GPU of a VRAM buffer (0 for host memory).
    #[getter]
    fn device(&self) -> u64 {
        self.buffer.dev
    }

    /// Messages handed out and not yet released.
    #[getter]
    fn held(&self) -> PyResult<usize> {
        Ok(self.get()?.held())
    }

    /// True once the sender closed the stream and every message was handed out.
    #[getter]
    fn finished(&self) -> PyResult<bool> {
        Ok(self.get()?.finished())
    }
}

impl Drop for PyPipeReceiver {
    fn drop(&mut self) {
        drop_taken(&self.inner);
    }
}

/// A message in a pipe's buffer (use `freight.Message`). Its bytes are a view of the
/// buffer until `release()`; the memory stays mapped as long as this object.
#[pyclass(frozen, name = "Message", module = "freight._native")]
pub struct PyMessage {
    inner: Mutex<Option<Message>>,
    seq: u64,
    tag: Py<PyBytes>,
    place: Place,
    /// A buffer the pipe allocated: a view may outlive the release and the pipe, and
    /// must not see the segment unmapped. (A caller's buffer is the pipe's `keep`.)
    segment: Option<Arc<SharedSegment>>,
    _pipe: Py<PyPipeReceiver>,
}

impl PyMessage {
    fn new(py: Python<'_>, m: Message, pipe: Py<PyPipeReceiver>) -> Self {
        let (kind, addr, dev) = m.location();
        let place = Place { kind, addr, len: m.len(), dev };
        let tag = PyBytes::new(py, m.tag()).unbind();
        PyMessage { seq: m.seq(), tag, place, segment: segment_of(&place), inner: Mutex::new(Some(m)), _pipe: pipe }
    }

    fn is_live(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).is_some())
    }

    fn lend(&self, py: Python<'_>) -> bool {
        self.is_live(py)
    }
}

placed_pymethods! {
    PyMessage, what = "message", live = "False once released.";

    /// Messages are numbered from 0 in the order they were sent.
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }

    /// What the sender attached.
    #[getter]
    fn tag(&self, py: Python<'_>) -> Py<PyBytes> {
        self.tag.clone_ref(py)
    }

    /// Frees the message's space for the sender. A view keeps the memory mapped, but
    /// after the release its bytes may be overwritten by later messages. Releasing
    /// twice is harmless.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        match lock(&self.inner).take() {
            Some(m) => py.detach(|| m.release()).or_raise(),
            None => Ok(()),
        }
    }
}

impl Drop for PyMessage {
    fn drop(&mut self) {
        drop_taken(&self.inner);
        // The last hold on a segment unmaps it.
        if let Some(segment) = self.segment.take() {
            drop_detached(segment);
        }
    }
}

// -- pipe: sending end ------------------------------------------------------------------

/// The sending end of a pipe (use `freight.PipeSender`).
#[pyclass(frozen, name = "PipeSender", module = "freight._native")]
pub struct PyPipeSender {
    inner: SenderCell<PipeSender>,
    peer: String,
    buffer: BufferInfo,
}

#[pymethods]
impl PyPipeSender {
    /// Opens a pipe to the agent listening at `addr` (it must accept within `timeout`).
    #[staticmethod]
    #[pyo3(signature = (agent, addr, timeout = 30.0, max_in_flight = 16))]
    fn connect(
        py: Python<'_>,
        agent: &Bound<'_, PyAgent>,
        addr: &str,
        timeout: f64,
        max_in_flight: usize,
    ) -> PyResult<Self> {
        let tx = connect_pipe(py, agent, addr, timeout, max_in_flight, Ok)?;
        Ok(PyPipeSender {
            peer: tx.peer().to_string(),
            buffer: tx.buffer().clone(),
            inner: Mutex::new(Some(Arc::new(tx))),
        })
    }

    /// Sends the bytes of `descs` (registered memory, gathered in order) as one message
    /// tagged `tag`; returns its number. `pieces` (offset, length) scatter them in the message.
    #[pyo3(signature = (descs, tag = Vec::new(), pieces = None))]
    fn send(
        &self,
        py: Python<'_>,
        descs: PyRef<'_, PyDescList>,
        tag: Vec<u8>,
        pieces: Option<Vec<(u64, u64)>>,
    ) -> PyResult<u64> {
        let list = &descs.inner;
        with_sender(py, &self.inner, |s| match &pieces {
            Some(p) => s.send_scattered(list, p, tag),
            None => s.send(list, tag),
        })
    }

    /// Waits until every message sent so far is written into the receiver's buffer.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        with_sender(py, &self.inner, |s| s.flush())
    }

    /// Flushes, then waits until the receiver released every message sent so far.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        with_sender(py, &self.inner, |s| s.drain())
    }

    /// Waits until no write of the pipe is in flight, whatever state the pipe is in:
    /// before memory it read is deregistered. Nothing to wait for once closed.
    fn settle_writes(&self, py: Python<'_>) -> PyResult<()> {
        settle_sender(py, &self.inner, |tx| tx.settle_writes())
    }

    /// Flushes and ends the stream; closing twice is harmless.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        close_sender(py, &self.inner, |tx| tx.close())
    }

    /// Breaks the pipe and tells the receiver `reason`; callable from any thread.
    fn abort(&self, py: Python<'_>, reason: &str) {
        abort_sender(py, &self.inner, |tx| tx.abort(reason))
    }

    /// The receiving agent's name.
    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// The largest message: the receiver's buffer size.
    #[getter]
    fn capacity(&self) -> u64 {
        self.buffer.len
    }

    /// "DRAM" or "VRAM": where the receiver's buffer is.
    #[getter]
    fn kind(&self) -> &'static str {
        self.buffer.kind.as_str()
    }

    /// Messages sent so far.
    #[getter]
    fn sent(&self, py: Python<'_>) -> PyResult<u64> {
        with_sender(py, &self.inner, |s| Ok(s.sent()))
    }
}

impl Drop for PyPipeSender {
    fn drop(&mut self) {
        drop_taken(&self.inner);
    }
}
