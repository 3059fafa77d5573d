//! Rank coordination for expert-parallel runs: how the ranks (one process per GPU) find each
//! other, swap small blobs (CUDA IPC handles, host names), wait for each other, and learn
//! promptly that one of them died, so that no rank sits in a collective, or in a kernel
//! polling a peer's memory, until some distant timeout.
//!
//! Two backends behind one [`Group`] trait:
//! - [`RankServer`] + [`ServerGroup`]: a small TCP server that the benchmark runner starts in
//!   process, for single-host runs (or any host that can reach it). A rank whose connection
//!   closes without a `leave` is dead; the server tells every other rank at once.
//! - [`EtcdGroup`]: ranks meet in etcd; each rank's presence is a key under its lease, so a
//!   rank that dies disappears when its lease ends and the survivors' watchers notice.
//!
//! Collectives are numbered per rank: the n-th `all_gather` (or `barrier`) call on each rank
//! forms the n-th collective. A collective that times out still counts, so the numbering
//! stays aligned and a later collective can succeed once the slow rank catches up; but a
//! rank that dies fails every pending and later collective on every survivor, immediately.

mod client;
mod collector;
mod etcd;
mod server;
mod wire;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use freight_core::{Error, Result};
use parking_lot::Mutex;

pub use client::ServerGroup;
pub use etcd::{EtcdGroup, EtcdOptions};
pub use server::RankServer;

/// The rank server's decoders, as the fuzz targets drive them (`crates/freight-fuzz`):
/// what ranks and the server send each other is read by these and nothing else. Each
/// takes any bytes, and panics only where an invariant breaks.
#[doc(hidden)]
pub mod fuzzing {
    use super::wire::{self, ToRank, ToServer};

    /// Decodes `line` as a message to the server and as one to a rank; whatever decodes
    /// encodes to a line that decodes to the same message.
    pub fn message(line: &[u8]) {
        if let Ok(m) = wire::decode::<ToServer>(line) {
            let again = wire::encode(&m).expect("a decoded message encodes");
            assert_eq!(wire::decode::<ToServer>(&again[..again.len() - 1]).expect("and decodes again"), m);
        }
        if let Ok(m) = wire::decode::<ToRank>(line) {
            let again = wire::encode(&m).expect("a decoded message encodes");
            assert_eq!(wire::decode::<ToRank>(&again[..again.len() - 1]).expect("and decodes again"), m);
        }
        if let Ok(text) = std::str::from_utf8(line) {
            if let Ok(bytes) = wire::base64_decode(text) {
                assert_eq!(wire::base64_decode(&wire::base64_encode(&bytes)).as_deref(), Ok(&bytes[..]));
            }
        }
    }

    /// Cuts `bytes` into lines as a connection's reader does, and decodes each.
    pub fn stream(bytes: &[u8]) {
        let mut reader = std::io::BufReader::new(bytes);
        let mut line = Vec::new();
        while let Ok(true) = wire::read_line(&mut reader, &mut line) {
            assert!(line.len() <= wire::MAX_LINE && !line.contains(&b'\n'));
            message(&line);
        }
    }
}

/// Called with `(rank, reason)` of the first rank found dead, or with
/// [`RENDEZVOUS_LOST`] for the rank where the rendezvous itself was lost first.
pub type DeathHook = Box<dyn Fn(usize, &str) + Send + Sync>;

/// The rank death hooks get when the rendezvous itself was lost (the rank server went
/// away): no rank is known dead ([`Group::dead`] stays `None`), but no death can be
/// learnt any more either, so whatever waits on the peers must stop instead of running
/// to its timeout.
pub const RENDEZVOUS_LOST: usize = usize::MAX;

/// A joined group of `world` ranks.
pub trait Group: Send + Sync {
    fn rank(&self) -> usize;

    fn world(&self) -> usize;

    /// Collective: every rank contributes a blob; returns all blobs in rank order. The n-th
    /// call on each rank forms the n-th collective. Fails with `PeerDisconnected` as soon as
    /// a rank is known dead, with `Timeout` (naming the ranks still missing) after `timeout`.
    fn all_gather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// Returns once every rank has reached the same barrier (it is an empty `all_gather`,
    /// so it takes a collective number like any other).
    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.all_gather(&[], timeout).map(drop)
    }

    /// The first rank known to have died, with why, if any.
    fn dead(&self) -> Option<(usize, String)>;

    /// Runs `hook(rank, reason)` once when a rank is found dead (or the rendezvous is lost:
    /// [`RENDEZVOUS_LOST`]), or at once if one already is: the place to raise the abort flag that GPU kernels poll, since a kernel waiting on
    /// a dead peer never returns to check a `Result`. Runs on the group's background thread
    /// (or the caller's, if the death is already known); keep it short and non-blocking.
    fn on_dead(&self, hook: DeathHook);

    /// Leaves cleanly: the others do not see this rank as dead, although a collective that
    /// needed it fails. Dropping a group without leaving looks like a death to the others.
    fn leave(&self) -> Result<()>;
}

/// The first death seen by one rank and the hooks waiting for it.
#[derive(Default)]
pub(crate) struct Deaths {
    inner: Mutex<DeathsInner>,
}

#[derive(Default)]
struct DeathsInner {
    first: Option<(usize, String)>,
    /// Why the rendezvous was lost, if it was before any death.
    lost: Option<String>,
    hooks: Vec<DeathHook>,
}

impl Deaths {
    pub(crate) fn first(&self) -> Option<(usize, String)> {
        self.inner.lock().first.clone()
    }

    /// Records a death; only the first one counts and fires the hooks. Returns whether this
    /// was the first.
    pub(crate) fn report(&self, rank: usize, reason: &str) -> bool {
        let hooks = {
            let mut inner = self.inner.lock();
            if inner.first.is_some() {
                return false;
            }
            inner.first = Some((rank, reason.to_owned()));
            std::mem::take(&mut inner.hooks)
        };
        // Outside the lock: a hook may well call `dead()`.
        for hook in &hooks {
            run_hook(hook, rank, reason);
        }
        true
    }

    /// Records that the rendezvous was lost: fires the hooks (once, and only if no death
    /// fired them) with [`RENDEZVOUS_LOST`], leaving `first` empty since no rank is known
    /// dead.
    pub(crate) fn lost(&self, reason: &str) {
        let hooks = {
            let mut inner = self.inner.lock();
            if inner.first.is_some() || inner.lost.is_some() {
                return;
            }
            inner.lost = Some(reason.to_owned());
            std::mem::take(&mut inner.hooks)
        };
        for hook in &hooks {
            run_hook(hook, RENDEZVOUS_LOST, reason);
        }
    }

    pub(crate) fn on_dead(&self, hook: DeathHook) {
        let (rank, reason) = {
            let mut inner = self.inner.lock();
            match (&inner.first, &inner.lost) {
                (Some(first), _) => first.clone(),
                (None, Some(lost)) => (RENDEZVOUS_LOST, lost.clone()),
                (None, None) => {
                    inner.hooks.push(hook);
                    return;
                }
            }
        };
        run_hook(&hook, rank, &reason);
    }
}

/// A panicking hook must not take down the thread that reports deaths to everyone else.
fn run_hook(hook: &DeathHook, rank: usize, reason: &str) {
    if catch_unwind(AssertUnwindSafe(|| hook(rank, reason))).is_err() {
        tracing::error!(rank, "a rendezvous death hook panicked");
    }
}

/// The error every collective returns once `rank` is known dead.
pub(crate) fn dead_error(rank: usize, reason: &str) -> Error {
    Error::PeerDisconnected { peer: format!("rank {rank}"), reason: reason.to_owned() }
}

pub(crate) fn check_rank(rank: usize, world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidArgument("world size 0: a group needs at least one rank".into()));
    }
    if rank >= world {
        return Err(Error::InvalidArgument(format!("rank {rank} out of range for world size {world}")));
    }
    Ok(())
}

/// Names the ranks a collective still waits for, and which of them have not even joined,
/// since "not started" and "started but stuck" call for different fixes.
pub(crate) fn describe_missing(missing: &[usize], absent: &[usize]) -> String {
    if missing.is_empty() {
        return "no rank is missing any more (it completed just after the deadline)".into();
    }
    let list = |ranks: &[usize]| ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    let mut text = match missing {
        [one] => format!("waiting for rank {one}"),
        many => format!("waiting for ranks {}", list(many)),
    };
    let absent: Vec<usize> = missing.iter().copied().filter(|r| absent.contains(r)).collect();
    match absent.as_slice() {
        [] => {}
        [one] => text.push_str(&format!(" (rank {one} has not joined)")),
        many => text.push_str(&format!(" (ranks {} have not joined)", list(many))),
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn hooks_fire_once_for_the_first_death_and_late_hooks_at_once() {
        let deaths = Deaths::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        deaths.on_dead(Box::new(move |rank, reason| {
            assert_eq!((rank, reason), (2, "gone"));
            c.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(deaths.report(2, "gone"));
        assert!(!deaths.report(3, "also gone"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(deaths.first(), Some((2, "gone".to_string())));

        let c = calls.clone();
        deaths.on_dead(Box::new(move |rank, _| {
            assert_eq!(rank, 2);
            c.fetch_add(10, Ordering::SeqCst);
        }));
        assert_eq!(calls.load(Ordering::SeqCst), 11);
    }

    #[test]
    fn a_lost_rendezvous_fires_the_hooks_once_without_a_death() {
        let deaths = Deaths::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        deaths.on_dead(Box::new(move |rank, reason| s.lock().push((rank, reason.to_owned()))));
        deaths.lost("the rank server was lost");
        deaths.lost("again");
        assert_eq!(*seen.lock(), [(RENDEZVOUS_LOST, "the rank server was lost".to_owned())]);
        assert_eq!(deaths.first(), None);
        // A hook set later fires at once; a death found later fires nothing again.
        let s = seen.clone();
        deaths.on_dead(Box::new(move |rank, _| s.lock().push((rank, String::new()))));
        assert!(deaths.report(1, "gone"));
        assert_eq!(seen.lock().len(), 2);
        assert_eq!(seen.lock()[1].0, RENDEZVOUS_LOST);
        assert_eq!(deaths.first(), Some((1, "gone".to_string())));
    }

    #[test]
    fn a_panicking_hook_does_not_stop_the_others() {
        let deaths = Deaths::default();
        let calls = Arc::new(AtomicUsize::new(0));
        deaths.on_dead(Box::new(|_, _| panic!("hook failure")));
        let c = calls.clone();
        deaths.on_dead(Box::new(move |_, _| {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        deaths.report(0, "x");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn missing_ranks_are_described() {
        assert_eq!(describe_missing(&[2], &[]), "waiting for rank 2");
        assert_eq!(describe_missing(&[1, 3], &[3]), "waiting for ranks 1, 3 (rank 3 has not joined)");
        assert_eq!(describe_missing(&[1, 3], &[1, 3]), "waiting for ranks 1, 3 (ranks 1, 3 have not joined)");
        assert!(describe_missing(&[], &[]).contains("completed"));
    }

    #[test]
    fn ranks_are_checked() {
        assert!(check_rank(0, 1).is_ok());
        assert!(matches!(check_rank(0, 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(check_rank(4, 4), Err(Error::InvalidArgument(_))));
    }
}
