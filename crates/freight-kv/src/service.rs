//! What the server does with a data-plane request, apart from moving the bytes: which
//! slots a GET reads and which it pins meanwhile, which slots a PUT reserves, and the
//! outcome of every item once the transfer has ended. The server's I/O loop
//! ([`crate::server`]) runs these around one engine transfer per request.
//!
//! A GET pins each value it found until its transfer has ended, so that a concurrent
//! PUT, DELETE or eviction cannot reuse the slot under the copy. A PUT reserves fresh
//! slots and commits them only after its transfer has succeeded: a reader sees the old
//! value or the new one, never a mix, and a failed or abandoned PUT frees its slots.

use crate::index::{Grant, Index, ReadPin};
use crate::pool::Slot;
use crate::wire::{Buffer, FailCode, Outcome, MAX_KEY};
use freight_core::Error;

/// A GET in flight: copy `copies` (pool slot to the client's buffer), then [`finish`].
///
/// [`finish`]: GetPlan::finish
#[derive(Debug)]
pub struct GetPlan {
    pub copies: Vec<(Slot, Buffer)>,
    outcomes: Vec<Outcome>,
    pins: Vec<ReadPin>,
}

impl GetPlan {
    /// Looks every key up, pinning the values found.
    pub fn new(index: &mut Index, items: &[(Vec<u8>, Buffer)], now_ms: u64) -> GetPlan {
        let mut plan = GetPlan { copies: Vec::new(), outcomes: Vec::with_capacity(items.len()), pins: Vec::new() };
        for (key, buffer) in items {
            if let Err(refused) = check_key(key) {
                plan.outcomes.push(refused);
                continue;
            }
            let outcome = match index.begin_get(key, now_ms) {
                None => Outcome::Missing,
                Some(pin) if pin.len > buffer.len => {
                    let outcome = Outcome::TooLarge { value: pin.len, buffer: buffer.len };
                    index.end_get(pin);
                    outcome
                }
                Some(pin) => {
                    plan.copies.push((pin.slot, buffer.prefix(pin.len)));
                    let outcome = Outcome::Found { len: pin.len, version: pin.version };
                    plan.pins.push(pin);
                    outcome
                }
            };
            plan.outcomes.push(outcome);
        }
        plan
    }

    /// The outcomes as they will be if the copies succeed: the reply that rides on the
    /// transfer.
    pub fn outcomes(&self) -> &[Outcome] {
        &self.outcomes
    }

    /// Releases the pins once the transfer has ended, each value a hit if it was copied.
    /// On failure, returns the outcomes to send instead (the items that were to be
    /// copied failed).
    pub fn finish(self, index: &mut Index, transfer: Result<(), Error>) -> Option<Vec<Outcome>> {
        let served = transfer.is_ok();
        for pin in self.pins {
            if served {
                index.end_get_served(pin);
            } else {
                index.end_get(pin);
            }
        }
        let error = transfer.err()?;
        Some(
            self.outcomes
                .into_iter()
                .map(|o| match o {
                    Outcome::Found { .. } => Outcome::Failed { code: FailCode::Transfer, error: error.to_string() },
                    other => other,
                })
                .collect(),
        )
    }
}

/// A PUT in flight: copy `copies` (the client's buffer into a reserved slot), then
/// [`finish`].
///
/// [`finish`]: PutPlan::finish
#[derive(Debug)]
pub struct PutPlan {
    pub copies: Vec<(Buffer, Slot)>,
    /// Per item: the outcome already decided (a refusal), or the reservation to commit.
    items: Vec<Result<Grant, Outcome>>,
}

impl PutPlan {
    /// Reserves a slot for every value; refused items get their outcome now.
    pub fn new(index: &mut Index, items: &[(Vec<u8>, Buffer)], ttl_ms: u64, now_ms: u64) -> PutPlan {
        let mut plan = PutPlan { copies: Vec::new(), items: Vec::with_capacity(items.len()) };
        for (key, buffer) in items {
            let item = if let Err(refused) = check_key(key) {
                Err(refused)
            } else if buffer.len == 0 {
                Err(invalid("a value of 0 bytes"))
            } else {
                index.begin_put(key, buffer.len, ttl_ms, now_ms).map_err(refusal)
            };
            if let Ok(grant) = &item {
                plan.copies.push((*buffer, grant.slot));
            }
            plan.items.push(item);
        }
        plan
    }

    /// The slot reserved for item `i`, or `None` where the item was refused.
    pub fn slot(&self, i: usize) -> Option<Slot> {
        self.items.get(i)?.as_ref().ok().map(|grant| grant.slot)
    }

    /// Commits the reservations if the transfer succeeded, frees them if not; returns
    /// every item's outcome.
    pub fn finish(self, index: &mut Index, transfer: Result<(), Error>, now_ms: u64) -> Vec<Outcome> {
        self.items
            .into_iter()
            .map(|item| match (item, &transfer) {
                (Err(outcome), _) => outcome,
                (Ok(grant), Ok(())) => match index.commit_put(grant.id, now_ms) {
                    Ok(version) => Outcome::Stored { version },
                    Err(e) => refusal(e),
                },
                (Ok(grant), Err(e)) => {
                    index.abort_put(grant.id);
                    Outcome::Failed { code: FailCode::Transfer, error: e.to_string() }
                }
            })
            .collect()
    }
}

/// Keys are names, not values: a key longer than [`MAX_KEY`] would cost the server's
/// index far more memory than the pool bytes its value is counted for.
fn check_key(key: &[u8]) -> Result<(), Outcome> {
    match key.len() {
        0 => Err(invalid("an empty key")),
        n if n > MAX_KEY => Err(invalid(&format!("a key of {n} bytes (at most {MAX_KEY})"))),
        _ => Ok(()),
    }
}

fn invalid(what: &str) -> Outcome {
    Outcome::Failed { code: FailCode::Invalid, error: format!("{what} cannot be stored or looked up") }
}

fn refusal(e: Error) -> Outcome {
    let code = match e {
        Error::NoSpace(_) => FailCode::NoSpace,
        Error::InvalidArgument(_) => FailCode::Invalid,
        _ => FailCode::Refused,
    };
    let error = match e {
        Error::NoSpace(m) | Error::InvalidArgument(m) => m,
        other => other.to_string(),
    };
    Outcome::Failed { code, error }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexConfig;
    use freight_core::MemKind;

    fn buf(addr: u64, len: u64) -> Buffer {
        Buffer { kind: MemKind::Dram, addr, len, dev: 0 }
    }

    /// An index whose keys count nothing against `capacity`: these tests reckon in
    /// slots alone.
    fn index(capacity: u64, evict: bool) -> Index {
        Index::slots_only(IndexConfig { capacity, evict })
    }

    fn put(ix: &mut Index, key: &[u8], len: u64) -> Outcome {
        let plan = PutPlan::new(ix, &[(key.to_vec(), buf(0x1000, len))], 0, 0);
        plan.finish(ix, Ok(()), 0).remove(0)
    }

    #[test]
    fn a_get_copies_what_it_found_and_answers_every_item() {
        let mut ix = index(1 << 20, true);
        assert!(matches!(put(&mut ix, b"a", 100), Outcome::Stored { .. }));
        let items = vec![(b"a".to_vec(), buf(0x9000, 4096)), (b"b".to_vec(), buf(0xa000, 10))];
        let plan = GetPlan::new(&mut ix, &items, 0);
        assert_eq!(plan.copies.len(), 1);
        assert_eq!(plan.copies[0].1, buf(0x9000, 100), "only the value's bytes are written");
        assert!(matches!(plan.outcomes()[0], Outcome::Found { len: 100, .. }));
        assert_eq!(plan.outcomes()[1], Outcome::Missing);
        assert!(plan.finish(&mut ix, Ok(())).is_none());
        assert_eq!(ix.stats().hits, 1);
        assert_eq!(ix.stats().misses, 1);
    }

    #[test]
    fn keys_longer_than_the_limit_are_refused_and_take_nothing() {
        let mut ix = index(1 << 20, true);
        let long = vec![b'k'; MAX_KEY + 1];
        let refused = put(&mut ix, &long, 100);
        assert!(matches!(&refused, Outcome::Failed { code: FailCode::Invalid, error } if error.contains("at most")));
        assert_eq!(ix.len(), 0);
        let plan = GetPlan::new(&mut ix, &[(long, buf(0x9000, 4096))], 0);
        assert!(plan.copies.is_empty());
        assert!(matches!(&plan.outcomes()[0], Outcome::Failed { code: FailCode::Invalid, .. }));
        assert!(matches!(put(&mut ix, &vec![b'k'; MAX_KEY], 100), Outcome::Stored { .. }), "the limit itself is fine");
    }

    #[test]
    fn a_value_larger_than_the_buffer_names_both_sizes_and_is_not_copied() {
        let mut ix = index(1 << 20, true);
        put(&mut ix, b"big", 5000);
        let plan = GetPlan::new(&mut ix, &[(b"big".to_vec(), buf(0x9000, 4096))], 0);
        assert!(plan.copies.is_empty());
        assert_eq!(plan.outcomes()[0], Outcome::TooLarge { value: 5000, buffer: 4096 });
        assert!(plan.finish(&mut ix, Ok(())).is_none());
        assert_eq!((ix.stats().hits, ix.stats().misses), (0, 0), "neither served nor missing");
    }

    #[test]
    fn a_pinned_value_survives_an_overwrite_until_its_get_ends() {
        let mut ix = index(256, false);
        put(&mut ix, b"k", 128);
        let get = GetPlan::new(&mut ix, &[(b"k".to_vec(), buf(0x9000, 4096))], 0);
        let old = get.copies[0].0;
        // The pool holds two values of 128: the new one must go elsewhere.
        assert!(matches!(put(&mut ix, b"k", 128), Outcome::Stored { .. }));
        let again = GetPlan::new(&mut ix, &[(b"k".to_vec(), buf(0x9000, 4096))], 0);
        assert_ne!(again.copies[0].0, old, "a reader of the old value keeps its slot");
        again.finish(&mut ix, Ok(()));
        // Full: a third value fits only once the old one's reader is done.
        assert!(matches!(put(&mut ix, b"other", 128), Outcome::Failed { code: FailCode::NoSpace, .. }));
        get.finish(&mut ix, Ok(()));
        assert!(matches!(put(&mut ix, b"other", 128), Outcome::Stored { .. }));
    }

    #[test]
    fn a_failed_get_transfer_turns_its_hits_into_failures() {
        let mut ix = index(1 << 20, true);
        put(&mut ix, b"a", 10);
        let items = vec![(b"a".to_vec(), buf(0x9000, 64)), (b"zz".to_vec(), buf(0xa000, 64))];
        let plan = GetPlan::new(&mut ix, &items, 0);
        let out = plan.finish(&mut ix, Err(Error::Io("peer gone".into()))).unwrap();
        assert!(matches!(&out[0], Outcome::Failed { code: FailCode::Transfer, error } if error.contains("peer gone")));
        assert_eq!(out[1], Outcome::Missing);
        assert_eq!((ix.stats().hits, ix.stats().misses), (0, 1), "a value that never arrived is no hit");
    }

    #[test]
    fn a_failed_put_frees_its_slots_and_keeps_the_old_value() {
        let mut ix = index(1 << 20, true);
        let Outcome::Stored { version } = put(&mut ix, b"k", 10) else { panic!() };
        let plan = PutPlan::new(&mut ix, &[(b"k".to_vec(), buf(0x1000, 20))], 0, 0);
        let out = plan.finish(&mut ix, Err(Error::Io("reset".into())), 0);
        assert!(matches!(&out[0], Outcome::Failed { code: FailCode::Transfer, .. }));
        let get = GetPlan::new(&mut ix, &[(b"k".to_vec(), buf(0x9000, 64))], 0);
        assert_eq!(get.outcomes()[0], Outcome::Found { len: 10, version });
        get.finish(&mut ix, Ok(()));
        assert_eq!(ix.stats().pending_puts, 0);
        assert_eq!(ix.pool().used(), 64, "one value of 10 bytes, in one 64-byte aligned slot");
    }

    #[test]
    fn bad_items_are_refused_one_by_one() {
        let mut ix = index(1000, false);
        let items = vec![
            (Vec::new(), buf(0x1000, 10)),
            (b"zero".to_vec(), buf(0x1000, 0)),
            (b"huge".to_vec(), buf(0x1000, 5000)),
            (b"fine".to_vec(), buf(0x1000, 10)),
        ];
        let plan = PutPlan::new(&mut ix, &items, 0, 0);
        assert_eq!(plan.copies.len(), 1);
        let out = plan.finish(&mut ix, Ok(()), 0);
        assert!(matches!(&out[0], Outcome::Failed { code: FailCode::Invalid, error } if error.contains("empty key")));
        assert!(matches!(&out[1], Outcome::Failed { code: FailCode::Invalid, error } if error.contains("0 bytes")));
        assert!(
            matches!(&out[2], Outcome::Failed { code: FailCode::NoSpace, error } if error.contains("5000") && error.contains("1000"))
        );
        assert!(matches!(out[3], Outcome::Stored { .. }));
    }
}
