//! One round of a transfer request, from its post until every part has reported:
//! bookkeeping only, without locks, threads or clocks. The engine's `Tracker` keeps a
//! [`Round`] under its lock and adds waiting, hooks and timing.
//!
//! A posted request is split by its transport into parts (chunks, copy pieces). Each
//! part reports success or failure exactly once. When the last one has, the round's
//! finisher runs (it releases region guards and sends the notification: I/O, so the
//! caller runs it outside its lock), and only then is the round settled: DONE, or
//! ERROR with the first error a part reported (or the finisher's). A waiter that sees
//! DONE may at once reuse or deregister the memory.
//!
//! Invariants (tested below):
//! - a round settles once, after every part reported and after its finisher ran;
//! - the first error reported wins; reports after the round settled change nothing;
//! - a round cannot begin while one is pending, nor with no part.

use crate::error::{Error, Result};

/// Where a request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Created, never posted.
    Idle,
    Pending,
    Done,
    Error(Error),
}

impl Status {
    pub fn is_final(&self) -> bool {
        matches!(self, Status::Done | Status::Error(_))
    }
}

/// The parts of one round and its finisher `F`, run once the last part reported.
#[derive(Debug)]
pub struct Round<F> {
    status: Status,
    remaining: u64,
    first_error: Option<Error>,
    finisher: Option<F>,
}

/// What the caller does when the last part reported: run `finisher` (if the round had
/// one) with `outcome`, the transfer's result, then [`Round::settle`] with what it gave.
#[derive(Debug)]
pub struct Finishing<F> {
    pub finisher: Option<F>,
    pub outcome: Result<()>,
}

impl<F> Default for Round<F> {
    fn default() -> Self {
        Round { status: Status::Idle, remaining: 0, first_error: None, finisher: None }
    }
}

impl<F> Round<F> {
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// Starts a round of `parts` parts. Fails while a previous round is still pending.
    pub fn begin(&mut self, parts: u64, finisher: F) -> Result<()> {
        if self.status == Status::Pending {
            return Err(Error::InvalidState("request is still pending; wait for it before posting again".into()));
        }
        if parts == 0 {
            return Err(Error::InvalidState("a round needs at least one part".into()));
        }
        self.status = Status::Pending;
        self.remaining = parts;
        self.first_error = None;
        self.finisher = Some(finisher);
        Ok(())
    }

    /// Reports `n` parts (a transport that fails a whole batch reports them at once).
    /// `Some` when these were the last: the caller finishes the round.
    pub fn report(&mut self, n: u64, result: Result<()>) -> Option<Finishing<F>> {
        if self.status != Status::Pending || n == 0 || self.remaining == 0 {
            return None;
        }
        if let Err(e) = result {
            self.first_error.get_or_insert(e);
        }
        self.remaining = self.remaining.saturating_sub(n);
        if self.remaining > 0 {
            return None;
        }
        let outcome = self.first_error.clone().map_or(Ok(()), Err);
        Some(Finishing { finisher: self.finisher.take(), outcome })
    }

    /// Fails a round that could not be started at all (no part was handed out): the
    /// caller runs the finisher, if any, with `e`, and settles with `e`.
    pub fn abort(&mut self, e: Error) -> Finishing<F> {
        self.remaining = 0;
        Finishing { finisher: self.finisher.take(), outcome: Err(e) }
    }

    /// Makes the round final with what its finishing gave.
    pub fn settle(&mut self, outcome: Result<()>) {
        self.status = match outcome {
            Ok(()) => Status::Done,
            Err(e) => Status::Error(e),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports like a part would; finishes the round as the engine does when told to.
    fn report(round: &mut Round<&'static str>, result: Result<()>) -> Option<&'static str> {
        let Finishing { finisher, outcome } = round.report(1, result)?;
        round.settle(outcome);
        finisher
    }

    #[test]
    fn done_only_after_every_part_and_the_finisher_comes_out_once() {
        let mut r = Round::default();
        assert_eq!(r.status(), &Status::Idle);
        r.begin(3, "finish").unwrap();
        assert_eq!(report(&mut r, Ok(())), None);
        assert_eq!(report(&mut r, Ok(())), None);
        assert_eq!(r.status(), &Status::Pending);
        assert_eq!(report(&mut r, Ok(())), Some("finish"));
        assert_eq!(r.status(), &Status::Done);
        // Extra reports after completion are ignored.
        assert_eq!(report(&mut r, Err(Error::Io("late".into()))), None);
        assert_eq!(r.status(), &Status::Done);
    }

    #[test]
    fn the_first_error_wins_and_a_new_round_waits_for_the_last() {
        let mut r = Round::default();
        r.begin(2, "a").unwrap();
        assert!(matches!(r.begin(1, "b"), Err(Error::InvalidState(_))));
        assert!(report(&mut r, Err(Error::Timeout("a".into()))).is_none());
        assert!(report(&mut r, Err(Error::Io("b".into()))).is_some());
        assert_eq!(r.status(), &Status::Error(Error::Timeout("a".into())));
        r.begin(1, "c").unwrap();
        assert_eq!(report(&mut r, Ok(())), Some("c"));
        assert_eq!(r.status(), &Status::Done);
    }

    #[test]
    fn parts_reported_together_count_as_many_and_a_round_needs_one() {
        let mut r = Round::default();
        assert!(matches!(r.begin(0, "x"), Err(Error::InvalidState(_))));
        r.begin(5, "x").unwrap();
        assert!(r.report(0, Err(Error::Io("nothing".into()))).is_none(), "no part reported");
        assert!(r.report(4, Ok(())).is_none());
        let f = r.report(1, Ok(())).unwrap();
        assert_eq!((f.finisher, f.outcome), (Some("x"), Ok(())));
    }

    #[test]
    fn an_aborted_round_hands_its_finisher_the_error() {
        let mut r = Round::default();
        r.begin(2, "x").unwrap();
        let f = r.abort(Error::Io("no connection".into()));
        assert_eq!(f.finisher, Some("x"));
        r.settle(f.outcome);
        assert_eq!(r.status(), &Status::Error(Error::Io("no connection".into())));
        assert!(r.report(2, Ok(())).is_none(), "reports after the abort change nothing");
    }
}
