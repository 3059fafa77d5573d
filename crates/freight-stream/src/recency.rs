//! Which keys of a store were used least recently: the bookkeeping behind an evicting
//! [`crate::storage::StoreReceiver`], kept apart from its I/O so that it is tested alone.
//!
//! A key is used when it is touched ([`Recency::touch`]); the store touches a key when
//! an object arrives under it and when `get` hands it out. [`Recency::victims`] picks
//! the least recently used keys that may go, oldest first, until they free enough.

use std::collections::{BTreeMap, HashMap};

/// Keys in the order of their last use.
#[derive(Debug, Default)]
pub struct Recency {
    /// The stamp of each key's last use; stamps only grow, so the smallest is the oldest.
    stamps: HashMap<String, u64>,
    by_stamp: BTreeMap<u64, String>,
    next: u64,
}

impl Recency {
    pub fn new() -> Recency {
        Recency::default()
    }

    /// Marks `key` used now, tracking it from now on if it was not.
    pub fn touch(&mut self, key: &str) {
        let stamp = self.next;
        self.next += 1;
        match self.stamps.get_mut(key) {
            Some(old) => {
                let key = self.by_stamp.remove(old).expect("every stamped key is ordered");
                *old = stamp;
                self.by_stamp.insert(stamp, key);
            }
            None => {
                self.stamps.insert(key.to_string(), stamp);
                self.by_stamp.insert(stamp, key.to_string());
            }
        }
    }

    /// Stops tracking `key`.
    pub fn forget(&mut self, key: &str) {
        if let Some(stamp) = self.stamps.remove(key) {
            self.by_stamp.remove(&stamp);
        }
    }

    /// Keys tracked.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Keys, least recently used first.
    pub fn oldest_first(&self) -> impl Iterator<Item = &str> {
        self.by_stamp.values().map(String::as_str)
    }

    /// The least recently used keys whose sizes add up to at least `need` bytes, oldest
    /// first. `size_if_free` gives a key's size, or `None` for a key that must stay (in
    /// use elsewhere): those are skipped. `None` when all the others together free less
    /// than `need`: then nothing should go, since evicting would not make room anyway.
    pub fn victims(&self, need: u64, mut size_if_free: impl FnMut(&str) -> Option<u64>) -> Option<Vec<String>> {
        let mut freed = 0;
        let mut victims = Vec::new();
        for key in self.oldest_first() {
            if freed >= need {
                break;
            }
            if let Some(size) = size_if_free(key) {
                freed += size;
                victims.push(key.to_string());
            }
        }
        (freed >= need).then_some(victims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(r: &Recency) -> Vec<&str> {
        r.oldest_first().collect()
    }

    #[test]
    fn keys_are_ordered_by_their_last_use() {
        let mut r = Recency::new();
        for key in ["a", "b", "c"] {
            r.touch(key);
        }
        assert_eq!(order(&r), ["a", "b", "c"]);
        r.touch("a");
        assert_eq!(order(&r), ["b", "c", "a"]);
        r.touch("a");
        assert_eq!(order(&r), ["b", "c", "a"], "a key used again is not tracked twice");
        r.forget("c");
        r.forget("never");
        assert_eq!(order(&r), ["b", "a"]);
        assert_eq!(r.len(), 2);
        r.forget("b");
        r.forget("a");
        assert!(r.is_empty() && r.stamps.is_empty() && r.by_stamp.is_empty());
    }

    #[test]
    fn victims_are_the_oldest_that_may_go_until_enough_is_freed() {
        let mut r = Recency::new();
        for key in ["a", "b", "c", "d"] {
            r.touch(key);
        }
        let size = |_: &str| Some(10);
        assert_eq!(r.victims(0, size), Some(vec![]), "nothing needed, nothing goes");
        assert_eq!(r.victims(1, size).unwrap(), ["a"]);
        assert_eq!(r.victims(10, size).unwrap(), ["a"]);
        assert_eq!(r.victims(11, size).unwrap(), ["a", "b"]);
        assert_eq!(r.victims(40, size).unwrap(), ["a", "b", "c", "d"]);
        // "a" and "c" are in use elsewhere: skipped, not counted.
        let busy = |k: &str| (k != "a" && k != "c").then_some(10);
        assert_eq!(r.victims(15, busy).unwrap(), ["b", "d"]);
        // Sizes differ: one large key may free what several small ones would.
        let sizes = |k: &str| Some(if k == "a" { 100 } else { 1 });
        assert_eq!(r.victims(50, sizes).unwrap(), ["a"]);
        assert_eq!(r.victims(101, sizes).unwrap(), ["a", "b"]);
    }

    #[test]
    fn nothing_goes_when_everything_that_may_go_is_not_enough() {
        let mut r = Recency::new();
        for key in ["a", "b", "c"] {
            r.touch(key);
        }
        assert_eq!(r.victims(31, |_| Some(10)), None);
        assert_eq!(r.victims(21, |k| (k != "b").then_some(10)), None, "a key in use frees nothing");
        assert_eq!(Recency::new().victims(1, |_| Some(10)), None);
        assert_eq!(order(&r), ["a", "b", "c"], "picking victims changes nothing");
    }
}
