//! The notification ring: one producer and one consumer, in two processes, sharing a
//! piece of memory and nothing else. This module is the ring alone, over raw memory,
//! so it is tested without processes or sockets; `freight_core::doorbell` puts it in a
//! shared segment and rings the peer when it may be asleep.
//!
//! Layout: three cache lines of header (the producer's position; the consumer's
//! position and whether it may be asleep; magic and capacity), then `capacity` bytes
//! of records. Positions count
//! bytes since the ring was made and only grow; a position's place in the ring is the
//! position modulo the capacity. Each side writes one line only, so neither slows the
//! other down by stealing the line it writes.
//!
//! A record is a u32 word (payload length and flags), the payload, and padding to 8
//! bytes; one that reaches the end of the ring continues at its start (the word itself
//! never straddles the end: records start at multiples of 8). A message larger than a
//! quarter of the ring travels as several records, so a message of any size fits, and a
//! producer waiting for room needs a quarter of the ring to move on, not the whole.

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Spacing of the header's fields: two lines, since Intel CPUs fetch lines in pairs.
pub const LINE: usize = 128;
/// Bytes before the records.
pub const HEADER: usize = 3 * LINE;
const PRODUCER: usize = 0;
const CONSUMER: usize = LINE;
/// Nonzero unless the consumer's agent said it polls for notifications: then a
/// producer need not ring when the consumer has caught up (see [`Consumer::set_asleep`]).
const ASLEEP: usize = LINE + 8;
const MAGIC_AT: usize = 2 * LINE;
const CAPACITY_AT: usize = 2 * LINE + 8;
const MAGIC: u64 = u64::from_le_bytes(*b"FRTRING1");

/// The message continues in the next record.
const MORE: u32 = 1 << 31;
/// The producer gave up on the message it had started (it timed out): drop its pieces.
const DISCARD: u32 = 1 << 30;
const LEN_MASK: u32 = DISCARD - 1;
const WORD: u64 = 4;

/// Capacities must be multiples of this (so a quarter of the ring is a whole number of
/// 8-byte units) and at least [`MIN_CAPACITY`].
const CAPACITY_UNIT: u64 = 64;
pub const MIN_CAPACITY: u64 = 1024;

/// Bytes a record of `len` payload bytes takes in the ring.
fn record_size(len: usize) -> u64 {
    (WORD + len as u64 + 7) & !7
}

/// The memory of one ring and the positions in its header.
struct Raw {
    base: NonNull<u8>,
    cap: u64,
}

impl Raw {
    /// # Safety
    /// `base` must point to `len` bytes that stay valid and mapped as long as the result
    /// lives, and are written only through rings (one producer, one consumer).
    unsafe fn new(base: *mut u8, len: usize) -> Result<Raw> {
        let base = NonNull::new(base).ok_or_else(|| bad("null memory"))?;
        if base.as_ptr().align_offset(8) != 0 {
            return Err(bad("memory is not 8-byte aligned"));
        }
        let cap = (len as u64).checked_sub(HEADER as u64).ok_or_else(|| bad(format!("{len} bytes hold no header")))?;
        if cap < MIN_CAPACITY || cap % CAPACITY_UNIT != 0 {
            return Err(bad(format!("capacity {cap} is not a multiple of {CAPACITY_UNIT} of at least {MIN_CAPACITY}")));
        }
        Ok(Raw { base, cap })
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is a header offset, 8-aligned inside the memory `new` checked.
        unsafe { &*(self.base.as_ptr().add(at) as *const AtomicU64) }
    }

    fn producer(&self) -> &AtomicU64 {
        self.word(PRODUCER)
    }

    fn consumer(&self) -> &AtomicU64 {
        self.word(CONSUMER)
    }

    fn asleep(&self) -> &AtomicU64 {
        self.word(ASLEEP)
    }

    /// Where position `pos` lies in memory.
    fn at(&self, pos: u64) -> *mut u8 {
        // SAFETY: the offset is below the capacity, inside the memory.
        unsafe { self.base.as_ptr().add(HEADER + (pos % self.cap) as usize) }
    }

    /// Largest payload of one record: records take at most a quarter of the ring.
    fn max_fragment(&self) -> usize {
        (self.cap / 4 - WORD) as usize
    }

    /// Copies `src` into the ring from position `pos` on, continuing at the start.
    ///
    /// # Safety
    /// `[pos, pos + src.len())` must be room the consumer has released.
    unsafe fn put(&self, pos: u64, src: &[u8]) {
        let first = src.len().min((self.cap - pos % self.cap) as usize);
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.at(pos), first);
        std::ptr::copy_nonoverlapping(src[first..].as_ptr(), self.at(0), src.len() - first);
    }

    /// Appends `len` bytes of the ring from position `pos` on to `out`.
    ///
    /// # Safety
    /// `[pos, pos + len)` must be bytes the producer has published.
    unsafe fn take(&self, pos: u64, len: usize, out: &mut Vec<u8>) {
        let first = len.min((self.cap - pos % self.cap) as usize);
        out.extend_from_slice(std::slice::from_raw_parts(self.at(pos), first));
        out.extend_from_slice(std::slice::from_raw_parts(self.at(0), len - first));
    }
}

fn bad(why: impl std::fmt::Display) -> Error {
    Error::Protocol(format!("notification ring: {why}"))
}

/// What one [`Producer::write`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The whole message is in the ring.
    pub done: bool,
    /// The consumer must be woken to see what was written: a record went into a ring it
    /// had found empty while it may be asleep, or the ring is more than half full.
    pub wake: bool,
}

/// The writing side. One per ring: `&mut self` makes every write exclusive.
pub struct Producer {
    raw: Raw,
    /// Our position (only we write it, so it need not be read back).
    head: u64,
    /// The consumer's position as last read: re-read only when room seems short.
    tail: u64,
    /// A message was started and not finished (the writer gave up waiting for room).
    abandoned: bool,
}

// The ring's memory is owned by whoever made the producer; the producer is the only
// writer of its side, wherever it moves.
unsafe impl Send for Producer {}

impl Producer {
    /// Lays out a new, empty ring over `len` bytes at `base`.
    ///
    /// # Safety
    /// As for the memory of any ring: `base` points to `len` writable bytes that outlive
    /// the producer, and nobody else writes the producer's side.
    pub unsafe fn init(base: *mut u8, len: usize) -> Result<Producer> {
        let raw = Raw::new(base, len)?;
        raw.producer().store(0, Ordering::Relaxed);
        raw.consumer().store(0, Ordering::Relaxed);
        // Until the consumer says otherwise, it may be asleep.
        raw.asleep().store(1, Ordering::Relaxed);
        raw.word(CAPACITY_AT).store(raw.cap, Ordering::Relaxed);
        raw.word(MAGIC_AT).store(MAGIC, Ordering::Release);
        Ok(Producer { raw, head: 0, tail: 0, abandoned: false })
    }

    /// Whether the consumer has taken everything written so far.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.raw.consumer().load(Ordering::Acquire) == self.head
    }

    fn room(&mut self, size: u64) -> bool {
        if self.raw.cap - (self.head - self.tail) >= size {
            return true;
        }
        // Acquire: the consumer has read the bytes we are about to overwrite.
        self.tail = self.raw.consumer().load(Ordering::Acquire);
        self.raw.cap - (self.head - self.tail) >= size
    }

    /// Whether the next record of a message of which `sent` bytes went already would fit
    /// now (for a writer waiting for room).
    pub fn ready(&mut self, msg: &[u8], sent: usize) -> bool {
        let first = if sent == 0 && self.abandoned { record_size(0) } else { 0 };
        let n = (msg.len() - sent).min(self.raw.max_fragment());
        self.room(first + record_size(n))
    }

    /// Publishes one record and tells whether the consumer may be asleep.
    fn record(&mut self, flags: u32, payload: &[u8]) -> bool {
        let start = self.head;
        // SAFETY: `room` checked that the consumer released these bytes.
        unsafe {
            self.raw.put(start, &(payload.len() as u32 | flags).to_le_bytes());
            self.raw.put(start + WORD, payload);
        }
        self.head = start + record_size(payload.len());
        self.raw.producer().store(self.head, Ordering::Release);
        // Dekker with `Consumer::drain` and `Consumer::set_asleep`: either the consumer,
        // after releasing the ring or before going to sleep, sees this record, or we see
        // that it had caught up with `start` while it may sleep, and ring.
        fence(Ordering::SeqCst);
        let asleep = self.raw.asleep().load(Ordering::Relaxed) != 0;
        self.tail = self.raw.consumer().load(Ordering::Acquire);
        // Past half full, ring whatever the consumer said: an application that polls
        // and then stops must not leave the ring to fill up and stall its senders.
        (asleep && self.tail == start) || (self.head - self.tail) * 2 > self.raw.cap
    }

    /// Writes as much of `msg[*sent..]` as fits, a whole record at a time, and advances
    /// `*sent`. Call with `*sent == 0` for each new message, and again with the same
    /// message after waiting for room until `done`. A message started and then not
    /// finished (its writer gave up) is dropped by the consumer once the next one starts.
    pub fn write(&mut self, msg: &[u8], sent: &mut usize) -> Written {
        let mut wake = false;
        if *sent == 0 && self.abandoned {
            if !self.room(record_size(0)) {
                return Written { done: false, wake };
            }
            wake |= self.record(DISCARD, &[]);
            self.abandoned = false;
        }
        loop {
            let rest = &msg[*sent..];
            let n = rest.len().min(self.raw.max_fragment());
            let more = n < rest.len();
            if !self.room(record_size(n)) {
                // Pieces already written stay unless the message is finished later.
                self.abandoned = *sent > 0;
                return Written { done: false, wake };
            }
            wake |= self.record(if more { MORE } else { 0 }, &rest[..n]);
            *sent += n;
            if !more {
                self.abandoned = false;
                return Written { done: true, wake };
            }
        }
    }
}

/// The reading side. It trusts nothing it reads: a corrupt ring is an error, never a
/// read outside the ring or an unbounded allocation.
pub struct Consumer {
    raw: Raw,
    tail: u64,
    /// Pieces of a message that continues in records not yet published.
    partial: Vec<u8>,
    max_message: usize,
    broken: Option<Error>,
}

// As for `Producer`: the consumer is the only writer of its side.
unsafe impl Send for Consumer {}

impl Consumer {
    /// Opens the ring laid out at `base` by a producer; messages above `max_message`
    /// bytes are corruption.
    ///
    /// # Safety
    /// As for [`Producer::init`], for the consumer's side.
    pub unsafe fn attach(base: *mut u8, len: usize, max_message: usize) -> Result<Consumer> {
        let raw = Raw::new(base, len)?;
        if raw.word(MAGIC_AT).load(Ordering::Acquire) != MAGIC {
            return Err(bad("no ring there (bad magic)"));
        }
        let cap = raw.word(CAPACITY_AT).load(Ordering::Relaxed);
        if cap != raw.cap {
            return Err(bad(format!("the header says {cap} bytes, the memory holds {}", raw.cap)));
        }
        // The producer laid the header out, so the starting position is as trustworthy
        // as the producer: records start at multiples of 8, and a word read from
        // anywhere else could run past the ring's end.
        let tail = raw.consumer().load(Ordering::Acquire);
        if tail % 8 != 0 {
            return Err(bad(format!("the consumer's position {tail} is not a multiple of 8")));
        }
        Ok(Consumer { raw, tail, partial: Vec::new(), max_message, broken: None })
    }

    /// Tells the producer whether this consumer may be asleep. A consumer that says no
    /// (its application polls) is not rung for while the ring is less than half full:
    /// it finds new records when it next looks. Before sleeping, a consumer says yes and
    /// then looks once more (Dekker with `Producer::record`).
    pub fn set_asleep(&self, asleep: bool) {
        self.raw.asleep().store(asleep as u64, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Hands every complete message in the ring to `deliver`, oldest first, and returns
    /// how many. Once it returns, the ring was empty after it had released its room (so a
    /// producer that writes later sees that and wakes the consumer).
    pub fn drain(&mut self, mut deliver: impl FnMut(Vec<u8>)) -> Result<usize> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let mut n = 0;
        loop {
            let head = self.raw.producer().load(Ordering::Acquire);
            if head == self.tail {
                return Ok(n);
            }
            if let Err(e) = self.take_until(head, &mut |m| {
                n += 1;
                deliver(m)
            }) {
                self.broken = Some(e.clone());
                return Err(e);
            }
            self.raw.consumer().store(self.tail, Ordering::Release);
            // Dekker with `Producer::record`: look again after releasing the room.
            fence(Ordering::SeqCst);
        }
    }

    fn take_until(&mut self, head: u64, deliver: &mut dyn FnMut(Vec<u8>)) -> Result<()> {
        if head < self.tail || head - self.tail > self.raw.cap || head & 7 != 0 {
            return Err(bad(format!("producer at {head}, consumer at {}", self.tail)));
        }
        while self.tail < head {
            let mut word = [0u8; 4];
            // SAFETY: the producer published up to `head`, and a word never straddles
            // the end; `put` writes within the ring whatever the values.
            unsafe { std::ptr::copy_nonoverlapping(self.raw.at(self.tail), word.as_mut_ptr(), 4) };
            let word = u32::from_le_bytes(word);
            let len = (word & LEN_MASK) as usize;
            let size = record_size(len);
            if len > self.raw.max_fragment() || size > head - self.tail {
                return Err(bad(format!("a record of {len} bytes at {} (producer at {head})", self.tail)));
            }
            if word & DISCARD != 0 {
                self.partial.clear();
            } else {
                if self.partial.len() + len > self.max_message {
                    return Err(bad(format!("a message of more than {} bytes", self.max_message)));
                }
                // SAFETY: `size` bytes from `tail` are published (checked above).
                unsafe { self.raw.take(self.tail + WORD, len, &mut self.partial) };
                if word & MORE == 0 {
                    deliver(std::mem::take(&mut self.partial));
                }
            }
            self.tail += size;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Ring memory on the heap, 8-byte aligned.
    struct Mem(Vec<u64>);

    impl Mem {
        fn new(cap: u64) -> Mem {
            Mem(vec![0; (HEADER + cap as usize) / 8])
        }
        fn base(&mut self) -> *mut u8 {
            self.0.as_mut_ptr().cast()
        }
        fn len(&self) -> usize {
            self.0.len() * 8
        }
        fn pair(&mut self, max_message: usize) -> (Producer, Consumer) {
            // SAFETY: the memory outlives both (tests keep `Mem` alive).
            unsafe {
                let p = Producer::init(self.base(), self.len()).unwrap();
                let c = Consumer::attach(self.base(), self.len(), max_message).unwrap();
                (p, c)
            }
        }
    }

    fn drain_all(c: &mut Consumer) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        c.drain(|m| got.push(m)).unwrap();
        got
    }

    /// Writes `msg` whole, draining into `got` whenever the ring is full.
    fn send(p: &mut Producer, c: &mut Consumer, msg: &[u8], got: &mut Vec<Vec<u8>>) {
        let mut sent = 0;
        while !p.write(msg, &mut sent).done {
            got.extend(drain_all(c));
        }
    }

    #[test]
    fn messages_come_out_whole_and_in_order() {
        let mut mem = Mem::new(4096);
        let (mut p, mut c) = mem.pair(1 << 20);
        for m in [&b""[..], b"a", b"seven b", b"exactly eight...", &[9u8; 1000]] {
            let mut sent = 0;
            assert!(p.write(m, &mut sent).done);
            assert_eq!(sent, m.len());
        }
        let got = drain_all(&mut c);
        assert_eq!(
            got,
            vec![b"".to_vec(), b"a".to_vec(), b"seven b".to_vec(), b"exactly eight...".to_vec(), vec![9; 1000]]
        );
        assert!(drain_all(&mut c).is_empty());
        assert!(p.is_empty());
    }

    #[test]
    fn a_full_ring_takes_nothing_until_the_consumer_frees_room() {
        let cap = 4096;
        let mut mem = Mem::new(cap);
        let (mut p, mut c) = mem.pair(1 << 20);
        let msg = [7u8; 100]; // 104 bytes of ring each
        let mut fitted = 0;
        loop {
            let mut sent = 0;
            let w = p.write(&msg, &mut sent);
            if !w.done {
                assert_eq!(sent, 0, "a one-record message goes in whole or not at all");
                break;
            }
            fitted += 1;
        }
        assert_eq!(fitted, cap / 104);
        assert!(!p.ready(&msg, 0));
        assert_eq!(drain_all(&mut c).len() as u64, fitted);
        assert!(p.ready(&msg, 0));
        let mut sent = 0;
        assert!(p.write(&msg, &mut sent).done);
        assert_eq!(drain_all(&mut c), vec![msg.to_vec()]);
    }

    #[test]
    fn the_producer_rings_only_when_the_consumer_caught_up() {
        let mut mem = Mem::new(4096);
        let (mut p, mut c) = mem.pair(1 << 20);
        let write = |p: &mut Producer, m: &[u8]| {
            let mut sent = 0;
            let w = p.write(m, &mut sent);
            assert!(w.done);
            w.wake
        };
        assert!(write(&mut p, b"first"), "an empty ring: the consumer may sleep");
        assert!(!write(&mut p, b"second"), "it has not drained the first yet: it will see this");
        assert!(!p.is_empty());
        assert_eq!(drain_all(&mut c).len(), 2);
        assert!(p.is_empty());
        assert!(write(&mut p, b"third"), "drained: it may be asleep again");
        // A message of several records rings once, for its first record (less than half
        // the ring: past half, every record rings).
        let big = vec![1u8; 1500];
        let mut sent = 0;
        let w = p.write(&big, &mut sent);
        assert_eq!(w, Written { done: true, wake: false });
        assert_eq!(drain_all(&mut c), vec![b"third".to_vec(), big.clone()]);
        let mut sent = 0;
        assert_eq!(p.write(&big, &mut sent), Written { done: true, wake: true });
    }

    #[test]
    fn a_polling_consumer_is_rung_only_for_a_ring_half_full() {
        let mut mem = Mem::new(4096);
        let (mut p, mut c) = mem.pair(1 << 20);
        c.set_asleep(false);
        let mut write = |m: &[u8]| {
            let mut sent = 0;
            let w = p.write(m, &mut sent);
            assert!(w.done);
            w.wake
        };
        assert!(!write(b"first"), "caught up, but it polls: no ring");
        assert_eq!(drain_all(&mut c).len(), 1);
        // 4096 bytes of ring: records of 400 bytes ring once they fill more than half.
        let rings: Vec<bool> = (0..8).map(|_| write(&[7u8; 396])).collect();
        assert_eq!(rings, vec![false, false, false, false, false, true, true, true]);
        assert_eq!(drain_all(&mut c).len(), 8);
        c.set_asleep(true);
        assert!(write(b"again"), "about to sleep: ring");
    }

    #[test]
    fn a_consumer_that_caught_up_between_records_is_woken() {
        let mut mem = Mem::new(1024);
        let (mut p, mut c) = mem.pair(1 << 20);
        let big = vec![3u8; 1500]; // 6 records of at most 252 bytes; 4 fit at a time
        let mut sent = 0;
        let w = p.write(&big, &mut sent);
        assert_eq!(w, Written { done: false, wake: true });
        assert!(sent > 0 && sent < big.len());
        assert!(drain_all(&mut c).is_empty(), "pieces are not a message");
        let w = p.write(&big, &mut sent);
        assert!(w.done && w.wake, "the consumer had taken every piece: it may sleep");
        assert_eq!(drain_all(&mut c), vec![big]);
    }

    #[test]
    fn an_abandoned_message_is_dropped_and_the_next_arrives() {
        let mut mem = Mem::new(1024);
        let (mut p, mut c) = mem.pair(1 << 20);
        let big = vec![5u8; 3000];
        let mut sent = 0;
        assert!(!p.write(&big, &mut sent).done);
        assert!(drain_all(&mut c).is_empty());
        // The writer gives up on `big`; the next message starts afresh.
        let mut got = Vec::new();
        send(&mut p, &mut c, b"next", &mut got);
        got.extend(drain_all(&mut c));
        assert_eq!(got, vec![b"next".to_vec()]);
    }

    #[test]
    fn bad_memory_and_headers_are_refused() {
        let mut mem = Mem::new(4096);
        // SAFETY: the memory outlives every ring made here.
        unsafe {
            assert!(Consumer::attach(mem.base(), mem.len(), 100).is_err(), "no magic yet");
            assert!(Producer::init(mem.base(), HEADER + 100).is_err(), "capacity too small");
            assert!(Producer::init(mem.base(), HEADER + 4000).is_err(), "capacity not a multiple");
            assert!(Producer::init(mem.base().add(4), mem.len() - 8).is_err(), "misaligned");
            assert!(Producer::init(std::ptr::null_mut(), mem.len()).is_err());
            Producer::init(mem.base(), mem.len()).unwrap();
            assert!(Consumer::attach(mem.base(), mem.len() - 64, 100).is_err(), "capacity disagrees");
            Consumer::attach(mem.base(), mem.len(), 100).unwrap();
        }
    }

    #[test]
    fn a_ring_whose_consumer_position_is_not_aligned_is_refused() {
        let mut mem = Mem::new(1024);
        let (p, _) = mem.pair(100);
        // One byte before the end: a word read there would take 3 bytes past the ring.
        p.raw.consumer().store(1024 - 1, Ordering::Release);
        p.raw.producer().store(1024 + 8, Ordering::Release);
        // SAFETY: the memory outlives the attempt.
        let e = unsafe { Consumer::attach(mem.base(), mem.len(), 100) }.err().expect("refused");
        assert!(e.to_string().contains("not a multiple of 8"), "{e}");
        p.raw.consumer().store(1024, Ordering::Release);
        unsafe { Consumer::attach(mem.base(), mem.len(), 100) }.expect("an aligned position is taken");
    }

    #[test]
    fn corrupt_positions_and_lengths_are_errors() {
        let mut mem = Mem::new(1024);
        let (p, mut c) = mem.pair(100);
        // The producer claims more than the ring holds.
        p.raw.producer().store(5000, Ordering::Release);
        assert!(c.drain(|_| ()).is_err());
        assert!(c.drain(|_| ()).is_err(), "a broken ring stays broken");

        let (mut p, mut c) = mem.pair(100);
        let mut sent = 0;
        p.write(b"hello", &mut sent);
        // A length running past what was published.
        unsafe { std::ptr::write(p.raw.at(0).cast::<u32>(), 200u32.to_le()) };
        assert!(c.drain(|_| ()).is_err());

        let (mut p, mut c) = mem.pair(100);
        let mut sent = 0;
        assert!(p.write(&[0u8; 150], &mut sent).done, "the ring takes it...");
        assert!(c.drain(|_| ()).is_err(), "...but the consumer refuses messages over its limit");
    }

    /// A consumer that drains only when rung, as the target's connection thread does,
    /// racing a producer: if a needed wake-up were ever skipped, the last messages would
    /// stay in the ring and the consumer would wait forever.
    #[test]
    fn no_wake_up_is_lost_between_threads() {
        const N: u32 = 200_000;
        let mut mem = Mem::new(4096);
        let (mut p, mut c) = mem.pair(1 << 20);
        let (bell, rung) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let consumer = s.spawn(move || {
                let mut next = 0u32;
                while next < N {
                    if rung.recv_timeout(std::time::Duration::from_secs(10)).is_err() {
                        return Err(format!("stuck at {next} of {N}: a wake-up was lost"));
                    }
                    c.drain(|m| {
                        assert_eq!(m[..4], next.to_le_bytes());
                        next += 1;
                    })
                    .unwrap();
                }
                Ok(())
            });
            'producing: for i in 0..N {
                let mut msg = i.to_le_bytes().to_vec();
                msg.resize(4 + i as usize % 50, 7);
                let mut sent = 0;
                loop {
                    let w = p.write(&msg, &mut sent);
                    if w.wake {
                        let _ = bell.send(());
                    }
                    if w.done {
                        break;
                    }
                    if consumer.is_finished() {
                        break 'producing;
                    }
                    std::thread::yield_now();
                }
            }
            consumer.join().unwrap().unwrap();
        });
    }

    proptest! {
        /// Messages of random sizes (a few larger than the ring) through a small ring, the
        /// consumer draining at random moments: each comes out once, whole, in order.
        #[test]
        fn random_messages_wrap_around_and_arrive_in_order(
            sizes in prop::collection::vec(prop_oneof![0usize..64, 0usize..600, 0usize..5000], 1..60),
            drains in prop::collection::vec(any::<bool>(), 60),
            cap_units in 16u64..40,
        ) {
            let mut mem = Mem::new(cap_units * CAPACITY_UNIT);
            let (mut p, mut c) = mem.pair(1 << 20);
            let msgs: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|k| (i * 31 + k * 7) as u8).collect())
                .collect();
            let mut got = Vec::new();
            for (m, drain) in msgs.iter().zip(drains) {
                send(&mut p, &mut c, m, &mut got);
                if drain {
                    got.extend(drain_all(&mut c));
                }
            }
            got.extend(drain_all(&mut c));
            prop_assert_eq!(got, msgs);
            prop_assert!(p.is_empty());
        }

        /// Whatever the bytes in the ring, the consumer returns messages or an error.
        #[test]
        fn garbage_never_panics(
            words in prop::collection::vec(any::<u64>(), 128),
            head in any::<u64>(),
        ) {
            let mut mem = Mem::new(1024);
            let (p, mut c) = mem.pair(4096);
            // SAFETY: within the ring's 1024 bytes.
            unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), p.raw.at(0).cast::<u64>(), 128) };
            p.raw.producer().store(head % 2048, Ordering::Release);
            let _ = c.drain(|m| assert!(m.len() <= 4096));
        }
    }
}
