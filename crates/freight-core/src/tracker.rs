//! Completion tracking for one request, shared by the thread that posts it and the
//! transport threads that finish its parts: the round's bookkeeping is
//! [`freight_proto::round`]'s; this adds the lock around it, waiting (brief polling,
//! then a condition variable), the hooks that run once a round settles, and its timing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use freight_proto::error::{Error, Result};
pub use freight_proto::round::Status;
use freight_proto::round::{Finishing, Round};

/// Runs once when every part has reported; its error (e.g. a notification that could not
/// be sent) turns a successful transfer into an error.
pub type Finisher = Box<dyn FnOnce(Result<()>) -> Result<()> + Send>;

/// Runs once the round's status is final (see [`Tracker::on_settled`]).
pub type SettledHook = Box<dyn FnOnce() + Send>;

struct State {
    round: Round<Finisher>,
    on_settled: Option<SettledHook>,
    /// When the current round began and when it became final.
    began: Option<Instant>,
    ended: Option<Instant>,
}

/// How long `wait` polls before it sleeps (see [`crate::poll`]): copies of a few hundred
/// KiB finish within it.
const WAIT_POLL: Duration = Duration::from_micros(50);

/// How long `wait` polls, on any host, for a round whose transport said it would be
/// over within a round trip ([`Tracker::answer_due`]): a loopback round trip took 35 to
/// 60 us on a 2-vCPU VM, and a sleeping waiter's wake-up as long again.
const DUE_POLL: Duration = Duration::from_micros(100);

/// Completion tracking for one request, shared by the poster and the transport.
pub struct Tracker {
    state: Mutex<State>,
    cv: Condvar,
    /// Mirrors "status is not Pending", for polling without the lock.
    settled: AtomicBool,
    /// The current round's answer is due within a round trip: `wait` polls for it.
    due: AtomicBool,
}

impl Default for Tracker {
    fn default() -> Self {
        Self::new()
    }
}

impl Tracker {
    pub fn new() -> Self {
        Tracker {
            state: Mutex::new(State { round: Round::default(), on_settled: None, began: None, ended: None }),
            cv: Condvar::new(),
            settled: AtomicBool::new(true),
            due: AtomicBool::new(false),
        }
    }

    /// Says that the current round will be over within a network round trip (a small
    /// message already on the wire to an idle stream), which `wait` then polls for even
    /// on hosts where polling does not pay: the poller leaves the other cores to the
    /// threads that answer, and a wake-up would cost as much as the round trip itself.
    pub fn answer_due(&self) {
        self.due.store(true, Ordering::Relaxed);
    }

    /// Starts a round of `parts` parts. Fails while a previous round is still pending.
    pub fn begin(&self, parts: u64, finisher: Finisher) -> Result<()> {
        let mut st = self.state.lock();
        st.round.begin(parts, finisher)?;
        st.began = Some(Instant::now());
        st.ended = None;
        self.due.store(false, Ordering::Relaxed);
        self.settled.store(false, Ordering::Release);
        Ok(())
    }

    /// Reports one part. The call that reports the last part runs the finisher.
    pub fn finish_part(&self, result: Result<()>) {
        self.finish_parts(1, result)
    }

    /// Reports `n` parts at once (a transport that fails a whole batch).
    pub fn finish_parts(&self, n: u64, result: Result<()>) {
        let finishing = self.state.lock().round.report(n, result);
        if let Some(finishing) = finishing {
            self.finish(finishing);
        }
    }

    /// Fails a round that could not be started at all (nothing was sent).
    pub fn fail_unstarted(&self, e: Error) {
        let Finishing { finisher, outcome } = self.state.lock().round.abort(e.clone());
        // The finisher releases what the round held; the round fails, with the
        // finisher's own error where it has one.
        self.settle(match finisher {
            Some(f) => f(outcome).and(Err(e)),
            None => outcome,
        });
    }

    /// Runs the finisher (it may do I/O, such as sending a notification: outside the
    /// lock), then settles the round with its result.
    fn finish(&self, Finishing { finisher, outcome }: Finishing<Finisher>) {
        let outcome = match finisher {
            Some(f) => f(outcome),
            None => outcome,
        };
        self.settle(outcome);
    }

    /// Makes the round final, wakes its waiters, then runs its hook.
    fn settle(&self, outcome: Result<()>) {
        let hook = {
            let mut st = self.state.lock();
            st.round.settle(outcome);
            st.ended = Some(Instant::now());
            self.settled.store(true, Ordering::Release);
            self.cv.notify_all();
            st.on_settled.take()
        };
        if let Some(hook) = hook {
            hook();
        }
    }

    /// Runs `hook` once the current round is final: on the settling thread, or at once
    /// on this one where the round already is (so no completion slips between posting
    /// and setting the hook). A round that is never posted never runs it. Hooks set
    /// for one round all run, in the order they were set.
    pub fn on_settled(&self, hook: SettledHook) {
        {
            let mut st = self.state.lock();
            if !st.round.status().is_final() {
                st.on_settled = Some(match st.on_settled.take() {
                    Some(first) => Box::new(move || {
                        first();
                        hook();
                    }),
                    None => hook,
                });
                return;
            }
        }
        hook();
    }

    pub fn status(&self) -> Status {
        self.state.lock().round.status().clone()
    }

    /// How long the last round took, from its start to its status becoming final
    /// (`None` while it is pending, or before the first round).
    pub fn duration(&self) -> Option<Duration> {
        let st = self.state.lock();
        Some(st.ended?.saturating_duration_since(st.began?))
    }

    /// Blocks until the round is final or `timeout` passes (then returns `Pending`).
    pub fn wait(&self, timeout: Option<Duration>) -> Status {
        let deadline = timeout.map(|t| Instant::now() + t);
        let settled = || self.settled.load(Ordering::Acquire).then_some(());
        if self.due.load(Ordering::Relaxed) {
            freight_host::poll::spin(timeout.map_or(DUE_POLL, |t| t.min(DUE_POLL)), settled);
        } else {
            freight_host::poll::briefly(timeout.map_or(WAIT_POLL, |t| t.min(WAIT_POLL)), settled);
        }
        let mut st = self.state.lock();
        while *st.round.status() == Status::Pending {
            match deadline {
                Some(d) => {
                    if self.cv.wait_until(&mut st, d).timed_out() {
                        break;
                    }
                }
                None => self.cv.wait(&mut st),
            }
        }
        st.round.status().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn counting() -> (Arc<AtomicUsize>, Finisher) {
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        (
            n,
            Box::new(move |r| {
                m.fetch_add(1, Ordering::SeqCst);
                r
            }),
        )
    }

    #[test]
    fn the_settled_hook_runs_once_after_the_status_is_final() {
        let t = Arc::new(Tracker::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let hook = |t: &Arc<Tracker>, runs: &Arc<AtomicUsize>| {
            let (t2, runs) = (t.clone(), runs.clone());
            Box::new(move || {
                assert!(t2.status().is_final(), "the hook ran before the status was final");
                runs.fetch_add(1, Ordering::SeqCst);
            }) as SettledHook
        };
        t.begin(2, Box::new(|r| r)).unwrap();
        // Two hooks for one round: both run.
        t.on_settled(hook(&t, &runs));
        t.on_settled(hook(&t, &runs));
        t.finish_part(Ok(()));
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        t.finish_part(Err(Error::Io("lost".into())));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        t.finish_part(Ok(()));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        // Set after the round settled: runs at once.
        t.on_settled(hook(&t, &runs));
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_rounds_duration_runs_from_its_start_to_its_end_and_is_none_meanwhile() {
        let t = Tracker::new();
        assert_eq!(t.duration(), None);
        t.begin(1, Box::new(|r| r)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(t.duration(), None, "pending");
        t.finish_part(Ok(()));
        let first = t.duration().unwrap();
        assert!(first >= Duration::from_millis(20) && first < Duration::from_secs(5), "{first:?}");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(t.duration(), Some(first), "the clock stops when the round ends");
        // A new round starts its own clock.
        t.begin(1, Box::new(|r| r)).unwrap();
        assert_eq!(t.duration(), None);
        t.finish_part(Err(Error::Io("lost".into())));
        assert!(t.duration().unwrap() < first);
    }

    #[test]
    fn finisher_error_fails_the_request() {
        let t = Tracker::new();
        t.begin(1, Box::new(|_| Err(Error::Io("notify failed".into())))).unwrap();
        t.finish_part(Ok(()));
        assert!(matches!(t.status(), Status::Error(Error::Io(_))));
    }

    /// A round whose answer is due is polled for, then slept on like any other: it is
    /// seen whether it ends within the poll or long after; the next round starts
    /// without the mark.
    #[test]
    fn a_due_answer_is_polled_for_then_slept_on() {
        let t = Arc::new(Tracker::new());
        for late in [Duration::ZERO, Duration::from_millis(30)] {
            let (_, f) = counting();
            t.begin(1, f).unwrap();
            assert!(!t.due.load(Ordering::Relaxed), "a new round starts without the mark");
            t.answer_due();
            let t2 = t.clone();
            let h = std::thread::spawn(move || {
                std::thread::sleep(late);
                t2.finish_part(Ok(()));
            });
            assert_eq!(t.wait(Some(Duration::from_secs(10))), Status::Done);
            h.join().unwrap();
        }
        let (_, f) = counting();
        t.begin(1, f).unwrap();
        t.answer_due();
        assert_eq!(t.wait(Some(Duration::from_millis(5))), Status::Pending, "polling gives up at the timeout");
    }

    #[test]
    fn wait_times_out_and_wakes() {
        let t = Arc::new(Tracker::new());
        let (_, f) = counting();
        t.begin(1, f).unwrap();
        assert_eq!(t.wait(Some(Duration::from_millis(20))), Status::Pending);
        let t2 = t.clone();
        let h = std::thread::spawn(move || t2.wait(Some(Duration::from_secs(10))));
        std::thread::sleep(Duration::from_millis(10));
        t.finish_part(Ok(()));
        assert_eq!(h.join().unwrap(), Status::Done);
    }
}
