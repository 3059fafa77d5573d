//! The rank server's bookkeeping, free of sockets so that every protocol rule can be tested
//! by calling methods: joins, per-collective contributions, departures and deaths in; the
//! messages to send, and to whom, out.
//!
//! Lifetime of a group: ranks join (in any order), run collectives, and leave or die. Once
//! every one of the `world` ranks has joined and is gone again, the group is over and the
//! collector starts afresh, so one server can host consecutive runs. Until then the old
//! state stays: a rank that joins late still learns at once that another rank died, and a
//! taken rank cannot be joined twice.

use std::collections::BTreeMap;

use super::wire::{ToRank, PROTOCOL};

/// One message and the ranks to send it to (serialized once, written to each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Send {
    pub to: Vec<usize>,
    pub msg: ToRank,
}

pub(crate) type Sends = Vec<Send>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Slot {
    Free,
    Joined,
    Left,
    Dead(String),
}

/// Contributions to one collective so far.
struct Round {
    blobs: Vec<Option<Vec<u8>>>,
    have: usize,
}

pub(crate) struct Collector {
    world: usize,
    slots: Vec<Slot>,
    /// The collective each rank contributes to next; everything below it is contributed.
    next_seq: Vec<u64>,
    rounds: BTreeMap<u64, Round>,
    /// The first death; once set, no collective can complete any more.
    death: Option<(usize, String)>,
    /// How many groups this collector has seen end; for logs only.
    generation: u64,
}

impl Collector {
    pub(crate) fn new(world: usize) -> Self {
        Self::with_generation(world, 0)
    }

    fn with_generation(world: usize, generation: u64) -> Self {
        Self {
            world,
            slots: vec![Slot::Free; world],
            next_seq: vec![0; world],
            rounds: BTreeMap::new(),
            death: None,
            generation,
        }
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// A join request. `Err` carries the reason for the refusal, sent back to the joiner.
    pub(crate) fn join(&mut self, rank: usize, world: usize, proto: u32) -> Result<Sends, String> {
        if proto != PROTOCOL {
            return Err(format!("rendezvous protocol {proto} is not the server's {PROTOCOL}"));
        }
        if world != self.world {
            return Err(format!("world size {world} differs from the rank server's {}", self.world));
        }
        if rank >= self.world {
            return Err(format!("rank {rank} out of range for world size {}", self.world));
        }
        match &self.slots[rank] {
            Slot::Free => {}
            Slot::Joined => return Err(format!("rank {rank} is already taken by a connected process")),
            Slot::Left => return Err(format!("rank {rank} already joined this group and left it")),
            Slot::Dead(reason) => return Err(format!("rank {rank} already joined this group and died ({reason})")),
        }
        self.slots[rank] = Slot::Joined;
        let mut sends = vec![Send { to: vec![rank], msg: ToRank::Welcome { world: self.world } }];
        if let Some((dead, reason)) = &self.death {
            sends.push(Send { to: vec![rank], msg: ToRank::Dead { rank: *dead, reason: reason.clone() } });
        }
        Ok(sends)
    }

    /// `rank`'s blob for collective `seq`. `Err` is a protocol violation by that rank (its
    /// connection should be dropped, which makes it dead).
    pub(crate) fn contribute(&mut self, rank: usize, seq: u64, blob: Vec<u8>) -> Result<Sends, String> {
        if self.slots.get(rank) != Some(&Slot::Joined) {
            return Err(format!("rank {rank} contributed without being joined"));
        }
        if seq != self.next_seq[rank] {
            return Err(format!("rank {rank} sent collective {seq} but its next one is {}", self.next_seq[rank]));
        }
        self.next_seq[rank] += 1;
        if self.death.is_some() {
            // The contributor has been (or is being) told about the death and fails locally.
            return Ok(Vec::new());
        }
        if let Some(gone) = self.left_before(seq) {
            let reason = format!("rank {gone} left the group before collective {seq}");
            return Ok(vec![Send { to: vec![rank], msg: ToRank::Failed { seq, reason } }]);
        }
        let world = self.world;
        let round = self.rounds.entry(seq).or_insert_with(|| Round { blobs: vec![None; world], have: 0 });
        round.blobs[rank] = Some(blob);
        round.have += 1;
        if round.have < world {
            return Ok(Vec::new());
        }
        let Some(round) = self.rounds.remove(&seq) else {
            return Ok(Vec::new());
        };
        let blobs = round.blobs.into_iter().map(Option::unwrap_or_default).collect();
        Ok(vec![Send { to: self.joined(), msg: ToRank::Gathered { seq, blobs } }])
    }

    /// Answer to `rank` asking about collective `seq`.
    pub(crate) fn status(&self, rank: usize, seq: u64) -> Sends {
        let missing = self.missing(seq);
        let absent = missing.iter().copied().filter(|&r| self.slots[r] == Slot::Free).collect();
        vec![Send { to: vec![rank], msg: ToRank::Status { seq, missing, absent } }]
    }

    /// Ranks that have not contributed to collective `seq`.
    pub(crate) fn missing(&self, seq: u64) -> Vec<usize> {
        (0..self.world).filter(|&r| self.next_seq[r] <= seq).collect()
    }

    /// A clean departure: not a death, but the collectives it did not contribute to fail.
    pub(crate) fn leave(&mut self, rank: usize) -> Sends {
        if self.slots.get(rank) != Some(&Slot::Joined) {
            return Vec::new();
        }
        self.slots[rank] = Slot::Left;
        let doomed: Vec<u64> = self.rounds.range(self.next_seq[rank]..).map(|(&seq, _)| seq).collect();
        let mut sends = Vec::new();
        for seq in doomed {
            let Some(round) = self.rounds.remove(&seq) else { continue };
            let to = (0..self.world).filter(|&r| round.blobs[r].is_some() && self.slots[r] == Slot::Joined).collect();
            let reason = format!("rank {rank} left the group before collective {seq}");
            sends.push(Send { to, msg: ToRank::Failed { seq, reason } });
        }
        self.restart_if_over();
        sends
    }

    /// `rank`'s connection ended without a leave: it is dead. The first death is broadcast
    /// to every other joined rank; later ones change nothing (the group is already over).
    pub(crate) fn disconnect(&mut self, rank: usize, reason: &str) -> Sends {
        if self.slots.get(rank) != Some(&Slot::Joined) {
            return Vec::new();
        }
        self.slots[rank] = Slot::Dead(reason.to_owned());
        let mut sends = Vec::new();
        if self.death.is_none() {
            tracing::error!(rank, reason, generation = self.generation, "rank died");
            self.death = Some((rank, reason.to_owned()));
            self.rounds.clear();
            sends.push(Send { to: self.joined(), msg: ToRank::Dead { rank, reason: reason.to_owned() } });
        } else {
            tracing::debug!(rank, reason, "rank disconnected after the group failed");
        }
        self.restart_if_over();
        sends
    }

    fn joined(&self) -> Vec<usize> {
        (0..self.world).filter(|&r| self.slots[r] == Slot::Joined).collect()
    }

    /// A rank that left without contributing to `seq`, which can hence never complete.
    fn left_before(&self, seq: u64) -> Option<usize> {
        (0..self.world).find(|&r| self.slots[r] == Slot::Left && self.next_seq[r] <= seq)
    }

    fn restart_if_over(&mut self) {
        if self.slots.iter().all(|s| matches!(s, Slot::Left | Slot::Dead(_))) {
            tracing::info!(
                generation = self.generation,
                failed = self.death.is_some(),
                "every rank has joined and gone; the rank server accepts a new group"
            );
            *self = Self::with_generation(self.world, self.generation + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(world: usize) -> Collector {
        let mut c = Collector::new(world);
        for r in 0..world {
            c.join(r, world, PROTOCOL).unwrap();
        }
        c
    }

    fn gathered(sends: &Sends) -> Option<(Vec<usize>, Vec<Vec<u8>>)> {
        match sends.as_slice() {
            [Send { to, msg: ToRank::Gathered { blobs, .. } }] => Some((to.clone(), blobs.clone())),
            _ => None,
        }
    }

    #[test]
    fn join_is_welcomed_and_refusals_say_why() {
        let mut c = Collector::new(3);
        let sends = c.join(1, 3, PROTOCOL).unwrap();
        assert_eq!(sends, vec![Send { to: vec![1], msg: ToRank::Welcome { world: 3 } }]);
        assert!(c.join(1, 3, PROTOCOL).unwrap_err().contains("already taken"));
        assert!(c.join(0, 4, PROTOCOL).unwrap_err().contains("world size 4"));
        assert!(c.join(3, 3, PROTOCOL).unwrap_err().contains("out of range"));
        assert!(c.join(0, 3, PROTOCOL + 1).unwrap_err().contains("protocol"));
        // Refusals leave the slot free.
        assert!(c.join(0, 3, PROTOCOL).is_ok());
    }

    #[test]
    fn a_collective_completes_in_rank_order_whatever_the_arrival_order() {
        let mut c = joined(3);
        assert!(c.contribute(2, 0, b"two".to_vec()).unwrap().is_empty());
        assert!(c.contribute(0, 0, b"zero".to_vec()).unwrap().is_empty());
        assert_eq!(c.missing(0), vec![1]);
        let (to, blobs) = gathered(&c.contribute(1, 0, vec![]).unwrap()).unwrap();
        assert_eq!(to, vec![0, 1, 2]);
        assert_eq!(blobs, vec![b"zero".to_vec(), vec![], b"two".to_vec()]);
        assert!(c.missing(0).is_empty());
    }

    #[test]
    fn fast_ranks_may_run_ahead_by_several_collectives() {
        let mut c = joined(2);
        for seq in 0..3 {
            assert!(c.contribute(0, seq, vec![seq as u8]).unwrap().is_empty());
        }
        for seq in 0..3 {
            let (_, blobs) = gathered(&c.contribute(1, seq, vec![10 + seq as u8]).unwrap()).unwrap();
            assert_eq!(blobs, vec![vec![seq as u8], vec![10 + seq as u8]]);
        }
    }

    #[test]
    fn out_of_order_or_unjoined_contributions_are_violations() {
        let mut c = Collector::new(2);
        assert!(c.contribute(0, 0, vec![]).is_err());
        c.join(0, 2, PROTOCOL).unwrap();
        assert!(c.contribute(0, 1, vec![]).unwrap_err().contains("next one is 0"));
        c.contribute(0, 0, vec![]).unwrap();
        assert!(c.contribute(0, 0, vec![]).is_err());
        assert!(c.contribute(5, 0, vec![]).is_err());
    }

    #[test]
    fn status_names_missing_and_absent_ranks() {
        let mut c = Collector::new(3);
        c.join(0, 3, PROTOCOL).unwrap();
        c.join(1, 3, PROTOCOL).unwrap();
        c.contribute(0, 0, vec![]).unwrap();
        let sends = c.status(0, 0);
        assert_eq!(
            sends,
            vec![Send { to: vec![0], msg: ToRank::Status { seq: 0, missing: vec![1, 2], absent: vec![2] } }]
        );
    }

    #[test]
    fn a_death_is_broadcast_and_stops_every_collective() {
        let mut c = joined(3);
        c.contribute(0, 0, vec![]).unwrap();
        let sends = c.disconnect(1, "eof");
        assert_eq!(sends, vec![Send { to: vec![0, 2], msg: ToRank::Dead { rank: 1, reason: "eof".into() } }]);
        // Nothing completes any more, and later deaths are not broadcast again.
        assert!(c.contribute(2, 0, vec![]).unwrap().is_empty());
        assert!(c.disconnect(2, "eof too").is_empty());
        // The dead rank cannot be rejoined while the group lives.
        assert!(c.join(1, 3, PROTOCOL).unwrap_err().contains("died (eof)"));
    }

    #[test]
    fn a_late_joiner_learns_of_an_earlier_death() {
        let mut c = Collector::new(3);
        c.join(0, 3, PROTOCOL).unwrap();
        c.join(1, 3, PROTOCOL).unwrap();
        c.disconnect(0, "crash");
        let sends = c.join(2, 3, PROTOCOL).unwrap();
        assert_eq!(sends[1], Send { to: vec![2], msg: ToRank::Dead { rank: 0, reason: "crash".into() } });
    }

    #[test]
    fn a_leave_is_not_a_death_but_fails_collectives_that_need_the_leaver() {
        let mut c = joined(3);
        c.contribute(0, 0, vec![]).unwrap();
        c.contribute(2, 0, vec![]).unwrap();
        c.contribute(0, 1, vec![]).unwrap();
        // Rank 1 leaves having contributed to nothing: both open collectives fail, for the
        // ranks that wait on them.
        let sends = c.leave(1);
        assert_eq!(sends.len(), 2);
        assert!(matches!(&sends[0], Send { to, msg: ToRank::Failed { seq: 0, .. } } if to == &vec![0, 2]));
        assert!(matches!(&sends[1], Send { to, msg: ToRank::Failed { seq: 1, .. } } if to == &vec![0]));
        // A later collective fails at once; nobody is dead.
        let sends = c.contribute(2, 1, vec![]).unwrap();
        assert!(matches!(&sends[0].msg, ToRank::Failed { reason, .. } if reason.contains("rank 1 left")));
        assert!(c.death.is_none());
        // A close after the leave is not a death either.
        assert!(c.disconnect(1, "eof").is_empty());
    }

    #[test]
    fn a_rank_that_contributed_then_left_still_completes_the_collective() {
        let mut c = joined(2);
        c.contribute(0, 0, b"a".to_vec()).unwrap();
        assert!(c.leave(0).is_empty());
        let (to, blobs) = gathered(&c.contribute(1, 0, b"b".to_vec()).unwrap()).unwrap();
        assert_eq!(to, vec![1]);
        assert_eq!(blobs, vec![b"a".to_vec(), b"b".to_vec()]);
    }

    #[test]
    fn the_group_restarts_once_every_rank_joined_and_went() {
        let mut c = joined(2);
        c.contribute(0, 0, vec![]).unwrap();
        c.leave(0);
        assert_eq!(c.generation(), 0);
        c.disconnect(1, "eof");
        assert_eq!(c.generation(), 1);
        // Fresh: both ranks can join again and numbering restarts at 0.
        c.join(0, 2, PROTOCOL).unwrap();
        c.join(1, 2, PROTOCOL).unwrap();
        c.contribute(0, 0, vec![]).unwrap();
        assert!(gathered(&c.contribute(1, 0, vec![]).unwrap()).is_some());
    }

    #[test]
    fn a_group_with_a_rank_never_joined_does_not_restart() {
        let mut c = Collector::new(2);
        c.join(0, 2, PROTOCOL).unwrap();
        c.disconnect(0, "crash");
        assert_eq!(c.generation(), 0);
        // The latecomer hears of the death, then its departure ends the group.
        assert_eq!(c.join(1, 2, PROTOCOL).unwrap().len(), 2);
        c.disconnect(1, "eof");
        assert_eq!(c.generation(), 1);
    }
}
