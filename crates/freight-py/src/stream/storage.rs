//! The storage backend's bindings: the putting side, the getting side and the objects
//! it holds (use `freight.StoreSender`, `freight.StoreReceiver`).
//!
//! Either end may be handed to a cache engine (`freight.CacheEngine`), which then owns
//! it: the Python object stays, and every later use of it says where the end went.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use freight_core::{Desc, Error, Result};
use freight_stream::{ChannelReceiver, CommitStats, Outgoing, StoreReceiver, StoreSender, StoredObject};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{accept_pipes, check_room, connect_channel, drop_detached, lock, wait_arg, Place, Region};
use crate::agent::PyAgent;
use crate::descs::parse_kind;
use crate::errors::{invalid, OrRaise};
use crate::interrupt;

/// A commit's figures: (objects, bytes, transfer seconds, wait-for-receiver seconds).
type PyCommitStats = (usize, u64, f64, f64);

fn stats(s: CommitStats) -> PyCommitStats {
    (s.objects, s.bytes, s.transfer.as_secs_f64(), s.wait_receiver.as_secs_f64())
}

/// An end of the store, and what became of it.
enum Slot<T> {
    Live(T),
    Closed,
    /// Handed to a cache engine.
    Handed,
}

impl<T> Slot<T> {
    fn gone(&self, what: &str) -> Error {
        match self {
            Slot::Handed => Error::InvalidState(format!("the {what} was handed to a cache engine; use the engine")),
            _ => Error::InvalidState(format!("the {what} is closed")),
        }
    }

    fn live(&mut self, what: &str) -> Result<&mut T> {
        match self {
            Slot::Live(t) => Ok(t),
            other => Err(other.gone(what)),
        }
    }

    /// The live end, leaving `then` in its place.
    fn take(&mut self, then: Slot<T>, what: &str) -> Result<T> {
        match std::mem::replace(self, then) {
            Slot::Live(t) => Ok(t),
            other => {
                let e = other.gone(what);
                *self = other;
                Err(e)
            }
        }
    }
}

const SENDER: &str = "store sender";
const RECEIVER: &str = "store receiver";

// -- the putting side -------------------------------------------------------------------

/// The putting side of a store (use `freight.StoreSender`).
#[pyclass(frozen, name = "StoreSender", module = "freight._native")]
pub struct PyStoreSender {
    inner: Mutex<Slot<StoreSender>>,
    peer: String,
    capacity: u64,
    commit_size: usize,
}

impl PyStoreSender {
    /// Runs `f` on the live sender with the GIL released (the lock is taken there too);
    /// Ctrl-C interrupts its waits.
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut StoreSender) -> Result<T> + Send) -> PyResult<T> {
        interrupt::detach(py, || lock(&self.inner).live(SENDER).and_then(f))
    }

    /// Fails unless the sender is live (it can be handed over).
    pub(crate) fn check_live(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).live(SENDER).map(|_| ())).or_raise()
    }

    /// The sender, for a cache engine that takes it over.
    pub(crate) fn hand_over(&self, py: Python<'_>) -> PyResult<StoreSender> {
        py.detach(|| lock(&self.inner).take(Slot::Handed, SENDER)).or_raise()
    }
}

#[pymethods]
impl PyStoreSender {
    /// Opens a pipe to the store receiver listening at `addr`; commits every
    /// `commit_size` puts.
    #[new]
    #[pyo3(signature = (agent, addr, commit_size = 128, batch_size = 32, timeout = 30.0, max_message = None, max_in_flight = 16))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent: &Bound<'_, PyAgent>,
        addr: &str,
        commit_size: usize,
        batch_size: usize,
        timeout: f64,
        max_message: Option<u64>,
        max_in_flight: usize,
    ) -> PyResult<Self> {
        if commit_size == 0 {
            return Err(invalid("the commit size must be at least 1"));
        }
        let channel = connect_channel(py, agent, addr, batch_size, timeout, max_message, max_in_flight)?;
        let (peer, capacity) = (channel.pipe().peer().to_string(), channel.pipe().capacity());
        let tx = StoreSender::new(channel, commit_size).or_raise()?;
        Ok(PyStoreSender { inner: Mutex::new(Slot::Live(tx)), peer, capacity, commit_size })
    }

    /// Queues an object (key, kind, addr, length, device, meta) and commits once
    /// `commit_size` are queued; returns that commit's figures, else None.
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        key: String,
        kind: &str,
        addr: u64,
        len: u64,
        dev: u64,
        meta: Vec<u8>,
    ) -> PyResult<Option<PyCommitStats>> {
        let object = Outgoing { key, kind: parse_kind(kind)?, local: Desc { addr, len, dev }, meta };
        Ok(self.with(py, move |s| s.put(object))?.map(stats))
    }

    /// Sends every queued object and waits until the receiver holds them; None when
    /// nothing was queued.
    fn commit(&self, py: Python<'_>) -> PyResult<Option<PyCommitStats>> {
        Ok(self.with(py, |s| s.commit())?.map(stats))
    }

    /// Objects queued and not yet committed (0 once closed).
    #[getter]
    fn pending(&self, py: Python<'_>) -> usize {
        py.detach(|| match &*lock(&self.inner) {
            Slot::Live(s) => s.pending(),
            _ => 0,
        })
    }

    /// Their keys, in put order.
    #[getter]
    fn pending_keys(&self, py: Python<'_>) -> Vec<String> {
        py.detach(|| match &*lock(&self.inner) {
            Slot::Live(s) => s.pending_keys().map(str::to_string).collect(),
            _ => Vec::new(),
        })
    }

    /// Commits what is queued, then ends the stream. Harmless when closed already (or
    /// handed to a cache engine).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let tx = py.detach(|| lock(&self.inner).take(Slot::Closed, SENDER).ok());
        match tx {
            Some(tx) => interrupt::detach(py, move || tx.close()),
            None => Ok(()),
        }
    }

    /// True until closed or handed to a cache engine.
    #[getter]
    fn live(&self, py: Python<'_>) -> bool {
        py.detach(|| matches!(&*lock(&self.inner), Slot::Live(_)))
    }

    /// True once handed to a cache engine.
    #[getter]
    fn handed(&self, py: Python<'_>) -> bool {
        py.detach(|| matches!(&*lock(&self.inner), Slot::Handed))
    }

    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// Size of the receiver's pipe buffer for this sender.
    #[getter]
    fn capacity(&self) -> u64 {
        self.capacity
    }

    #[getter]
    fn commit_size(&self) -> usize {
        self.commit_size
    }
}

impl Drop for PyStoreSender {
    fn drop(&mut self) {
        if let Ok(tx) = lock(&self.inner).take(Slot::Closed, SENDER) {
            drop_detached(tx);
        }
    }
}

// -- the getting side -------------------------------------------------------------------

/// The getting side of a store (use `freight.StoreReceiver`).
#[pyclass(frozen, name = "StoreReceiver", module = "freight._native")]
pub struct PyStoreReceiver {
    inner: Mutex<Slot<Arc<StoreReceiver>>>,
    timeout: Duration,
    peers: Vec<String>,
    capacity: Option<u64>,
    evict: bool,
    _keep: Option<Py<PyAny>>,
}

impl PyStoreReceiver {
    /// Runs `f` on the live store with the GIL released; the store is let go there too
    /// (the last hold on a closed store waits for its thread).
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&StoreReceiver) -> T + Send) -> PyResult<T> {
        py.detach(|| {
            let store = lock(&self.inner).live(RECEIVER).cloned()?;
            Ok(f(&store))
        })
        .or_raise()
    }

    /// Runs the wait `f` on the store for up to `timeout` (None: the store's own);
    /// Ctrl-C interrupts it.
    fn wait(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        f: impl FnOnce(&StoreReceiver, Duration) -> Result<()> + Send,
    ) -> PyResult<()> {
        let timeout = wait_arg(timeout, self.timeout)?;
        let store = py.detach(|| lock(&self.inner).live(RECEIVER).cloned()).or_raise()?;
        let out = interrupt::detach(py, || f(&store, timeout));
        drop_detached(store);
        out
    }

    /// Fails unless the store is live (it can be handed over).
    pub(crate) fn check_live(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).live(RECEIVER).map(|_| ())).or_raise()
    }

    /// The store, for a cache engine that takes it over.
    pub(crate) fn hand_over(&self, py: Python<'_>) -> PyResult<StoreReceiver> {
        py.detach(|| {
            let mut slot = lock(&self.inner);
            let store = slot.take(Slot::Handed, RECEIVER)?;
            Arc::try_unwrap(store).map_err(|store| {
                *slot = Slot::Live(store);
                Error::InvalidState("the store receiver is in use by another thread (a wait?)".into())
            })
        })
        .or_raise()
    }
}

#[pymethods]
impl PyStoreReceiver {
    /// Accepts `num_senders` pipes, each with a host buffer of `capacity` bytes or the
    /// next of `regions` (registered by the caller; `keep` is held meanwhile), and
    /// stores what arrives on them: at most `store_capacity` bytes (None: no limit),
    /// evicting the least recently used objects to make room with `evict` (which needs
    /// a `store_capacity`).
    #[new]
    #[pyo3(signature = (agent, num_senders = 1, capacity = None, regions = None, keep = None, timeout = 30.0, credit_batch = None, store_capacity = None, evict = false))]
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
        store_capacity: Option<u64>,
        evict: bool,
    ) -> PyResult<Self> {
        // Refused before any sender is waited for.
        let evicting = match (evict, store_capacity) {
            (true, None) => return Err(invalid("evict needs a store capacity: the bytes to stay within")),
            (true, Some(capacity)) => Some(capacity),
            (false, _) => None,
        };
        let (pipes, timeout) = accept_pipes(py, agent, num_senders, capacity, regions, timeout, credit_batch)?;
        let peers = pipes.iter().map(|p| p.peer().to_string()).collect();
        let channel = ChannelReceiver::new(pipes, timeout);
        let store = match evicting {
            Some(capacity) => StoreReceiver::evicting(channel, capacity),
            None => StoreReceiver::new(channel, store_capacity),
        };
        Ok(PyStoreReceiver {
            inner: Mutex::new(Slot::Live(Arc::new(store))),
            timeout,
            peers,
            capacity: store_capacity,
            evict,
            _keep: keep,
        })
    }

    /// The object held under `key` (marked used, for eviction), or None.
    fn get(&self, py: Python<'_>, key: &str) -> PyResult<Option<PyStoredObject>> {
        let got = self.with(py, |s| s.get(key))?;
        Ok(got.map(|o| PyStoredObject::new(py, o)))
    }

    fn contains(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.with(py, |s| s.contains(key))
    }

    fn __contains__(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.contains(py, key)
    }

    /// Drops the store's hold on `key` and returns the object (its memory goes with
    /// the last holder), or None when the key is unknown.
    fn remove(&self, py: Python<'_>, key: &str) -> PyResult<Option<PyStoredObject>> {
        let got = self.with(py, |s| s.remove(key))?;
        Ok(got.map(|o| PyStoredObject::new(py, o)))
    }

    fn keys(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.with(py, |s| s.keys())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.len())
    }

    /// Bytes held.
    #[getter]
    fn nbytes(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |s| s.bytes())
    }

    /// Objects taken in since the start (replacements included).
    #[getter]
    fn received(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |s| s.received())
    }

    /// Objects evicted to make room since the start.
    #[getter]
    fn evicted(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |s| s.evicted())
    }

    /// Waits until every key of `keys` is held.
    #[pyo3(signature = (keys, timeout = None))]
    fn wait_for(&self, py: Python<'_>, keys: Vec<String>, timeout: Option<f64>) -> PyResult<()> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.wait(py, timeout, |s, timeout| s.wait_for(&refs, timeout))
    }

    /// Waits until `count` objects were taken in since the start.
    #[pyo3(signature = (count, timeout = None))]
    fn wait_received(&self, py: Python<'_>, count: u64, timeout: Option<f64>) -> PyResult<()> {
        self.wait(py, timeout, |s, timeout| s.wait_received(count, timeout))
    }

    /// Waits until every sender closed its stream.
    #[pyo3(signature = (timeout = None))]
    fn wait_closed(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        self.wait(py, timeout, |s, timeout| s.wait_closed(timeout))
    }

    /// Stops taking objects in (senders still putting are told). Objects got stay valid.
    /// Harmless when closed already (or handed to a cache engine).
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let store = lock(&self.inner).take(Slot::Closed, RECEIVER).ok();
            // A wait on another thread holds the store too: it must end now.
            if let Some(store) = &store {
                store.close();
            }
            drop(store)
        });
    }

    /// True until closed or handed to a cache engine.
    #[getter]
    fn live(&self, py: Python<'_>) -> bool {
        py.detach(|| matches!(&*lock(&self.inner), Slot::Live(_)))
    }

    /// True once handed to a cache engine.
    #[getter]
    fn handed(&self, py: Python<'_>) -> bool {
        py.detach(|| matches!(&*lock(&self.inner), Slot::Handed))
    }

    /// The senders' agent names, in the order of `StoredObject.sender`.
    #[getter]
    fn peers(&self) -> Vec<String> {
        self.peers.clone()
    }

    /// The most bytes the store holds (None: no limit).
    #[getter]
    fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Whether a batch that does not fit evicts objects instead of stopping the store.
    #[getter]
    fn evict(&self) -> bool {
        self.evict
    }
}

impl Drop for PyStoreReceiver {
    fn drop(&mut self) {
        if let Ok(store) = lock(&self.inner).take(Slot::Closed, RECEIVER) {
            drop_detached(store);
        }
    }
}

// -- what the store holds ---------------------------------------------------------------

/// An object a store holds (use `freight.StoredObject`); its memory lives as long as
/// this object or the store holds it.
#[pyclass(frozen, name = "StoredObject", module = "freight._native")]
pub struct PyStoredObject {
    inner: Option<Arc<StoredObject>>,
    meta: Py<PyBytes>,
    place: Place,
}

impl PyStoredObject {
    fn new(py: Python<'_>, object: Arc<StoredObject>) -> Self {
        let (kind, addr, dev) = object.data.location();
        PyStoredObject {
            meta: PyBytes::new(py, &object.meta).unbind(),
            place: Place { kind, addr, len: object.len(), dev },
            inner: Some(object),
        }
    }

    fn object(&self) -> &StoredObject {
        self.inner.as_ref().expect("set until dropped")
    }

    /// Always: the object holds its memory.
    fn is_live(&self, _py: Python<'_>) -> bool {
        true
    }

    fn lend(&self, _py: Python<'_>) -> bool {
        true
    }
}

placed_pymethods! {
    PyStoredObject,
    what = "object",
    live = "Always True: a stored object's memory lives as long as the object.";

    #[getter]
    fn key(&self) -> &str {
        &self.object().key
    }

    /// The metadata the sender attached, unchanged.
    #[getter]
    fn meta(&self, py: Python<'_>) -> Py<PyBytes> {
        self.meta.clone_ref(py)
    }

    /// Which of the receiver's senders put it.
    #[getter]
    fn sender(&self) -> usize {
        self.object().sender
    }

    /// Copies the bytes to `addr` (`len` bytes of memory of `kind`, at least as many as
    /// the object has).
    fn copy_to(&self, py: Python<'_>, kind: &str, addr: u64, len: u64) -> PyResult<()> {
        let kind = parse_kind(kind)?;
        check_room(len, self.place.len)?;
        let object = self.object();
        py.detach(|| object.data.copy_to(kind, addr)).or_raise()
    }
}

impl Drop for PyStoredObject {
    fn drop(&mut self) {
        if let Some(object) = self.inner.take() {
            drop_detached(object);
        }
    }
}

/// Frees the memory that received objects leave behind for reuse (kept per memory kind,
/// GPU and size, up to 4 GiB of host memory and 16 GiB per GPU).
#[pyfunction]
pub fn release_pooled_memory() {
    freight_stream::owned::trim();
}
