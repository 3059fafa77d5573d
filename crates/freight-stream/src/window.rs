//! The pipe's flow control: which part of the receiver's buffer each message takes,
//! and when space comes back.
//!
//! Both sides count in *stream positions*: bytes since the pipe opened, never wrapping
//! (u64). A position's place in the buffer is `position % capacity`. A message is one
//! contiguous run of the buffer: one that would run past the end starts over at the
//! beginning, and the gap it leaves is freed with the message before it.
//!
//! The sender may use the positions below `credit + capacity`, where `credit` is the
//! receiver's last word on what it has finished with. Anything it wrote since then and
//! the receiver still holds lies in `[credit, head)`, so a new message ending at or
//! before `credit + capacity` never lands on it (see the property test below). When
//! the receiver holds nothing (`credit == head`) a message may go anywhere: otherwise
//! a whole-buffer message after an unaligned head would never fit.
//!
//! The receiver checks each announced message against the same placement rule, so a
//! confused or hostile sender cannot point it at live data, and frees space in order:
//! messages may be released in any order (zero-copy views are dropped when their owner
//! likes), but the credit only moves past a run of released ones.

use std::collections::{BTreeMap, BTreeSet};

/// One message in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Messages are numbered from 0 in the order they are sent.
    pub seq: u64,
    /// Stream position of the first byte.
    pub start: u64,
    pub len: u64,
}

impl Slot {
    pub fn end(&self) -> u64 {
        // Saturating: a slot from the wire may be nonsense, and is refused, not a panic.
        self.start.saturating_add(self.len)
    }

    /// Byte offset of the message in a buffer of `capacity` bytes.
    pub fn offset(&self, capacity: u64) -> u64 {
        self.start % capacity
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("a pipe buffer must hold at least one byte")]
    NoCapacity,
    #[error("empty messages cannot be sent (a pipe message has at least one byte)")]
    Empty,
    #[error("a message of {len} bytes does not fit in the pipe's buffer of {capacity} bytes")]
    TooLarge { len: u64, capacity: u64 },
    #[error("credit {credit} goes back behind the previous credit {previous}")]
    CreditBackwards { credit: u64, previous: u64 },
    #[error("credit {credit} is beyond what was sent (up to {head})")]
    CreditAhead { credit: u64, head: u64 },
    #[error("message {got} arrived where message {expected} was due")]
    OutOfOrder { expected: u64, got: u64 },
    #[error("message {seq} claims bytes {start}..{end}, but it belongs at {due}")]
    Misplaced { seq: u64, start: u64, end: u64, due: u64 },
    #[error("message {seq} claims bytes {start}..{end}, over the message at {held} that is still held")]
    Overwrites { seq: u64, start: u64, end: u64, held: u64 },
    #[error("no message starts at position {start} in the buffer (never received, or already released)")]
    NotHeld { start: u64 },
}

fn check_len(len: u64, capacity: u64) -> Result<(), WindowError> {
    match len {
        0 => Err(WindowError::Empty),
        l if l > capacity => Err(WindowError::TooLarge { len, capacity }),
        _ => Ok(()),
    }
}

/// Where a message of `len` bytes goes after `head`: at `head`, or at the start of the
/// buffer's next round when it would run past the end.
fn place(head: u64, len: u64, capacity: u64) -> u64 {
    let offset = head % capacity;
    if offset + len > capacity {
        head + (capacity - offset)
    } else {
        head
    }
}

/// The sender's view.
#[derive(Debug, Clone)]
pub struct SendWindow {
    capacity: u64,
    /// End of the last message sent.
    head: u64,
    /// Everything before this position the receiver has finished with.
    credit: u64,
    next_seq: u64,
}

impl SendWindow {
    pub fn new(capacity: u64) -> Result<SendWindow, WindowError> {
        if capacity == 0 {
            return Err(WindowError::NoCapacity);
        }
        Ok(SendWindow { capacity, head: 0, credit: 0, next_seq: 0 })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Messages reserved so far.
    pub fn sent(&self) -> u64 {
        self.next_seq
    }

    /// Bytes written that the receiver has not handed back yet (gaps included).
    pub fn in_flight(&self) -> u64 {
        self.head - self.credit
    }

    /// Stream position after the last message reserved.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The receiver has finished with everything before this position.
    pub fn credited(&self) -> u64 {
        self.credit
    }

    /// Takes the place of the next message, of `len` bytes; `None` while the receiver
    /// holds too much of the buffer (wait for a credit and ask again).
    pub fn reserve(&mut self, len: u64) -> Result<Option<Slot>, WindowError> {
        check_len(len, self.capacity)?;
        let start = place(self.head, len, self.capacity);
        // With nothing held, any place is free, however far the gap pushed it.
        let fits = self.credit == self.head || start + len <= self.credit + self.capacity;
        if !fits {
            return Ok(None);
        }
        let slot = Slot { seq: self.next_seq, start, len };
        self.next_seq += 1;
        self.head = slot.end();
        Ok(Some(slot))
    }

    /// The credit a message of `len` bytes waits for: once the receiver has finished
    /// with everything before it, [`SendWindow::reserve`] finds room.
    pub fn needs_credit(&self, len: u64) -> u64 {
        (place(self.head, len, self.capacity) + len).saturating_sub(self.capacity).min(self.head)
    }

    /// The receiver has finished with everything before `upto`.
    pub fn credit(&mut self, upto: u64) -> Result<(), WindowError> {
        if upto < self.credit {
            return Err(WindowError::CreditBackwards { credit: upto, previous: self.credit });
        }
        if upto > self.head {
            return Err(WindowError::CreditAhead { credit: upto, head: self.head });
        }
        self.credit = upto;
        Ok(())
    }
}

/// The receiver's view.
#[derive(Debug, Clone)]
pub struct RecvWindow {
    capacity: u64,
    next_seq: u64,
    /// End of the last message accepted.
    head: u64,
    /// Messages accepted and not released: start -> end.
    held: BTreeMap<u64, u64>,
    /// The last credit given to the sender (sent, or on its way).
    credited: u64,
    /// The last credit known to have been sent: a credit that could not be sent is
    /// owed again from here.
    delivered: u64,
    /// Credits are sent once at least this many bytes are free again (or when nothing
    /// is held), so that a stream of small messages is not answered message by message.
    batch: u64,
    /// Positions the sender waits for: a credit goes as soon as one is free.
    wanted: BTreeSet<u64>,
}

impl RecvWindow {
    /// `batch`: the least number of freed bytes worth a credit (clamped to the
    /// capacity; a quarter of it is a good choice).
    pub fn new(capacity: u64, batch: u64) -> Result<RecvWindow, WindowError> {
        if capacity == 0 {
            return Err(WindowError::NoCapacity);
        }
        Ok(RecvWindow {
            capacity,
            next_seq: 0,
            head: 0,
            held: BTreeMap::new(),
            credited: 0,
            delivered: 0,
            batch: batch.clamp(1, capacity),
            wanted: BTreeSet::new(),
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The sequence number of the next message to accept.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Messages accepted and not yet released.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Checks an announced message (the next in order, where the placement rule puts
    /// it) and holds it until released.
    pub fn accept(&mut self, slot: Slot) -> Result<(), WindowError> {
        if slot.seq != self.next_seq {
            return Err(WindowError::OutOfOrder { expected: self.next_seq, got: slot.seq });
        }
        check_len(slot.len, self.capacity)?;
        let due = place(self.head, slot.len, self.capacity);
        if slot.start != due {
            return Err(WindowError::Misplaced { seq: slot.seq, start: slot.start, end: slot.end(), due });
        }
        // A sender that ignored credits would write over bytes still handed out.
        if let Some(&held) = self.held.keys().next() {
            if slot.end() > held + self.capacity {
                return Err(WindowError::Overwrites { seq: slot.seq, start: slot.start, end: slot.end(), held });
            }
        }
        self.next_seq += 1;
        self.head = slot.end();
        self.held.insert(slot.start, slot.end());
        Ok(())
    }

    /// Everything before this position is free: up to the oldest message still held.
    fn freed(&self) -> u64 {
        self.held.keys().next().copied().unwrap_or(self.head)
    }

    /// The consumer is done with the message starting at `start`. Returns the credit
    /// to send the sender, when one is due.
    pub fn release(&mut self, start: u64) -> Result<Option<u64>, WindowError> {
        self.held.remove(&start).ok_or(WindowError::NotHeld { start })?;
        let freed = self.freed();
        let wanted = self.wanted.first().is_some_and(|&w| w <= freed);
        if freed - self.credited >= self.batch || (self.held.is_empty() && freed > self.credited) || wanted {
            self.wanted.retain(|&w| w > freed);
            self.credited = freed;
            return Ok(Some(freed));
        }
        Ok(None)
    }

    /// The sender waits until everything before `upto` is released: the credit that
    /// says so goes at once when it is (returned here), else with the release that
    /// frees it, whatever the batch.
    pub fn want(&mut self, upto: u64) -> Option<u64> {
        let freed = self.freed();
        if upto > freed {
            self.wanted.insert(upto);
            return None;
        }
        self.flush()
    }

    /// A credit returned here was sent.
    pub fn credit_sent(&mut self, upto: u64) {
        self.delivered = self.delivered.max(upto);
    }

    /// A credit returned here could not be sent: the next release, flush or want
    /// owes everything since the last one sent, whatever the batch.
    pub fn credit_lost(&mut self) {
        self.credited = self.delivered;
    }

    /// The credit not sent yet, if any (for a receiver about to wait, or closing).
    pub fn flush(&mut self) -> Option<u64> {
        let freed = self.freed();
        (freed > self.credited).then(|| {
            self.credited = freed;
            freed
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_message_that_would_run_past_the_end_starts_over() {
        let mut s = SendWindow::new(100).unwrap();
        assert_eq!(s.reserve(60).unwrap(), Some(Slot { seq: 0, start: 0, len: 60 }));
        // 60 + 50 > 100: skips to position 100 (offset 0), which the first still holds.
        assert_eq!(s.reserve(50).unwrap(), None);
        s.credit(60).unwrap();
        let slot = s.reserve(50).unwrap().unwrap();
        assert_eq!((slot.seq, slot.start, slot.offset(100)), (1, 100, 0));
        assert_eq!(s.in_flight(), 90, "the 40-byte gap counts until the message after it is freed");
    }

    #[test]
    fn bad_sizes_and_credits_are_refused() {
        assert_eq!(SendWindow::new(0).unwrap_err(), WindowError::NoCapacity);
        let mut s = SendWindow::new(64).unwrap();
        assert_eq!(s.reserve(0).unwrap_err(), WindowError::Empty);
        assert_eq!(s.reserve(65).unwrap_err(), WindowError::TooLarge { len: 65, capacity: 64 });
        s.reserve(10).unwrap().unwrap();
        assert_eq!(s.credit(11).unwrap_err(), WindowError::CreditAhead { credit: 11, head: 10 });
        s.credit(10).unwrap();
        assert_eq!(s.credit(5).unwrap_err(), WindowError::CreditBackwards { credit: 5, previous: 10 });
        assert!(s.reserve(64).unwrap().is_some(), "a whole-buffer message fits an empty buffer");
    }

    #[test]
    fn the_receiver_refuses_announcements_the_sender_could_not_have_made() {
        let mut r = RecvWindow::new(100, 25).unwrap();
        let e = r.accept(Slot { seq: 1, start: 0, len: 10 }).unwrap_err();
        assert_eq!(e, WindowError::OutOfOrder { expected: 0, got: 1 });
        let e = r.accept(Slot { seq: 0, start: 5, len: 10 }).unwrap_err();
        assert!(matches!(e, WindowError::Misplaced { due: 0, .. }), "{e}");
        assert_eq!(
            r.accept(Slot { seq: 0, start: 0, len: 101 }).unwrap_err().to_string(),
            "a message of 101 bytes does not fit in the pipe's buffer of 100 bytes"
        );
        r.accept(Slot { seq: 0, start: 0, len: 10 }).unwrap();
        assert_eq!(r.release(3).unwrap_err(), WindowError::NotHeld { start: 3 });
        assert_eq!(r.release(0).unwrap(), Some(10));
        assert_eq!(r.release(0).unwrap_err(), WindowError::NotHeld { start: 0 }, "released twice");
        // A sender that ignores credits: 10..70 is held, and 70..130 would wrap over it.
        r.accept(Slot { seq: 1, start: 10, len: 60 }).unwrap();
        let e = r.accept(Slot { seq: 2, start: 100, len: 60 }).unwrap_err();
        assert_eq!(e, WindowError::Overwrites { seq: 2, start: 100, end: 160, held: 10 });
        r.accept(Slot { seq: 2, start: 70, len: 30 }).unwrap();
    }

    /// The credit a stuck sender asks for is exactly what it needs: just below it there
    /// is no room, at it there is, whether or not the message wraps.
    #[test]
    fn a_stuck_sender_asks_for_the_credit_it_needs() {
        for (sent, len) in [(30, 50), (70, 50), (100, 100), (95, 10), (40, 60)] {
            let mut w = SendWindow::new(100).unwrap();
            w.reserve(sent).unwrap().unwrap();
            if w.clone().reserve(len).unwrap().is_some() {
                continue;
            }
            let needed = w.needs_credit(len);
            assert!(needed > 0 && needed <= sent, "sent {sent}, len {len}: {needed}");
            let mut short = w.clone();
            short.credit(needed - 1).unwrap();
            assert!(short.reserve(len).unwrap().is_none(), "sent {sent}, len {len}: room before {needed}");
            w.credit(needed).unwrap();
            assert!(w.reserve(len).unwrap().is_some(), "sent {sent}, len {len}: no room at {needed}");
        }
    }

    #[test]
    fn a_position_the_sender_waits_for_is_credited_at_once() {
        let mut r = RecvWindow::new(1000, 500).unwrap();
        for (seq, start) in [(0, 0), (1, 100), (2, 200)] {
            r.accept(Slot { seq, start, len: 100 }).unwrap();
        }
        assert_eq!(r.want(200), None, "not free yet");
        assert_eq!(r.release(100).unwrap(), None, "out of order: nothing before 200 is free");
        assert_eq!(r.release(0).unwrap(), Some(200), "free up to the wanted point: credited below the batch");
        assert_eq!(r.release(200).unwrap(), Some(300), "nothing held");
        assert_eq!(r.want(300), None, "credited already");
        r.accept(Slot { seq: 3, start: 300, len: 50 }).unwrap();
        r.release(300).unwrap();
        assert_eq!(r.want(320), None, "credited when nothing was held");
        r.accept(Slot { seq: 4, start: 350, len: 50 }).unwrap();
        assert_eq!(r.want(350), None, "freed up to 350 and credited already");
    }

    #[test]
    fn a_credit_that_could_not_be_sent_is_owed_again() {
        let mut r = RecvWindow::new(1000, 500).unwrap();
        r.accept(Slot { seq: 0, start: 0, len: 100 }).unwrap();
        assert_eq!(r.release(0).unwrap(), Some(100), "nothing held");
        r.credit_sent(100);
        r.accept(Slot { seq: 1, start: 100, len: 100 }).unwrap();
        assert_eq!(r.release(100).unwrap(), Some(200));
        r.credit_lost();
        assert_eq!(r.flush(), Some(200), "the lost credit goes again");
        r.credit_lost();
        assert_eq!(r.want(150), Some(200), "asked for: the lost credit goes again");
        r.credit_sent(200);
        r.credit_lost();
        assert_eq!(r.flush(), None, "nothing lost since the last credit sent");
    }

    #[test]
    fn credits_wait_for_the_oldest_message_and_come_in_batches() {
        let mut r = RecvWindow::new(100, 25).unwrap();
        for (seq, start) in [(0, 0), (1, 10), (2, 20), (3, 30)] {
            r.accept(Slot { seq, start, len: 10 }).unwrap();
        }
        assert_eq!(r.release(10).unwrap(), None, "message 0 is still held");
        assert_eq!(r.release(0).unwrap(), None, "20 bytes free: below the batch");
        assert_eq!(r.release(20).unwrap(), Some(30));
        assert_eq!(r.flush(), None);
        assert_eq!(r.release(30).unwrap(), Some(40), "nothing held: credit at once");
    }

    #[derive(Debug, Clone)]
    enum Step {
        Send(u64),
        Deliver,
        Release(usize),
        Credit,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u64..=64).prop_map(Step::Send),
            Just(Step::Deliver),
            any::<usize>().prop_map(Step::Release),
            Just(Step::Credit),
        ]
    }

    proptest! {
        /// A sender and a receiver with messages and credits in flight, releases in any
        /// order: the sender never writes over bytes the receiver still holds (or has
        /// not seen yet), the receiver accepts every honest announcement in order, and
        /// once everything is released and credited the whole buffer is free again.
        #[test]
        fn no_message_overwrites_another(steps in prop::collection::vec(step(), 1..400), batch in 1u64..=64) {
            const CAP: u64 = 64;
            let mut send = SendWindow::new(CAP).unwrap();
            let mut recv = RecvWindow::new(CAP, batch).unwrap();
            let mut owner: Vec<Option<u64>> = vec![None; CAP as usize];
            let mut announced = std::collections::VecDeque::new();
            let mut credits = std::collections::VecDeque::new();
            let mut held: Vec<Slot> = Vec::new();
            let cells = |s: &Slot| (s.start..s.end()).map(|p| (p % CAP) as usize).collect::<Vec<_>>();
            for st in steps {
                match st {
                    Step::Send(len) => {
                        if let Some(slot) = send.reserve(len).unwrap() {
                            for c in cells(&slot) {
                                prop_assert_eq!(owner[c], None, "message {} overwrites a held byte", slot.seq);
                                owner[c] = Some(slot.seq);
                            }
                            announced.push_back(slot);
                        }
                    }
                    Step::Deliver => {
                        if let Some(slot) = announced.pop_front() {
                            recv.accept(slot).unwrap();
                            held.push(slot);
                        }
                    }
                    Step::Release(i) => {
                        if !held.is_empty() {
                            let slot = held.swap_remove(i % held.len());
                            for c in cells(&slot) {
                                owner[c] = None;
                            }
                            if let Some(c) = recv.release(slot.start).unwrap() {
                                credits.push_back(c);
                            }
                        }
                    }
                    Step::Credit => {
                        if let Some(c) = credits.pop_front() {
                            send.credit(c).unwrap();
                        }
                    }
                }
            }
            // Drain: deliver, release and credit everything.
            while let Some(slot) = announced.pop_front() {
                recv.accept(slot).unwrap();
                held.push(slot);
            }
            for slot in held.drain(..) {
                if let Some(c) = recv.release(slot.start).unwrap() {
                    credits.push_back(c);
                }
            }
            credits.extend(recv.flush());
            for c in credits {
                send.credit(c).unwrap();
            }
            prop_assert_eq!(send.in_flight(), 0);
            prop_assert!(send.reserve(CAP).unwrap().is_some());
        }
    }
}
