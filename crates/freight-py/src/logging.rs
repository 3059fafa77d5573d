//! Engine logs in a Python process. One tracing subscriber per process, installed with
//! the module, with two outlets:
//!
//! - Python's `logging` (through pyo3-log), by default: a record of target
//!   `freight_core::server` goes to the logger `freight_core.server`, so an application's
//!   handlers, formats and levels apply. Engine threads never take the GIL: they only
//!   queue the records Python's levels let through (pyo3-log's cached levels, read
//!   without the GIL); one thread of ours hands them to `logging`. A thread waiting for
//!   the GIL while it holds an engine lock could deadlock against Python code waiting
//!   for that lock.
//! - stderr, once `set_log_level` is called or `FREIGHT_LOG`/`RUST_LOG` is set: the
//!   command line's format and filters (`freight_cli::logs`), instead of `logging`.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use freight_cli::logs::{self, Format};
use log::Log;
use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter};

use crate::errors::invalid;

/// Records queued for Python's `logging` beyond which new ones are dropped (and counted):
/// an engine thread never waits for Python.
const QUEUE: usize = 4096;

/// The stderr outlet's filter: swaps in a new one (`Err` where the subscriber is gone).
type Reload = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;

struct Installed {
    reload: Reload,
    /// pyo3-log's level cache, reset when the application's levels change.
    levels: pyo3_log::ResetHandle,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();
static INSTALL: Mutex<()> = Mutex::new(());
/// Records go to stderr (a level was set there), not to `logging`.
static TO_STDERR: AtomicBool = AtomicBool::new(false);
/// Records queued for `logging` and not yet handed over.
static PENDING: AtomicU64 = AtomicU64::new(0);
/// The interpreter is exiting: records are no longer handed to Python (whose
/// interpreter may be gone by the time a late one arrives).
static CLOSED: AtomicBool = AtomicBool::new(false);

/// A record on its way to Python: level, target, message with its fields.
type Queued = (log::Level, String, String);

/// The outlet to Python's `logging`.
struct ToPython {
    logger: std::sync::Arc<pyo3_log::Logger>,
    queue: Sender<Queued>,
    dropped: std::sync::Arc<AtomicU64>,
}

fn log_level(level: &tracing::Level) -> log::Level {
    match *level {
        tracing::Level::ERROR => log::Level::Error,
        tracing::Level::WARN => log::Level::Warn,
        tracing::Level::INFO => log::Level::Info,
        tracing::Level::DEBUG => log::Level::Debug,
        tracing::Level::TRACE => log::Level::Trace,
    }
}

/// The message and then each field as ` key=value`.
#[derive(Default)]
struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let fields = std::mem::take(&mut self.0);
            let _ = write!(self.0, "{value:?}{fields}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let fields = std::mem::take(&mut self.0);
            self.0 = format!("{value}{fields}");
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for ToPython {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let mut message = Message::default();
        event.record(&mut message);
        let item = (log_level(meta.level()), meta.target().to_string(), message.0);
        PENDING.fetch_add(1, Ordering::Relaxed);
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.queue.try_send(item) {
            PENDING.fetch_sub(1, Ordering::Relaxed);
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Hands queued records to `logging`, on a thread of its own (the only one of ours that
/// takes the GIL for logs).
fn deliver(queue: Receiver<Queued>, logger: std::sync::Arc<pyo3_log::Logger>, dropped: std::sync::Arc<AtomicU64>) {
    let send = |level: log::Level, target: &str, message: &str| {
        logger.log(&log::Record::builder().level(level).target(target).args(format_args!("{message}")).build());
    };
    for (level, target, message) in queue {
        // SAFETY: Py_IsInitialized may be called without the GIL, at any time.
        if !CLOSED.load(Ordering::Acquire) && unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            send(level, &target, &message);
        }
        PENDING.fetch_sub(1, Ordering::Relaxed);
        let lost = dropped.swap(0, Ordering::Relaxed);
        if lost > 0 {
            send(
                log::Level::Warn,
                "freight",
                &format!("{lost} engine log records dropped: Python took them too slowly"),
            );
        }
    }
}

/// Installs the subscriber (once per process): records to `logging` until a level is
/// set for stderr.
pub fn install(py: Python<'_>) -> PyResult<()> {
    let _guard = INSTALL.lock().unwrap_or_else(PoisonError::into_inner);
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    let format = Format::from_env().map_err(invalid)?.unwrap_or_default();
    let logger = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels)?.filter(log::LevelFilter::Trace);
    let levels = logger.reset_handle();
    let logger = std::sync::Arc::new(logger);
    let (queue, taken) = bounded(QUEUE);
    let dropped = std::sync::Arc::new(AtomicU64::new(0));
    let (l, d) = (logger.clone(), dropped.clone());
    std::thread::Builder::new()
        .name("freight-logging".into())
        .spawn(move || deliver(taken, l, d))
        .map_err(|e| invalid(format!("cannot start the logging thread: {e}")))?;
    let stderr: Box<dyn Layer<_> + Send + Sync> = match format {
        Format::Text => Box::new(fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal())),
        Format::Json => Box::new(fmt::layer().json().with_writer(std::io::stderr).with_ansi(false)),
    };
    let (filter, handle) = reload::Layer::new(EnvFilter::new("off"));
    // Its own filter, asked for every record (Python's levels change): what it turns
    // away still reaches stderr where that outlet wants it.
    let to_python = ToPython { logger, queue, dropped };
    let wanted = to_python.logger.clone();
    let wanted = filter_fn(move |meta| {
        !TO_STDERR.load(Ordering::Relaxed)
            && wanted.enabled(&log::Metadata::builder().level(log_level(meta.level())).target(meta.target()).build())
    });
    tracing_subscriber::registry()
        .with(to_python.with_filter(wanted))
        .with(stderr.with_filter(filter))
        .try_init()
        .map_err(|e| invalid(format!("another tracing subscriber is already installed: {e}")))?;
    let reload: Reload = Box::new(move |f| handle.reload(f).map_err(|e| e.to_string()));
    let _ = INSTALLED.set(Installed { reload, levels });
    // Where a variable asks for stderr, records go there from the first one. A bad value
    // is reported when an agent is created (`_init_logging_from_env`), not by the import.
    if let Ok(Some((filter, _var))) = logs::filter_from_env() {
        to_stderr(filter)?;
    }
    Ok(())
}

fn to_stderr(filter: EnvFilter) -> PyResult<()> {
    let installed = INSTALLED.get().ok_or_else(|| invalid("engine logging is not installed"))?;
    (installed.reload)(filter).map_err(|e| invalid(format!("cannot change the log filter: {e}")))?;
    TO_STDERR.store(true, Ordering::Relaxed);
    Ok(())
}

/// Sends the engine's logs to stderr at `level` ("error", "warn", "info", "debug",
/// "trace", "off", or a tracing filter such as "freight_core=debug,info") instead of
/// Python's `logging`. With no level, uses $FREIGHT_LOG, else $RUST_LOG, else "info";
/// the format is $FREIGHT_LOG_FORMAT's (text by default). Later calls change the level.
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
    to_stderr(filter)
}

/// Sends the logs to stderr where $FREIGHT_LOG (else $RUST_LOG) is set (called when the
/// first agent is created). Returns whether it is; a bad level in the variable is an
/// error naming it.
#[pyfunction]
pub fn _init_logging_from_env() -> PyResult<bool> {
    if TO_STDERR.load(Ordering::Relaxed) {
        return Ok(true);
    }
    match logs::filter_from_env().map_err(invalid)? {
        Some((filter, _var)) => to_stderr(filter).map(|_| true),
        None => Ok(false),
    }
}

/// Reads Python's logger levels again: records of a level an application switched on
/// after the engine first logged pass from now on (pyo3-log keeps each logger's level
/// once read, so that engine threads need no GIL to ask it).
#[pyfunction]
pub fn reload_log_levels() -> PyResult<()> {
    if let Some(installed) = INSTALLED.get() {
        installed.levels.reset();
    }
    Ok(())
}

/// Waits (up to `timeout` seconds, without the GIL) until every record queued for
/// `logging` has been handed over. At interpreter exit (`last`), so that the last
/// records (an agent closing) are not lost; later ones are then dropped.
#[pyfunction]
#[pyo3(signature = (timeout = 1.0, last = false))]
pub fn _flush_logs(py: Python<'_>, timeout: f64, last: bool) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
    py.detach(|| {
        while PENDING.load(Ordering::Relaxed) > 0 && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    if last {
        CLOSED.store(true, Ordering::Release);
    }
}
