//! What an agent knows about one peer, and its connections to it (opened lazily).

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use parking_lot::{Mutex, RwLock};

use crate::error::{Error, Result};
use crate::memory::RemoteRegions;
use crate::metadata::AgentMetadata;
use crate::net::{self, Introduction};
use crate::transport::cuda::CudaPeer;
use crate::transport::shm::ShmPeer;
use crate::transport::tcp::{Health, TcpConfig, TcpConn};
use crate::wire::{self, Frame, Role};

/// Connection settings a peer needs from its agent.
#[derive(Debug, Clone)]
pub struct DialContext {
    pub intro: Introduction,
    pub timeout: std::time::Duration,
    pub peer_timeout: std::time::Duration,
}

pub struct Peer {
    pub name: String,
    pub md: AgentMetadata,
    pub same_host: bool,
    pub regions: RwLock<RemoteRegions>,
    pub shm: ShmPeer,
    pub cuda: CudaPeer,
    links: Mutex<Links>,
    removed: AtomicBool,
}

#[derive(Default)]
struct Links {
    control: Option<Arc<ControlLink>>,
    tcp: Option<Arc<TcpConn>>,
}

/// The connection notifications travel on; its reader learns of revocations and of the
/// peer's death.
pub struct ControlLink {
    writer: Mutex<TcpStream>,
    health: Arc<Health>,
}

impl ControlLink {
    pub fn send(&self, frame: &Frame) -> Result<()> {
        let mut w = self.writer.lock();
        wire::write_frame(&mut *w, frame, &[]).inspect_err(|e| self.health.kill(format!("write failed: {e}")))
    }
}

impl Peer {
    pub fn new(md: AgentMetadata, same_host: bool) -> Peer {
        Peer {
            name: md.name.clone(),
            regions: RwLock::new(RemoteRegions::new(&md.regions)),
            shm: ShmPeer::new(md.host.pid),
            cuda: CudaPeer::default(),
            md,
            same_host,
            links: Mutex::new(Links::default()),
            removed: AtomicBool::new(false),
        }
    }

    fn disconnected(&self, reason: impl Into<String>) -> Error {
        Error::PeerDisconnected { peer: self.name.clone(), reason: reason.into() }
    }

    /// Fails when the peer was removed or a connection to it broke.
    pub fn check_alive(&self) -> Result<()> {
        if self.removed.load(Ordering::Acquire) {
            return Err(self.disconnected("the peer was removed or replaced; prepare against the new peer"));
        }
        let links = self.links.lock();
        let dead = links
            .control
            .as_ref()
            .and_then(|c| c.health.reason())
            .or_else(|| links.tcp.as_ref().and_then(|t| t.dead_reason()));
        match dead {
            Some(reason) => Err(self.disconnected(format!("{reason}; add the peer again to reconnect"))),
            None => Ok(()),
        }
    }

    /// The control link, dialled on first use.
    pub fn control(self: &Arc<Self>, ctx: &DialContext) -> Result<Arc<ControlLink>> {
        self.check_alive()?;
        let mut links = self.links.lock();
        if let Some(c) = &links.control {
            return Ok(c.clone());
        }
        let intro = self.intro(ctx);
        let stream = net::dial(&self.md.addresses, None, Role::Control, &intro, ctx.timeout)
            .map_err(|e| self.disconnected(format!("cannot open control connection: {e}")))?;
        let health = Arc::new(Health::default());
        let reader = stream.try_clone()?;
        let link = Arc::new(ControlLink { writer: Mutex::new(stream), health: health.clone() });
        let peer = self.clone();
        thread::Builder::new().name("freight-ctl-rx".into()).spawn(move || peer.watch_control(reader, health))?;
        links.control = Some(link.clone());
        Ok(link)
    }

    fn intro(&self, ctx: &DialContext) -> Introduction {
        Introduction { target_id: self.md.agent_id, token: self.md.secret.to_vec(), ..ctx.intro.clone() }
    }

    /// Reads what the peer sends back on the control link until it closes.
    fn watch_control(self: Arc<Self>, mut reader: TcpStream, health: Arc<Health>) {
        loop {
            match wire::read_frame(&mut reader) {
                Ok(Some(Frame::Revoke { region })) => {
                    tracing::debug!(peer = %self.name, region, "peer revoked a region");
                    let mut regions = self.regions.write();
                    regions.remove(region);
                    // Close the peer's GPU allocations no registered region lies in any more.
                    let live: Vec<u64> = regions.iter().filter_map(|r| r.gpu.as_ref().map(|g| g.alloc_base)).collect();
                    drop(regions);
                    self.cuda.imports.retain(|base| live.contains(&base));
                }
                Ok(Some(other)) => {
                    health.kill(format!("protocol error: unexpected {other:?} on the control link"));
                    break;
                }
                Ok(None) => {
                    // An orderly close (the peer closed its agent or removed us): not a
                    // failure, though requests still in flight to it will fail.
                    tracing::info!(peer = %self.name, "the peer closed its control connection");
                    health.close("the peer closed the connection");
                    break;
                }
                Err(e) => {
                    health.kill(e.to_string());
                    break;
                }
            }
        }
        // The peer is gone: fail the data path too, so that nothing waits for it.
        if let Some(t) = self.links.lock().tcp.clone() {
            t.shutdown(&health.reason().unwrap_or_default());
        }
    }

    /// The tcp data streams, dialled on first use.
    pub fn tcp(&self, ctx: &DialContext, cfg: &TcpConfig) -> Result<Arc<TcpConn>> {
        self.check_alive()?;
        let mut links = self.links.lock();
        if let Some(t) = &links.tcp {
            return Ok(t.clone());
        }
        let intro = self.intro(ctx);
        let n = cfg.streams.max(1);
        let mut sockets = Vec::with_capacity(n);
        for i in 0..n {
            let bind = (!cfg.local_addrs.is_empty()).then(|| cfg.local_addrs[i % cfg.local_addrs.len()]);
            // Spread streams over the peer's addresses too (one per NIC).
            let mut addrs = self.md.addresses.clone();
            if !addrs.is_empty() {
                let k = i % addrs.len();
                addrs.rotate_left(k);
            }
            let s = net::dial(&addrs, bind, Role::Data { index: i as u32 }, &intro, ctx.timeout)
                .map_err(|e| self.disconnected(format!("cannot open data stream {i}: {e}")))?;
            sockets.push(s);
        }
        let conn = Arc::new(TcpConn::start(&self.name, sockets, cfg, ctx.peer_timeout, Arc::new(Health::default()))?);
        tracing::info!(peer = %self.name, streams = n, chunk_size = cfg.chunk_size, window = cfg.window, "tcp connection up");
        links.tcp = Some(conn.clone());
        Ok(conn)
    }

    /// Closes every connection; in-flight requests fail.
    pub fn shutdown(&self, reason: &str) {
        self.removed.store(true, Ordering::Release);
        let links = std::mem::take(&mut *self.links.lock());
        if let Some(c) = links.control {
            c.health.close(reason);
            let _ = c.writer.lock().shutdown(Shutdown::Both);
        }
        if let Some(t) = links.tcp {
            t.shutdown(reason);
        }
    }
}
