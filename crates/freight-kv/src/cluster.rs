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
//! GET of one of its keys is a miss (its values went with it), a PUT goes to the key's
//! next choice. Neither is an error. A member that answers with an error (it could not
//! move a value, it timed out) is not gone: the error is the caller's.
//!
//! A member thought gone may come back with its values (the connection broke, not the
//! server). So a PUT that went past a key's owner leaves the owner a delete of that key,
//! and one that goes to the owner again leaves one to the member that held the key
//! meanwhile: each member carries out what it owes before it serves this client again,
//! so that it never answers with a value older than one written elsewhere since. What is
//! owed lives in this client only.
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

/// The most keys owed deletes (and the most keys written past their owner) that a client
/// remembers; past that a warning says what may be served stale.
const MAX_OWED: usize = 100_000;

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
    let mut ranked: Vec<(u64, &str)> =
        members.iter().map(|m| (xxh3_64_with_seed(key, xxh3_64(m.as_bytes())), m.as_str())).collect();
    // Highest score first; names break ties, so every client agrees.
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked.into_iter().map(|(_, m)| m).collect()
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
}

impl ClusterConfig {
    pub fn new(etcd: EtcdConfig) -> ClusterConfig {
        ClusterConfig {
            etcd,
            client: ClientConfig { connect_for: Duration::from_millis(500), ..Default::default() },
            refresh_every: Duration::from_secs(1),
            suspect_for: Duration::from_secs(10),
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
    /// Per member, keys to delete there before it serves again (see the module docs).
    owed: HashMap<String, HashSet<Vec<u8>>>,
    /// Keys whose last PUT went to a member other than their owner, and that member.
    displaced: HashMap<Vec<u8>, String>,
}

impl ClusterClient {
    pub fn connect(config: ClusterConfig) -> Result<ClusterClient> {
        let directory = config.etcd.directory()?;
        let mut c = ClusterClient {
            config,
            directory,
            members: HashMap::new(),
            clients: HashMap::new(),
            suspects: HashMap::new(),
            next_refresh: Instant::now(),
            failed_refreshes: 0,
            owed: HashMap::new(),
            displaced: HashMap::new(),
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
                    self.placed(key, &member);
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

    /// Deletes `key` from its owner; says whether it was there.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        let Some(member) = self.candidates(key).into_iter().next() else { return Err(no_member(&self.config.etcd)) };
        // A copy written elsewhere while the owner did not answer goes too.
        if let Some(holder) = self.displaced.remove(key) {
            if holder != member {
                self.owe(&holder, key);
            }
        }
        match self.on(&member, |c| c.delete(&[key])) {
            Ok(deleted) => Ok(deleted.first().copied().unwrap_or(false)),
            Err(e) if member_down(&e) => {
                self.suspect(&member, &e);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// The members (up, not suspected) in `key`'s order of preference.
    fn candidates(&mut self, key: &[u8]) -> Vec<String> {
        self.refresh_if_due();
        let now = Instant::now();
        self.suspects.retain(|_, until| *until > now);
        let up: Vec<String> = self.members.keys().filter(|m| !self.suspects.contains_key(*m)).cloned().collect();
        preference(key, &up).into_iter().map(String::from).collect()
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
        let result = pay(client, self.owed.get_mut(member)).and_then(|()| f(client));
        // A client that timed out is closed for good: the next call gets a new one.
        if !client.usable() {
            self.clients.remove(member);
        }
        result
    }

    /// `key` was just written to `member`: every member before it in the key's order
    /// (gone, as far as this client knows) and the member that held it before, if
    /// another, owe its deletion.
    fn placed(&mut self, key: &[u8], member: &str) {
        let all: Vec<String> = self.members.keys().cloned().collect();
        let order = preference(key, &all);
        let before: Vec<String> = order.iter().take_while(|m| **m != member).map(|m| m.to_string()).collect();
        for m in &before {
            self.owe(m, key);
        }
        let previous = if before.is_empty() {
            self.displaced.remove(key)
        } else if self.displaced.len() < MAX_OWED || self.displaced.contains_key(key) {
            self.displaced.insert(key.to_vec(), member.to_string())
        } else {
            tracing::warn!(
                member,
                "too many keys written past their owner to track: one of them may be read stale later"
            );
            None
        };
        if let Some(previous) = previous.filter(|p| p != member) {
            self.owe(&previous, key);
        }
    }

    fn owe(&mut self, member: &str, key: &[u8]) {
        let keys = self.owed.entry(member.to_string()).or_default();
        if keys.len() < MAX_OWED {
            keys.insert(key.to_vec());
        } else if !keys.contains(key) {
            tracing::warn!(member, "too many deletes owed by one KV server: it may serve a stale value later");
        }
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
        }
    }

    fn refresh(&mut self) -> Result<()> {
        let mut members = HashMap::new();
        for name in self.directory.list()? {
            if let Some(url) = self.directory.fetch(&name)? {
                members.insert(name, String::from_utf8_lossy(&url).into_owned());
            }
        }
        // Members that left, or came back under a new URL (another server), get a new
        // client and a clean slate.
        let old = &self.members;
        self.clients.retain(|m, _| members.get(m) == old.get(m));
        self.suspects.retain(|m, _| members.get(m) == old.get(m));
        self.owed.retain(|m, _| members.contains_key(m));
        self.displaced.retain(|_, m| members.contains_key(m));
        if members != self.members {
            tracing::info!(members = members.len(), "KV cluster membership changed");
        }
        self.members = members;
        self.failed_refreshes = 0;
        self.next_refresh = Instant::now() + self.config.refresh_every;
        Ok(())
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
            let etcd = Etcd { child, url, dir };
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
                assert!(Instant::now() < deadline, "etcd did not listen");
                std::thread::sleep(Duration::from_millis(50));
            }
            Some(etcd)
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
        let start = || {
            crate::Server::start(crate::ServerConfig {
                listen: "127.0.0.1:0".into(),
                memory_bytes: 1 << 20,
                ..Default::default()
            })
            .unwrap()
        };
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
