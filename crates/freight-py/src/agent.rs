//! The agent binding: conversions and GIL release around `freight_core::Agent`.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use freight_core::{
    Agent, AgentConfig, CompletionMode, CudaConfig, FabricConfig, KernelMode, LaunchShape, MemKind, OpKind, Pinning,
    SharedSegment, ShmConfig, TcpConfig, TransportKind,
};
use freight_stream::router::Router;
use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::descs::{for_each_triple, indices, parse_kind, PyDescList, PyPreparedLocal, PyPreparedRemote};
use crate::errors::{invalid, to_py_err, OrRaise};
use crate::request::{PyRequest, SIGNAL_SLICE};
use crate::segment::PySharedSegment;
use crate::util::{seconds, timeout_arg};

static NEXT_AGENT_ID: AtomicU64 = AtomicU64::new(1);

/// Native agent (use `freight.Agent`, which wraps it with Python conveniences).
#[pyclass(frozen, name = "Agent", module = "freight._native")]
pub struct PyAgent {
    /// Taken out by `Drop` only (closing an agent waits on its peers: not with the GIL
    /// held). Clone it with `Arc::clone`: a `ManuallyDrop` clone would never be dropped.
    pub(crate) inner: ManuallyDrop<Arc<Agent>>,
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

fn transport(s: &str) -> PyResult<TransportKind> {
    TransportKind::parse(s).or_raise()
}

#[pymethods]
impl PyAgent {
    /// Creates an agent and starts its listener. Arguments mirror `freight.AgentConfig`.
    #[new]
    #[pyo3(signature = (
        name, *, listen = "127.0.0.1:0".to_string(), advertise = Vec::new(),
        transports = vec!["shm".to_string(), "tcp".to_string()], require = None,
        tcp_streams = 4, tcp_chunk_size = 1 << 20, tcp_window = 8, tcp_local_addrs = Vec::new(), tcp_zerocopy = true, tcp_pin = "numa".to_string(),
        fabric_provider = None, fabric_domains = Vec::new(), fabric_chunk_size = 4 << 20, fabric_stage_remote_host = false,
        fabric_gpu_direct = true,
        shm_threads = None, shm_inline_bytes = None, cuda_copy_engine_min_host = None,
        cuda_copy_engine_min_peer = None, cuda_kernel_item_bytes = None, cuda_kernel_blocks_per_sm = None,
        cuda_kernel_threads = None, cuda_kernel_mode = None, cuda_completion = None, peer_timeout = 30.0,
        connect_timeout = 5.0, token = None, serve_metadata = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        listen: String,
        advertise: Vec<String>,
        transports: Vec<String>,
        require: Option<String>,
        tcp_streams: usize,
        tcp_chunk_size: u64,
        tcp_window: usize,
        tcp_local_addrs: Vec<String>,
        tcp_zerocopy: bool,
        tcp_pin: String,
        fabric_provider: Option<String>,
        fabric_domains: Vec<String>,
        fabric_chunk_size: u64,
        fabric_stage_remote_host: bool,
        fabric_gpu_direct: bool,
        shm_threads: Option<usize>,
        shm_inline_bytes: Option<u64>,
        cuda_copy_engine_min_host: Option<u64>,
        cuda_copy_engine_min_peer: Option<u64>,
        cuda_kernel_item_bytes: Option<u64>,
        cuda_kernel_blocks_per_sm: Option<u32>,
        cuda_kernel_threads: Option<u32>,
        cuda_kernel_mode: Option<String>,
        cuda_completion: Option<String>,
        peer_timeout: f64,
        connect_timeout: f64,
        token: Option<Vec<u8>>,
        serve_metadata: bool,
    ) -> PyResult<Self> {
        if transports.is_empty() {
            return Err(invalid("at least one transport must be enabled"));
        }
        let mut kinds = Vec::with_capacity(transports.len());
        for t in &transports {
            let k = transport(t)?;
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
        let local_addrs = tcp_local_addrs
            .iter()
            .map(|a| a.parse::<IpAddr>().map_err(|_| invalid(format!("tcp_local_addrs: '{a}' is not an IP address"))))
            .collect::<PyResult<Vec<_>>>()?;
        let shm_default = ShmConfig::default();
        let config = AgentConfig {
            listen,
            advertise,
            transports: kinds,
            require: require.as_deref().map(transport).transpose()?,
            tcp: TcpConfig {
                streams: tcp_streams,
                chunk_size: tcp_chunk_size,
                window: tcp_window,
                local_addrs,
                pin: Pinning::parse(&tcp_pin).map_err(|e| invalid(format!("tcp_pin: {e}")))?,
                zerocopy: tcp_zerocopy,
            },
            fabric: FabricConfig {
                provider: fabric_provider,
                domains: fabric_domains,
                chunk_size: fabric_chunk_size,
                stage_remote_host: fabric_stage_remote_host,
                gpu_direct: fabric_gpu_direct,
            },
            shm: ShmConfig {
                threads: shm_threads.unwrap_or(shm_default.threads),
                inline_bytes: shm_inline_bytes.unwrap_or(shm_default.inline_bytes),
                ..shm_default
            },
            cuda: {
                let d = CudaConfig::default();
                CudaConfig {
                    copy_engine_min_host: cuda_copy_engine_min_host.unwrap_or(d.copy_engine_min_host),
                    copy_engine_min_peer: cuda_copy_engine_min_peer.unwrap_or(d.copy_engine_min_peer),
                    kernel_item_bytes: cuda_kernel_item_bytes.unwrap_or(d.kernel_item_bytes),
                    kernel_shape: LaunchShape {
                        mode: cuda_kernel_mode
                            .as_deref()
                            .map(KernelMode::parse)
                            .transpose()
                            .or_raise()?
                            .unwrap_or(d.kernel_shape.mode),
                        threads: cuda_kernel_threads.unwrap_or(d.kernel_shape.threads),
                        blocks_per_sm: cuda_kernel_blocks_per_sm.unwrap_or(d.kernel_shape.blocks_per_sm),
                    },
                    completion: cuda_completion
                        .as_deref()
                        .map(CompletionMode::parse)
                        .transpose()
                        .or_raise()?
                        .unwrap_or(d.completion),
                }
            },
            peer_timeout: seconds(peer_timeout, "peer_timeout")?,
            connect_timeout: seconds(connect_timeout, "connect_timeout")?,
            token,
            serve_metadata,
        };
        let inner = Arc::new(py.detach(|| Agent::new(&name, config)).or_raise()?);
        Ok(PyAgent {
            inner: ManuallyDrop::new(inner),
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

    /// Stops listening and closes every connection; in-flight requests fail. The objects
    /// kept for registered memory are let go once nothing of the agent can still use
    /// them (no request object, pipe end, store or cache engine), else with the agent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
        if self.idle() {
            let kept = std::mem::take(&mut *self.keep());
            drop(kept);
        }
    }

    /// Listens on one more address; returns the bound ip:port.
    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<String> {
        py.detach(|| self.inner.listen(addr)).or_raise().map(|a| a.to_string())
    }

    // -- memory ----------------------------------------------------------------------

    /// Allocates `nbytes` of zeroed host memory in a shared segment (reachable by
    /// same-host peers through shm) and returns it as a uint8 numpy array whose base
    /// (a `freight.SharedSegment`) keeps the memory alive.
    fn alloc<'py>(&self, py: Python<'py>, nbytes: usize) -> PyResult<Bound<'py, PyArray1<u8>>> {
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
    fn share_in_place(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<PySharedSegment> {
        let seg = py.detach(|| self.inner.share_in_place(addr, length)).or_raise()?;
        Ok(PySharedSegment { seg })
    }

    /// Registers `[addr, addr + length)` of `kind` on `device`; returns the region key.
    /// `keep` (any object) is held until the region is deregistered. `read_only`: no
    /// transfer may write it (peers only read it).
    #[pyo3(signature = (kind, addr, length, device = 0, keep = None, read_only = false))]
    #[allow(clippy::too_many_arguments)]
    fn register(
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
    fn register_many(
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

    /// Deregisters a region. RegionBusyError while a transfer uses it;
    /// UnknownRegionError for a key that is not registered.
    fn deregister(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        py.detach(|| self.inner.deregister(key)).or_raise()?;
        let released = self.keep().remove(&key);
        drop(released);
        Ok(())
    }

    // -- metadata and peers ----------------------------------------------------------

    /// This agent's metadata (addresses, transports, registered regions) as bytes.
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let md = py.detach(|| self.inner.metadata());
        PyBytes::new(py, &md)
    }

    /// Adds (or replaces) a peer from its metadata bytes; returns its name.
    /// Adds a peer from its metadata; `token`: the peer's access token, if it has one.
    #[pyo3(signature = (metadata, token = None))]
    fn add_peer(&self, py: Python<'_>, metadata: Vec<u8>, token: Option<Vec<u8>>) -> PyResult<String> {
        py.detach(|| self.inner.add_peer_with_token(&metadata, token.as_deref())).or_raise()
    }

    /// Forgets a peer and closes its connections.
    fn remove_peer(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.inner.remove_peer(name)).or_raise()
    }

    /// Fetches a peer's metadata from its listener at `addr` and adds the peer.
    #[pyo3(signature = (addr, token = None))]
    fn connect(&self, py: Python<'_>, addr: &str, token: Option<Vec<u8>>) -> PyResult<String> {
        py.detach(|| self.inner.connect(addr, token.as_deref())).or_raise()
    }

    /// Re-reads a known peer's metadata from its listener.
    #[pyo3(signature = (name, token = None))]
    fn refresh_peer(&self, py: Python<'_>, name: &str, token: Option<Vec<u8>>) -> PyResult<()> {
        py.detach(|| self.inner.refresh_peer(name, token.as_deref())).or_raise()
    }

    /// (transport, reason) for host-memory transfers to `peer`.
    fn path_to(&self, py: Python<'_>, peer: &str) -> PyResult<(&'static str, String)> {
        let p = py.detach(|| self.inner.path_to(peer)).or_raise()?;
        Ok((p.transport.as_str(), p.reason))
    }

    /// (control connections, tcp connections, fabric connections, handshakes, set-up us,
    /// last set-up us).
    fn connection_stats(&self, peer: &str) -> PyResult<(u64, u64, u64, u64, u64, u64)> {
        let s = self.inner.connection_stats(peer).or_raise()?;
        Ok((s.control_connections, s.tcp_connections, s.fabric_connections, s.handshakes, s.setup_us, s.last_setup_us))
    }

    // -- descriptors and requests ----------------------------------------------------

    /// Checks a descriptor list against this agent's registered memory.
    fn prepare_local(&self, py: Python<'_>, descs: PyRef<'_, PyDescList>) -> PyResult<PyPreparedLocal> {
        let list = &descs.inner;
        let inner = py.detach(|| self.inner.prepare_local(list)).or_raise()?;
        Ok(PyPreparedLocal { inner, agent_id: self.id })
    }

    /// Checks a descriptor list against `peer`'s advertised memory.
    fn prepare_remote(&self, py: Python<'_>, peer: &str, descs: PyRef<'_, PyDescList>) -> PyResult<PyPreparedRemote> {
        let list = &descs.inner;
        let inner = py.detach(|| self.inner.prepare_remote(peer, list)).or_raise()?;
        Ok(PyPreparedRemote { inner, agent_id: self.id })
    }

    /// Builds an idle request (see freight.Agent.make_request).
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, notif = None))]
    fn make_request(
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
    fn transfer(
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

    /// Sends a notification to `peer` (ordered with the other notifications to it).
    fn notify(&self, py: Python<'_>, peer: &str, msg: Vec<u8>) -> PyResult<()> {
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
        format!("<freight._native.Agent '{}' at {:?}>", self.inner.name(), self.inner.addresses())
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
