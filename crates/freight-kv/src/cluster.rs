//! Several servers sharing one key space.
//!
//! Each server publishes its control plane's URL in etcd under a lease that it keeps
//! alive (the engine's [`EtcdDirectory`]); a server that dies drops out when the lease
//! runs out, one that stops withdraws at once. A [`ClusterClient`] lists the members and
//! sends each key to the member that rendezvous hashing picks: the one with the highest
//! hash of (member, key). When a member leaves, only its keys move, each to its second
//! choice (where it is missing until written again); every other key stays where it was.
//!
//! A member that stops answering is treated as gone at once, before etcd says so: a GET
//! of one of its keys is a miss (its values went with it), a PUT goes to the key's next
//! choice. Neither is an error.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use freight_core::exchange::etcd::EtcdDirectory;
use freight_core::{Error, Result};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::client::{Client, ClientConfig};

/// Where servers publish themselves in etcd by default.
pub const DEFAULT_PREFIX: &str = "/freight/kv/servers/";

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
    refreshed: Option<Instant>,
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
            refreshed: None,
        };
        c.refresh()?;
        Ok(c)
    }

    /// The members that are up, as far as this client knows, sorted.
    pub fn members(&mut self) -> Result<Vec<String>> {
        self.refresh_if_due()?;
        let mut up: Vec<String> = self.members.keys().filter(|m| !self.suspects.contains_key(*m)).cloned().collect();
        up.sort();
        Ok(up)
    }

    /// Stores `value` under `key` on its owner (or, if the owner does not answer, on
    /// the next member in its preference).
    pub fn put(&mut self, key: &[u8], value: &[u8], ttl: Duration) -> Result<u64> {
        for member in self.candidates(key)? {
            match self.on(&member, |c| c.put(key, value, ttl)) {
                Err(e) if member_down(&e) => self.suspect(&member, &e),
                other => return other,
            }
        }
        Err(no_member(&self.config.etcd))
    }

    /// The value of `key` from its owner; a miss when the owner is gone.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let Some(member) = self.candidates(key)?.into_iter().next() else { return Err(no_member(&self.config.etcd)) };
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
        let Some(member) = self.candidates(key)?.into_iter().next() else { return Err(no_member(&self.config.etcd)) };
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
    fn candidates(&mut self, key: &[u8]) -> Result<Vec<String>> {
        self.refresh_if_due()?;
        let now = Instant::now();
        self.suspects.retain(|_, until| *until > now);
        let up: Vec<String> = self.members.keys().filter(|m| !self.suspects.contains_key(*m)).cloned().collect();
        Ok(preference(key, &up).into_iter().map(String::from).collect())
    }

    fn on<R>(&mut self, member: &str, f: impl FnOnce(&mut Client) -> Result<R>) -> Result<R> {
        if !self.clients.contains_key(member) {
            let url = self.members.get(member).cloned().ok_or_else(|| Error::UnknownPeer(member.into()))?;
            let client = Client::connect(ClientConfig { server: url, ..self.config.client.clone() })?;
            self.clients.insert(member.to_string(), client);
        }
        f(self.clients.get_mut(member).expect("just made"))
    }

    fn suspect(&mut self, member: &str, why: &Error) {
        tracing::warn!(member, error = %why, "a KV server does not answer; leaving it out");
        self.clients.remove(member);
        self.suspects.insert(member.to_string(), Instant::now() + self.config.suspect_for);
        // etcd may know better by now.
        self.refreshed = None;
    }

    fn refresh_if_due(&mut self) -> Result<()> {
        match self.refreshed {
            Some(t) if t.elapsed() < self.config.refresh_every => Ok(()),
            _ => self.refresh(),
        }
    }

    fn refresh(&mut self) -> Result<()> {
        let mut members = HashMap::new();
        for name in self.directory.list()? {
            if let Some(url) = self.directory.fetch(&name)? {
                members.insert(name, String::from_utf8_lossy(&url).into_owned());
            }
        }
        // Members that left, or came back under a new URL, get a new client.
        self.clients.retain(|m, _| members.contains_key(m));
        self.suspects.retain(|m, _| members.contains_key(m));
        if members.keys().collect::<std::collections::BTreeSet<_>>()
            != self.members.keys().collect::<std::collections::BTreeSet<_>>()
        {
            tracing::info!(members = members.len(), "KV cluster membership changed");
        }
        self.members = members;
        self.refreshed = Some(Instant::now());
        Ok(())
    }
}

/// Errors that mean the member is not there (rather than that the request was wrong).
fn member_down(e: &Error) -> bool {
    matches!(e, Error::PeerDisconnected { .. } | Error::UnknownPeer(_) | Error::Io(_) | Error::Timeout(_))
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
}
