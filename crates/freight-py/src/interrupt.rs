//! Ctrl-C during a blocking call.
//!
//! A call that waits runs with the GIL released, where Python cannot run its signal
//! handlers. [`detach`] installs the engine's interrupt check (see
//! `freight_core::interrupt`) for the call: between the slices of its waits the check
//! takes the GIL and runs the pending handlers; an exception from one (Ctrl-C's
//! `KeyboardInterrupt`) stops the wait, and that exception is what the call raises.

use std::cell::RefCell;

use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;

use crate::errors::OrRaise;

thread_local! {
    /// What a signal handler raised during this thread's current call.
    static RAISED: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// Runs `f` with the GIL released and its waits interruptible by signal handlers.
pub(crate) fn detach<T: Send>(py: Python<'_>, f: impl FnOnce() -> freight_core::Result<T> + Send) -> PyResult<T> {
    RAISED.with(|r| r.borrow_mut().take());
    py.detach(|| freight_core::interrupt::interruptible(signal_raised, f)).or_raise()
}

/// Runs the pending signal handlers; true when one raised (its exception is kept).
fn signal_raised() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            RAISED.with(|r| *r.borrow_mut() = Some(e));
            true
        }
    })
}

/// The exception an interrupted wait raises: the signal handler's, or a plain
/// `KeyboardInterrupt` when the check that stopped it was not ours.
pub(crate) fn raised(msg: String) -> PyErr {
    RAISED.with(|r| r.borrow_mut().take()).unwrap_or_else(|| PyKeyboardInterrupt::new_err(msg))
}
