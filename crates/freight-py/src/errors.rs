//! The one mapping from engine errors to Python exceptions.
//!
//! The exception classes live in `freight/errors.py` (several of them inherit from two
//! bases, e.g. `UnknownPeerError(FreightError, KeyError)`, which `create_exception!`
//! cannot express); this module looks them up once and instantiates them with the
//! engine's message plus structured attributes (`peer`, `key`, `addr`, ...).

use std::cell::RefCell;

use freight_core::Error;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::IntoPyObjectExt;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// Result of an engine call, convertible into a Python result.
pub(crate) trait OrRaise<T> {
    /// Converts an engine error into the matching `freight` exception.
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for freight_core::Result<T> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(to_py_err)
    }
}

/// An `InvalidArgumentError` raised by the binding itself (bad input caught before the
/// engine sees it).
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    to_py_err(Error::InvalidArgument(msg.into()))
}

/// Converts an engine error into an instance of the matching `freight` exception.
pub(crate) fn to_py_err(e: Error) -> PyErr {
    Python::attach(|py| build(py, e).unwrap_or_else(|lookup_failure| lookup_failure))
}

/// The exception class name and extra attributes for every engine error. The match is
/// exhaustive on purpose: a new engine variant must be mapped before this compiles.
fn build(py: Python<'_>, e: Error) -> PyResult<PyErr> {
    let msg = e.to_string();
    let mut attrs: Vec<(&str, Bound<'_, PyAny>)> = Vec::new();
    let name = match e {
        Error::InvalidArgument(_) => "InvalidArgumentError",
        Error::NotRegistered { kind, addr, len, dev } => {
            attrs.push(("kind", kind.into_bound_py_any(py)?));
            attrs.push(("addr", addr.into_bound_py_any(py)?));
            attrs.push(("length", len.into_bound_py_any(py)?));
            attrs.push(("device", dev.into_bound_py_any(py)?));
            "NotRegisteredError"
        }
        Error::OutOfBounds { addr, len, region_addr, region_len } => {
            attrs.push(("addr", addr.into_bound_py_any(py)?));
            attrs.push(("length", len.into_bound_py_any(py)?));
            attrs.push(("region_addr", region_addr.into_bound_py_any(py)?));
            attrs.push(("region_length", region_len.into_bound_py_any(py)?));
            "OutOfBoundsError"
        }
        Error::Overlap { addr, len, existing } => {
            attrs.push(("addr", addr.into_bound_py_any(py)?));
            attrs.push(("length", len.into_bound_py_any(py)?));
            attrs.push(("existing", existing.into_bound_py_any(py)?));
            "OverlapError"
        }
        Error::RegionBusy { key, users } => {
            attrs.push(("key", key.into_bound_py_any(py)?));
            attrs.push(("users", users.into_bound_py_any(py)?));
            "RegionBusyError"
        }
        Error::UnknownRegion(key) => {
            attrs.push(("key", key.into_bound_py_any(py)?));
            "UnknownRegionError"
        }
        Error::UnknownPeer(peer) => {
            attrs.push(("peer", peer.into_bound_py_any(py)?));
            "UnknownPeerError"
        }
        Error::TransportUnavailable(_) => "TransportUnavailableError",
        Error::Metadata(_) => "MetadataError",
        Error::Protocol(_) => "ProtocolError",
        Error::Auth(_) => "AuthError",
        Error::RemoteRejected { peer, reason } => {
            attrs.push(("peer", peer.into_bound_py_any(py)?));
            attrs.push(("reason", reason.into_bound_py_any(py)?));
            "RemoteRejectedError"
        }
        Error::PeerDisconnected { peer, reason } => {
            attrs.push(("peer", peer.into_bound_py_any(py)?));
            attrs.push(("reason", reason.into_bound_py_any(py)?));
            "PeerDisconnectedError"
        }
        Error::Timeout(_) => "TimeoutError",
        Error::Interrupted(_) => return Ok(raised(msg)),
        Error::InvalidState(_) => "InvalidStateError",
        Error::Io(_) => "IoError",
        Error::NoSpace(_) => "NoSpaceError",
        Error::Etcd(_) => "EtcdError",
        Error::Cuda { .. } => "CudaError",
    };
    let module = ERRORS_MODULE.get_or_try_init(py, || py.import("freight.errors").map(Bound::unbind))?;
    let exc = module.bind(py).getattr(name)?.call1((msg,))?;
    for (k, v) in attrs {
        exc.setattr(k, v)?;
    }
    Ok(PyErr::from_value(exc))
}

thread_local! {
    /// What a signal handler raised during this thread's current call (see
    /// [`crate::interrupt`]): the exception an interrupted wait raises.
    static RAISED: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// Keeps what a signal handler raised during this thread's call (`None`: forgets it,
/// as a new call starts).
pub(crate) fn keep_raised(e: Option<PyErr>) {
    RAISED.with(|r| *r.borrow_mut() = e);
}

/// The exception an interrupted wait raises: the signal handler's, or a plain
/// `KeyboardInterrupt` when the check that stopped it was not ours.
pub(crate) fn raised(msg: String) -> PyErr {
    RAISED.with(|r| r.borrow_mut().take()).unwrap_or_else(|| PyKeyboardInterrupt::new_err(msg))
}
