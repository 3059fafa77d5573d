//! Letting the caller stop a long wait.
//!
//! A host language installs a check around a blocking call ([`interruptible`]): Python
//! does, so that Ctrl-C stops a `send` waiting for room instead of being noticed only
//! when the wait times out. Waits that can last call [`check`] between their slices;
//! when the check says stop they return [`Error::Interrupted`] and leave what they were
//! waiting on as it was (a message not received stays due, a slot not taken stays free),
//! so the caller may call again.
//!
//! The check belongs to the thread that installed it: the engine's own threads never
//! see it, and a wait on them is not stopped.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use freight_proto::error::{Error, Result};

/// "No limit" for a wait: a century, short enough to add to an `Instant`. A caller's
/// longer wait is taken for one of this long ([`deadline_after`]).
pub const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The instant `wait` from now. A caller's wait is any `Duration`, and adding one past
/// what the clock holds would panic: such a wait ends after [`FOREVER`].
pub fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait).unwrap_or_else(|| now + FOREVER)
}

thread_local! {
    static CHECK: RefCell<Option<Rc<dyn Fn() -> bool>>> = const { RefCell::new(None) };
}

/// Runs `f` with `stop` as this thread's interrupt check: waits inside `f` that call
/// [`check`] end with [`Error::Interrupted`] once `stop` returns true. The previous
/// check (if any) is back when `f` returns or unwinds.
pub fn interruptible<R>(stop: impl Fn() -> bool + 'static, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Rc<dyn Fn() -> bool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CHECK.with(|c| *c.borrow_mut() = previous);
        }
    }
    let previous = CHECK.with(|c| c.borrow_mut().replace(Rc::new(stop)));
    let _restore = Restore(previous);
    f()
}

/// Fails with [`Error::Interrupted`] when this thread's interrupt check says stop.
/// Without a check installed it always passes.
pub fn check() -> Result<()> {
    // The check runs outside the borrow: it may itself run code that waits.
    let stop = CHECK.with(|c| c.borrow().clone());
    match stop {
        Some(stop) if stop() => Err(Error::Interrupted("the caller stopped the wait".into())),
        _ => Ok(()),
    }
}

/// The longest a wait goes without looking at the interrupt check.
pub const SLICE: Duration = Duration::from_millis(100);

/// Waits until `deadline` in slices of at most [`SLICE`]: `attempt(slice)` waits up to
/// `slice` and returns what it got, if anything. Between slices the interrupt check
/// runs. `attempt` runs at least once, even past the deadline (a zero wait polls);
/// `Ok(None)` when the deadline passed with nothing got.
pub fn until<T>(deadline: Instant, mut attempt: impl FnMut(Duration) -> Result<Option<T>>) -> Result<Option<T>> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(got) = attempt(left.min(SLICE))? {
            return Ok(Some(got));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        check()?;
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn a_wait_past_what_the_clock_holds_is_a_long_wait_not_a_panic() {
        let far = deadline_after(Duration::MAX);
        assert!(far > Instant::now() + Duration::from_secs(50 * 365 * 24 * 3600));
        let near = deadline_after(Duration::from_millis(10));
        assert!(near <= Instant::now() + Duration::from_millis(10));
    }

    #[test]
    fn without_a_check_nothing_interrupts() {
        assert!(check().is_ok());
    }

    #[test]
    fn the_check_decides_and_is_gone_afterwards() {
        let calls = Rc::new(Cell::new(0));
        let seen = calls.clone();
        let out = interruptible(
            move || {
                seen.set(seen.get() + 1);
                seen.get() >= 2
            },
            || (check().is_ok(), check().is_err()),
        );
        assert_eq!(out, (true, true));
        assert_eq!(calls.get(), 2);
        assert!(check().is_ok(), "the check outlived its call");
    }

    #[test]
    fn nested_checks_restore_the_outer_one() {
        interruptible(
            || true,
            || {
                interruptible(|| false, || assert!(check().is_ok()));
                assert!(matches!(check(), Err(Error::Interrupted(_))));
            },
        );
    }

    #[test]
    fn a_wait_polls_once_past_its_deadline() {
        let mut attempts = Vec::new();
        let got = until(Instant::now(), |slice| {
            attempts.push(slice);
            Ok(None::<()>)
        });
        assert!(matches!(got, Ok(None)));
        assert_eq!(attempts, vec![Duration::ZERO]);
    }

    #[test]
    fn a_wait_stops_between_slices_when_interrupted() {
        let started = Instant::now();
        let mut attempts = 0;
        let got = interruptible(
            || true,
            || {
                until(started + Duration::from_secs(60), |slice| {
                    attempts += 1;
                    std::thread::sleep(slice.min(Duration::from_millis(1)));
                    Ok(None::<()>)
                })
            },
        );
        assert!(matches!(got, Err(Error::Interrupted(_))));
        assert_eq!(attempts, 1);
    }

    #[test]
    fn a_wait_returns_what_it_got() {
        let mut n = 0;
        let got = until(Instant::now() + Duration::from_secs(60), |_| {
            n += 1;
            Ok((n == 3).then_some(n))
        });
        assert_eq!(got.unwrap(), Some(3));
    }

    #[test]
    fn another_thread_does_not_see_the_check() {
        interruptible(|| true, || std::thread::spawn(|| assert!(check().is_ok())).join().unwrap());
    }
}
