//! Ranks reached through the engine instead of CUDA IPC (`--nvlink-backend freight`,
//! or `none` for the network transports only): the kernels write what is meant for such
//! a rank into a local copy of the rank's block (an "outbox" in this GPU's memory, laid
//! out like the block it stands for), and the host ships the part that was written to
//! the real block with engine WRITEs, rows first, then the signal word with a
//! notification. The receiving host waits for those notifications before it launches
//! the kernel that reads the rows, so no kernel spins on a word that an incoming copy
//! has yet to write (on a GPU that several processes share, the copy may not get to
//! run while the kernel spins).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use freight_core::{
    Agent, AgentConfig, Desc, DescList, Error, MemKind, OpKind, Request, Result, Status, TransportKind,
};
use freight_cuda::driver::{Device, DeviceBuffer};

use crate::layout::Shape;
use crate::rendezvous::{dead_error, Group, RENDEZVOUS_LOST};

/// How often host waits look up the group's deaths.
const DEATH_POLL: Duration = Duration::from_millis(100);

/// Which engine path ranks other than this one take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Kernels write into peers' memory through CUDA IPC (one host).
    Ipc,
    /// The engine's choice of transport (cuda on one host, else the network).
    Engine,
    /// The engine's network transports only (tcp), even on one host.
    Network,
}

impl Backend {
    /// The seed's names: `ipc`, `freight` (this engine), `none` (no NVLink: network).
    pub fn parse(name: &str) -> Result<Backend> {
        match name {
            "ipc" => Ok(Backend::Ipc),
            "freight" => Ok(Backend::Engine),
            "none" => Ok(Backend::Network),
            other => Err(Error::InvalidArgument(format!("unknown backend '{other}': ipc, freight or none"))),
        }
    }
}

/// Signal word kinds, as kernels.cu numbers them.
pub const DISPATCH_ARRIVED: u64 = 0;
pub const DISPATCH_RELEASED: u64 = 1;
pub const COMBINE_ARRIVED: u64 = 2;
pub const COMBINE_RELEASED: u64 = 3;

struct Peer {
    name: String,
    outbox: DeviceBuffer,
    /// Where our block starts in the peer's workspace (its address space).
    block: u64,
    /// The device the peer registered its workspace on, as the peer numbers its GPUs:
    /// ranks that share a host need not share a GPU.
    dev: u64,
}

pub struct Relay {
    agent: Agent,
    /// Signal notifications received and not yet awaited, by kind.
    arrived: Mutex<HashMap<u64, usize>>,
    /// By rank; `None` for this rank.
    peers: Vec<Option<Peer>>,
    shape: Shape,
    device: &'static Device,
    timeout: Duration,
    /// Watched while waiting: a dead peer never signals, and waiting on would only end at
    /// the timeout.
    group: Arc<dyn Group>,
    /// The first death the group's hooks reported, the rendezvous' own loss included
    /// (which [`Group::dead`] does not name, no rank being known dead).
    ended: Arc<std::sync::OnceLock<(usize, String)>>,
}

/// What a rank tells the others about its engine side.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Announcement {
    pub metadata: Vec<u8>,
    pub workspace: u64,
    /// The workspace's device, as the announcing rank numbers its GPUs.
    pub device: u64,
}

impl Relay {
    /// An agent for this rank of `group` with `workspace` registered, and an outbox per
    /// other rank. `backend` picks the transports (see [`Backend`]).
    pub fn new(
        group: Arc<dyn Group>,
        shape: &Shape,
        device: &'static Device,
        workspace: &DeviceBuffer,
        backend: Backend,
        listen: &str,
        timeout: Duration,
    ) -> Result<(Relay, Announcement)> {
        let rank = group.rank();
        let mut config = AgentConfig { listen: listen.to_string(), peer_timeout: timeout, ..AgentConfig::default() };
        if backend == Backend::Network {
            config.require = Some(TransportKind::Tcp);
        }
        let agent = Agent::new(&format!("ep-rank-{rank}"), config)?;
        let dev = device.ordinal as u64;
        agent.register(MemKind::Vram, workspace.addr(), workspace.len() as u64, dev)?;
        let mut peers = Vec::with_capacity(shape.ranks as usize);
        for r in 0..shape.ranks as usize {
            if r == rank {
                peers.push(None);
                continue;
            }
            // Its signal words must start at zero.
            let outbox = DeviceBuffer::zeroed(device, shape.block_bytes as usize)?;
            agent.register(MemKind::Vram, outbox.addr(), outbox.len() as u64, dev)?;
            peers.push(Some(Peer { name: String::new(), outbox, block: 0, dev: 0 }));
        }
        let me = Announcement { metadata: agent.metadata(), workspace: workspace.addr(), device: dev };
        let ended = Arc::new(std::sync::OnceLock::new());
        let seen = Arc::downgrade(&ended);
        group.on_dead(Box::new(move |rank, reason| {
            if let Some(ended) = seen.upgrade() {
                let _ = ended.set((rank, reason.to_owned()));
            }
        }));
        let relay = Relay { agent, arrived: Mutex::default(), peers, shape: *shape, device, timeout, group, ended };
        Ok((relay, me))
    }

    /// Connects to every other rank from what they announced.
    pub fn connect(&mut self, announcements: &[Announcement]) -> Result<()> {
        for (r, peer) in self.peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            peer.name = self.agent.add_peer(&announcements[r].metadata)?;
            peer.block = announcements[r].workspace + self.shape.block_offset(self.shape.me as usize);
            peer.dev = announcements[r].device;
            tracing::info!(rank = r, path = ?self.agent.path_to(&peer.name)?, "expert-parallel rank reached through the engine");
        }
        Ok(())
    }

    /// Where the kernels should write what is meant for rank `r`: its outbox, shifted so
    /// that the kernels' offsets for our block land at its start.
    pub fn kernel_base(&self, r: usize) -> Option<u64> {
        let peer = self.peers.get(r)?.as_ref()?;
        Some(peer.outbox.addr().wrapping_sub(self.shape.block_offset(self.shape.me as usize)))
    }

    /// Ships to each other rank `runs(rank)` (byte ranges within the block: rows,
    /// records), then the signal word `kind`.
    pub fn ship(&self, kind: u64, runs: impl Fn(usize) -> Vec<(u64, u64)>) -> Result<()> {
        let dev = self.device.ordinal as u64;
        let vram = |descs: Vec<Desc>| DescList::from_descs(MemKind::Vram, descs);
        let post = |r: usize, peer: &Peer, ranges: &[(u64, u64)]| -> Result<Option<Request>> {
            if ranges.is_empty() {
                return Ok(None);
            }
            let local =
                vram(ranges.iter().map(|&(off, len)| Desc { addr: peer.outbox.addr() + off, len, dev }).collect())?;
            let remote =
                vram(ranges.iter().map(|&(off, len)| Desc { addr: peer.block + off, len, dev: peer.dev }).collect())?;
            tracing::trace!(rank = r, ranges = ranges.len(), "shipping to an expert-parallel rank");
            self.agent.transfer(OpKind::Write, &local, &peer.name, &remote, None).map(Some)
        };
        let post_signal = |r: usize, peer: &Peer, kind: u64| -> Result<Option<Request>> {
            let local = vram(vec![Desc { addr: peer.outbox.addr() + kind * 8, len: 8, dev }])?;
            let remote = vram(vec![Desc { addr: peer.block + kind * 8, len: 8, dev: peer.dev }])?;
            tracing::trace!(rank = r, kind, "signalling an expert-parallel rank");
            self.agent.transfer(OpKind::Write, &local, &peer.name, &remote, Some(signal_message(kind))).map(Some)
        };
        let live = || self.peers.iter().enumerate().filter_map(|(r, p)| p.as_ref().map(|p| (r, p)));
        let rows: Vec<_> = live().map(|(r, p)| post(r, p, &runs(r))).collect::<Result<_>>()?;
        self.wait_all(rows)?;
        let signals: Vec<_> = live().map(|(r, p)| post_signal(r, p, kind)).collect::<Result<_>>()?;
        self.wait_all(signals)
    }

    /// Waits until every other rank's signal `kind` has landed here (its notification,
    /// sent once the word and the rows before it were visible, has come).
    pub fn await_signal(&self, kind: u64) -> Result<()> {
        let want = self.peers.iter().flatten().count();
        let deadline = Instant::now() + self.timeout;
        loop {
            {
                let mut arrived = self.arrived.lock();
                let have = arrived.entry(kind).or_default();
                if *have >= want {
                    *have -= want;
                    return Ok(());
                }
            }
            self.check_alive()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(format!(
                    "not every rank's signal {kind} came within {:?}; are they alive and running the same sequence of calls?",
                    self.timeout
                )));
            }
            for n in self.agent.wait_notifs(left.min(DEATH_POLL)) {
                match signal_of(&n.msg) {
                    Some(k) => *self.arrived.lock().entry(k).or_default() += 1,
                    None => tracing::warn!(from = %n.from, "an unexpected notification on an expert-parallel agent"),
                }
            }
        }
    }

    fn wait_all(&self, requests: Vec<Option<Request>>) -> Result<()> {
        for req in requests.into_iter().flatten() {
            let deadline = Instant::now() + self.timeout;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match req.wait(Some(left.min(DEATH_POLL))) {
                    Status::Done => break,
                    Status::Error(e) => return Err(e),
                    other if left.is_zero() => {
                        return Err(Error::Timeout(format!(
                            "shipping to another rank did not finish within {:?} ({other:?})",
                            self.timeout
                        )))
                    }
                    _ => self.check_alive()?,
                }
            }
        }
        Ok(())
    }

    /// Fails as the group's collectives do once it knows a rank died.
    fn check_alive(&self) -> Result<()> {
        if let Some((rank, reason)) = self.group.dead() {
            return Err(dead_error(rank, &reason));
        }
        match self.ended.get() {
            Some((RENDEZVOUS_LOST, reason)) => {
                Err(Error::PeerDisconnected { peer: "the rendezvous".into(), reason: reason.clone() })
            }
            Some((rank, reason)) => Err(dead_error(*rank, reason)),
            None => Ok(()),
        }
    }

    /// Byte ranges of our block's dispatch rows and records for `rows` tokens of
    /// `row_bytes` each (rows sit `shape.row_bytes` apart: fp8 rows fill part of theirs).
    pub fn dispatch_runs(&self, rows: usize, row_bytes: u64) -> Vec<(u64, u64)> {
        dispatch_runs(&self.shape, rows, row_bytes)
    }
}

/// The notification that rides on signal `kind`.
fn signal_message(kind: u64) -> Vec<u8> {
    format!("freight-ep-signal:{kind}").into_bytes()
}

fn signal_of(msg: &[u8]) -> Option<u64> {
    std::str::from_utf8(msg).ok()?.strip_prefix("freight-ep-signal:")?.parse().ok()
}

/// See [`Relay::dispatch_runs`].
pub fn dispatch_runs(shape: &Shape, rows: usize, row_bytes: u64) -> Vec<(u64, u64)> {
    if rows == 0 {
        return Vec::new();
    }
    let mut runs = if row_bytes == shape.row_bytes {
        vec![(shape.off_drows, rows as u64 * row_bytes)]
    } else {
        (0..rows as u64).map(|i| (shape.off_drows + i * shape.row_bytes, row_bytes)).collect()
    };
    runs.push((shape.off_dmeta, rows as u64 * shape.meta_bytes));
    runs
}

/// Byte ranges of a block's combine rows for `tokens` (sorted token indices at the
/// peer), consecutive tokens merged.
pub fn combine_runs(shape: &Shape, tokens: &[u32]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &t in tokens {
        let off = shape.off_crows + t as u64 * shape.row_bytes;
        match runs.last_mut() {
            Some((start, len)) if *start + *len == off => *len += shape.row_bytes,
            _ => runs.push((off, shape.row_bytes)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Config;

    #[test]
    fn backends_have_the_seeds_names() {
        assert_eq!(Backend::parse("ipc").unwrap(), Backend::Ipc);
        assert_eq!(Backend::parse("freight").unwrap(), Backend::Engine);
        assert_eq!(Backend::parse("none").unwrap(), Backend::Network);
        assert!(Backend::parse("nvlink").unwrap_err().to_string().contains("ipc, freight or none"));
    }

    #[test]
    fn signal_kinds_match_the_kernels() {
        for (name, kind) in [
            ("DISPATCH_ARRIVED", DISPATCH_ARRIVED),
            ("DISPATCH_RELEASED", DISPATCH_RELEASED),
            ("COMBINE_ARRIVED", COMBINE_ARRIVED),
            ("COMBINE_RELEASED", COMBINE_RELEASED),
        ] {
            assert!(crate::kernels::SOURCE.contains(&format!("#define {name} {kind}")), "{name}");
        }
    }

    #[test]
    fn signal_notifications_name_their_kind() {
        for kind in [DISPATCH_ARRIVED, COMBINE_RELEASED] {
            assert_eq!(signal_of(&signal_message(kind)), Some(kind));
        }
        assert_eq!(signal_of(b"layer-0"), None);
        assert_eq!(signal_of(b"freight-ep-signal:x"), None);
    }

    #[test]
    fn dispatch_rows_are_shipped_whole_or_row_by_row() {
        let config = Config { ranks: 2, rank: 0, max_tokens: 16, hidden: 512, topk: 2, local_experts: 1 };
        let shape = Shape::of(&config).unwrap();
        let records = (shape.off_dmeta, 3 * shape.meta_bytes);
        assert_eq!(dispatch_runs(&shape, 3, 1024), vec![(shape.off_drows, 3 * 1024), records]);
        let fp8 = crate::kernels::fp8_row_bytes(512);
        let runs = dispatch_runs(&shape, 3, fp8);
        assert_eq!(runs.len(), 4);
        assert_eq!(runs[1], (shape.off_drows + 1024, fp8));
        assert_eq!(runs[3], records);
        assert!(dispatch_runs(&shape, 0, 1024).is_empty());
    }

    #[test]
    fn combine_rows_are_shipped_in_merged_runs() {
        let config = Config { ranks: 2, rank: 0, max_tokens: 16, hidden: 8, topk: 2, local_experts: 1 };
        let shape = Shape::of(&config).unwrap();
        let runs = combine_runs(&shape, &[0, 1, 2, 5, 7, 8]);
        let rb = shape.row_bytes;
        let at = |t: u64| shape.off_crows + t * rb;
        assert_eq!(runs, vec![(at(0), 3 * rb), (at(5), rb), (at(7), 2 * rb)]);
    }
}
