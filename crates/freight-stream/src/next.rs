//! What a bounded wait for the next item of a stream came to.

use freight_core::{Error, Result};

/// The outcome of waiting a while for a stream's next item. Unlike a timeout error,
/// which may come from deep inside (a credit the other end did not take in time),
/// `NotYet` says that the wait ran out having taken and changed nothing: waiting again
/// is always right.
#[derive(Debug)]
pub enum Next<T> {
    Item(T),
    /// The stream ended: every sender closed it and everything was handed out.
    End,
    NotYet,
}

impl<T> Next<T> {
    /// The shape of `recv`: the item, `None` at the end, and the error `timed_out`
    /// makes when nothing came.
    pub fn or_timeout(self, timed_out: impl FnOnce() -> Error) -> Result<Option<T>> {
        match self {
            Next::Item(t) => Ok(Some(t)),
            Next::End => Ok(None),
            Next::NotYet => Err(timed_out()),
        }
    }
}
