//! Ctrl-C during a blocking call.
//!
//! A call that waits runs with the GIL released, where Python cannot run its signal
//! handlers. [`detach`] installs the engine's interrupt check (see
//! `freight_core::interrupt`) for the call: between the slices of its waits the check
//! takes the GIL and runs the pending handlers; an exception from one (Ctrl-C's
//! `KeyboardInterrupt`) stops the wait, and that exception is what the call raises.

use pyo3::prelude::*;

use crate::errors::{keep_raised, OrRaise};

/// Runs `f` with the GIL released and its waits interruptible by signal handlers.
pub(crate) fn detach<T: Send>(py: Python<'_>, f: impl FnOnce() -> freight_core::Result<T> + Send) -> PyResult<T> {
    keep_raised(None);
    py.detach(|| freight_core::interrupt::interruptible(signal_raised, f)).or_raise()
}

/// Runs the pending signal handlers; true when one raised (its exception is kept).
fn signal_raised() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            keep_raised(Some(e));
            true
        }
    })
}
