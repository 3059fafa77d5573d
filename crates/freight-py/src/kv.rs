//! The KV cache server's bindings (`freight_kv`), wrapped by `freight.kv.Server` and
//! `freight.kv.Client`.
//!
//! Python hands keys over as `bytes` and values (and `get_into`'s destination) as
//! one-dimensional uint8 arrays viewing the caller's memory; every call that talks to
//! the server, starts or stops one runs with the GIL released. A client serves one
//! request at a time: its calls are serialized by a lock, taken with the GIL released.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use freight_core::{AgentConfig, Error, Result, TransportKind};
use freight_kv::client::too_small;
use freight_kv::index::Stats;
use freight_kv::{Client, ClientConfig, Server, ServerConfig, TlsIdentity};
use numpy::{PyReadonlyArray1, PyReadwriteArray1};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use pyo3::IntoPyObjectExt;

use crate::errors::{invalid, to_py_err, OrRaise};
use crate::interrupt;
use crate::util::{positive_int, seconds};

/// `get_many` asks for at most this many keys at once per this many bytes of the
/// client's buffer (the buffer is shared out evenly between the keys of one request).
const MIN_SHARE: u64 = 4096;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// "auto" (the engine picks: shm on the same host, else tcp), "shm" or "tcp".
fn transport_arg(transport: &str) -> PyResult<Option<TransportKind>> {
    match transport.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(None),
        "shm" => Ok(Some(TransportKind::Shm)),
        "tcp" => Ok(Some(TransportKind::Tcp)),
        other => Err(invalid(format!("unknown transport {other:?} (expected auto, shm or tcp)"))),
    }
}

/// The client's engine agent. The server moves every value, choosing among the
/// transports the client's agent advertises: a client that asks for one transport
/// advertises only that one (requiring it on the client alone would change nothing).
fn client_engine(require: Option<TransportKind>) -> AgentConfig {
    let d = AgentConfig::default();
    match require {
        Some(t) => AgentConfig { transports: vec![t], require: Some(t), ..d },
        None => d,
    }
}

/// A TTL in seconds (0: never expires). The server counts in milliseconds: a TTL of
/// less than one is rounded up to one, not down to "never".
fn ttl_arg(ttl: f64) -> PyResult<Duration> {
    let d = seconds(ttl, "ttl")?;
    Ok(if d.is_zero() { d } else { d.max(Duration::from_millis(1)) })
}

/// A client's token: `given`, or where none is given, FREIGHT_KV_TOKEN (an empty one is
/// none: a server reads a missing header as an empty token); printable ASCII, as an
/// HTTP header carries it. Errors name where it came from.
fn client_token(given: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    let (token, what) = match given {
        Some(t) => {
            let t = t.extract::<String>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "token must be a str, got {}",
                    t.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                ))
            })?;
            (Some(t), "token")
        }
        None => (std::env::var("FREIGHT_KV_TOKEN").ok(), "FREIGHT_KV_TOKEN"),
    };
    match token {
        Some(t) if t.is_empty() => Ok(None),
        Some(t) if !t.bytes().all(|b| (b' '..=b'~').contains(&b)) => {
            Err(invalid(format!("{what} must be printable ASCII (no line breaks or other control characters)")))
        }
        t => Ok(t),
    }
}

/// The path a Python argument names: a str or an `os.PathLike` (not bytes, which would
/// more likely be a certificate given in place of its file).
fn pem_path(arg: &Bound<'_, PyAny>, what: &str) -> PyResult<PathBuf> {
    if arg.is_instance_of::<PyBytes>() || arg.is_instance_of::<pyo3::types::PyByteArray>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be the path of a PEM file (str or os.PathLike), got bytes"
        )));
    }
    arg.extract::<PathBuf>().map_err(|_| {
        let kind = arg.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!("{what} must be the path of a PEM file (str or os.PathLike), got {kind}"))
    })
}

/// A PEM file named by a Python argument, read whole.
fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::Io(format!("cannot read {what} {}: {e}", path.display())))
}

fn slice<'a>(a: &'a PyReadonlyArray1<'_, u8>, what: &str) -> PyResult<&'a [u8]> {
    a.as_slice().map_err(|_| invalid(format!("{what} must be a contiguous uint8 array")))
}

fn drop_detached<T: Send>(v: T) {
    Python::attach(|py| py.detach(move || drop(v)));
}

/// The pool's counters as a dict, with `clients` (sessions open) where it is known.
fn stats_dict<'py>(py: Python<'py>, pool: &Stats, clients: Option<u64>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in pool.named() {
        d.set_item(k, v)?;
    }
    if let Some(clients) = clients {
        d.set_item("clients", clients)?;
    }
    Ok(d)
}

// -- the server -------------------------------------------------------------------------

/// A KV server running in this process: the same server as `freight serve`, reached by
/// clients of any process through `listen` ("ip:port"; port 0 picks a free one: see
/// `url`).
///
/// `memory_size`: bytes of the value pool (allocated and touched at start). `evict`: a
/// full pool evicts least recently used values; False: it refuses writes with
/// `freight.NoSpaceError`. `data_listen`: the data plane's engine listener (clients on
/// other hosts reach it over TCP). `transport`: "auto" (shared memory on the same host,
/// else TCP), "shm" or "tcp".
///
/// Securing it as `freight serve` options do: `token` (`--token`), a secret every
/// client must present (`Client`'s `token`; others get `freight.AuthError`). Unlike
/// `freight serve`, the server does not read FREIGHT_KV_TOKEN: pass
/// `token=os.environ["FREIGHT_KV_TOKEN"]` for that. `tls_cert` and `tls_key`
/// (`--tls-cert`, `--tls-key`): paths of PEM files, the server's certificate chain and
/// its private key, to serve the control plane over TLS (`url` is then https://...;
/// clients give `tls_ca`). A self-signed certificate must not be a CA certificate
/// (docs/kv.md shows an `openssl` line that makes one). `metrics_listen`
/// (`--metrics-listen`): an "ip:port" to serve Prometheus metrics on (see
/// `metrics_url`).
///
/// Context manager: `shutdown()` on exit (dropping the object shuts it down too).
#[pyclass(frozen, name = "Server", module = "freight.kv")]
pub struct PyKvServer {
    inner: Mutex<Option<Server>>,
    /// The control plane's URL, what clients connect to: "http://127.0.0.1:PORT"
    /// (https with TLS).
    #[pyo3(get)]
    url: String,
    /// The control plane's bound "ip:port" (with the port picked, where 0 was asked).
    #[pyo3(get)]
    address: String,
    /// Bytes of the value pool.
    #[pyo3(get)]
    memory_size: u64,
    /// Whether a full pool evicts least recently used values.
    #[pyo3(get)]
    evict: bool,
    metrics_address: Option<String>,
}

impl PyKvServer {
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&Server) -> T + Send) -> PyResult<T> {
        py.detach(|| match lock(&self.inner).as_ref() {
            Some(s) => Ok(f(s)),
            None => Err(Error::InvalidState("the KV server was shut down".into())),
        })
        .or_raise()
    }
}

#[pymethods]
impl PyKvServer {
    #[new]
    #[pyo3(signature = (
        listen = "127.0.0.1:0".to_string(), memory_size = None, evict = true, *,
        data_listen = "127.0.0.1:0".to_string(), transport = "auto", token = None, tls_cert = None,
        tls_key = None, metrics_listen = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: String,
        memory_size: Option<&Bound<'_, PyAny>>,
        evict: bool,
        data_listen: String,
        transport: &str,
        token: Option<String>,
        tls_cert: Option<&Bound<'_, PyAny>>,
        tls_key: Option<&Bound<'_, PyAny>>,
        metrics_listen: Option<String>,
    ) -> PyResult<Self> {
        let memory_size = match memory_size {
            Some(v) => positive_int("memory_size", v)? as u64,
            None => 1 << 30,
        };
        let require = transport_arg(transport)?;
        let tls = match (tls_cert, tls_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(TlsIdentity {
                cert_pem: read_pem(&pem_path(cert, "tls_cert")?, "tls_cert").or_raise()?,
                key_pem: read_pem(&pem_path(key, "tls_key")?, "tls_key").or_raise()?,
            }),
            _ => return Err(invalid("tls_cert and tls_key go together: give both, or neither")),
        };
        crate::logging::_init_logging_from_env()?;
        let config = ServerConfig {
            listen,
            memory_bytes: memory_size,
            evict,
            engine: AgentConfig { listen: data_listen, require, ..AgentConfig::default() },
            token,
            tls,
            metrics_listen,
            ..ServerConfig::default()
        };
        let server = py.detach(move || Server::start(config)).or_raise()?;
        Ok(PyKvServer {
            url: server.url(),
            address: server.addr().to_string(),
            metrics_address: server.metrics_addr().map(|a| a.to_string()),
            inner: Mutex::new(Some(server)),
            memory_size,
            evict,
        })
    }

    /// The control plane's port (the one picked, where 0 was asked for).
    #[getter]
    fn port(&self) -> u16 {
        self.address.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)
    }

    /// Where Prometheus metrics are served ("http://ip:port/metrics"), or None without
    /// `metrics_listen`.
    #[getter]
    fn metrics_url(&self) -> Option<String> {
        self.metrics_address.as_ref().map(|a| format!("http://{a}/metrics"))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.shutdown(py)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let state = if self.live(py) { self.url.clone() } else { "shut down".into() };
        format!("<freight.kv.Server {state}, pool {} bytes>", self.memory_size)
    }

    /// False once shut down.
    #[getter]
    fn live(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).is_some())
    }

    /// The pool's counters: `keys`, `bytes` (of values), `pool_used` (with alignment
    /// and values being written or still read), `capacity`, `index_bytes` (the keys'
    /// share of the capacity: each key's bytes plus an estimate of the index's memory
    /// for it), `hits` (values served), `misses`, `evictions`, `expirations`,
    /// `pending_puts` (values reserved by PUTs not yet committed). Raises
    /// `freight.InvalidStateError` once shut down.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let pool = self.with(py, |s| s.stats())?;
        stats_dict(py, &pool, None)
    }

    /// Stops taking requests, lets those in flight finish, and frees the pool; clients'
    /// later calls fail. Harmless when called again.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(s) = lock(&self.inner).take() {
                s.shutdown();
            }
        })
    }
}

impl Drop for PyKvServer {
    fn drop(&mut self) {
        if let Some(s) = lock(&self.inner).take() {
            drop_detached(s);
        }
    }
}

// -- the client -------------------------------------------------------------------------

/// A session with a KV server (`freight.kv.Client` adds the conversions of keys and
/// values: str keys, any buffer, array or tensor as a value). Its settings, checked
/// here: `server` (a URL "http://ip:port", or a `freight.kv.Server`), `buffer_size`,
/// `name`, `timeout`, `transport` ("auto", "shm" or "tcp"), `token` (None: the
/// FREIGHT_KV_TOKEN variable, where set; an empty one is none) and `tls_ca` (the PEM
/// file of the authority that signed an https:// server's certificate).
#[pyclass(frozen, subclass, name = "KvClient", module = "freight._native")]
pub struct PyKvClient {
    inner: Mutex<Option<Client>>,
    /// The server's URL.
    #[pyo3(get)]
    server: String,
    /// The client's name, in the server's logs.
    #[pyo3(get)]
    name: String,
    /// Bytes of the receive buffer: the largest value this client can get or put.
    #[pyo3(get)]
    buffer_size: u64,
    /// Seconds one call may take to get the server's answer.
    #[pyo3(get)]
    timeout: f64,
}

impl PyKvClient {
    /// Runs `f` on the client with the GIL released (the lock is taken there too);
    /// Ctrl-C interrupts its wait, and leaves the client unusable (see `Client`).
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Client) -> Result<T> + Send) -> PyResult<T> {
        interrupt::detach(py, || match lock(&self.inner).as_mut() {
            Some(c) => f(c),
            None => Err(self.closed()),
        })
    }

    fn closed(&self) -> Error {
        Error::InvalidState("the KV client is closed".into())
    }
}

/// Values of `keys`, in batches whose share of the buffer is at least [`MIN_SHARE`]; a
/// value that does not fit its share (or any other item that failed) is fetched again
/// on its own, with the whole buffer.
fn get_many(c: &mut Client, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
    let per_batch = (c.buffer_bytes() / MIN_SHARE).max(1) as usize;
    let mut out = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(per_batch) {
        for (key, item) in chunk.iter().zip(c.get_batch(chunk)?) {
            out.push(match item {
                Ok(v) => v,
                Err(_) => c.get(key)?,
            });
        }
    }
    Ok(out)
}

/// Stores the items in as few requests as the buffer allows; one result per item. A
/// value larger than the buffer fails alone; a failure of a whole request (the server
/// gone, a timeout) is the error of the call.
fn put_many(c: &mut Client, items: &[(&[u8], &[u8])], ttl: Duration) -> Result<Vec<Result<u64>>> {
    let cap = c.buffer_bytes();
    let mut out = Vec::with_capacity(items.len());
    let (mut start, mut total) = (0usize, 0u64);
    for (i, (key, value)) in items.iter().enumerate() {
        let len = value.len() as u64;
        if total + len > cap || len > cap {
            if start < i {
                out.extend(c.put_batch(&items[start..i], ttl)?);
            }
            start = i;
            total = 0;
        }
        if len > cap {
            // Refused before anything is sent: the error names both sizes.
            out.push(c.put(key, value, ttl));
            start = i + 1;
            continue;
        }
        total += len;
    }
    if start < items.len() {
        out.extend(c.put_batch(&items[start..], ttl)?);
    }
    Ok(out)
}

#[pymethods]
impl PyKvClient {
    /// Connects to the server at `server` (its control plane's URL) with a receive buffer
    /// of `buffer_size` bytes; `timeout` (seconds) bounds each call's wait for the server,
    /// a new session after it went away included (see `ClientConfig::timeout`).
    /// `token`: the server's secret; `tls_ca`: the PEM file of the authority to trust,
    /// for an https server.
    #[new]
    #[pyo3(signature = (
        server = None, buffer_size = None, name = "freight-kv-client".to_string(), timeout = 30.0,
        transport = "auto", *, token = None, tls_ca = None, direct = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        server: Option<&Bound<'_, PyAny>>,
        buffer_size: Option<&Bound<'_, PyAny>>,
        name: String,
        timeout: f64,
        transport: &str,
        token: Option<&Bound<'_, PyAny>>,
        tls_ca: Option<&Bound<'_, PyAny>>,
        direct: bool,
    ) -> PyResult<Self> {
        let server = match server {
            None => format!("http://{}", freight_kv::control::DEFAULT_LISTEN),
            Some(s) => match s.cast::<PyKvServer>() {
                Ok(running) => running.get().url.clone(),
                Err(_) => s.extract::<String>().map_err(|_| {
                    PyTypeError::new_err("server must be a URL (\"http://ip:port\") or a freight.kv.Server")
                })?,
            },
        };
        let buffer_size = match buffer_size {
            Some(v) => positive_int("buffer_size", v)? as u64,
            None => 64 << 20,
        };
        let wait = seconds(timeout, "timeout")?;
        if wait.is_zero() {
            return Err(invalid("timeout must be more than 0 seconds"));
        }
        let token = client_token(token)?;
        let tls_ca = tls_ca.map(|p| pem_path(p, "tls_ca")).transpose()?;
        if tls_ca.is_some() && !server.to_ascii_lowercase().starts_with("https://") {
            return Err(invalid(format!("tls_ca is for https:// servers; {server:?} is not one")));
        }
        let tls_ca_pem = tls_ca.map(|p| read_pem(&p, "tls_ca")).transpose().or_raise()?;
        crate::logging::_init_logging_from_env()?;
        let config = ClientConfig {
            server: server.clone(),
            buffer_bytes: buffer_size,
            name: name.clone(),
            engine: client_engine(transport_arg(transport)?),
            timeout: wait,
            // A server starting up gets a few seconds to accept, within the timeout.
            connect_for: wait.min(ClientConfig::default().connect_for),
            token,
            tls_ca_pem,
            direct,
        };
        let client = py.detach(move || Client::connect(config)).or_raise()?;
        Ok(PyKvClient { buffer_size: client.buffer_bytes(), inner: Mutex::new(Some(client)), server, name, timeout })
    }

    /// False once closed, or once a request timed out or lost its connection to a server
    /// that lives on (the client cannot be used again).
    #[getter]
    fn live(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).as_ref().is_some_and(Client::usable))
    }

    /// Where the client's engine agent listens (the server's agent dials it); empty once
    /// closed.
    /// Whether values take a direct connection to the server (a server reached over
    /// tcp offers one) rather than the engine.
    #[getter]
    fn direct(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).as_ref().is_some_and(Client::direct))
    }

    #[getter]
    fn engine_addresses(&self, py: Python<'_>) -> Vec<String> {
        py.detach(|| lock(&self.inner).as_ref().map(Client::engine_addresses).unwrap_or_default())
    }

    /// Stores `value` (a contiguous uint8 array) under `key`; returns its version.
    fn _put(&self, py: Python<'_>, key: &[u8], value: PyReadonlyArray1<'_, u8>, ttl: f64) -> PyResult<u64> {
        let ttl = ttl_arg(ttl)?;
        let value = slice(&value, "the value")?;
        self.with(py, |c| c.put(key, value, ttl))
    }

    /// Stores `values[i]` under `keys[i]`; one int (the version) or exception object per
    /// item.
    fn _put_many(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyBytes>>,
        values: Vec<PyReadonlyArray1<'_, u8>>,
        ttl: f64,
    ) -> PyResult<Vec<Py<PyAny>>> {
        if keys.len() != values.len() {
            return Err(invalid(format!("{} keys for {} values", keys.len(), values.len())));
        }
        let ttl = ttl_arg(ttl)?;
        let mut items = Vec::with_capacity(keys.len());
        for (k, v) in keys.iter().zip(&values) {
            items.push((k.as_bytes(), slice(v, "every value")?));
        }
        let results = self.with(py, |c| put_many(c, &items, ttl))?;
        results
            .into_iter()
            .map(|r| match r {
                Ok(version) => version.into_py_any(py),
                Err(e) => Ok(to_py_err(e).into_value(py).into_any()),
            })
            .collect()
    }

    /// The value of `key` as bytes, or None.
    fn _get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let value = self.with(py, |c| c.get(key))?;
        Ok(value.map(|v| PyBytes::new(py, &v)))
    }

    /// Copies the value of `key` into `out` (a writable contiguous uint8 array); returns
    /// its length, or None when there is no such key.
    fn _get_into(&self, py: Python<'_>, key: &[u8], mut out: PyReadwriteArray1<'_, u8>) -> PyResult<Option<u64>> {
        let out = out.as_slice_mut().map_err(|_| invalid("out must be a contiguous uint8 array"))?;
        let copied = self.with(py, |c| {
            c.get_with(key, |v| {
                if v.len() > out.len() {
                    return Err(too_small(v.len() as u64, out.len() as u64));
                }
                out[..v.len()].copy_from_slice(v);
                Ok(v.len() as u64)
            })
        })?;
        copied.transpose().or_raise()
    }

    /// Copies the value of `key` into GPU memory (`capacity` bytes at device address
    /// `addr` on GPU `device`); its length, or None.
    fn _get_into_gpu(
        &self,
        py: Python<'_>,
        key: &[u8],
        addr: u64,
        capacity: u64,
        device: usize,
    ) -> PyResult<Option<u64>> {
        self.with(py, |c| c.get_to_gpu(key, addr, capacity, device))
    }

    /// Values of `keys` (bytes or None each).
    fn _get_many<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Bound<'py, PyBytes>>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let values = self.with(py, |c| get_many(c, &raw))?;
        Ok(values.into_iter().map(|v| v.map(|v| PyBytes::new(py, &v))).collect())
    }

    /// Whether each key has a live value.
    fn _exists(&self, py: Python<'_>, keys: Vec<Bound<'_, PyBytes>>) -> PyResult<Vec<bool>> {
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        self.with(py, |c| c.exists(&raw))
    }

    /// Deletes the keys; whether each was there.
    fn _delete(&self, py: Python<'_>, keys: Vec<Bound<'_, PyBytes>>) -> PyResult<Vec<bool>> {
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        self.with(py, |c| c.delete(&raw))
    }

    /// The server's counters, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let reply = self.with(py, |c| c.stats())?;
        stats_dict(py, &reply.pool(), Some(reply.clients))
    }

    /// Ends the session (the server releases what it holds for this client) and frees
    /// the receive buffer. Harmless when called again, and when the server is gone
    /// already (its sessions went with it); later calls raise `InvalidStateError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let closed = py.detach(|| match lock(&self.inner).take() {
            Some(c) => c.close(),
            None => Ok(()),
        });
        match closed {
            Err(Error::PeerDisconnected { reason, .. }) => {
                tracing::debug!(%reason, "closed a KV client whose server is gone");
                Ok(())
            }
            other => other.or_raise(),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the client; leaving on an error, a failure to close does not hide it.
    #[pyo3(signature = (exc_type = None, *_exc))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: &Bound<'_, pyo3::types::PyTuple>,
    ) -> PyResult<()> {
        match self.close(py) {
            Err(_) if exc_type.is_some_and(|t| !t.is_none()) => Ok(()),
            other => other,
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let state = if self.live(py) { "" } else { ", closed" };
        format!("<freight.kv.Client of {}, buffer {} bytes{state}>", self.server, self.buffer_size)
    }
}

impl Drop for PyKvClient {
    fn drop(&mut self) {
        // Dropped without a goodbye (which could wait on a dead server): its agent
        // closes, and the server drops the session once it notices.
        if let Some(c) = lock(&self.inner).take() {
            drop_detached(c);
        }
    }
}
