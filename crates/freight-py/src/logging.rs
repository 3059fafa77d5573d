//! Engine logs: a tracing-subscriber fmt subscriber writing to stderr, installed once per
//! process; later calls only change its filter. Levels, filters, the variables read and
//! the formats are the command line's (`freight_cli::logs`).

use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock, PoisonError};

use freight_cli::logs::{self, Format};
use freight_core::Error;
use pyo3::prelude::*;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter, Registry};

use crate::errors::{invalid, to_py_err};

static HANDLE: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();
static INSTALL: Mutex<()> = Mutex::new(());

fn apply(filter: EnvFilter) -> PyResult<()> {
    let _guard = INSTALL.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(h) = HANDLE.get() {
        return h
            .reload(filter)
            .map_err(|e| to_py_err(Error::InvalidState(format!("cannot change the log filter: {e}"))));
    }
    // The format is read once, with the subscriber; FREIGHT_LOG_FORMAT=json for a log
    // collector.
    let format = Format::from_env().map_err(invalid)?.unwrap_or_default();
    let (layer, handle) = reload::Layer::new(filter);
    let text = (format == Format::Text)
        .then(|| fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()));
    let json = (format == Format::Json).then(|| fmt::layer().json().with_writer(std::io::stderr).with_ansi(false));
    tracing_subscriber::registry()
        .with(layer)
        .with(text)
        .with(json)
        .try_init()
        .map_err(|e| to_py_err(Error::InvalidState(format!("another tracing subscriber is already installed: {e}"))))?;
    let _ = HANDLE.set(handle);
    Ok(())
}

/// Sends the engine's logs to stderr at `level` ("error", "warn", "info", "debug",
/// "trace", "off", or a tracing filter such as "freight_core=debug,info"). With no
/// level, uses $FREIGHT_LOG, else $RUST_LOG, else "info". The first call installs the
/// subscriber (in the format $FREIGHT_LOG_FORMAT names, text by default); later calls
/// change its level.
#[pyfunction]
#[pyo3(signature = (level = None))]
pub fn set_log_level(level: Option<String>) -> PyResult<()> {
    let filter = match level {
        Some(spec) => logs::filter(&spec).map_err(invalid)?,
        None => match logs::filter_from_env().map_err(invalid)? {
            Some((filter, _var)) => filter,
            None => EnvFilter::new("info"),
        },
    };
    apply(filter)
}

/// Installs the subscriber from $FREIGHT_LOG (else $RUST_LOG) if one is set and nothing
/// is installed yet (called when the first agent is created). Returns whether logging
/// is configured; a bad level in the variable is an error naming it.
#[pyfunction]
pub fn _init_logging_from_env() -> PyResult<bool> {
    if HANDLE.get().is_some() {
        return Ok(true);
    }
    match logs::filter_from_env().map_err(invalid)? {
        Some((filter, _var)) => apply(filter).map(|_| true),
        None => Ok(false),
    }
}
