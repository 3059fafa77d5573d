//! Small conversions shared by the bindings.

use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyMemoryView, PyString};

use crate::errors::invalid;

pub(crate) use freight_core::interrupt::FOREVER;

/// Seconds (finite, >= 0) as a Duration, at most [`FOREVER`] (a caller's `1e19` means
/// "forever", not a deadline past what the clock holds); `what` names the argument in
/// errors.
pub(crate) fn seconds(secs: f64, what: &str) -> PyResult<Duration> {
    if !secs.is_finite() || secs < 0.0 {
        return Err(invalid(format!("{what} must be a finite number of seconds >= 0, got {secs}")));
    }
    if secs >= FOREVER.as_secs_f64() {
        return Ok(FOREVER);
    }
    Duration::try_from_secs_f64(secs).map_err(|e| invalid(format!("{what}: {e}")))
}

/// An optional timeout in seconds: None or +inf mean no limit.
pub(crate) fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t == f64::INFINITY => Ok(None),
        Some(t) => seconds(t, "timeout").map(Some),
    }
}

/// The bytes of a bytes, bytearray or memoryview argument; `TypeError` naming `what`
/// for anything else.
pub(crate) fn bytes_like(what: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(b) = v.cast::<PyByteArray>() {
        return Ok(b.to_vec());
    }
    if v.is_instance_of::<PyMemoryView>() {
        return Ok(v.call_method0("tobytes")?.cast::<PyBytes>()?.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!("{what} must be bytes, bytearray or memoryview, got {}", type_name(v))))
}

/// [`bytes_like`], or a str taken as UTF-8.
pub(crate) fn bytes_or_str(what: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(s.to_cow()?.as_bytes().to_vec());
    }
    bytes_like(what, v).map_err(|_| PyTypeError::new_err(format!("{what} must be str or bytes, got {}", type_name(v))))
}

/// A positive int argument (a bool is no count): `TypeError`, or
/// `InvalidArgumentError` for zero and below, naming `what`.
pub(crate) fn positive_int(what: &str, v: &Bound<'_, PyAny>) -> PyResult<usize> {
    let n: i128 = match v.extract() {
        Ok(n) if !v.is_instance_of::<PyBool>() => n,
        _ => return Err(PyTypeError::new_err(format!("{what} must be an int, got {}", type_name(v)))),
    };
    usize::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| invalid(format!("{what} must be positive, got {n}")))
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "an object".into())
}
