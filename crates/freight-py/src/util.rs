//! Small conversions shared by the bindings.

use std::time::Duration;

use pyo3::prelude::*;

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
