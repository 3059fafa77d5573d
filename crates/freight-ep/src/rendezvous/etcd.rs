//! Ranks that meet in etcd, through [`EtcdDirectory`].
//!
//! Keys, all under `{prefix}{group}/` and all under the rank's own lease (so they vanish
//! when the process dies and its lease runs out, or at once when it is dropped):
//! - `alive-{rank}`: the rank's presence (`{"world", "pid", "host"}` as JSON);
//! - `left-{rank}`: the rank left cleanly (published before `alive-{rank}` is withdrawn);
//! - `dead-{rank}`: a survivor's verdict, so that ranks which never saw the dead one alive
//!   (late joiners) agree on who died and why;
//! - `c{n}-{rank}`: the rank's blob for collective `n`.
//!
//! The names are flat (`alive-3`, not `alive/3`) because `EtcdDirectory` keeps one level of
//! names under its prefix. A watcher thread lists the group every `poll`: a rank once seen
//! alive whose `alive` key is gone without a `left` key has died.
//!
//! A group name is for one run: the keys of a finished run linger for up to the lease TTL
//! (a left rank's `left` marker on purpose, so that slow watchers still see it), and would
//! make a rerun under the same name refuse the ranks or see stale blobs. The runner picks a
//! unique name (e.g. with a timestamp or UUID).

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use freight_core::exchange::etcd::EtcdDirectory;
use freight_core::{interrupt, Error, Result};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::{check_rank, dead_error, describe_missing, DeathHook, Deaths, Group};

/// Tunables of an [`EtcdGroup`]; the defaults suit real runs, tests shorten them.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Where groups live in etcd; a group's keys are under `{prefix}{group}/`.
    pub prefix: String,
    /// Lease TTL of this rank's keys: how long a rank that crashed (or lost etcd) still
    /// looks alive. Whole seconds, at least 1.
    pub ttl: Duration,
    /// How often the group is listed to spot deaths, and how often a waiting collective
    /// checks for one.
    pub poll: Duration,
    /// Bound on each etcd call.
    pub call_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            prefix: "freight/ep/".into(),
            ttl: Duration::from_secs(5),
            poll: Duration::from_millis(200),
            call_timeout: Duration::from_secs(2),
        }
    }
}

/// A rank joined through etcd; see the module docs.
pub struct EtcdGroup {
    inner: Arc<Inner>,
    /// Dropping the sender stops the watcher.
    watcher: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
}

struct Inner {
    rank: usize,
    world: usize,
    group: String,
    poll: Duration,
    /// `None` only while dropping.
    dir: Option<EtcdDirectory>,
    next_seq: Mutex<u64>,
    deaths: Deaths,
    view: Mutex<View>,
}

/// What this rank knows about the others.
struct View {
    /// Seen alive at least once: only such a rank can be declared dead.
    seen: Vec<bool>,
    left: Vec<bool>,
    /// "pid 123 on node-a", from the rank's presence; for death reasons.
    who: Vec<Option<String>>,
    /// Once set, every collective fails with it.
    failure: Option<Error>,
    /// On drop, let the lease run out instead of revoking it: after `leave` so that the
    /// `left` marker outlives the process long enough for every watcher to see it.
    linger: bool,
}

#[derive(Serialize, Deserialize)]
struct Presence {
    world: usize,
    pid: u32,
    host: String,
}

fn alive_key(rank: usize) -> String {
    format!("alive-{rank}")
}

fn left_key(rank: usize) -> String {
    format!("left-{rank}")
}

fn dead_key(rank: usize) -> String {
    format!("dead-{rank}")
}

fn blob_key(seq: u64, rank: usize) -> String {
    format!("c{seq}-{rank}")
}

impl EtcdGroup {
    /// Joins `group` as `rank` of `world` through etcd at `endpoints`, with default
    /// [`EtcdOptions`]. Keeps trying to reach etcd until `timeout`; returns once this rank is
    /// published, without waiting for the others (the first collective does that).
    pub fn join(endpoints: &[String], group: &str, rank: usize, world: usize, timeout: Duration) -> Result<EtcdGroup> {
        Self::join_with(endpoints, group, rank, world, timeout, &EtcdOptions::default())
    }

    pub fn join_with(
        endpoints: &[String],
        group: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
        options: &EtcdOptions,
    ) -> Result<EtcdGroup> {
        check_rank(rank, world)?;
        if group.is_empty() || group.contains('/') {
            return Err(Error::InvalidArgument(format!("etcd group name {group:?} is empty or contains '/'")));
        }
        if options.poll.is_zero() {
            return Err(Error::InvalidArgument("zero etcd poll interval".into()));
        }
        let base = if options.prefix.ends_with('/') { options.prefix.clone() } else { format!("{}/", options.prefix) };
        let prefix = format!("{base}{group}/");
        let dir = connect(endpoints, &prefix, options, timeout)?;

        let rejected = |reason: String| Error::RemoteRejected { peer: format!("etcd group '{group}'"), reason };
        let names: HashSet<String> = dir.list()?.into_iter().collect();
        let taken = || rejected(format!("rank {rank} is already taken by a live process"));
        if names.contains(&alive_key(rank)) {
            return Err(taken());
        }
        if names.contains(&left_key(rank)) {
            return Err(rejected(format!("rank {rank} already joined this group and left it")));
        }
        if names.contains(&dead_key(rank)) {
            return Err(rejected(format!("rank {rank} already joined this group and died")));
        }
        for name in &names {
            let Some(other) = name.strip_prefix("alive-") else { continue };
            let presence = dir.fetch(name)?.and_then(|v| serde_json::from_slice::<Presence>(&v).ok());
            if let Some(p) = presence.filter(|p| p.world != world) {
                return Err(rejected(format!("world size {world} differs from rank {other}'s {}", p.world)));
            }
        }
        let presence = Presence { world, pid: std::process::id(), host: hostname() };
        let presence = serde_json::to_vec(&presence).map_err(|e| Error::Protocol(e.to_string()))?;
        // Claimed, not put: two processes that both found the rank free above must not
        // both join as it.
        if !dir.claim(&alive_key(rank), &presence)? {
            return Err(taken());
        }

        let inner = Arc::new(Inner {
            rank,
            world,
            group: group.to_owned(),
            poll: options.poll,
            dir: Some(dir),
            next_seq: Mutex::new(0),
            deaths: Deaths::default(),
            view: Mutex::new(View {
                seen: vec![false; world],
                left: vec![false; world],
                who: vec![None; world],
                failure: None,
                linger: false,
            }),
        });
        // A death recorded before we came is known before `join` returns.
        inner.scan()?;
        let (stop, stopped) = bounded::<()>(0);
        let thread = {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name(format!("freight-etcd-rank-{rank}"))
                .spawn(move || watch(&inner, &stopped))?
        };
        tracing::info!(%prefix, rank, world, "joined the etcd group");
        Ok(EtcdGroup { inner, watcher: Mutex::new(Some((stop, thread))) })
    }

    /// Drops this rank as a crash would: no leave, no lease revoke, so the others notice
    /// only when the lease TTL runs out. For tests of that path.
    #[doc(hidden)]
    pub fn simulate_crash(self) {
        self.inner.view.lock().linger = true;
    }

    fn stop_watcher(&self) {
        if let Some((stop, thread)) = self.watcher.lock().take() {
            drop(stop);
            let _ = thread.join();
        }
    }
}

impl Drop for EtcdGroup {
    fn drop(&mut self) {
        self.stop_watcher();
    }
}

impl Group for EtcdGroup {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world(&self) -> usize {
        self.inner.world
    }

    fn all_gather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let inner = &*self.inner;
        inner.check()?;
        let deadline = Instant::now() + timeout;
        let dir = inner.dir()?;
        let seq = {
            let mut next = inner.next_seq.lock();
            *next += 1;
            *next - 1
        };
        dir.publish(&blob_key(seq, inner.rank), blob)?;
        let mut blobs = vec![Vec::new(); inner.world];
        blobs[inner.rank] = blob.to_vec();
        for r in (0..inner.world).filter(|&r| r != inner.rank) {
            let key = blob_key(seq, r);
            blobs[r] = loop {
                inner.check()?;
                interrupt::check()?;
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(inner.timeout_error(seq, timeout));
                }
                match dir.wait_for(&key, left.min(inner.poll)) {
                    Ok(value) => break value,
                    Err(Error::Timeout(_)) => {}
                    Err(e) => return Err(e),
                }
                if inner.view.lock().left[r] {
                    // It contributed everything it was going to before leaving.
                    match dir.fetch(&key)? {
                        Some(value) => break value,
                        None => {
                            return Err(Error::InvalidState(format!(
                                "collective {seq} cannot complete: rank {r} left the group before it"
                            )))
                        }
                    }
                }
            };
        }
        // Everyone has published `seq`, so everyone is done reading `seq - 1`.
        if seq > 0 {
            if let Err(e) = dir.withdraw(&blob_key(seq - 1, inner.rank)) {
                tracing::debug!(rank = inner.rank, seq, error = %e, "cannot withdraw an old collective blob");
            }
        }
        Ok(blobs)
    }

    fn dead(&self) -> Option<(usize, String)> {
        self.inner.deaths.first()
    }

    fn on_dead(&self, hook: DeathHook) {
        self.inner.deaths.on_dead(hook);
    }

    fn leave(&self) -> Result<()> {
        let inner = &*self.inner;
        if inner.view.lock().linger {
            return Ok(());
        }
        let dir = inner.dir()?;
        // `left` first: a watcher's listing then shows `alive`, or `left`, never neither.
        dir.publish(&left_key(inner.rank), b"")?;
        if let Err(e) = dir.withdraw(&alive_key(inner.rank)) {
            tracing::warn!(rank = inner.rank, error = %e, "cannot withdraw the alive key; it expires with the lease");
        }
        {
            let mut view = inner.view.lock();
            view.linger = true;
            view.failure.get_or_insert_with(|| Error::InvalidState(format!("rank {} has left the group", inner.rank)));
        }
        self.stop_watcher();
        tracing::info!(group = %inner.group, rank = inner.rank, "left the etcd group");
        Ok(())
    }
}

impl Inner {
    fn dir(&self) -> Result<&EtcdDirectory> {
        self.dir.as_ref().ok_or_else(|| Error::InvalidState("etcd group is closing".into()))
    }

    fn check(&self) -> Result<()> {
        match &self.view.lock().failure {
            Some(failure) => Err(failure.clone()),
            None => Ok(()),
        }
    }

    /// Lists the group once and updates the view; declares the first death it finds.
    fn scan(&self) -> Result<()> {
        let dir = self.dir()?;
        let names: HashSet<String> = dir.list()?.into_iter().collect();
        let mut fresh = Vec::new();
        // (rank, reason): reason `None` means "read it from the dead marker".
        let mut verdict: Option<(usize, Option<String>)> = None;
        {
            let mut view = self.view.lock();
            if view.failure.is_some() {
                return Ok(());
            }
            for r in (0..self.world).filter(|&r| r != self.rank) {
                if names.contains(&left_key(r)) {
                    if !view.left[r] {
                        view.left[r] = true;
                        tracing::info!(rank = self.rank, peer = r, "rank left the group");
                    }
                    continue;
                }
                if view.left[r] {
                    continue;
                }
                let alive = names.contains(&alive_key(r));
                if alive && !view.seen[r] {
                    view.seen[r] = true;
                    fresh.push(r);
                }
                if names.contains(&dead_key(r)) {
                    verdict = Some((r, None));
                    break;
                }
                if view.seen[r] && !alive {
                    let who = view.who[r].clone().unwrap_or_else(|| "its process".into());
                    let reason = format!("its etcd lease ended without a leave ({who} exited, crashed or lost etcd)");
                    verdict = Some((r, Some(reason)));
                    break;
                }
            }
            if verdict.is_none() && names.contains(&dead_key(self.rank)) {
                verdict = Some((self.rank, None));
            }
        }

        for r in fresh {
            tracing::debug!(rank = self.rank, peer = r, "rank seen alive");
            let Some(value) = dir.fetch(&alive_key(r))? else { continue };
            let Ok(presence) = serde_json::from_slice::<Presence>(&value) else { continue };
            let mut view = self.view.lock();
            view.who[r] = Some(format!("pid {} on {}", presence.pid, presence.host));
            if presence.world != self.world {
                let msg = format!("rank {r} joined with world size {}, this rank with {}", presence.world, self.world);
                tracing::error!(rank = self.rank, peer = r, "{msg}");
                view.failure.get_or_insert(Error::Protocol(msg));
            }
        }

        if let Some((r, reason)) = verdict {
            let reason = match reason {
                Some(reason) => {
                    if let Err(e) = dir.publish(&dead_key(r), reason.as_bytes()) {
                        tracing::warn!(rank = self.rank, dead = r, error = %e, "cannot record the death in etcd");
                    }
                    reason
                }
                None => match dir.fetch(&dead_key(r)) {
                    Ok(Some(reason)) => String::from_utf8_lossy(&reason).into_owned(),
                    _ => "declared dead by another rank".into(),
                },
            };
            self.declare_dead(r, &reason);
        }
        Ok(())
    }

    fn declare_dead(&self, rank: usize, reason: &str) {
        self.view.lock().failure.get_or_insert_with(|| dead_error(rank, reason));
        if self.deaths.report(rank, reason) {
            tracing::error!(group = %self.group, rank = self.rank, dead = rank, reason, "a rank of the group died");
        }
    }

    fn timeout_error(&self, seq: u64, timeout: Duration) -> Error {
        let detail = match self.dir().and_then(EtcdDirectory::list) {
            Ok(names) => {
                let names: HashSet<String> = names.into_iter().collect();
                let missing: Vec<usize> = (0..self.world).filter(|&r| !names.contains(&blob_key(seq, r))).collect();
                let view = self.view.lock();
                let absent: Vec<usize> = missing
                    .iter()
                    .copied()
                    .filter(|&r| !view.seen[r] && !view.left[r] && !names.contains(&alive_key(r)))
                    .collect();
                describe_missing(&missing, &absent)
            }
            Err(e) => format!("cannot list the missing ranks: {e}"),
        };
        Error::Timeout(format!(
            "collective {seq} of etcd group '{}' did not complete within {timeout:?} on rank {} of {}: {detail}",
            self.group, self.rank, self.world
        ))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let linger = self.view.get_mut().linger;
        if let Some(dir) = self.dir.take() {
            if linger {
                dir.forget_without_revoke();
            }
            // Otherwise dropping revokes the lease: the others see this rank gone at once.
        }
    }
}

fn connect(endpoints: &[String], prefix: &str, options: &EtcdOptions, timeout: Duration) -> Result<EtcdDirectory> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(50);
    loop {
        match EtcdDirectory::connect(endpoints, prefix, options.ttl, options.call_timeout) {
            Ok(dir) => return Ok(dir),
            Err(e @ Error::InvalidArgument(_)) => return Err(e),
            Err(e) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(e);
                }
                tracing::debug!(error = %e, "etcd not reachable yet; retrying");
                std::thread::sleep(backoff.min(left));
                interrupt::check()?;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// The watcher thread: scans every `poll` until stopped or the group has failed.
fn watch(inner: &Inner, stop: &Receiver<()>) {
    let mut failing = false;
    loop {
        if stop.recv_timeout(inner.poll) != Err(RecvTimeoutError::Timeout) {
            return;
        }
        if inner.view.lock().failure.is_some() {
            return;
        }
        match inner.scan() {
            Ok(()) if failing => {
                tracing::info!(rank = inner.rank, "etcd reachable again; death detection resumed");
                failing = false;
            }
            Ok(()) => {}
            Err(e) => {
                if !failing {
                    tracing::warn!(rank = inner.rank, error = %e, "cannot list the group in etcd; death detection paused");
                }
                failing = true;
            }
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "an unknown host".into())
}
