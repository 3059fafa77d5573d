//! Brief polling before sleeping.
//!
//! Waking a sleeping thread costs tens of microseconds, as much as copying a few hundred
//! KiB, so completion waiters and copy threads look again for a short while before they
//! block. That only pays where other cores are free to do the work meanwhile: on small
//! machines the poller would steal the core of the thread it waits for, so there it
//! sleeps at once. Either way an idle agent burns nothing. The exception, [`spin`], is
//! for a wait that only the network ends (a small tcp message's answer): no thread of
//! this host needs the poller's core, and a wake-up costs as much as the round trip.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Hosts with at least this many cores poll before sleeping.
const MIN_CORES_TO_POLL: usize = 8;

/// Whether this host has cores to spare for polling.
pub fn polling_pays() -> bool {
    static PAYS: OnceLock<bool> = OnceLock::new();
    *PAYS.get_or_init(|| std::thread::available_parallelism().is_ok_and(|n| n.get() >= MIN_CORES_TO_POLL))
}

/// Calls `ready` until it yields something or `budget` passes (at once, on small hosts).
pub fn briefly<T>(budget: Duration, mut ready: impl FnMut() -> Option<T>) -> Option<T> {
    if let Some(v) = ready() {
        return Some(v);
    }
    if !polling_pays() {
        return None;
    }
    spin(budget, ready)
}

/// Calls `ready` until it yields something or `budget` passes, on any host: for a caller
/// that knows what it waits for is at most a round trip away, and that nothing it waits
/// for needs its core.
pub fn spin<T>(budget: Duration, mut ready: impl FnMut() -> Option<T>) -> Option<T> {
    if let Some(v) = ready() {
        return Some(v);
    }
    let until = Instant::now() + budget;
    while Instant::now() < until {
        std::hint::spin_loop();
        if let Some(v) = ready() {
            return Some(v);
        }
    }
    None
}
