//! The agent binding: conversions and GIL release around `freight_core::Agent`.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use freight_core::{Agent, MemKind, OpKind, SharedSegment};
use freight_stream::router::Router;
use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};

use crate::config::{config_from, PyAgentConfig};
use crate::descs::{for_each_triple, indices, parse_kind, PyDescList, PyPreparedLocal, PyPreparedRemote};
use crate::errors::{invalid, to_py_err, OrRaise};
use crate::request::{PyRequest, SIGNAL_SLICE};
use crate::segment::PySharedSegment;
use crate::util::{bytes_like, bytes_or_str, positive_int, timeout_arg};

static NEXT_AGENT_ID: AtomicU64 = AtomicU64::new(1);

/// The engine's agent (`freight.Agent` adds what takes Python objects: arrays, buffers,
/// tensors and descriptor lists, converted to the ranges this class takes).
#[pyclass(frozen, subclass, name = "Agent", module = "freight._native")]
pub struct PyAgent {
    /// Taken out by `Drop` only (closing an agent waits on its peers: not with the GIL
    /// held). Clone it with `Arc::clone`: a `ManuallyDrop` clone would never be dropped.
    pub(crate) inner: ManuallyDrop<Arc<Agent>>,
    /// The configuration the agent was created with.
    config: Py<PyAgentConfig>,
    /// Identifies this agent in prepared lists (so that they are not used with another).
    id: u64,
    /// Python objects whose memory is registered, by region key: they stay alive while
    /// registered (and while any request of this agent exists).
    keep: Mutex<HashMap<u64, Py<PyAny>>>,
    /// Request objects of this agent that exist.
    pub(crate) requests: Arc<AtomicUsize>,
    /// The pipe router, once a pipe end was made here: from then on it owns the engine's
    /// notification queue, and the agent's own notifications are read from it. Held
    /// for the agent's life so that notifications it keeps are never dropped with it.
    router: OnceLock<Arc<Router>>,
    /// Readers of the engine's queue hold this shared; starting the router takes it
    /// exclusively, so that no reader can take a pipe message meant for the router.
    queue_gate: RwLock<()>,
}

type PyNotif = (String, Py<PyBytes>);

impl PyAgent {
    fn keep(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Py<PyAny>>> {
        self.keep.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The agent's pipe router, started on first use.
    pub(crate) fn router(&self) -> Arc<Router> {
        if let Some(r) = self.router.get() {
            return r.clone();
        }
        let _gate = self.queue_gate.write().unwrap_or_else(PoisonError::into_inner);
        self.router.get_or_init(|| Router::of(&self.inner)).clone()
    }

    /// Waits up to `timeout` for notifications that are not pipe messages: from the
    /// engine's queue, or from the router once it took the queue over.
    fn take_notifs(&self, timeout: Duration) -> Vec<freight_core::Notification> {
        if let Some(r) = self.router.get() {
            return r.wait_foreign(timeout);
        }
        let gate = self.queue_gate.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = self.router.get() {
            drop(gate);
            return r.wait_foreign(timeout);
        }
        if timeout.is_zero() {
            self.inner.get_notifs()
        } else {
            self.inner.wait_notifs(timeout)
        }
    }

    fn notifs(py: Python<'_>, v: Vec<freight_core::Notification>) -> Vec<PyNotif> {
        v.into_iter().map(|n| (n.from, PyBytes::new(py, &n.msg).unbind())).collect()
    }

    fn request(slf: &Bound<'_, Self>, inner: freight_core::Request, peer: String) -> PyRequest {
        let counted = slf.get().requests.clone();
        counted.fetch_add(1, Ordering::AcqRel);
        PyRequest { inner, peer, _owner: slf.clone().into_any().unbind(), counted }
    }

    /// True when nothing of this agent can move bytes any more: no request object, and
    /// no pipe end, store or cache engine holding the engine (directly or through the
    /// router). A closed agent starts nothing new, so this stays true.
    fn idle(&self) -> bool {
        let router = self.router.get();
        let holders = 1 + usize::from(router.is_some());
        self.requests.load(Ordering::Acquire) == 0
            && router.is_none_or(|r| Arc::strong_count(r) == 1)
            && Arc::strong_count(&self.inner) == holders
    }

    fn register_one(&self, kind: MemKind, addr: u64, len: u64, dev: u64, read_only: bool) -> freight_core::Result<u64> {
        if read_only {
            self.inner.register_read_only(kind, addr, len, dev)
        } else {
            self.inner.register(kind, addr, len, dev)
        }
    }

    fn check_owner(&self, id: u64, what: &str) -> PyResult<()> {
        if id != self.id {
            return Err(invalid(format!("this {what} list was prepared by another agent")));
        }
        Ok(())
    }
}

#[pymethods]
impl PyAgent {
    /// Creates an agent and starts its listener. `config`: a `freight.AgentConfig`, a
    /// dict of its settings, or None for the defaults.
    #[new]
    #[pyo3(signature = (name, config = None))]
    fn new(py: Python<'_>, name: String, config: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        let config = config_from(py, config.as_ref())?;
        // Logs of the agent's start-up reach FREIGHT_LOG's destination too.
        crate::logging::_init_logging_from_env()?;
        let engine_config = config.get().inner.clone();
        let config = config.unbind();
        let inner = Arc::new(py.detach(|| Agent::new(&name, engine_config)).or_raise()?);
        Ok(PyAgent {
            inner: ManuallyDrop::new(inner),
            config,
            id: NEXT_AGENT_ID.fetch_add(1, Ordering::Relaxed),
            keep: Mutex::default(),
            requests: Arc::default(),
            router: OnceLock::new(),
            queue_gate: RwLock::new(()),
        })
    }

    /// The agent's name (unique among the peers it talks to).
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// Addresses (ip:port) that peers are told to use.
    #[getter]
    fn addresses(&self) -> Vec<String> {
        self.inner.addresses()
    }

    /// The configuration the agent was created with.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyAgentConfig> {
        self.config.clone_ref(py)
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Names of known peers, sorted.
    #[getter]
    fn peers(&self) -> Vec<String> {
        self.inner.peers()
    }

    /// Number of registered regions.
    #[getter]
    fn registered_regions(&self) -> usize {
        self.inner.registered_regions()
    }

    /// Stops listening and closes every connection; in-flight requests fail. Idempotent.
    /// The objects kept for registered memory are let go once nothing of the agent can
    /// still use them (no request object, pipe end, store or cache engine), else with
    /// the agent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
        if self.idle() {
            let kept = std::mem::take(&mut *self.keep());
            drop(kept);
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) {
        self.close(py)
    }

    /// Listens on one more address (for example a well-known port peers `connect` to);
    /// returns the bound "ip:port".
    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<String> {
        py.detach(|| self.inner.listen(addr)).or_raise().map(|a| a.to_string())
    }

    // -- memory ----------------------------------------------------------------------

    /// Allocates `nbytes` of zeroed host memory that same-host peers can reach through
    /// shm, as a uint8 numpy array whose base (a `freight.SharedSegment`) keeps the
    /// memory alive. Register it (or parts of it) to make it transferable.
    fn alloc<'py>(&self, py: Python<'py>, nbytes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let nbytes = positive_int("nbytes", nbytes)?;
        let seg: Arc<SharedSegment> = py.detach(|| self.inner.alloc(nbytes)).or_raise()?;
        let (ptr, len) = (seg.as_ptr() as *const u8, seg.len());
        let holder = Bound::new(py, PySharedSegment { seg })?;
        // SAFETY: the view covers exactly the segment's mapping, which `holder` keeps
        // alive for as long as the array (its base object) exists.
        let array = unsafe {
            let view = ArrayView1::from_shape_ptr(len, ptr);
            PyArray1::borrow_from_array(&view, holder.into_any())
        };
        Ok(array)
    }

    /// Lays a shared segment under `[addr, addr + length)` of this process's host
    /// memory, keeping its bytes and addresses, so that same-host peers reach it
    /// through shm once it is registered; returns the segment (`freight.SharedSegment`).
    fn _share_in_place(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<PySharedSegment> {
        let seg = py.detach(|| self.inner.share_in_place(addr, length)).or_raise()?;
        Ok(PySharedSegment { seg })
    }

    /// Registers `[addr, addr + length)` of `kind` on `device`; returns the region key.
    /// `keep` (any object) is held until the region is deregistered. `read_only`: no
    /// transfer may write it (peers only read it).
    #[pyo3(signature = (kind, addr, length, device = 0, keep = None, read_only = false))]
    #[allow(clippy::too_many_arguments)]
    fn _register(
        &self,
        py: Python<'_>,
        kind: &str,
        addr: u64,
        length: u64,
        device: u64,
        keep: Option<Py<PyAny>>,
        read_only: bool,
    ) -> PyResult<u64> {
        let kind = parse_kind(kind)?;
        let key = py.detach(|| self.register_one(kind, addr, length, device, read_only)).or_raise()?;
        if let Some(k) = keep {
            self.keep().insert(key, k);
        }
        Ok(key)
    }

    /// Registers every (addr, length, device) of a list of tuples or an Nx3 array, all or nothing (on
    /// error nothing stays registered and the exception's `index` names the culprit).
    #[pyo3(signature = (kind, triples, keeps = None, read_only = false))]
    fn _register_many(
        &self,
        py: Python<'_>,
        kind: &str,
        triples: &Bound<'_, PyAny>,
        keeps: Option<Vec<Py<PyAny>>>,
        read_only: bool,
    ) -> PyResult<Vec<u64>> {
        let kind: MemKind = parse_kind(kind)?;
        let mut all = Vec::new();
        for_each_triple(triples, |a, l, d| {
            all.push((a, l, d));
            Ok(())
        })?;
        if let Some(k) = &keeps {
            if k.len() != all.len() {
                return Err(invalid(format!("{} keep objects for {} regions", k.len(), all.len())));
            }
        }
        let outcome = py.detach(|| {
            let mut keys = Vec::with_capacity(all.len());
            for (i, &(addr, len, dev)) in all.iter().enumerate() {
                match self.register_one(kind, addr, len, dev, read_only) {
                    Ok(k) => keys.push(k),
                    Err(e) => {
                        for k in keys {
                            let _ = self.inner.deregister(k);
                        }
                        return Err((i, e));
                    }
                }
            }
            Ok(keys)
        });
        match outcome {
            Ok(keys) => {
                if let Some(k) = keeps {
                    self.keep().extend(keys.iter().copied().zip(k));
                }
                Ok(keys)
            }
            Err((i, e)) => {
                let err = to_py_err(e);
                err.value(py).setattr("index", i)?;
                Err(err)
            }
        }
    }

    /// Deregisters a region (and lets go of the object registered with it).
    /// `RegionBusyError` while a transfer uses it, `UnknownRegionError` for a key that is
    /// not registered. Peers learn of it and fail later accesses with
    /// `RemoteRejectedError`.
    fn deregister(&self, py: Python<'_>, key: i64) -> PyResult<()> {
        // No key is negative: such an int did not come from register().
        let key = u64::try_from(key)
            .map_err(|_| invalid(format!("region keys are what register() returned, never negative; got {key}")))?;
        py.detach(|| self.inner.deregister(key)).or_raise()?;
        let released = self.keep().remove(&key);
        drop(released);
        Ok(())
    }

    // -- metadata and peers ----------------------------------------------------------

    /// This agent's metadata (name, addresses, transports, registered regions and the
    /// secret that opens them) as bytes. Give it to peers only.
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let md = py.detach(|| self.inner.metadata());
        PyBytes::new(py, &md)
    }

    /// Adds (or replaces) a peer from its metadata bytes; returns its name.
    /// `MetadataError` for bytes that are not metadata. `token` (bytes or str): the
    /// peer's `AgentConfig.token`, where it has one, presented on every connection to
    /// it. Replacing a peer (a restarted process) closes the old connections; requests
    /// prepared against the old one fail.
    #[pyo3(signature = (metadata, token = None))]
    fn add_peer(
        &self,
        py: Python<'_>,
        metadata: &Bound<'_, PyAny>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        if metadata.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("metadata must be bytes (use bytes.fromhex() for hex text)"));
        }
        let metadata = bytes_like("metadata", metadata)?;
        let token = token.map(|t| bytes_or_str("token", t)).transpose()?;
        py.detach(|| self.inner.add_peer_with_token(&metadata, token.as_deref())).or_raise()
    }

    /// Forgets a peer and closes its connections (`UnknownPeerError` if unknown).
    fn remove_peer(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.inner.remove_peer(name)).or_raise()
    }

    /// Fetches a peer's metadata from its listener at "ip:port" and adds the peer;
    /// returns its name. `token` must match the peer's `AgentConfig.token` where it has
    /// one (else `AuthError`), and is presented on every connection to it from then on.
    #[pyo3(signature = (addr, token = None))]
    fn connect(&self, py: Python<'_>, addr: &str, token: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
        let token = token.map(|t| bytes_or_str("token", t)).transpose()?;
        py.detach(|| self.inner.connect(addr, token.as_deref())).or_raise()
    }

    /// Re-reads a known peer's metadata from its listener (to see regions it
    /// registered since), with `token`, or else the token it was added with.
    #[pyo3(signature = (name, token = None))]
    fn refresh_peer(&self, py: Python<'_>, name: &str, token: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let token = token.map(|t| bytes_or_str("token", t)).transpose()?;
        py.detach(|| self.inner.refresh_peer(name, token.as_deref())).or_raise()
    }

    /// (transport, reason) for host-memory transfers to `peer`.
    fn _path_to(&self, py: Python<'_>, peer: &str) -> PyResult<(&'static str, String)> {
        let p = py.detach(|| self.inner.path_to(peer)).or_raise()?;
        Ok((p.transport.as_str(), p.reason))
    }

    /// The connections this agent made to `peer` since it was added:
    /// `control_connections`, `tcp_connections` and `fabric_connections` (more than one
    /// of any means it reconnected), `handshakes` (one per control connection, tcp data
    /// stream and fabric exchange), `setup_us` (time spent setting them all up) and
    /// `last_setup_us`.
    fn connection_stats<'py>(&self, py: Python<'py>, peer: &str) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.connection_stats(peer).or_raise()?;
        let d = PyDict::new(py);
        for (k, v) in [
            ("control_connections", s.control_connections),
            ("tcp_connections", s.tcp_connections),
            ("fabric_connections", s.fabric_connections),
            ("handshakes", s.handshakes),
            ("setup_us", s.setup_us),
            ("last_setup_us", s.last_setup_us),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    // -- descriptors and requests ----------------------------------------------------

    /// Checks a descriptor list against this agent's registered memory.
    fn _prepare_local(&self, py: Python<'_>, descs: PyRef<'_, PyDescList>) -> PyResult<PyPreparedLocal> {
        let list = &descs.inner;
        let inner = py.detach(|| self.inner.prepare_local(list)).or_raise()?;
        Ok(PyPreparedLocal { inner, agent_id: self.id })
    }

    /// Checks a descriptor list against `peer`'s advertised memory.
    fn _prepare_remote(&self, py: Python<'_>, peer: &str, descs: PyRef<'_, PyDescList>) -> PyResult<PyPreparedRemote> {
        let list = &descs.inner;
        let inner = py.detach(|| self.inner.prepare_remote(peer, list)).or_raise()?;
        Ok(PyPreparedRemote { inner, agent_id: self.id })
    }

    /// Builds an idle request (see freight.Agent.make_request).
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, notif = None))]
    fn _make_request(
        slf: &Bound<'_, Self>,
        op: &str,
        local: &Bound<'_, PyPreparedLocal>,
        local_indices: Option<&Bound<'_, PyAny>>,
        remote: &Bound<'_, PyPreparedRemote>,
        remote_indices: Option<&Bound<'_, PyAny>>,
        notif: Option<Vec<u8>>,
    ) -> PyResult<PyRequest> {
        let this = slf.get();
        let op = OpKind::parse(op).or_raise()?;
        let (local, remote) = (local.get(), remote.get());
        this.check_owner(local.agent_id, "local")?;
        this.check_owner(remote.agent_id, "remote")?;
        let li = indices(local_indices, local.inner.len())?;
        let ri = indices(remote_indices, remote.inner.list.len())?;
        let req = slf
            .py()
            .detach(|| this.inner.make_request(op, &local.inner, li.as_deref(), &remote.inner, ri.as_deref(), notif))
            .or_raise()?;
        Ok(Self::request(slf, req, remote.inner.peer().to_string()))
    }

    /// One-shot: prepares both lists, builds the request and posts it.
    #[pyo3(signature = (op, local, peer, remote, notif = None))]
    fn _transfer(
        slf: &Bound<'_, Self>,
        op: &str,
        local: PyRef<'_, PyDescList>,
        peer: &str,
        remote: PyRef<'_, PyDescList>,
        notif: Option<Vec<u8>>,
    ) -> PyResult<PyRequest> {
        let this = slf.get();
        let op = OpKind::parse(op).or_raise()?;
        let (l, r) = (&local.inner, &remote.inner);
        let req = slf.py().detach(|| this.inner.transfer(op, l, peer, r, notif)).or_raise()?;
        Ok(Self::request(slf, req, peer.to_string()))
    }

    // -- notifications ---------------------------------------------------------------

    /// Sends a notification (bytes; a str is sent UTF-8 encoded). Notifications to one
    /// peer arrive in the order they were sent. To a peer on this host they go through
    /// shared memory; if it takes none for `peer_timeout` (it does not run) this raises
    /// `TimeoutError`, and `PeerDisconnectedError` once it is gone.
    fn notify(&self, py: Python<'_>, peer: &str, msg: &Bound<'_, PyAny>) -> PyResult<()> {
        let msg = bytes_or_str("msg", msg)?;
        py.detach(|| self.inner.notify(peer, msg)).or_raise()
    }

    /// Notifications received so far as [(peer, bytes)], oldest first (non-blocking).
    /// Pipe messages are not among them: they are the pipes' own.
    fn get_notifs(&self, py: Python<'_>) -> Vec<PyNotif> {
        let got = py.detach(|| self.take_notifs(Duration::ZERO));
        Self::notifs(py, got)
    }

    /// Waits up to `timeout` seconds (None: no limit) for at least one notification;
    /// returns everything received, oldest first ([] on timeout). Pipe messages are not
    /// among them.
    #[pyo3(signature = (timeout = None))]
    fn wait_notifs(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Vec<PyNotif>> {
        let deadline = timeout_arg(timeout)?.map(|t| Instant::now() + t);
        loop {
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_SLICE),
                None => SIGNAL_SLICE,
            };
            let got = py.detach(|| self.take_notifs(slice));
            if !got.is_empty() {
                return Ok(Self::notifs(py, got));
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(Vec::new());
            }
        }
    }

    fn __repr__(&self) -> String {
        let state = if self.inner.is_closed() { "closed".to_string() } else { self.inner.addresses().join(", ") };
        format!("<freight.Agent '{}' [{state}] peers={:?}>", self.inner.name(), self.inner.peers())
    }
}

impl Drop for PyAgent {
    /// The last hold on the engine closes it, which shuts its peers down, and the
    /// router's joins its thread: neither with the GIL held.
    fn drop(&mut self) {
        let router = self.router.take();
        // SAFETY: `inner` is taken once, here, and `self` is not used after.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        Python::attach(|py| {
            py.detach(move || {
                drop(router);
                drop(inner);
            })
        });
    }
}
