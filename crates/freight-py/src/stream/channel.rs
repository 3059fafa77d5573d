//! The channel's bindings: sending end, receiving end and the objects it hands out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use freight_core::{Desc, Error, SharedSegment};
use freight_stream::owned::Owned;
use freight_stream::{ChannelReceiver, ChannelSender, Next, Outgoing, Received};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{
    abort_sender, accept_pipes, check_room, close_sender, connect_channel, drop_detached, drop_taken, lock, segment_of,
    settle_sender, wait_arg, with_sender, Place, Region, SenderCell,
};
use crate::agent::PyAgent;
use crate::descs::parse_kind;
use crate::errors::{to_py_err, OrRaise};
use crate::request::SIGNAL_SLICE;

/// An object to send: (key, kind, addr, length, device, meta).
type PyOutgoing = (String, String, u64, u64, u64, Vec<u8>);

/// The sending end of a channel (use `freight.ChannelSender`).
#[pyclass(frozen, name = "ChannelSender", module = "freight._native")]
pub struct PyChannelSender {
    inner: SenderCell<ChannelSender>,
    peer: String,
    capacity: u64,
}

#[pymethods]
impl PyChannelSender {
    #[new]
    #[pyo3(signature = (agent, addr, batch_size = 32, timeout = 30.0, max_message = None, max_in_flight = 16))]
    fn new(
        py: Python<'_>,
        agent: &Bound<'_, PyAgent>,
        addr: &str,
        batch_size: usize,
        timeout: f64,
        max_message: Option<u64>,
        max_in_flight: usize,
    ) -> PyResult<Self> {
        let tx = connect_channel(py, agent, addr, batch_size, timeout, max_message, max_in_flight)?;
        let (peer, capacity) = (tx.pipe().peer().to_string(), tx.pipe().capacity());
        Ok(PyChannelSender { inner: Mutex::new(Some(Arc::new(tx))), peer, capacity })
    }

    /// Sends objects (key, kind, addr, length, device, meta) in batches; returns the
    /// number of pipe messages used.
    fn send(&self, py: Python<'_>, objects: Vec<PyOutgoing>) -> PyResult<usize> {
        let objects = objects
            .into_iter()
            .map(|(key, kind, addr, len, dev, meta)| {
                Ok(Outgoing { key, kind: parse_kind(&kind)?, local: Desc { addr, len, dev }, meta })
            })
            .collect::<PyResult<Vec<_>>>()?;
        with_sender(py, &self.inner, |s| s.send(&objects))
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        with_sender(py, &self.inner, |s| s.flush())
    }

    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        with_sender(py, &self.inner, |s| s.drain())
    }

    /// Waits until no write of the channel is in flight, whatever state its pipe is
    /// in: before memory it read is deregistered. Nothing to wait for once closed.
    fn settle_writes(&self, py: Python<'_>) -> PyResult<()> {
        settle_sender(py, &self.inner, |tx| tx.settle_writes())
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        close_sender(py, &self.inner, |tx| tx.close())
    }

    /// Breaks the channel's pipe and tells the receiver `reason`; callable from any thread.
    fn abort(&self, py: Python<'_>, reason: &str) {
        abort_sender(py, &self.inner, |tx| tx.pipe().abort(reason))
    }

    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// Size of the receiver's buffer for this sender.
    #[getter]
    fn capacity(&self) -> u64 {
        self.capacity
    }
}

impl Drop for PyChannelSender {
    fn drop(&mut self) {
        drop_taken(&self.inner);
    }
}

/// The receiving end of a channel (use `freight.ChannelReceiver`).
#[pyclass(frozen, name = "ChannelReceiver", module = "freight._native")]
pub struct PyChannelReceiver {
    inner: Mutex<Option<ChannelReceiver>>,
    timeout: Duration,
    peers: Vec<String>,
    _keep: Option<Py<PyAny>>,
}

#[pymethods]
impl PyChannelReceiver {
    /// Accepts `num_senders` pipes, each with a host buffer of `capacity` bytes or the
    /// next of `regions` (registered by the caller; `keep` is held meanwhile).
    #[new]
    #[pyo3(signature = (agent, num_senders = 1, capacity = None, regions = None, keep = None, timeout = 30.0, credit_batch = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent: &Bound<'_, PyAgent>,
        num_senders: usize,
        capacity: Option<u64>,
        regions: Option<Vec<Region>>,
        keep: Option<Py<PyAny>>,
        timeout: f64,
        credit_batch: Option<u64>,
    ) -> PyResult<Self> {
        let (pipes, timeout) = accept_pipes(py, agent, num_senders, capacity, regions, timeout, credit_batch)?;
        let peers = pipes.iter().map(|p| p.peer().to_string()).collect();
        let rx = ChannelReceiver::new(pipes, timeout);
        Ok(PyChannelReceiver { inner: Mutex::new(Some(rx)), timeout, peers, _keep: keep })
    }

    /// The objects of the next message that completes any, or None once every sender
    /// closed its stream. Waits up to `timeout` seconds (None: the channel's timeout).
    #[pyo3(signature = (timeout = None))]
    fn recv(slf: &Bound<'_, Self>, timeout: Option<f64>) -> PyResult<Option<Vec<PyReceived>>> {
        let py = slf.py();
        let this = slf.get();
        let timeout = wait_arg(timeout, this.timeout)?;
        // In slices, so that `close` from another thread gets the receiver between two.
        let deadline = Instant::now() + timeout;
        let got = loop {
            let slice = deadline.saturating_duration_since(Instant::now()).min(SIGNAL_SLICE);
            let next = py
                .detach(|| match lock(&this.inner).as_mut() {
                    Some(rx) => rx.next_within(slice),
                    None => Err(Error::InvalidState("the channel receiver is closed".into())),
                })
                .or_raise()?;
            match next {
                Next::Item(objects) => break Some(objects),
                Next::End => break None,
                Next::NotYet if Instant::now() < deadline => py.check_signals()?,
                Next::NotYet => {
                    let e = Error::Timeout(format!("no object arrived within {:.1}s", timeout.as_secs_f64()));
                    return Err(to_py_err(e));
                }
            }
        };
        let buffer = || this._keep.as_ref().map(|k| k.clone_ref(py));
        Ok(got.map(|objects| objects.into_iter().map(|r| PyReceived::new(py, r, buffer())).collect()))
    }

    /// Stops receiving; senders still sending are told. Objects handed out stay valid
    /// until released, and their memory while they exist.
    fn close(&self, py: Python<'_>) {
        py.detach(|| drop(lock(&self.inner).take()));
    }

    /// The senders' agent names, in the order of `Received.sender`.
    #[getter]
    fn peers(&self) -> Vec<String> {
        self.peers.clone()
    }
}

impl Drop for PyChannelReceiver {
    fn drop(&mut self) {
        drop_taken(&self.inner);
    }
}

/// An object received whole (use `freight.Received`): a view of a pipe buffer, or
/// reassembled memory, until `release()`. The memory itself lives as long as this
/// object (see `release`).
#[pyclass(frozen, name = "Received", module = "freight._native")]
pub struct PyReceived {
    inner: Mutex<Option<Received>>,
    key: String,
    meta: Py<PyBytes>,
    sender: usize,
    is_view: bool,
    place: Place,
    /// Set (under `inner`'s lock) once a view of the bytes was made.
    viewed: AtomicBool,
    /// Reassembled memory that was viewed, taken out of the object on release: back to
    /// the pool, a later object would be written into it under the view.
    kept: Mutex<Option<Owned>>,
    /// A pipe buffer the receiver allocated: a view may outlive the release and the
    /// receiver, and must not see the segment unmapped.
    segment: Option<Arc<SharedSegment>>,
    /// The caller's buffer a view points into, kept alive as long as the view.
    _buffer: Option<Py<PyAny>>,
}

impl PyReceived {
    fn new(py: Python<'_>, r: Received, buffer: Option<Py<PyAny>>) -> Self {
        let (kind, addr, dev) = r.location();
        let place = Place { kind, addr, len: r.len(), dev };
        PyReceived {
            key: r.key.clone(),
            meta: PyBytes::new(py, &r.meta).unbind(),
            sender: r.sender,
            is_view: r.is_view(),
            place,
            viewed: AtomicBool::new(false),
            kept: Mutex::new(None),
            segment: r.is_view().then(|| segment_of(&place)).flatten(),
            _buffer: buffer.filter(|_| r.is_view()),
            inner: Mutex::new(Some(r)),
        }
    }

    // `inner` is locked with the GIL released: a `copy_to` may hold it for long.
    fn is_live(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).is_some())
    }

    fn lend(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            let inner = lock(&self.inner);
            if inner.is_some() {
                self.viewed.store(true, Ordering::Relaxed);
            }
            inner.is_some()
        })
    }
}

placed_pymethods! {
    PyReceived, what = "object", live = "False once released.";

    #[getter]
    fn key(&self) -> &str {
        &self.key
    }

    /// The metadata the sender attached, unchanged.
    #[getter]
    fn meta(&self, py: Python<'_>) -> Py<PyBytes> {
        self.meta.clone_ref(py)
    }

    /// Which of the receiver's pipes it came through.
    #[getter]
    fn sender(&self) -> usize {
        self.sender
    }

    /// True when the bytes are a view of a pipe buffer (not reassembled).
    #[getter]
    fn is_view(&self) -> bool {
        self.is_view
    }

    /// Copies the bytes to `addr` (`len` bytes of memory of `kind`, at least as many as
    /// the object has).
    fn copy_to(&self, py: Python<'_>, kind: &str, addr: u64, len: u64) -> PyResult<()> {
        let kind = parse_kind(kind)?;
        check_room(len, self.place.len)?;
        py.detach(|| match lock(&self.inner).as_ref() {
            Some(r) => r.copy_to(kind, addr),
            None => Err(Error::InvalidState("the object was released".into())),
        })
        .or_raise()
    }

    /// Frees the object's space (its message's, once every object of it is released).
    /// A view keeps the memory (mapped, and out of reuse for later objects) as long as
    /// this object lives, but after the release a view of a pipe buffer may see its
    /// bytes overwritten by later messages. Releasing twice is harmless.
    fn release(&self, py: Python<'_>) {
        let taken = py.detach(|| lock(&self.inner).take().map(|r| (r, self.viewed.load(Ordering::Relaxed))));
        let Some((mut r, viewed)) = taken else { return };
        if viewed && !r.is_view() {
            // Reassembled memory is moved out, which cannot fail.
            *lock(&self.kept) = r.take_owned().ok();
        }
        py.detach(move || drop(r));
    }
}

impl Drop for PyReceived {
    fn drop(&mut self) {
        drop_taken(&self.inner);
        drop_taken(&self.kept);
        if let Some(segment) = self.segment.take() {
            drop_detached(segment);
        }
    }
}
