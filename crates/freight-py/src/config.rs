//! `freight.AgentConfig`: the engine's configuration, built from keyword arguments and
//! checked once, by the engine (`freight_core::AgentConfig::validate`). A value of the
//! wrong type is a `TypeError`, a bad value an `InvalidArgumentError`; both name the
//! setting.

use std::net::IpAddr;
use std::time::Duration;

use freight_core::{AgentConfig, CompletionMode, KernelMode, Pinning, TransportKind};
use pyo3::exceptions::{PyDeprecationWarning, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::errors::{invalid, OrRaise};

/// Transports this build knows, in order of preference.
pub(crate) const TRANSPORTS: [&str; 4] = ["cuda", "shm", "fabric", "tcp"];

/// Everything a `freight.Agent` can be told at creation; immutable (derive variants with
/// `replace(**changes)`). Every setting is a keyword argument, documented in the
/// stubs (`freight/_native.pyi`) and docs/engine.md; `TypeError` for a wrong type,
/// `freight.InvalidArgumentError` for a bad value, both naming the setting.
#[pyclass(frozen, name = "AgentConfig", module = "freight")]
#[derive(Clone)]
pub struct PyAgentConfig {
    pub(crate) inner: AgentConfig,
}

fn type_error(field: &str, expected: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let ty = got.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    let shown = got.repr().map(|r| r.to_string()).unwrap_or_default();
    PyTypeError::new_err(format!("AgentConfig.{field} must be {expected}, got {ty} {shown}"))
}

/// A string, or a sequence of strings (a lone string is one item).
fn strings(field: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(vec![s.to_cow()?.into_owned()]);
    }
    if v.is_instance_of::<PyBytes>()
        || !(v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() || v.hasattr("__iter__")?)
    {
        return Err(type_error(field, "a sequence of strings", v));
    }
    v.try_iter()?
        .map(|item| {
            let item = item?;
            item.cast::<PyString>().map(|s| s.to_string()).map_err(|_| type_error(field, "a sequence of strings", v))
        })
        .collect()
}

/// A token as bytes (a str is taken as UTF-8).
fn token(field: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(s.to_cow()?.as_bytes().to_vec());
    }
    if v.is_instance_of::<PyString>() || v.extract::<i64>().is_ok() {
        return Err(type_error(field, "None, bytes or str", v));
    }
    v.extract::<Vec<u8>>().map_err(|_| type_error(field, "None, bytes or str", v))
}

/// A switch: True or False (not 0, 1 or a string, which may mean the opposite of what
/// they look like: "no" is truthy), or the engine's default where None or not given.
fn flag(field: &str, v: Option<Bound<'_, PyAny>>, default: bool) -> PyResult<bool> {
    match v {
        None => Ok(default),
        Some(v) => match v.cast::<PyBool>() {
            Ok(b) => Ok(b.is_true()),
            Err(_) => Err(type_error(field, "a bool", &v)),
        },
    }
}

/// A count that must not be negative (the engine checks the lower bounds it needs).
fn count(field: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| invalid(format!("AgentConfig.{field} must be >= 0, got {v}")))
}

/// A setting a component refused, named.
fn refused(field: &str, e: freight_core::Error) -> PyErr {
    let why = match e {
        freight_core::Error::InvalidArgument(m) => m,
        other => other.to_string(),
    };
    invalid(format!("AgentConfig.{field} is refused: {why}"))
}

fn seconds(field: &str, v: f64) -> PyResult<Duration> {
    if !v.is_finite() || v <= 0.0 {
        return Err(invalid(format!("AgentConfig.{field} must be a positive, finite number of seconds, got {v}")));
    }
    Duration::try_from_secs_f64(v).map_err(|e| invalid(format!("AgentConfig.{field}: {e}")))
}

fn transport(field: &str, name: &str) -> PyResult<TransportKind> {
    TransportKind::parse(name).map_err(|_| {
        invalid(format!("AgentConfig.{field}: unknown transport {name:?} (expected one of {TRANSPORTS:?})"))
    })
}

#[pymethods]
impl PyAgentConfig {
    #[new]
    #[pyo3(signature = (
        *, listen = "127.0.0.1:0".to_string(), advertise = None, transports = None, require = None,
        tcp_streams = 4, tcp_chunk_size = 1 << 20, tcp_window = 8, tcp_local_addrs = None, tcp_zerocopy = None,
        tcp_pin = None, fabric_provider = None, fabric_domains = None, fabric_chunk_size = 4 << 20,
        fabric_stage_remote_host = None, fabric_gpu_direct = None, shm_threads = None, shm_inline_bytes = None,
        cuda_copy_engine_min_host = None, cuda_copy_engine_min_peer = None, cuda_kernel_mode = None,
        cuda_kernel_threads = None, cuda_kernel_blocks_per_sm = None, cuda_kernel_item_bytes = None,
        cuda_completion = None, peer_timeout = 30.0, connect_timeout = 5.0, token = None, serve_metadata = None,
        metadata_token = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: String,
        advertise: Option<Bound<'_, PyAny>>,
        transports: Option<Bound<'_, PyAny>>,
        require: Option<String>,
        tcp_streams: i64,
        tcp_chunk_size: i64,
        tcp_window: i64,
        tcp_local_addrs: Option<Bound<'_, PyAny>>,
        tcp_zerocopy: Option<Bound<'_, PyAny>>,
        tcp_pin: Option<Bound<'_, PyAny>>,
        fabric_provider: Option<String>,
        fabric_domains: Option<Bound<'_, PyAny>>,
        fabric_chunk_size: i64,
        fabric_stage_remote_host: Option<Bound<'_, PyAny>>,
        fabric_gpu_direct: Option<Bound<'_, PyAny>>,
        shm_threads: Option<i64>,
        shm_inline_bytes: Option<i64>,
        cuda_copy_engine_min_host: Option<i64>,
        cuda_copy_engine_min_peer: Option<i64>,
        cuda_kernel_mode: Option<String>,
        cuda_kernel_threads: Option<i64>,
        cuda_kernel_blocks_per_sm: Option<i64>,
        cuda_kernel_item_bytes: Option<i64>,
        cuda_completion: Option<String>,
        peer_timeout: f64,
        connect_timeout: f64,
        token: Option<Bound<'_, PyAny>>,
        serve_metadata: Option<Bound<'_, PyAny>>,
        metadata_token: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut c = AgentConfig { listen, ..AgentConfig::default() };
        if let Some(a) = advertise {
            c.advertise = strings("advertise", &a)?;
        }
        if let Some(t) = transports {
            let mut kinds = Vec::new();
            for name in strings("transports", &t)? {
                let k = transport("transports", &name)?;
                if !kinds.contains(&k) {
                    kinds.push(k);
                }
            }
            c.transports = kinds;
        }
        c.require = require.as_deref().map(|r| transport("require", r)).transpose()?;
        c.tcp.streams = count("tcp_streams", tcp_streams)? as usize;
        c.tcp.chunk_size = count("tcp_chunk_size", tcp_chunk_size)?;
        c.tcp.window = count("tcp_window", tcp_window)? as usize;
        if let Some(a) = tcp_local_addrs {
            c.tcp.local_addrs = strings("tcp_local_addrs", &a)?
                .iter()
                .map(|a| {
                    a.parse::<IpAddr>()
                        .map_err(|_| invalid(format!("AgentConfig.tcp_local_addrs: {a:?} is not an IP address")))
                })
                .collect::<PyResult<_>>()?;
        }
        c.tcp.zerocopy = flag("tcp_zerocopy", tcp_zerocopy, c.tcp.zerocopy)?;
        if let Some(pin) = tcp_pin {
            let spec = match pin.extract::<Vec<usize>>() {
                Ok(cores) if !pin.is_instance_of::<PyString>() && !cores.is_empty() => {
                    cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
                }
                _ => pin
                    .extract::<String>()
                    .map_err(|_| type_error("tcp_pin", "\"numa\", \"off\" or a list of cores", &pin))?,
            };
            c.tcp.pin = Pinning::parse(&spec).map_err(|e| invalid(format!("AgentConfig.tcp_pin: {e}")))?;
        }
        c.fabric.provider = fabric_provider;
        if let Some(d) = fabric_domains {
            c.fabric.domains = strings("fabric_domains", &d)?;
        }
        c.fabric.chunk_size = count("fabric_chunk_size", fabric_chunk_size)?;
        c.fabric.stage_remote_host =
            flag("fabric_stage_remote_host", fabric_stage_remote_host, c.fabric.stage_remote_host)?;
        c.fabric.gpu_direct = flag("fabric_gpu_direct", fabric_gpu_direct, c.fabric.gpu_direct)?;
        if let Some(n) = shm_threads {
            c.shm.threads = count("shm_threads", n)? as usize;
        }
        if let Some(n) = shm_inline_bytes {
            c.shm.inline_bytes = count("shm_inline_bytes", n)?;
        }
        if let Some(n) = cuda_copy_engine_min_host {
            c.cuda.copy_engine_min_host = count("cuda_copy_engine_min_host", n)?;
        }
        if let Some(n) = cuda_copy_engine_min_peer {
            c.cuda.copy_engine_min_peer = count("cuda_copy_engine_min_peer", n)?;
        }
        if let Some(m) = cuda_kernel_mode {
            c.cuda.kernel_shape.mode = KernelMode::parse(&m).map_err(|e| refused("cuda_kernel_mode", e))?;
        }
        if let Some(n) = cuda_kernel_threads {
            c.cuda.kernel_shape.threads = u32::try_from(count("cuda_kernel_threads", n)?).unwrap_or(u32::MAX);
        }
        if let Some(n) = cuda_kernel_blocks_per_sm {
            c.cuda.kernel_shape.blocks_per_sm =
                u32::try_from(count("cuda_kernel_blocks_per_sm", n)?).unwrap_or(u32::MAX);
        }
        if let Some(n) = cuda_kernel_item_bytes {
            c.cuda.kernel_item_bytes = count("cuda_kernel_item_bytes", n)?;
        }
        if let Some(m) = cuda_completion {
            c.cuda.completion = CompletionMode::parse(&m).map_err(|e| refused("cuda_completion", e))?;
        }
        c.peer_timeout = seconds("peer_timeout", peer_timeout)?;
        c.connect_timeout = seconds("connect_timeout", connect_timeout)?;
        c.token = token.map(|t| self::token("token", &t)).transpose()?;
        if let Some(old) = metadata_token {
            PyErr::warn(
                py,
                &py.get_type::<PyDeprecationWarning>(),
                c"AgentConfig.metadata_token is now AgentConfig.token (required on every connection)",
                2,
            )?;
            let old = self::token("metadata_token", &old)?;
            if c.token.as_ref().is_some_and(|t| *t != old) {
                return Err(invalid("AgentConfig: token and metadata_token are both given, and differ"));
            }
            c.token = Some(old);
        }
        c.serve_metadata = flag("serve_metadata", serve_metadata, c.serve_metadata)?;
        c.validate().or_raise()?;
        Ok(PyAgentConfig { inner: c })
    }

    /// A copy with some settings changed (checked again).
    #[pyo3(signature = (**changes))]
    fn replace<'py>(&self, py: Python<'py>, changes: Option<&Bound<'py, PyDict>>) -> PyResult<Bound<'py, PyAny>> {
        let fields = self.fields(py)?;
        if let Some(changes) = changes {
            fields.update(changes.as_mapping())?;
        }
        py.get_type::<PyAgentConfig>().call((), Some(&fields))
    }

    /// Every setting by name, as the constructor takes them.
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let d = PyDict::new(py);
        d.set_item("listen", &c.listen)?;
        d.set_item("advertise", PyTuple::new(py, &c.advertise)?)?;
        d.set_item("transports", self.transports(py)?)?;
        d.set_item("require", c.require.map(TransportKind::as_str))?;
        d.set_item("tcp_streams", c.tcp.streams)?;
        d.set_item("tcp_chunk_size", c.tcp.chunk_size)?;
        d.set_item("tcp_window", c.tcp.window)?;
        d.set_item("tcp_local_addrs", self.tcp_local_addrs(py)?)?;
        d.set_item("tcp_zerocopy", c.tcp.zerocopy)?;
        d.set_item("tcp_pin", c.tcp.pin.spec())?;
        d.set_item("fabric_provider", &c.fabric.provider)?;
        d.set_item("fabric_domains", PyTuple::new(py, &c.fabric.domains)?)?;
        d.set_item("fabric_chunk_size", c.fabric.chunk_size)?;
        d.set_item("fabric_stage_remote_host", c.fabric.stage_remote_host)?;
        d.set_item("fabric_gpu_direct", c.fabric.gpu_direct)?;
        d.set_item("shm_threads", c.shm.threads)?;
        d.set_item("shm_inline_bytes", c.shm.inline_bytes)?;
        d.set_item("cuda_copy_engine_min_host", c.cuda.copy_engine_min_host)?;
        d.set_item("cuda_copy_engine_min_peer", c.cuda.copy_engine_min_peer)?;
        d.set_item("cuda_kernel_mode", c.cuda.kernel_shape.mode.as_str())?;
        d.set_item("cuda_kernel_threads", c.cuda.kernel_shape.threads)?;
        d.set_item("cuda_kernel_blocks_per_sm", c.cuda.kernel_shape.blocks_per_sm)?;
        d.set_item("cuda_kernel_item_bytes", c.cuda.kernel_item_bytes)?;
        d.set_item("cuda_completion", c.cuda.completion.as_str())?;
        d.set_item("peer_timeout", c.peer_timeout.as_secs_f64())?;
        d.set_item("connect_timeout", c.connect_timeout.as_secs_f64())?;
        d.set_item("token", c.token.as_deref().map(|t| PyBytes::new(py, t)))?;
        d.set_item("serve_metadata", c.serve_metadata)?;
        Ok(d)
    }

    /// Equal when every setting is.
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        match other.cast::<PyAgentConfig>() {
            Ok(other) => self.fields(py)?.eq(other.get().fields(py)?),
            Err(_) => Ok(false),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let fields = self.fields(py)?;
        let shown: Vec<String> = fields
            .iter()
            .map(|(k, v)| {
                // The token is a secret: its length only.
                let v = if k.to_string() == "token" && !v.is_none() {
                    format!("<{} bytes>", v.len().unwrap_or(0))
                } else {
                    v.repr().map(|r| r.to_string()).unwrap_or_default()
                };
                format!("{k}={v}")
            })
            .collect();
        Ok(format!("AgentConfig({})", shown.join(", ")))
    }

    #[getter]
    fn listen(&self) -> &str {
        &self.inner.listen
    }
    #[getter]
    fn advertise<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.inner.advertise)
    }
    #[getter]
    fn transports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.transports.iter().map(|t| t.as_str()))
    }
    #[getter]
    fn require(&self) -> Option<&'static str> {
        self.inner.require.map(TransportKind::as_str)
    }
    #[getter]
    fn tcp_streams(&self) -> usize {
        self.inner.tcp.streams
    }
    #[getter]
    fn tcp_chunk_size(&self) -> u64 {
        self.inner.tcp.chunk_size
    }
    #[getter]
    fn tcp_window(&self) -> usize {
        self.inner.tcp.window
    }
    #[getter]
    fn tcp_local_addrs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.tcp.local_addrs.iter().map(|a| a.to_string()))
    }
    #[getter]
    fn tcp_zerocopy(&self) -> bool {
        self.inner.tcp.zerocopy
    }
    #[getter]
    fn tcp_pin(&self) -> String {
        self.inner.tcp.pin.spec()
    }
    #[getter]
    fn fabric_provider(&self) -> Option<&str> {
        self.inner.fabric.provider.as_deref()
    }
    #[getter]
    fn fabric_domains<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.inner.fabric.domains)
    }
    #[getter]
    fn fabric_chunk_size(&self) -> u64 {
        self.inner.fabric.chunk_size
    }
    #[getter]
    fn fabric_stage_remote_host(&self) -> bool {
        self.inner.fabric.stage_remote_host
    }
    #[getter]
    fn fabric_gpu_direct(&self) -> bool {
        self.inner.fabric.gpu_direct
    }
    #[getter]
    fn shm_threads(&self) -> usize {
        self.inner.shm.threads
    }
    #[getter]
    fn shm_inline_bytes(&self) -> u64 {
        self.inner.shm.inline_bytes
    }
    #[getter]
    fn cuda_copy_engine_min_host(&self) -> u64 {
        self.inner.cuda.copy_engine_min_host
    }
    #[getter]
    fn cuda_copy_engine_min_peer(&self) -> u64 {
        self.inner.cuda.copy_engine_min_peer
    }
    #[getter]
    fn cuda_kernel_mode(&self) -> &'static str {
        self.inner.cuda.kernel_shape.mode.as_str()
    }
    #[getter]
    fn cuda_kernel_threads(&self) -> u32 {
        self.inner.cuda.kernel_shape.threads
    }
    #[getter]
    fn cuda_kernel_blocks_per_sm(&self) -> u32 {
        self.inner.cuda.kernel_shape.blocks_per_sm
    }
    #[getter]
    fn cuda_kernel_item_bytes(&self) -> u64 {
        self.inner.cuda.kernel_item_bytes
    }
    #[getter]
    fn cuda_completion(&self) -> &'static str {
        self.inner.cuda.completion.as_str()
    }
    #[getter]
    fn peer_timeout(&self) -> f64 {
        self.inner.peer_timeout.as_secs_f64()
    }
    #[getter]
    fn connect_timeout(&self) -> f64 {
        self.inner.connect_timeout.as_secs_f64()
    }
    #[getter]
    fn token<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.token.as_deref().map(|t| PyBytes::new(py, t))
    }
    #[getter]
    fn serve_metadata(&self) -> bool {
        self.inner.serve_metadata
    }
}

/// The configuration object for what `freight.Agent` was given: the `AgentConfig`
/// itself, one made from a dict of its settings, or the defaults for `None`.
pub(crate) fn config_from<'py>(
    py: Python<'py>,
    given: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAgentConfig>> {
    let class = py.get_type::<PyAgentConfig>();
    match given {
        None => Ok(class.call0()?.cast_into()?),
        Some(c) if c.is_none() => Ok(class.call0()?.cast_into()?),
        Some(c) => {
            if let Ok(cfg) = c.cast::<PyAgentConfig>() {
                return Ok(cfg.clone());
            }
            if let Ok(d) = c.cast::<PyDict>() {
                return Ok(class.call((), Some(d))?.cast_into()?);
            }
            Err(type_error("(the whole configuration)", "a freight.AgentConfig or a dict of its settings", c))
        }
    }
}
