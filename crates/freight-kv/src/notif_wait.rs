//! Waiting for notifications on both ends of the data plane.
//!
//! A reply (or the next request of a busy client) is usually microseconds away, while
//! sleeping and being woken costs tens of microseconds and, between processes, a tcp
//! wake-up from the sender. So a waiter first polls the engine's notification rings,
//! yielding its core between looks (other threads of a small machine run meanwhile),
//! and sleeps only when nothing came for a while. While it polls, same-host senders do
//! not ring at all (see the engine's `wait_notifs`).
//!
//! Not the engine's `poll::briefly`, which spins and so polls only on hosts with cores
//! to spare: this waiter gives its core up between looks, so it polls on small hosts
//! too, where a KV client and the server often share two cores.

use std::time::{Duration, Instant};

use freight_core::{Agent, Notification};

/// How long a waiter polls before it sleeps: a few round trips of a small request.
pub const POLL_BEFORE_SLEEP: Duration = Duration::from_micros(300);

/// The notifications that arrive next: polled for up to [`POLL_BEFORE_SLEEP`], then
/// slept for up to `sleep` (empty if none came). Returns early, possibly empty, once
/// `woken` says so or the agent's [`freight_core::Waker`] is rung.
pub fn next_notifs(agent: &Agent, sleep: Duration, woken: impl Fn() -> bool) -> Vec<Notification> {
    let until = Instant::now() + POLL_BEFORE_SLEEP;
    loop {
        let got = agent.get_notifs();
        if !got.is_empty() || woken() {
            return got;
        }
        if Instant::now() >= until {
            return agent.wait_notifs(sleep);
        }
        std::thread::yield_now();
    }
}
