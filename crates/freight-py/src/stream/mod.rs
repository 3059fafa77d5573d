//! Pipe and channel bindings (`freight_stream`), wrapped by `freight.stream`.
//!
//! Blocking calls release the GIL, and Ctrl-C interrupts their waits (see
//! [`crate::interrupt`]). Mutexes that a blocking call holds are only ever locked
//! with the GIL released, so that a thread waiting for one never holds up the thread
//! that owns it. Messages and received objects expose their bytes zero-copy, through
//! `__array_interface__` (host memory) or `__cuda_array_interface__` (GPU memory): the
//! consumer (numpy, torch, cupy) keeps the Python object, and with it the memory, alive.
//! Releasing one hands its space back (later messages may write over it), but the
//! memory stays mapped, or out of the reuse pool, until the Python object goes: a view
//! kept past `release()` sees stale bytes, never unmapped memory.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use freight_core::{Error, MemKind, SharedSegment};
use freight_stream::{Buffer, BufferInfo, ChannelSender, PipeConfig, PipeListener, PipeReceiver, PipeSender};
use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::agent::PyAgent;
use crate::descs::parse_kind;
use crate::errors::{invalid, to_py_err};
use crate::interrupt;
use crate::util::{seconds, timeout_arg, FOREVER};

/// The `#[pymethods]` block of a pyclass whose bytes lie at `self.place` (a [`Place`]):
/// the methods given, then the getters that every such class shares (`nbytes`,
/// `__len__`, `kind`, `device`, `addr`, `live` and the two array interfaces).
///
/// The macro writes the whole block because pyo3 reads one `#[pymethods]` block per
/// class (a second needs its `multiple-pymethods` feature) and does not expand macros
/// inside one. The class has an `is_live(py)` (false once its bytes may no longer be
/// used) and a `lend(py)` (the same, noting that a view of the bytes is being made);
/// `what` names it in error messages and docs, `live` documents `live`.
macro_rules! placed_pymethods {
    ($ty:ty, what = $what:literal, live = $live_doc:literal; $($methods:tt)*) => {
        #[::pyo3::pymethods]
        impl $ty {
            $($methods)*

            /// Length in bytes.
            #[getter]
            fn nbytes(&self) -> u64 {
                self.place.len
            }

            fn __len__(&self) -> usize {
                self.place.len as usize
            }

            /// "DRAM" or "VRAM".
            #[getter]
            fn kind(&self) -> &'static str {
                self.place.kind.as_str()
            }

            #[doc = concat!("The GPU of a VRAM ", $what, " (0 for host memory).")]
            #[getter]
            fn device(&self) -> u64 {
                self.place.dev
            }

            /// Address of the first byte.
            #[getter]
            fn addr(&self) -> u64 {
                self.place.addr
            }

            #[doc = $live_doc]
            #[getter]
            fn live(&self, py: ::pyo3::Python<'_>) -> bool {
                self.is_live(py)
            }

            #[getter]
            fn __array_interface__<'py>(
                &self,
                py: ::pyo3::Python<'py>,
            ) -> ::pyo3::PyResult<::pyo3::Bound<'py, ::pyo3::types::PyDict>> {
                self.place.host_interface(py, self.lend(py), $what)
            }

            #[getter]
            fn __cuda_array_interface__<'py>(
                &self,
                py: ::pyo3::Python<'py>,
            ) -> ::pyo3::PyResult<::pyo3::Bound<'py, ::pyo3::types::PyDict>> {
                self.place.cuda_interface(py, self.lend(py), $what)
            }
        }
    };
}

// After the macro: a macro_rules! is visible only in the modules declared below it.
mod channel;
mod pipe;
mod storage;

pub(crate) use channel::{PyChannelReceiver, PyChannelSender, PyReceived};
pub(crate) use pipe::{PyMessage, PyPipeListener, PyPipeReceiver, PyPipeSender};
pub(crate) use storage::{release_pooled_memory, PyStoreReceiver, PyStoreSender, PyStoredObject};

/// A memory region as Python passes it: (kind, address, length, device).
type Region = (String, u64, u64, u64);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn released(what: &str) -> PyErr {
    to_py_err(Error::InvalidState(format!("the {what} was released")))
}

/// Drops `v` with the GIL released: dropping pipe ends and messages talks to the peer.
fn drop_detached<T: Send>(v: T) {
    Python::attach(|py| py.detach(move || drop(v)));
}

/// Takes what `cell` holds, if anything, and drops it with the GIL released: what
/// the `Drop` of a binding that holds a pipe end or a message does.
fn drop_taken<T: Send>(cell: &Mutex<Option<T>>) {
    if let Some(v) = lock(cell).take() {
        drop_detached(v);
    }
}

/// Opens a pipe from `agent` to the agent listening at `addr` and makes `then` of it,
/// with the GIL released.
fn connect_pipe<T: Send>(
    py: Python<'_>,
    agent: &Bound<'_, PyAgent>,
    addr: &str,
    timeout: f64,
    max_in_flight: usize,
    then: impl FnOnce(PipeSender) -> freight_core::Result<T> + Send,
) -> PyResult<T> {
    let a = agent.get();
    // The agent holds its router first, so that its own notifications survive.
    a.router();
    let config = pipe_config(timeout, None, max_in_flight)?;
    let inner = Arc::clone(&a.inner);
    interrupt::detach(py, || PipeSender::connect(&inner, addr, &config).and_then(then))
}

/// [`connect_pipe`], sending objects in batches of `batch_size` over the pipe.
fn connect_channel(
    py: Python<'_>,
    agent: &Bound<'_, PyAgent>,
    addr: &str,
    batch_size: usize,
    timeout: f64,
    max_message: Option<u64>,
    max_in_flight: usize,
) -> PyResult<ChannelSender> {
    connect_pipe(py, agent, addr, timeout, max_in_flight, |p| ChannelSender::new(p, batch_size, max_message))
}

fn pipe_config(timeout: f64, credit_batch: Option<u64>, max_in_flight: usize) -> PyResult<PipeConfig> {
    let timeout = seconds(timeout, "timeout")?;
    // Checked here too: `accept` waits in slices, each of them positive.
    if timeout.is_zero() {
        return Err(invalid("a pipe's timeout must be positive"));
    }
    Ok(PipeConfig { timeout, credit_batch, max_in_flight })
}

/// The receiver's buffer: host memory the pipe allocates (`capacity` bytes), or a
/// region the caller registered.
fn buffer_arg(capacity: Option<u64>, region: Option<Region>) -> PyResult<Buffer> {
    match (capacity, region) {
        (Some(capacity), None) => Ok(Buffer::Host { capacity }),
        (None, Some((kind, addr, len, dev))) => {
            Ok(Buffer::Registered(BufferInfo { kind: parse_kind(&kind)?, addr, len, dev }))
        }
        _ => Err(invalid("give either a capacity or a registered region for the pipe buffer")),
    }
}

/// Accepts `num_senders` pipes on `agent`, each with a host buffer of `capacity` bytes
/// or the next of `regions` (registered by the caller); returns them with the pipes'
/// timeout.
fn accept_pipes(
    py: Python<'_>,
    agent: &Bound<'_, PyAgent>,
    num_senders: usize,
    capacity: Option<u64>,
    regions: Option<Vec<Region>>,
    timeout: f64,
    credit_batch: Option<u64>,
) -> PyResult<(Vec<PipeReceiver>, Duration)> {
    if num_senders == 0 {
        return Err(invalid("a channel needs at least one sender"));
    }
    let buffers = match regions {
        Some(r) if r.len() != num_senders => {
            return Err(invalid(format!("{} buffer regions for {num_senders} senders", r.len())))
        }
        Some(r) => r.into_iter().map(|r| buffer_arg(None, Some(r))).collect::<PyResult<Vec<_>>>()?,
        None => (0..num_senders).map(|_| buffer_arg(capacity, None)).collect::<PyResult<Vec<_>>>()?,
    };
    let a = agent.get();
    a.router();
    let config = pipe_config(timeout, credit_batch, 1)?;
    let listener = PipeListener::new(&a.inner);
    let pipes = buffers.into_iter().map(|b| accept_pipe(py, &listener, b, &config)).collect::<PyResult<Vec<_>>>()?;
    Ok((pipes, config.timeout))
}

/// Waits up to `config.timeout` for a sender to open a pipe on `listener`, and sets it
/// up with `buffer`.
fn accept_pipe(py: Python<'_>, listener: &PipeListener, buffer: Buffer, config: &PipeConfig) -> PyResult<PipeReceiver> {
    interrupt::detach(py, || listener.accept(buffer, config))
}

/// A `recv` timeout: None is the end's own, +inf practically forever.
fn wait_arg(timeout: Option<f64>, default: Duration) -> PyResult<Duration> {
    match timeout {
        None => Ok(default),
        Some(t) => Ok(timeout_arg(Some(t))?.unwrap_or(FOREVER)),
    }
}

/// `__array_interface__` (host) or `__cuda_array_interface__` (GPU) of `len` bytes at
/// `addr`, as a flat uint8 array.
fn interface<'py>(py: Python<'py>, addr: u64, len: u64, cuda: bool) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("shape", (len,))?;
    d.set_item("typestr", "|u1")?;
    d.set_item("data", (addr, false))?;
    d.set_item("version", 3)?;
    if cuda {
        d.set_item("strides", py.None())?;
    }
    Ok(d)
}

/// Where some bytes lie, for the array interfaces.
#[derive(Clone, Copy)]
struct Place {
    kind: MemKind,
    addr: u64,
    len: u64,
    dev: u64,
}

impl Place {
    fn host_interface<'py>(&self, py: Python<'py>, live: bool, what: &str) -> PyResult<Bound<'py, PyDict>> {
        if self.kind != MemKind::Dram {
            return Err(PyAttributeError::new_err(format!(
                "this {what} is in GPU memory: use __cuda_array_interface__"
            )));
        }
        if !live {
            return Err(released(what));
        }
        interface(py, self.addr, self.len, false)
    }

    fn cuda_interface<'py>(&self, py: Python<'py>, live: bool, what: &str) -> PyResult<Bound<'py, PyDict>> {
        if self.kind != MemKind::Vram {
            return Err(PyAttributeError::new_err(format!("this {what} is in host memory: use __array_interface__")));
        }
        if !live {
            return Err(released(what));
        }
        interface(py, self.addr, self.len, true)
    }
}

/// The shared segment that the bytes at `place` lie in, if they are host memory in one
/// (a pipe buffer the pipe allocated, say). Held with a view of them, it keeps them
/// mapped after the pipe that owned the segment is gone.
fn segment_of(place: &Place) -> Option<Arc<SharedSegment>> {
    (place.kind == MemKind::Dram).then(|| SharedSegment::containing(place.addr, place.len)).flatten()
}

/// Fails unless a destination of `room` bytes holds the `len` bytes of an object.
fn check_room(room: u64, len: u64) -> PyResult<()> {
    if room < len {
        return Err(invalid(format!("the destination holds {room} bytes, the object has {len}")));
    }
    Ok(())
}

/// A sending end as its binding holds it: `None` once closed. The sender is shared, not
/// locked, while a call works on it, so that another thread may abort it meanwhile.
pub(crate) type SenderCell<S> = Mutex<Option<Arc<S>>>;

/// Takes a live sender out of `cell` and ends its stream with `close`, with the GIL
/// released; harmless when closed already.
fn close_sender<S: Send + Sync>(
    py: Python<'_>,
    cell: &SenderCell<S>,
    close: impl FnOnce(&S) -> freight_core::Result<()> + Send,
) -> PyResult<()> {
    match py.detach(|| lock(cell).take()) {
        Some(s) => interrupt::detach(py, move || close(&s)),
        None => Ok(()),
    }
}

/// Runs `f` on a live sender, with the GIL released and the cell unlocked.
fn with_sender<T: Send, S: Send + Sync>(
    py: Python<'_>,
    cell: &SenderCell<S>,
    f: impl FnOnce(&S) -> freight_core::Result<T> + Send,
) -> PyResult<T> {
    interrupt::detach(py, || {
        let sender = lock(cell).clone().ok_or_else(|| Error::InvalidState("the sender is closed".into()))?;
        f(&sender)
    })
}

/// Runs `settle` on a live sender, like [`with_sender`]. A closed one is no error: its
/// close settled the writes, or failed without, and then nothing here can wait on them
/// any more (the caller's deregistration says whether they are done).
fn settle_sender<S: Send + Sync>(
    py: Python<'_>,
    cell: &SenderCell<S>,
    settle: impl FnOnce(&S) -> freight_core::Result<()> + Send,
) -> PyResult<()> {
    interrupt::detach(py, || match lock(cell).clone() {
        Some(sender) => settle(&sender),
        None => Ok(()),
    })
}

/// Aborts a live sender with `abort`, with the GIL released: a call another thread is
/// in on it fails within a slice of its wait. Harmless once closed.
fn abort_sender<S: Send + Sync>(py: Python<'_>, cell: &SenderCell<S>, abort: impl FnOnce(&S) + Send) {
    py.detach(|| {
        let sender = lock(cell).clone();
        if let Some(s) = sender {
            abort(&s);
        }
    })
}
