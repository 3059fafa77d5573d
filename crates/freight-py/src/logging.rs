//! Engine logs: a tracing-subscriber fmt subscriber writing to stderr, installed once per
//! process; later calls only change its filter.

use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock, PoisonError};

use freight_core::Error;
use pyo3::prelude::*;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter, Registry};

use crate::errors::{invalid, to_py_err};

/// Environment variable read when no level is given.
const ENV: &str = "FREIGHT_LOG";

static HANDLE: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();
static INSTALL: Mutex<()> = Mutex::new(());

fn apply(spec: &str) -> PyResult<()> {
    let filter = EnvFilter::try_new(spec).map_err(|e| invalid(format!("bad log level or filter '{spec}': {e}")))?;
    let _guard = INSTALL.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(h) = HANDLE.get() {
        return h
            .reload(filter)
            .map_err(|e| to_py_err(Error::InvalidState(format!("cannot change the log filter: {e}"))));
    }
    let (layer, handle) = reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(layer)
        .with(fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()))
        .try_init()
        .map_err(|e| to_py_err(Error::InvalidState(format!("another tracing subscriber is already installed: {e}"))))?;
    let _ = HANDLE.set(handle);
    Ok(())
}

/// Sends the engine's logs to stderr at `level` ("error", "warn", "info", "debug",
/// "trace", "off", or a tracing filter such as "freight_core=debug,info"). With no
/// level, uses $FREIGHT_LOG, else "info". The first call installs the subscriber; later
/// calls change its level.
#[pyfunction]
#[pyo3(signature = (level = None))]
pub fn set_log_level(level: Option<String>) -> PyResult<()> {
    let spec =
        level.or_else(|| std::env::var(ENV).ok().filter(|s| !s.trim().is_empty())).unwrap_or_else(|| "info".into());
    apply(&spec)
}

/// Installs the subscriber from $FREIGHT_LOG if that is set and nothing is installed yet
/// (called when the first agent is created). Returns whether logging is configured.
#[pyfunction]
pub fn _init_logging_from_env() -> PyResult<bool> {
    if HANDLE.get().is_some() {
        return Ok(true);
    }
    match std::env::var(ENV) {
        Ok(spec) if !spec.trim().is_empty() => apply(&spec).map(|_| true),
        _ => Ok(false),
    }
}
