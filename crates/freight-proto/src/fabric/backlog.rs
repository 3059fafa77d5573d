//! Operations waiting for a rail, queued by destination. Each destination's operations
//! keep their order, and the rail's thread serves destinations in turn, one operation
//! each: a peer the provider cannot take more for right now (`FI_EAGAIN`), or one huge
//! request to one peer, does not hold up a small request to another. Plain bookkeeping,
//! tested without a provider.

use std::collections::{HashMap, VecDeque};

/// What a backlog holds: something bound for a destination.
pub trait Addressed {
    fn dest(&self) -> u64;
}

/// What became of an operation offered by [`Backlog::serve`].
pub enum Offer<T> {
    /// Posted, or failed for good and reported: it leaves the backlog.
    Taken,
    /// Its destination takes no more for now: it goes back first in its line, and the
    /// destination sits out the rest of this round.
    Busy(T),
}

/// Operations by destination, and the order destinations are served in.
pub struct Backlog<T> {
    lines: HashMap<u64, VecDeque<T>>,
    /// Destinations with operations waiting, each once, next to be served first.
    turns: VecDeque<u64>,
}

impl<T> Default for Backlog<T> {
    fn default() -> Self {
        Backlog { lines: HashMap::new(), turns: VecDeque::new() }
    }
}

impl<T: Addressed> Backlog<T> {
    /// Queues `item` last in its destination's line.
    pub fn push(&mut self, item: T) {
        let dest = item.dest();
        let line = self.lines.entry(dest).or_default();
        if line.is_empty() {
            self.turns.push_back(dest);
        }
        line.push_back(item);
    }

    /// Takes every operation bound for `dest`, in order.
    pub fn take_dest(&mut self, dest: u64) -> VecDeque<T> {
        self.turns.retain(|&d| d != dest);
        self.lines.remove(&dest).unwrap_or_default()
    }

    /// Takes everything, each destination's operations in order.
    pub fn drain(&mut self) -> Vec<T> {
        let mut lines = std::mem::take(&mut self.lines);
        self.turns.drain(..).flat_map(|d| lines.remove(&d).unwrap_or_default()).collect()
    }

    /// Offers operations to `post`, the oldest of each destination, destinations in
    /// turn, until every destination is empty or busy. Busy destinations are served first
    /// next time, in the order they were served now.
    pub fn serve(&mut self, mut post: impl FnMut(T) -> Offer<T>) {
        let mut busy = Vec::new();
        while let Some(dest) = self.turns.pop_front() {
            let line = self.lines.get_mut(&dest).expect("a destination in turn has a line");
            let item = line.pop_front().expect("a destination in turn has an operation");
            match post(item) {
                Offer::Taken => {
                    if line.is_empty() {
                        self.lines.remove(&dest);
                    } else {
                        self.turns.push_back(dest);
                    }
                }
                Offer::Busy(item) => {
                    line.push_front(item);
                    busy.push(dest);
                }
            }
        }
        self.turns.extend(busy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<T> Backlog<T> {
        fn len(&self) -> usize {
            self.lines.values().map(VecDeque::len).sum()
        }

        fn is_empty(&self) -> bool {
            self.turns.is_empty() && self.lines.is_empty()
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Op {
        dest: u64,
        n: u32,
    }

    impl Addressed for Op {
        fn dest(&self) -> u64 {
            self.dest
        }
    }

    fn backlog(ops: &[(u64, u32)]) -> Backlog<Op> {
        let mut b = Backlog::default();
        for &(dest, n) in ops {
            b.push(Op { dest, n });
        }
        b
    }

    /// Serves `b` with a provider that takes at most `room` operations per destination.
    fn serve_with_room(b: &mut Backlog<Op>, room: &mut HashMap<u64, usize>) -> Vec<(u64, u32)> {
        let mut posted = Vec::new();
        b.serve(|op| match room.get_mut(&op.dest) {
            Some(r) if *r > 0 => {
                *r -= 1;
                posted.push((op.dest, op.n));
                Offer::Taken
            }
            _ => Offer::Busy(op),
        });
        posted
    }

    #[test]
    fn destinations_take_turns_and_each_keeps_its_order() {
        // One long request to peer 1 queued before two operations to peer 2.
        let mut b = backlog(&[(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]);
        let mut room = HashMap::from([(1, 10), (2, 10)]);
        let posted = serve_with_room(&mut b, &mut room);
        assert_eq!(posted, [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (1, 3)]);
        assert!(b.is_empty());
        assert_eq!(b.len(), 0);
    }

    #[test]
    fn a_busy_destination_holds_up_no_other() {
        let mut b = backlog(&[(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (3, 0)]);
        let mut room = HashMap::from([(1, 1), (2, 5), (3, 5)]);
        let posted = serve_with_room(&mut b, &mut room);
        assert_eq!(posted, [(1, 0), (2, 0), (3, 0), (2, 1)]);
        // Peer 1's rest waits, in order, and goes first once it has room again.
        assert_eq!(b.len(), 2);
        room.insert(1, 5);
        b.push(Op { dest: 2, n: 2 });
        let posted = serve_with_room(&mut b, &mut room);
        assert_eq!(posted, [(1, 1), (2, 2), (1, 2)]);
        assert!(b.is_empty());
    }

    #[test]
    fn when_nothing_has_room_everything_stays_in_order() {
        let mut b = backlog(&[(1, 0), (2, 0), (1, 1)]);
        assert!(serve_with_room(&mut b, &mut HashMap::new()).is_empty());
        assert_eq!(b.len(), 3);
        let left: Vec<_> = b.drain().into_iter().map(|o| (o.dest, o.n)).collect();
        assert_eq!(left, [(1, 0), (1, 1), (2, 0)]);
        assert!(b.is_empty());
    }

    #[test]
    fn a_destination_is_taken_out_whole_and_the_others_go_on() {
        let mut b = backlog(&[(1, 0), (2, 0), (1, 1), (3, 0)]);
        let gone: Vec<_> = b.take_dest(1).into_iter().map(|o| o.n).collect();
        assert_eq!(gone, [0, 1]);
        assert!(b.take_dest(1).is_empty());
        assert_eq!(b.len(), 2);
        let posted = serve_with_room(&mut b, &mut HashMap::from([(1, 9), (2, 9), (3, 9)]));
        assert_eq!(posted, [(2, 0), (3, 0)]);
        // A destination emptied by serving comes back in turn when it has work again.
        b.push(Op { dest: 2, n: 1 });
        assert_eq!(serve_with_room(&mut b, &mut HashMap::from([(2, 1)])), [(2, 1)]);
    }
}
