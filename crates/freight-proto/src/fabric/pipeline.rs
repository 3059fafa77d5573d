//! The bookkeeping of staging through a peer's landing buffers, without I/O.
//!
//! One-sided operations cannot reach memory the provider cannot register (the peer's
//! GPU memory without `FI_HMEM`). The peer then lends a few pinned buffers, its
//! *docks*, registered with its rails, and copies between them and its memory when told
//! to. Each chunk of a request takes a dock and goes through two steps:
//!
//! - a WRITE is put on the wire into the dock (`Post`), then the peer is told to move
//!   the dock's bytes into place (`Land`);
//! - a READ first has the peer fill the dock from its memory (`Lift`), then reads the
//!   dock over the wire (`Post`).
//!
//! The dock goes back once the second step is done (or either fails), and the next
//! queued chunk takes it. [`Pipeline`] decides what happens next; the caller does it
//! and reports back, so the protocol is tested here without a network.

use std::collections::{HashMap, VecDeque};

/// What the caller must do next.
#[derive(Debug, PartialEq, Eq)]
pub enum Action<C, E> {
    /// Put `chunk` on the wire between its local bytes and dock `dock`; report with
    /// [`Pipeline::wire_done`].
    Post { token: u64, dock: usize, chunk: C },
    /// Tell the peer to copy dock `dock` into the memory `chunk` names; report with
    /// [`Pipeline::docked`].
    Land { token: u64, dock: usize, chunk: C },
    /// Tell the peer to copy the memory `chunk` names into dock `dock`; report with
    /// [`Pipeline::docked`].
    Lift { token: u64, dock: usize, chunk: C },
    /// `chunk` is done, or failed.
    Finish { chunk: C, result: Result<(), E> },
}

/// A chunk of a request as the pipeline sees it.
pub trait Chunk: Clone {
    /// A READ (the peer's bytes come here), else a WRITE.
    fn reads(&self) -> bool;
}

/// Which step a chunk in a dock waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Wire,
    Dock,
}

struct Docked<C> {
    chunk: C,
    dock: usize,
    step: Step,
}

pub struct Pipeline<C: Chunk, E: Clone> {
    free: Vec<usize>,
    queued: VecDeque<C>,
    active: HashMap<u64, Docked<C>>,
    next_token: u64,
    /// Why no chunk can move any more (the peer went away).
    closed: Option<E>,
}

impl<C: Chunk, E: Clone> Pipeline<C, E> {
    /// A pipeline over `docks` landing buffers.
    pub fn new(docks: usize) -> Pipeline<C, E> {
        Pipeline {
            free: (0..docks).rev().collect(),
            queued: VecDeque::new(),
            active: HashMap::new(),
            next_token: 1,
            closed: None,
        }
    }

    /// Queues chunks; those that find a free dock start at once.
    pub fn push(&mut self, chunks: impl IntoIterator<Item = C>) -> Vec<Action<C, E>> {
        let mut actions = Vec::new();
        for chunk in chunks {
            match &self.closed {
                Some(why) => actions.push(Action::Finish { chunk, result: Err(why.clone()) }),
                None => self.queued.push_back(chunk),
            }
        }
        self.fill(&mut actions);
        actions
    }

    /// The wire step of `token` ended.
    pub fn wire_done(&mut self, token: u64, result: Result<(), E>) -> Vec<Action<C, E>> {
        self.advance(token, Step::Wire, result)
    }

    /// The peer answered `token`'s `Land` or `Lift`.
    pub fn docked(&mut self, token: u64, result: Result<(), E>) -> Vec<Action<C, E>> {
        self.advance(token, Step::Dock, result)
    }

    /// The peer is gone: every chunk queued or waiting for the peer fails with `why`,
    /// and so does every chunk pushed later; no dock is lent again. A chunk on the wire
    /// fails only once its wire step is reported: until then the provider may still
    /// move its local bytes, which its request must not hand back before.
    pub fn close(&mut self, why: E) -> Vec<Action<C, E>> {
        self.closed.get_or_insert_with(|| why.clone());
        let fail = |chunk| Action::Finish { chunk, result: Err(why.clone()) };
        let mut actions: Vec<Action<C, E>> = self.queued.drain(..).map(fail).collect();
        let mut waiting: Vec<u64> = self.active.iter().filter(|(_, d)| d.step == Step::Dock).map(|(t, _)| *t).collect();
        waiting.sort_unstable();
        actions.extend(waiting.into_iter().filter_map(|t| self.active.remove(&t)).map(|d| fail(d.chunk)));
        actions
    }

    /// After [`Pipeline::close`]: fails the chunks whose wire step was never reported,
    /// for a caller that cannot wait for the provider any longer.
    pub fn give_up(&mut self) -> Vec<Action<C, E>> {
        let Some(why) = self.closed.clone() else { return Vec::new() };
        let mut tokens: Vec<u64> = self.active.keys().copied().collect();
        tokens.sort_unstable();
        let gone = tokens.into_iter().filter_map(|t| self.active.remove(&t));
        gone.map(|d| Action::Finish { chunk: d.chunk, result: Err(why.clone()) }).collect()
    }

    /// Chunks waiting for a dock or in one.
    pub fn in_flight(&self) -> usize {
        self.queued.len() + self.active.len()
    }

    /// Whether the pipeline was closed.
    pub fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    fn advance(&mut self, token: u64, step: Step, result: Result<(), E>) -> Vec<Action<C, E>> {
        let mut actions = Vec::new();
        match self.active.get(&token) {
            Some(d) if d.step == step => {}
            // Unknown (failed by `close`) or a report out of turn: nothing to do.
            _ => return actions,
        }
        let d = self.active.get_mut(&token).expect("looked up above");
        // A WRITE ends at the dock, a READ on the wire.
        let last = if d.chunk.reads() { Step::Wire } else { Step::Dock };
        if let Some(why) = &self.closed {
            // Its wire step is over: the chunk fails with the pipeline, its dock stays.
            let d = self.active.remove(&token).expect("looked up above");
            actions.push(Action::Finish { chunk: d.chunk, result: Err(why.clone()) });
            return actions;
        }
        if result.is_ok() && step != last {
            d.step = last;
            let (dock, chunk) = (d.dock, d.chunk.clone());
            actions.push(match step {
                Step::Wire => Action::Land { token, dock, chunk },
                Step::Dock => Action::Post { token, dock, chunk },
            });
            return actions;
        }
        let d = self.active.remove(&token).expect("looked up above");
        self.free.push(d.dock);
        actions.push(Action::Finish { chunk: d.chunk, result });
        self.fill(&mut actions);
        actions
    }

    /// Starts queued chunks while docks are free.
    fn fill(&mut self, actions: &mut Vec<Action<C, E>>) {
        while !self.queued.is_empty() {
            let Some(dock) = self.free.pop() else { return };
            let chunk = self.queued.pop_front().expect("not empty");
            let token = self.next_token;
            self.next_token += 1;
            let reads = chunk.reads();
            let step = if reads { Step::Dock } else { Step::Wire };
            self.active.insert(token, Docked { chunk: chunk.clone(), dock, step });
            actions.push(if reads { Action::Lift { token, dock, chunk } } else { Action::Post { token, dock, chunk } });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk named by a number; odd numbers read.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct N(u32);

    impl Chunk for N {
        fn reads(&self) -> bool {
            self.0 % 2 == 1
        }
    }

    fn finished(actions: &[Action<N, String>]) -> Vec<(u32, Result<(), String>)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Finish { chunk, result } => Some((chunk.0, result.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_write_goes_on_the_wire_then_lands() {
        let mut p: Pipeline<N, String> = Pipeline::new(1);
        let a = p.push([N(2)]);
        assert_eq!(a, vec![Action::Post { token: 1, dock: 0, chunk: N(2) }]);
        assert_eq!(p.wire_done(1, Ok(())), vec![Action::Land { token: 1, dock: 0, chunk: N(2) }]);
        // A second wire report for the same step is out of turn.
        assert!(p.wire_done(1, Ok(())).is_empty());
        assert_eq!(p.docked(1, Ok(())), vec![Action::Finish { chunk: N(2), result: Ok(()) }]);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn a_read_is_lifted_then_read_over_the_wire() {
        let mut p: Pipeline<N, String> = Pipeline::new(1);
        assert_eq!(p.push([N(1)]), vec![Action::Lift { token: 1, dock: 0, chunk: N(1) }]);
        assert!(p.wire_done(1, Ok(())).is_empty(), "the wire step comes second");
        assert_eq!(p.docked(1, Ok(())), vec![Action::Post { token: 1, dock: 0, chunk: N(1) }]);
        assert_eq!(p.wire_done(1, Ok(())), vec![Action::Finish { chunk: N(1), result: Ok(()) }]);
    }

    /// More chunks than docks: the rest wait, in order, and each freed dock starts the
    /// next one; no dock is ever lent twice.
    #[test]
    fn chunks_wait_for_docks_in_order() {
        let mut p: Pipeline<N, String> = Pipeline::new(2);
        let started = p.push((0..6).map(|i| N(i * 2)));
        assert_eq!(
            started,
            vec![Action::Post { token: 1, dock: 0, chunk: N(0) }, Action::Post { token: 2, dock: 1, chunk: N(2) }]
        );
        assert_eq!(p.in_flight(), 6);
        p.wire_done(2, Ok(()));
        let next = p.docked(2, Ok(()));
        assert_eq!(
            next,
            vec![Action::Finish { chunk: N(2), result: Ok(()) }, Action::Post { token: 3, dock: 1, chunk: N(4) }]
        );
        let mut done = vec![2];
        let mut tokens = vec![1, 3];
        while let Some(t) = tokens.pop() {
            p.wire_done(t, Ok(()));
            for a in p.docked(t, Ok(())) {
                match a {
                    Action::Finish { chunk, .. } => done.push(chunk.0),
                    Action::Post { token, dock, .. } => {
                        assert!(dock < 2);
                        tokens.push(token);
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        done.sort_unstable();
        assert_eq!(done, vec![0, 2, 4, 6, 8, 10]);
        assert_eq!(p.in_flight(), 0);
    }

    /// A failed step ends the chunk with its error and frees the dock for the next.
    #[test]
    fn failures_end_the_chunk_and_free_its_dock() {
        let mut p: Pipeline<N, String> = Pipeline::new(1);
        p.push([N(2), N(1), N(4)]);
        let a = p.wire_done(1, Err("fi_write failed".into()));
        assert_eq!(finished(&a), vec![(2, Err("fi_write failed".into()))]);
        assert_eq!(a[1], Action::Lift { token: 2, dock: 0, chunk: N(1) });
        let a = p.docked(2, Err("region 9 is not registered".into()));
        assert_eq!(finished(&a), vec![(1, Err("region 9 is not registered".into()))]);
        assert_eq!(a[1], Action::Post { token: 3, dock: 0, chunk: N(4) });
        p.wire_done(3, Ok(()));
        let a = p.docked(3, Err("copy failed".into()));
        assert_eq!(finished(&a), vec![(4, Err("copy failed".into()))]);
    }

    /// A dead peer fails at once every chunk queued or waiting for the peer, and later
    /// chunks too; a chunk on the wire fails once its wire step is reported (the
    /// provider may move its bytes until then), and its dock is not lent again.
    #[test]
    fn closing_fails_everything_but_waits_for_the_wire() {
        let mut p: Pipeline<N, String> = Pipeline::new(2);
        // Chunk 2 (a write) is on the wire in dock 0; chunk 1 (a read) waits for its lift.
        p.push([N(2), N(1), N(4)]);
        let a = p.close("peer gone".to_string());
        let mut f = finished(&a);
        f.sort();
        assert_eq!(f, vec![(1, Err("peer gone".into())), (4, Err("peer gone".into()))]);
        assert_eq!(p.in_flight(), 1, "the write on the wire is still the provider's");
        assert!(p.docked(2, Ok(())).is_empty(), "a lift answer for a failed chunk changes nothing");
        assert_eq!(finished(&p.wire_done(1, Ok(()))), vec![(2, Err("peer gone".into()))]);
        assert_eq!(p.in_flight(), 0);
        assert!(p.wire_done(1, Ok(())).is_empty());
        assert_eq!(finished(&p.push([N(6)])), vec![(6, Err("peer gone".into()))]);
        assert!(p.is_closed() && p.in_flight() == 0, "no dock is lent after a close");
        // One that is never reported is failed when the caller stops waiting.
        let mut p: Pipeline<N, String> = Pipeline::new(1);
        assert!(p.give_up().is_empty(), "only after a close");
        p.push([N(2)]);
        assert!(p.close("stop".to_string()).is_empty());
        assert_eq!(finished(&p.give_up()), vec![(2, Err("stop".into()))]);
        assert_eq!(p.in_flight(), 0);
    }
}
