//! Several servers sharing one key space.
//!
//! Each server publishes its control plane's URL in etcd under a lease that it keeps
//! alive (the engine's [`EtcdDirectory`]); a server that dies drops out when the lease
//! runs out, one that stops withdraws at once. A [`ClusterClient`] lists the members and
//! sends each key to the member that rendezvous hashing picks: the one with the highest
//! hash of (member, key). When a member leaves, only its keys move, each to its second
//! choice (where it is missing until written again); every other key stays where it was.
//!
//! A member whose connection is lost is treated as gone at once, before etcd says so: a
//! GET of one of its keys is a miss (its values went with it), a PUT or a DELETE goes to
//! the key's next choice. Neither is an error. A member that answers with an error (it
//! could not move a value, it timed out) is not gone: the error is the caller's.
//!
//! A member thought gone may come back with its values (the connection broke, not the
//! server). So a PUT that went past a key's owner leaves the owner a delete of that key,
//! and one that goes to the owner again leaves one to the member that held the key
//! meanwhile; a DELETE leaves one to every member before the one that answered it in the
//! key's order, and to the member that held a copy written past the owner. Each member
//! carries out what it owes before it serves this client again, so that it never answers
//! with a value older than one written or deleted elsewhere since. What is owed lives in
//! this client only.
//!
//! A member may also leave the member list and come back to it under the same name, with
//! its values: one that cannot reach etcd for longer than its lease's TTL is dropped from
//! the list, and publishes itself again once it can. So a member that left the list is
//! remembered for [`ClusterConfig::remember_gone_for`]: it keeps what it owes, it still
//! counts in each key's order when a PUT or DELETE decides who owes what, and if it comes
//! back it carries out what it owes first. Past that time, or past 64 such members or
//! 100,000 keys owed by them all (the ones gone longest go first), it is forgotten, with a
//! log line.
//!
//! etcd being unreachable does not stop the cluster: the last list of members stays in
//! use, and reading it again is retried less and less often until it works.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use freight_core::exchange::etcd::EtcdDirectory;
use freight_core::{Error, Result};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::client::{Client, ClientConfig};

/// Where servers publish themselves in etcd by default.
pub const DEFAULT_PREFIX: &str = "/freight/kv/servers/";

/// The most keys owed deletes by one member (and by all the members that left the list,
/// together), and the most keys written past their owner, that a client remembers; past
/// that a warning says what may be served stale.
const MAX_OWED: usize = 100_000;

/// The most members that left the member list that a client remembers at once (see
/// [`ClusterConfig::remember_gone_for`]); past that the one gone longest is forgotten.
const MAX_GONE: usize = 64;

/// Keys per Delete call when a member pays what it owes: well within a gRPC message.
const DELETE_CHUNK: usize = 1000;

/// The longest wait between reads of the member list while etcd does not answer.
const MAX_REFRESH_BACKOFF: Duration = Duration::from_secs(30);

/// A server's membership: etcd's address, the prefix, and the lease's time to live (how
/// long a dead server stays listed).
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub ttl: Duration,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig { endpoints, prefix: DEFAULT_PREFIX.into(), ttl: Duration::from_secs(5) }
    }

    pub(crate) fn directory(&self) -> Result<EtcdDirectory> {
        EtcdDirectory::connect(&self.endpoints, &self.prefix, self.ttl, Duration::from_secs(5))
    }
}

/// The members in the order in which they should hold `key`: its owner first.
pub fn preference<'a>(key: &[u8], members: &'a [String]) -> Vec<&'a str> {
    rank(key, members.iter().map(String::as_str))
}

fn rank<'a>(key: &[u8], members: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut ranked: Vec<(u64, &str)> = members.map(|m| (score(key, m), m)).collect();
    // Highest score first; names break ties, so every client agrees.
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked.into_iter().map(|(_, m)| m).collect()
}

fn score(key: &[u8], member: &str) -> u64 {
    xxh3_64_with_seed(key, xxh3_64(member.as_bytes()))
}

/// How a cluster client works.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd's endpoints and the prefix the servers publish under (the TTL is unused
    /// here: a client publishes nothing).
    pub etcd: EtcdConfig,
    /// For each member's client; its `server` is filled in per member.
    pub client: ClientConfig,
    /// How often the member list is read again.
    pub refresh_every: Duration,
    /// How long a member that did not answer is left out.
    pub suspect_for: Duration,
    /// How long a member that left the member list is remembered, in case it comes back
    /// under the same name with its values (its lease ran out while it could not reach
    /// etcd): meanwhile it owes the deletes of keys written or deleted elsewhere, and
    /// carries them out if it comes back. Keep it well above the servers' lease TTL.
    pub remember_gone_for: Duration,
}

impl ClusterConfig {
    pub fn new(etcd: EtcdConfig) -> ClusterConfig {
        ClusterConfig {
            etcd,
            client: ClientConfig { connect_for: Duration::from_millis(500), ..Default::default() },
            refresh_every: Duration::from_secs(1),
            suspect_for: Duration::from_secs(10),
            remember_gone_for: Duration::from_secs(600),
        }
    }
}

/// A client of every server of a cluster, each key sent to its owner.
pub struct ClusterClient {
    config: ClusterConfig,
    directory: EtcdDirectory,
    /// Member name to its control plane's URL, as last read from etcd.
    members: HashMap<String, String>,
    clients: HashMap<String, Client>,
    suspects: HashMap<String, Instant>,
    /// When the member list is read next.
    next_refresh: Instant,
    /// Reads of the member list that failed in a row.
    failed_refreshes: u32,
    /// What each member owes (see the module docs).
    ledger: Ledger,
}

impl ClusterClient {
    pub fn connect(config: ClusterConfig) -> Result<ClusterClient> {
        let directory = config.etcd.directory()?;
        let ledger = Ledger::new(config.remember_gone_for);
        let mut c = ClusterClient {
            config,
            directory,
            members: HashMap::new(),
            clients: HashMap::new(),
            suspects: HashMap::new(),
            next_refresh: Instant::now(),
            failed_refreshes: 0,
            ledger,
        };
        c.refresh()?;
        Ok(c)
    }

    /// The members that are up, as far as this client knows, sorted.
    pub fn members(&mut self) -> Result<Vec<String>> {
        self.refresh_if_due();
        let mut up: Vec<String> = self.members.keys().filter(|m| !self.suspects.contains_key(*m)).cloned().collect();
        up.sort();
        Ok(up)
    }

    /// Stores `value` under `key` on its owner (or, if the owner does not answer, on
    /// the next member in its preference).
    pub fn put(&mut self, key: &[u8], value: &[u8], ttl: Duration) -> Result<u64> {
        for member in self.candidates(key) {
            match self.on(&member, |c| c.put(key, value, ttl)) {
                Err(e) if member_down(&e) => self.suspect(&member, &e),
                Ok(version) => {
                    self.ledger.placed(key, &member);
                    return Ok(version);
                }
                Err(e) => return Err(e),
            }
        }
        Err(no_member(&self.config.etcd))
    }

    /// The value of `key` from its owner; a miss when the owner is gone.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let Some(member) = self.candidates(key).into_iter().next() else { return Err(no_member(&self.config.etcd)) };
        match self.on(&member, |c| c.get(key)) {
            Err(e) if member_down(&e) => {
                self.suspect(&member, &e);
                Ok(None)
            }
            other => other,
        }
    }

    /// Deletes `key` on the first member in its order of preference that answers (its
    /// owner, unless that one does not answer). Every member before that one in the key's
    /// order (suspected, down, or off the member list lately) and the member that holds a
    /// copy written past the owner owe the delete instead: each carries it out before it
    /// serves this client again.
    ///
    /// `Ok(false)` only when no value was there, as far as can be known: the member asked
    /// had none, and no other member may hold one. `Ok(true)` when a value was deleted,
    /// or may have been: some member that may hold one was not asked and owes the delete.
    /// An error when no member answers (each one owes the delete all the same), or when
    /// one fails the request (then it owes the delete too, as it may not have been done).
    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        for member in self.candidates(key) {
            match self.on(&member, |c| c.delete(&[key])) {
                Ok(deleted) => {
                    let unasked = self.ledger.deleted(key, Some(&member));
                    return Ok(unasked || deleted.first().copied().unwrap_or(false));
                }
                Err(e) if member_down(&e) => self.suspect(&member, &e),
                Err(e) => {
                    self.ledger.deleted(key, Some(&member));
                    self.ledger.owe(&member, key);
                    return Err(e);
                }
            }
        }
        self.ledger.deleted(key, None);
        Err(no_member(&self.config.etcd))
    }

    /// The members (up, not suspected) in `key`'s order of preference.
    fn candidates(&mut self, key: &[u8]) -> Vec<String> {
        self.refresh_if_due();
        let now = Instant::now();
        self.suspects.retain(|_, until| *until > now);
        let up = self.members.keys().filter(|m| !self.suspects.contains_key(*m)).map(String::as_str);
        rank(key, up).into_iter().map(String::from).collect()
    }

    /// Runs `f` on `member`'s client, connected first where there is none, once the
    /// member has deleted what it owes.
    fn on<R>(&mut self, member: &str, f: impl FnOnce(&mut Client) -> Result<R>) -> Result<R> {
        if !self.clients.contains_key(member) {
            let url = self.members.get(member).cloned().ok_or_else(|| Error::UnknownPeer(member.into()))?;
            let client = Client::connect(ClientConfig { server: url.clone(), ..self.config.client.clone() }).map_err(
                |e| match e {
                    // Not reached, or no answer to the hello: as good as gone.
                    Error::Io(reason) | Error::Timeout(reason) => Error::PeerDisconnected { peer: url, reason },
                    other => other,
                },
            )?;
            self.clients.insert(member.to_string(), client);
        }
        let client = self.clients.get_mut(member).expect("just made");
        let result = pay(client, self.ledger.owed.get_mut(member)).and_then(|()| f(client));
        self.ledger.paid(member);
        // A client that timed out is closed for good: the next call gets a new one.
        if !client.usable() {
            self.clients.remove(member);
        }
        result
    }

    fn suspect(&mut self, member: &str, why: &Error) {
        tracing::warn!(member, error = %why, "lost the connection to a KV server; leaving it out");
        self.clients.remove(member);
        self.suspects.insert(member.to_string(), Instant::now() + self.config.suspect_for);
        // etcd may know better by now, unless it does not answer (its backoff holds).
        if self.failed_refreshes == 0 {
            self.next_refresh = Instant::now();
        }
    }

    /// Reads the member list again when it is time; where etcd does not answer, the last
    /// list stays, and the next try waits twice as long as the one before (up to
    /// [`MAX_REFRESH_BACKOFF`]).
    fn refresh_if_due(&mut self) {
        if Instant::now() < self.next_refresh {
            return;
        }
        if let Err(e) = self.refresh() {
            self.failed_refreshes = self.failed_refreshes.saturating_add(1);
            let every = self.config.refresh_every;
            let wait =
                every.saturating_mul(1 << (self.failed_refreshes - 1).min(16)).min(MAX_REFRESH_BACKOFF.max(every));
            self.next_refresh = Instant::now() + wait;
            tracing::warn!(error = %e, failures = self.failed_refreshes, retry_in = ?wait, members = self.members.len(), "cannot read the KV cluster's members from etcd; going on with the last list");
            // Members that left before etcd stopped answering are still forgotten in time.
            self.ledger.expire(Instant::now());
        }
    }

    fn refresh(&mut self) -> Result<()> {
        let mut members = HashMap::new();
        for name in self.directory.list()? {
            if let Some(url) = self.directory.fetch(&name)? {
                members.insert(name, String::from_utf8_lossy(&url).into_owned());
            }
        }
        // Members that left, or came back under a new URL, get a new client. What they
        // owe stays: one that left may come back under its name with its values.
        let old = &self.members;
        self.clients.retain(|m, _| members.get(m) == old.get(m));
        self.suspects.retain(|m, _| members.get(m) == old.get(m));
        self.ledger.listed(members.keys().cloned().collect(), Instant::now());
        if members != self.members {
            tracing::info!(members = members.len(), "KV cluster membership changed");
        }
        self.members = members;
        self.failed_refreshes = 0;
        self.next_refresh = Instant::now() + self.config.refresh_every;
        Ok(())
    }
}

/// Who owes which deletes, and which members left the member list lately (see the module
/// docs): bookkeeping only, no I/O, and the time is passed in.
#[derive(Debug)]
struct Ledger {
    /// The members etcd lists (suspected ones included).
    listed: HashSet<String>,
    /// Members that left the list, and when this client saw them go.
    gone: HashMap<String, Instant>,
    /// How long a member that left the list is remembered.
    remember_gone_for: Duration,
    /// Per member, keys to delete there before it serves again.
    owed: HashMap<String, HashSet<Vec<u8>>>,
    /// Keys whose last PUT went to a member other than their owner, and that member.
    displaced: HashMap<Vec<u8>, String>,
    /// Members warned about for owing more than can be remembered (once each, until they
    /// pay or are forgotten).
    warned: HashSet<String>,
    /// Whether the warning about too many keys written past their owner was given (again
    /// once there is room for a tenth of them).
    warned_displaced: bool,
}

impl Ledger {
    fn new(remember_gone_for: Duration) -> Ledger {
        Ledger {
            listed: HashSet::new(),
            gone: HashMap::new(),
            remember_gone_for,
            owed: HashMap::new(),
            displaced: HashMap::new(),
            warned: HashSet::new(),
            warned_displaced: false,
        }
    }

    /// The members that may hold `key`, in its order of preference: those listed and
    /// those that left the list but are still remembered.
    fn order(&self, key: &[u8]) -> Vec<String> {
        rank(key, self.listed.iter().chain(self.gone.keys()).map(String::as_str))
            .into_iter()
            .map(String::from)
            .collect()
    }

    /// `key`'s owner among the members of [`Ledger::order`].
    fn owner(&self, key: &[u8]) -> Option<&str> {
        self.listed.iter().chain(self.gone.keys()).map(|m| (score(key, m), m.as_str())).max().map(|(_, m)| m)
    }

    /// The member list read at `now` is `listed`: members no longer on it left at `now`;
    /// members on it again under their name keep what they owe (they carry it out before
    /// they serve).
    fn listed(&mut self, listed: HashSet<String>, now: Instant) {
        for m in self.listed.difference(&listed) {
            self.gone.insert(m.clone(), now);
        }
        for m in &listed {
            self.gone.remove(m);
        }
        self.listed = listed;
        self.expire(now);
    }

    /// Forgets the members that left the list [`ClusterConfig::remember_gone_for`] ago or
    /// earlier; then, while more than [`MAX_GONE`] members are remembered or they owe more
    /// than [`MAX_OWED`] keys together, the one gone longest.
    fn expire(&mut self, now: Instant) {
        let over: Vec<String> = self
            .gone
            .iter()
            .filter(|(_, left)| now.saturating_duration_since(**left) >= self.remember_gone_for)
            .map(|(m, _)| m.clone())
            .collect();
        for member in over {
            let (owed, displaced) = self.forget(&member);
            if owed + displaced > 0 {
                tracing::info!(
                    member,
                    owed,
                    displaced,
                    "forgetting what a KV server that left the cluster owes: it left longer ago than \
                     remember_gone_for (should it come back under that name, it may serve stale values)"
                );
            }
        }
        while self.gone.len() > MAX_GONE || self.owed_by_gone() > MAX_OWED {
            let Some(oldest) = self.gone.iter().map(|(m, left)| (*left, m)).min().map(|(_, m)| m.clone()) else {
                break;
            };
            let (owed, displaced) = self.forget(&oldest);
            tracing::warn!(
                member = oldest,
                owed,
                displaced,
                "forgetting what a KV server that left the cluster owes: too many servers left, or they owe too \
                 much (should it come back under that name, it may serve stale values)"
            );
        }
    }

    /// Forgets a member that left the list: what it owes and the keys written to it past
    /// their owner; says how many of each.
    fn forget(&mut self, member: &str) -> (usize, usize) {
        self.gone.remove(member);
        self.warned.remove(member);
        let owed = self.owed.remove(member).map_or(0, |keys| keys.len());
        let before = self.displaced.len();
        self.displaced.retain(|_, m| m != member);
        let displaced = before - self.displaced.len();
        // Keys written past it only, to what is now their owner: nothing to remember.
        let moot: Vec<Vec<u8>> = self
            .displaced
            .iter()
            .filter(|(key, holder)| self.owner(key) == Some(holder.as_str()))
            .map(|(key, _)| key.clone())
            .collect();
        for key in moot {
            self.displaced.remove(&key);
        }
        (owed, displaced)
    }

    fn owed_by_gone(&self) -> usize {
        self.gone.keys().filter_map(|m| self.owed.get(m)).map(HashSet::len).sum()
    }

    /// `key` was just written to `member`: every member before it in the key's order (not
    /// up, as far as this client knows) and the member that held it before, if another,
    /// owe its deletion.
    fn placed(&mut self, key: &[u8], member: &str) {
        let before: Vec<String> = self.order(key).into_iter().take_while(|m| m != member).collect();
        for m in &before {
            self.owe(m, key);
        }
        let previous = if before.is_empty() {
            self.displaced.remove(key)
        } else if self.displaced.len() < MAX_OWED || self.displaced.contains_key(key) {
            if self.displaced.len() < MAX_OWED - MAX_OWED / 10 {
                self.warned_displaced = false;
            }
            self.displaced.insert(key.to_vec(), member.to_string())
        } else {
            if !std::mem::replace(&mut self.warned_displaced, true) {
                tracing::warn!(
                    member,
                    "too many keys written past their owner to track: some of them may be read stale later"
                );
            }
            None
        };
        if let Some(previous) = previous.filter(|p| p != member) {
            self.owe(&previous, key);
        }
    }

    /// `key` was deleted on `answered` (`None`: on no member, none answered): the members
    /// before it in the key's order (all of them where none answered) and the member that
    /// held a copy written past the owner owe its deletion. Says whether any does: whether
    /// a member that may hold the key was not asked.
    fn deleted(&mut self, key: &[u8], answered: Option<&str>) -> bool {
        let mut unasked: Vec<String> =
            self.order(key).into_iter().take_while(|m| Some(m.as_str()) != answered).collect();
        if let Some(holder) = self.displaced.remove(key) {
            if Some(holder.as_str()) != answered && !unasked.contains(&holder) {
                unasked.push(holder);
            }
        }
        for m in &unasked {
            self.owe(m, key);
        }
        !unasked.is_empty()
    }

    /// `member` is to delete `key` before it serves again. A member neither listed nor
    /// remembered is not; past [`MAX_OWED`] keys (for one member, or for all those that
    /// left the list together) the delete is not remembered, with a warning.
    fn owe(&mut self, member: &str, key: &[u8]) {
        let gone = self.gone.contains_key(member);
        if !gone && !self.listed.contains(member) {
            return;
        }
        let room_for_gone = !gone || self.owed_by_gone() < MAX_OWED;
        let keys = self.owed.entry(member.to_string()).or_default();
        if keys.contains(key) {
            return;
        }
        if room_for_gone && keys.len() < MAX_OWED {
            keys.insert(key.to_vec());
        } else if self.warned.insert(member.to_string()) {
            tracing::warn!(
                member,
                gone,
                "too many deletes owed by a KV server to remember more: it may serve stale values later"
            );
        }
    }

    /// After `member` tried to carry out what it owes: done with it if it owes nothing.
    fn paid(&mut self, member: &str) {
        if self.owed.get(member).is_some_and(HashSet::is_empty) {
            self.owed.remove(member);
            self.warned.remove(member);
        }
    }
}

/// Deletes what a member owes, before it serves again.
fn pay(client: &mut Client, owed: Option<&mut HashSet<Vec<u8>>>) -> Result<()> {
    let Some(owed) = owed.filter(|keys| !keys.is_empty()) else { return Ok(()) };
    let keys: Vec<Vec<u8>> = owed.iter().cloned().collect();
    for chunk in keys.chunks(DELETE_CHUNK) {
        let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
        client.delete(&refs)?;
        for k in chunk {
            owed.remove(k);
        }
    }
    tracing::debug!(keys = keys.len(), "a KV server deleted the values it held stale");
    Ok(())
}

/// Errors that mean the connection to the member is lost (rather than that the member,
/// still there, refused or failed the request).
fn member_down(e: &Error) -> bool {
    matches!(e, Error::PeerDisconnected { .. } | Error::UnknownPeer(_))
}

fn no_member(etcd: &EtcdConfig) -> Error {
    Error::PeerDisconnected {
        peer: format!("KV cluster {}", etcd.prefix),
        reason: format!("no server is listed in etcd at {} (or none answers)", etcd.endpoints.join(",")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("server-{i}")).collect()
    }

    #[test]
    fn every_client_agrees_and_the_keys_spread() {
        let members = names(3);
        let mut counts = HashMap::new();
        for k in 0..3000u32 {
            let key = format!("key-{k}");
            let order = preference(key.as_bytes(), &members);
            assert_eq!(order.len(), 3);
            let mut reversed: Vec<String> = members.iter().rev().cloned().collect();
            reversed.rotate_left(1);
            assert_eq!(preference(key.as_bytes(), &reversed), order, "the order of the list does not matter");
            *counts.entry(order[0]).or_insert(0) += 1;
        }
        assert!(counts.values().all(|&n| (800..1200).contains(&n)), "{counts:?}");
    }

    #[test]
    fn a_member_leaving_moves_only_its_own_keys() {
        let all = names(4);
        let fewer: Vec<String> = all.iter().filter(|m| *m != "server-2").cloned().collect();
        for k in 0..2000u32 {
            let key = format!("key-{k}");
            let before = preference(key.as_bytes(), &all);
            let after = preference(key.as_bytes(), &fewer);
            if before[0] == "server-2" {
                assert_eq!(after[0], before[1], "its keys go to their second choice");
            } else {
                assert_eq!(after[0], before[0], "other keys stay");
            }
        }
    }

    #[test]
    fn no_members_no_owner() {
        assert!(preference(b"k", &[]).is_empty());
    }

    #[test]
    fn only_a_lost_connection_is_a_member_down() {
        use crate::wire::FailCode;
        let lost = Error::PeerDisconnected { peer: "s".into(), reason: "reset".into() };
        assert!(member_down(&lost));
        assert!(member_down(&Error::UnknownPeer("s".into())));
        // A live server that could not move one value, or was slow, is still there.
        assert!(!member_down(&FailCode::Transfer.error("s", "the copy failed".into())));
        assert!(!member_down(&Error::Timeout("slow".into())));
        assert!(!member_down(&FailCode::NoSpace.error("s", "full".into())));
    }

    // The bookkeeping alone: no servers, and the time is made up.

    fn ledger(listed: &[&str], now: Instant) -> Ledger {
        let mut l = Ledger::new(Duration::from_secs(600));
        l.listed(listed.iter().map(|m| m.to_string()).collect(), now);
        l
    }

    /// A key whose order among `members` is `order`.
    fn key_ordered(members: &[&str], order: &[&str]) -> Vec<u8> {
        let members: Vec<String> = members.iter().map(|m| m.to_string()).collect();
        (0..).map(|i| format!("key-{i}").into_bytes()).find(|k| preference(k, &members) == order).unwrap()
    }

    fn owes(l: &Ledger, member: &str, key: &[u8]) -> bool {
        l.owed.get(member).is_some_and(|keys| keys.contains(key))
    }

    #[test]
    fn a_delete_is_owed_by_every_member_before_the_one_that_answered() {
        let mut l = ledger(&["a", "b", "c"], Instant::now());
        let k = key_ordered(&["a", "b", "c"], &["a", "b", "c"]);
        // The owner answered, nothing else may hold the key: the answer is known.
        assert!(!l.deleted(&k, Some("a")));
        assert!(l.owed.is_empty());
        // The owner was suspected (or down): it owes the delete, and the answer is not known.
        assert!(l.deleted(&k, Some("b")));
        assert!(owes(&l, "a", &k) && !owes(&l, "b", &k) && !owes(&l, "c", &k));
        // None answered: every member owes it.
        assert!(l.deleted(&k, None));
        assert!(["a", "b", "c"].iter().all(|m| owes(&l, m, &k)));
    }

    #[test]
    fn a_delete_is_owed_by_the_member_that_holds_a_copy_written_past_the_owner() {
        let mut l = ledger(&["a", "b", "c"], Instant::now());
        let k = key_ordered(&["a", "b", "c"], &["a", "b", "c"]);
        l.placed(&k, "c"); // "a" and "b" did not answer
        assert!(owes(&l, "a", &k) && owes(&l, "b", &k));
        l.owed.clear();
        // The owner is back and answers; "c" still holds the copy.
        assert!(l.deleted(&k, Some("a")));
        assert!(owes(&l, "c", &k) && !owes(&l, "b", &k));
        assert!(l.displaced.is_empty());
    }

    #[test]
    fn a_member_off_the_list_is_owed_what_is_written_or_deleted_meanwhile_until_forgotten() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(600);
        let mut l = ledger(&["a", "b"], t0);
        let keys: Vec<Vec<u8>> = (0..)
            .map(|i| format!("key-{i}").into_bytes())
            .filter(|k| preference(k, &["a".to_string(), "b".to_string()])[0] == "a")
            .take(2)
            .collect();
        let (rewritten, deleted) = (&keys[0], &keys[1]);
        // "a" leaves the list (its lease ran out), values kept.
        let left = t0 + Duration::from_secs(1);
        l.listed(["b".to_string()].into(), left);
        l.placed(rewritten, "b");
        assert!(l.deleted(deleted, Some("b")), "\"a\" may hold it");
        assert!(owes(&l, "a", rewritten) && owes(&l, "a", deleted));
        // Still remembered just before the grace runs out; back under its name, it owes both.
        l.expire(left + grace - Duration::from_millis(1));
        l.listed(["a".to_string(), "b".to_string()].into(), left + grace - Duration::from_millis(1));
        assert!(owes(&l, "a", rewritten) && owes(&l, "a", deleted));
        // Written to its owner again: "b" owes its copy's delete.
        l.placed(rewritten, "a");
        assert!(owes(&l, "b", rewritten));

        // Gone again, and past the grace: forgotten, with what it owed.
        let mut l = ledger(&["a", "b"], t0);
        l.listed(["b".to_string()].into(), left);
        l.placed(rewritten, "b");
        assert_eq!(l.displaced.len(), 1);
        l.expire(left + grace);
        assert!(l.gone.is_empty() && !l.owed.contains_key("a"));
        assert!(l.displaced.is_empty(), "\"b\" is the key's owner now: nothing to remember");
        l.placed(deleted, "b");
        assert!(!l.deleted(deleted, Some("b")), "no member that may hold it was left out");
        assert!(l.owed.is_empty());
    }

    #[test]
    fn members_off_the_list_and_what_they_owe_are_bounded() {
        let t0 = Instant::now();
        let names: Vec<String> = (0..=MAX_GONE).map(|i| format!("m{i}")).collect();
        let mut l = ledger(&[], t0);
        let mut listed: HashSet<String> = names.iter().cloned().chain(["up".to_string()]).collect();
        l.listed(listed.clone(), t0);
        // They leave one by one: the one gone longest is forgotten.
        for (i, m) in names.iter().enumerate() {
            listed.remove(m);
            l.listed(listed.clone(), t0 + Duration::from_millis(i as u64));
        }
        assert_eq!(l.gone.len(), MAX_GONE);
        assert!(!l.gone.contains_key("m0") && l.gone.contains_key("m1"));
        // Together they owe at most MAX_OWED keys.
        for i in 0..MAX_OWED + 10 {
            let m = &names[1 + i % 2];
            l.owe(m, format!("k{i}").as_bytes());
        }
        assert_eq!(l.owed_by_gone(), MAX_OWED);
        // A member on the list owes on its own account...
        l.owe("up", b"k");
        assert!(owes(&l, "up", b"k"));
        // ...until it leaves too (as another comes back, so that as many are gone as may
        // be): then the one gone longest goes, to make room.
        listed.remove("up");
        listed.insert("m10".to_string());
        l.listed(listed.clone(), t0 + Duration::from_secs(1));
        assert_eq!(l.gone.len(), MAX_GONE - 1);
        assert!(l.gone.contains_key("up") && !l.gone.contains_key("m1") && l.gone.contains_key("m2"));
        assert!(l.owed_by_gone() <= MAX_OWED && !l.owed.contains_key("m1"));
        // Neither listed nor remembered: owes nothing.
        l.owe("m0", b"k");
        assert!(!l.owed.contains_key("m0"));
    }

    // With a real etcd (skipped where there is none) and servers in this process.

    const ETCD: &str = "/usr/bin/etcd";

    /// An etcd of its own, killed when dropped.
    struct Etcd {
        child: std::process::Child,
        url: String,
        dir: std::path::PathBuf,
    }

    impl Etcd {
        fn start() -> Option<Etcd> {
            if !std::path::Path::new(ETCD).exists() {
                eprintln!("skipped: {ETCD} is missing");
                return None;
            }
            // The ports are free when picked, not when etcd binds them: a test running
            // beside this one may take one meanwhile, and this etcd then exits (while
            // the other one answers on the port). Another pair, then.
            for _ in 0..5 {
                if let Some(etcd) = Etcd::try_start() {
                    return Some(etcd);
                }
            }
            panic!("etcd did not start on any of 5 pairs of ports");
        }

        /// An etcd on ports picked now; `None` if it exited instead of serving them.
        fn try_start() -> Option<Etcd> {
            let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let (client, peer) = (port(), port());
            let url = format!("http://127.0.0.1:{client}");
            let dir = std::env::temp_dir().join(format!("freight-kv-etcd-{}-{client}", std::process::id()));
            let child = std::process::Command::new(ETCD)
                .args([
                    "--data-dir",
                    dir.to_str().unwrap(),
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .env("ETCD_UNSUPPORTED_ARCH", "arm64")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let mut etcd = Etcd { child, url, dir };
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
                if etcd.exited() {
                    return None;
                }
                assert!(Instant::now() < deadline, "etcd did not listen");
                std::thread::sleep(Duration::from_millis(50));
            }
            // A listener on the port is not proof that it is this etcd's: still alive
            // a moment later, it is.
            std::thread::sleep(Duration::from_millis(200));
            (!etcd.exited()).then_some(etcd)
        }

        fn exited(&mut self) -> bool {
            !matches!(self.child.try_wait(), Ok(None))
        }

        fn config(&self) -> EtcdConfig {
            EtcdConfig { ttl: Duration::from_secs(2), ..EtcdConfig::new(vec![self.url.clone()]) }
        }
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn member(etcd: &Etcd) -> crate::Server {
        crate::Server::start(crate::ServerConfig {
            listen: "127.0.0.1:0".into(),
            memory_bytes: 1 << 20,
            etcd: Some(etcd.config()),
            ..Default::default()
        })
        .unwrap()
    }

    fn cluster(etcd: &Etcd) -> ClusterClient {
        ClusterClient::connect(ClusterConfig {
            refresh_every: Duration::from_millis(100),
            suspect_for: Duration::from_millis(300),
            ..ClusterConfig::new(etcd.config())
        })
        .unwrap()
    }

    fn lost() -> Error {
        Error::PeerDisconnected { peer: "test".into(), reason: "cut off for a while".into() }
    }

    #[test]
    fn a_member_back_from_a_lost_connection_never_serves_a_value_written_elsewhere_meanwhile() {
        let Some(etcd) = Etcd::start() else { return };
        let servers = [member(&etcd), member(&etcd)];
        let mut c = cluster(&etcd);
        assert_eq!(c.members().unwrap().len(), 2);
        let owner = c.candidates(b"k")[0].clone();
        c.put(b"k", b"one", Duration::ZERO).unwrap();
        // The owner drops out for a while (its connection broke; it kept its values).
        c.suspect(&owner, &lost());
        c.put(b"k", b"two", Duration::ZERO).unwrap();
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"two"[..]), "from the next member meanwhile");
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(c.candidates(b"k")[0], owner, "the owner is back");
        assert_eq!(c.get(b"k").unwrap(), None, "a miss, not the value written before");
        // Written to its owner again; the member that held it meanwhile drops its copy
        // before it serves again.
        c.put(b"k", b"three", Duration::ZERO).unwrap();
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"three"[..]));
        c.suspect(&owner, &lost());
        assert_eq!(c.get(b"k").unwrap(), None, "not the value written while the owner was out");
        let keys: u64 = servers.iter().map(|s| s.stats().keys).sum();
        assert_eq!(keys, 1, "only the owner holds the key");
    }

    /// Two servers published by hand as "a" and "b", so that a test can take one off the
    /// list and put it back (as a lease that ran out and was granted again would).
    fn published(etcd: &Etcd) -> ([crate::Server; 2], EtcdDirectory) {
        let start = crate::server::test_support::test_server;
        let servers = [start(), start()];
        let directory = etcd.config().directory().unwrap();
        directory.publish("a", servers[0].url().as_bytes()).unwrap();
        directory.publish("b", servers[1].url().as_bytes()).unwrap();
        (servers, directory)
    }

    /// Keys that "a" owns (and "b" holds while "a" is out).
    fn owned_by_a(n: usize) -> Vec<Vec<u8>> {
        let ab = ["a".to_string(), "b".to_string()];
        (0..).map(|i| format!("key-{i}").into_bytes()).filter(|k| preference(k, &ab)[0] == "a").take(n).collect()
    }

    #[test]
    fn a_delete_while_the_owner_is_suspected_is_owed_by_it() {
        let Some(etcd) = Etcd::start() else { return };
        let (servers, _directory) = published(&etcd);
        let mut c = cluster(&etcd);
        let k = owned_by_a(1).remove(0);
        c.put(&k, b"one", Duration::ZERO).unwrap();
        assert_eq!(servers[0].stats().keys, 1);
        c.suspect("a", &lost());
        let answer = c.delete(&k).unwrap();
        // "a" is back (its connection broke, not the server), with its values.
        c.suspects.clear();
        assert_eq!(c.get(&k).unwrap(), None, "not the deleted value");
        assert!(answer, "the owner was not asked: the value may have been there");
        assert_eq!(servers[0].stats().keys, 0);
    }

    #[test]
    fn a_delete_that_finds_the_owner_down_is_owed_by_it() {
        let Some(etcd) = Etcd::start() else { return };
        let (servers, directory) = published(&etcd);
        let mut c = cluster(&etcd);
        let k = owned_by_a(1).remove(0);
        c.put(&k, b"one", Duration::ZERO).unwrap();
        // "a" is listed where nothing answers, so the delete cannot reach it...
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        directory.publish("a", format!("http://127.0.0.1:{port}").as_bytes()).unwrap();
        c.refresh().unwrap();
        let answer = c.delete(&k).unwrap();
        // ...then where it is again, with its values.
        directory.publish("a", servers[0].url().as_bytes()).unwrap();
        c.refresh().unwrap();
        assert_eq!(c.get(&k).unwrap(), None, "not the deleted value");
        assert!(answer, "the owner was not asked: the value may have been there");
    }

    #[test]
    fn a_member_back_on_the_list_under_its_name_deletes_what_was_rewritten_or_deleted_meanwhile() {
        let Some(etcd) = Etcd::start() else { return };
        let (servers, directory) = published(&etcd);
        let mut c = cluster(&etcd);
        let keys = owned_by_a(2);
        let (rewritten, deleted) = (&keys[0], &keys[1]);
        c.put(rewritten, b"one", Duration::ZERO).unwrap();
        c.put(deleted, b"one", Duration::ZERO).unwrap();
        assert_eq!(servers[0].stats().keys, 2);
        // "a" cannot reach etcd for longer than its lease: it leaves the list, values kept.
        directory.withdraw("a").unwrap();
        c.refresh().unwrap();
        assert_eq!(c.members().unwrap(), ["b"]);
        c.put(rewritten, b"two", Duration::ZERO).unwrap();
        let answer = c.delete(deleted).unwrap();
        // It gets a new lease and publishes itself again: same name, same values.
        directory.publish("a", servers[0].url().as_bytes()).unwrap();
        c.refresh().unwrap();
        assert_eq!(c.get(rewritten).unwrap(), None, "a miss, not the value written over meanwhile");
        assert_eq!(c.get(deleted).unwrap(), None, "not the value deleted meanwhile");
        assert_eq!(servers[0].stats().keys, 0);
        assert!(answer, "\"a\" was not asked: the value may have been there");
        // Written to its owner again: "b" drops its copy before it serves again.
        c.put(rewritten, b"three", Duration::ZERO).unwrap();
        assert_eq!(c.get(rewritten).unwrap().as_deref(), Some(&b"three"[..]));
        c.suspect("a", &lost());
        assert_eq!(c.get(rewritten).unwrap(), None, "not the value written while \"a\" was off the list");
    }

    #[test]
    fn the_cluster_goes_on_with_its_last_member_list_while_etcd_is_down() {
        let Some(etcd) = Etcd::start() else { return };
        let _servers = [member(&etcd), member(&etcd)];
        let mut c = cluster(&etcd);
        c.put(b"k", b"v", Duration::ZERO).unwrap();
        drop(etcd);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(c.members().unwrap().len(), 2);
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
        c.put(b"k2", b"w", Duration::ZERO).unwrap();
        assert_eq!(c.get(b"k2").unwrap().as_deref(), Some(&b"w"[..]));
        assert!(c.failed_refreshes > 0 && c.next_refresh > Instant::now(), "it waits before trying again");
    }

    #[test]
    fn a_member_listed_under_a_new_url_gets_a_new_client() {
        let Some(etcd) = Etcd::start() else { return };
        let start = crate::server::test_support::test_server;
        let (first, second) = (start(), start());
        let config = etcd.config();
        let directory = config.directory().unwrap();
        directory.publish("m", first.url().as_bytes()).unwrap();
        let mut c = cluster(&etcd);
        c.put(b"a", b"1", Duration::ZERO).unwrap();
        assert_eq!(first.stats().keys, 1);
        directory.publish("m", second.url().as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        c.put(b"b", b"2", Duration::ZERO).unwrap();
        assert_eq!((first.stats().keys, second.stats().keys), (1, 1), "the write went to the new URL");
    }

    #[test]
    fn a_member_on_every_interface_publishes_the_address_it_advertises() {
        let Some(etcd) = Etcd::start() else { return };
        let e = crate::Server::start(crate::ServerConfig {
            listen: "0.0.0.0:0".into(),
            memory_bytes: 1 << 20,
            etcd: Some(etcd.config()),
            ..Default::default()
        })
        .err()
        .unwrap();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("advertise")), "{e}");
        let s = crate::Server::start(crate::ServerConfig {
            listen: "0.0.0.0:0".into(),
            memory_bytes: 1 << 20,
            etcd: Some(etcd.config()),
            advertise: Some("127.0.0.1".into()),
            ..Default::default()
        })
        .unwrap();
        let mut c = cluster(&etcd);
        let url = c.members.values().next().cloned().unwrap();
        assert_eq!(url, format!("http://127.0.0.1:{}", s.addr().port()));
        c.put(b"k", b"v", Duration::ZERO).unwrap();
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    }
}
