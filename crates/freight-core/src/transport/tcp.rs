//! The tcp transport: several streams per peer, large requests striped across them,
//! small blocks batched into one message, payload sent from and received into registered
//! memory directly (writev/readv, no staging copy; large payloads to other hosts go out
//! with `MSG_ZEROCOPY`, see [`super::zerocopy`]).
//!
//! Each stream has a sender thread (takes chunks, writes requests) and a receiver thread
//! (reads the answers). A stream's answers come back in order, so the receiver learns
//! what to expect from a bounded queue the sender fills: its capacity is the window.

use std::io::{IoSlice, IoSliceMut};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::memory::{MemKind, Registry};
use crate::plan::Chunk;
use crate::request::Tracker;
use crate::transport::zerocopy::{self, ZeroCopySocket};
use crate::transport::OpKind;
use crate::wire::{self, Frame, Seg};

/// Tunables of the tcp transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Parallel data streams per peer.
    pub streams: usize,
    /// Largest message payload; large copies are split into chunks of this size.
    pub chunk_size: u64,
    /// Chunks in flight per stream before the sender waits for answers.
    pub window: usize,
    /// Local addresses to bind data streams to, round-robin (several NICs); empty = any.
    pub local_addrs: Vec<std::net::IpAddr>,
    /// Send payloads of 64 KiB and more with `MSG_ZEROCOPY` to peers on other hosts
    /// (never on loopback, where the kernel copies anyway).
    pub zerocopy: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig { streams: 4, chunk_size: 1 << 20, window: 8, local_addrs: Vec::new(), zerocopy: true }
    }
}

/// One unit of work for a stream: chunk `index` of a request's chunk list.
struct Job {
    op: OpKind,
    chunks: Arc<Vec<Chunk>>,
    index: usize,
    tracker: Arc<Tracker>,
}

/// Why a connection stopped working, shared by all its threads.
#[derive(Default)]
pub struct Health {
    dead: Mutex<Option<String>>,
}

impl Health {
    /// Marks the connection dead. The first reason wins; it is what in-flight requests
    /// report. Closes this agent asked for are expected and logged at debug level only.
    pub fn kill(&self, reason: impl Into<String>) {
        self.mark(reason.into(), false);
    }

    pub fn close(&self, reason: &str) {
        self.mark(reason.to_string(), true);
    }

    fn mark(&self, reason: String, expected: bool) {
        let mut d = self.dead.lock();
        if d.is_none() {
            if expected {
                tracing::debug!(%reason, "connection closed");
            } else {
                tracing::warn!(%reason, "connection failed");
            }
            *d = Some(reason);
        }
    }
    pub fn reason(&self) -> Option<String> {
        self.dead.lock().clone()
    }
}

/// The initiator's side of a tcp connection to one peer.
pub struct TcpConn {
    peer: String,
    streams: Vec<Sender<Job>>,
    sockets: Vec<TcpStream>,
    next: AtomicUsize,
    health: Arc<Health>,
}

impl TcpConn {
    /// Starts the threads of already-connected data streams.
    pub fn start(
        peer: &str,
        sockets: Vec<TcpStream>,
        cfg: &TcpConfig,
        timeout: Duration,
        health: Arc<Health>,
    ) -> Result<TcpConn> {
        let mut streams = Vec::with_capacity(sockets.len());
        let mut kept = Vec::with_capacity(sockets.len());
        for (i, sock) in sockets.into_iter().enumerate() {
            let (job_tx, job_rx) = unbounded::<Job>();
            let (exp_tx, exp_rx) = bounded::<(u64, Job)>(cfg.window.max(1));
            let writer = sock.try_clone()?;
            let zc = ZeroCopySocket::new(&writer, cfg.zerocopy && sock.peer_addr().is_ok_and(zerocopy::worthwhile));
            let reader = sock.try_clone()?;
            reader.set_read_timeout(Some(timeout))?;
            let (h1, h2) = (health.clone(), health.clone());
            let (p1, p2) = (peer.to_string(), peer.to_string());
            thread::Builder::new()
                .name(format!("freight-tcp-tx{i}"))
                .spawn(move || send_loop(writer, zc, job_rx, exp_tx, h1, p1))?;
            thread::Builder::new()
                .name(format!("freight-tcp-rx{i}"))
                .spawn(move || receive_loop(reader, exp_rx, h2, p2))?;
            streams.push(job_tx);
            kept.push(sock);
        }
        Ok(TcpConn { peer: peer.to_string(), streams, sockets: kept, next: AtomicUsize::new(0), health })
    }

    pub fn dead_reason(&self) -> Option<String> {
        self.health.reason()
    }

    /// Queues every chunk of a request; the tracker must expect `chunks.len()` parts.
    pub fn submit(&self, op: OpKind, chunks: Arc<Vec<Chunk>>, tracker: &Arc<Tracker>) {
        let n = self.streams.len();
        // Start where the previous request stopped so that small requests spread out.
        let start = self.next.fetch_add(chunks.len(), Ordering::Relaxed);
        for index in 0..chunks.len() {
            let job = Job { op, chunks: chunks.clone(), index, tracker: tracker.clone() };
            if let Err(e) = self.streams[(start + index) % n].send(job) {
                e.0.tracker.finish_part(Err(self.disconnected("stream closed")));
            }
        }
    }

    fn disconnected(&self, fallback: &str) -> Error {
        Error::PeerDisconnected {
            peer: self.peer.clone(),
            reason: self.health.reason().unwrap_or_else(|| fallback.into()),
        }
    }

    /// Closes the sockets; threads notice and fail whatever is still queued.
    pub fn shutdown(&self, reason: &str) {
        self.health.close(reason);
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpConn {
    fn drop(&mut self) {
        self.shutdown("connection closed by this agent");
    }
}

fn segs_of(chunk: &Chunk) -> Vec<Seg> {
    chunk.segs.iter().map(|o| Seg { region: o.remote_region, addr: o.remote_addr, len: o.len }).collect()
}

fn send_loop(
    mut sock: TcpStream,
    mut zc: ZeroCopySocket,
    jobs: Receiver<Job>,
    expect: Sender<(u64, Job)>,
    health: Arc<Health>,
    peer: String,
) {
    let mut tag = 0u64;
    for job in jobs {
        if let Some(reason) = health.reason() {
            job.tracker.finish_part(Err(Error::PeerDisconnected { peer: peer.clone(), reason }));
            continue;
        }
        tag += 1;
        let chunk = &job.chunks[job.index];
        let frame = match job.op {
            OpKind::Write => Frame::Write { tag, segs: segs_of(chunk) },
            OpKind::Read => Frame::Read { tag, segs: segs_of(chunk) },
        };
        // SAFETY: the request holds guards on the local regions until every chunk has
        // been answered, so the memory stays registered and mapped while we read it.
        let payload: Vec<IoSlice<'_>> = match job.op {
            OpKind::Write => chunk
                .segs
                .iter()
                .map(|o| IoSlice::new(unsafe { std::slice::from_raw_parts(o.local_addr as *const u8, o.len as usize) }))
                .collect(),
            OpKind::Read => Vec::new(),
        };
        let result = zc.write_all(&mut sock, &wire::encode(&frame), &payload);
        drop(payload);
        // Hand the expectation over before anything else can fail: from here on the
        // receiver owns the job's completion (exactly one report per part).
        let job_tracker = job.tracker.clone();
        if expect.send((tag, job)).is_err() {
            job_tracker.finish_part(Err(Error::Io("receiver stopped".into())));
            continue;
        }
        if let Err(e) = result {
            health.kill(format!("write failed: {e}"));
            let _ = sock.shutdown(Shutdown::Both);
        }
    }
}

fn receive_loop(mut sock: TcpStream, expect: Receiver<(u64, Job)>, health: Arc<Health>, peer: String) {
    for (tag, job) in expect.iter() {
        let outcome = match health.reason() {
            Some(reason) => Err(Error::PeerDisconnected { peer: peer.clone(), reason }),
            None => receive_answer(&mut sock, tag, &job, &peer),
        };
        if let Err(e) = &outcome {
            if !matches!(e, Error::RemoteRejected { .. }) {
                health.kill(e.to_string());
                let _ = sock.shutdown(Shutdown::Both);
            }
        }
        let outcome = outcome.map_err(|e| match e {
            Error::RemoteRejected { .. } | Error::PeerDisconnected { .. } => e,
            other => Error::PeerDisconnected { peer: peer.clone(), reason: other.to_string() },
        });
        job.tracker.finish_part(outcome);
    }
}

fn receive_answer(sock: &mut TcpStream, tag: u64, job: &Job, peer: &str) -> Result<()> {
    let frame = match wire::read_frame(sock) {
        Ok(Some(f)) => f,
        Ok(None) => return Err(Error::Io("the peer closed the connection".into())),
        Err(Error::Timeout(_)) => return Err(Error::Timeout("no answer from the peer within the peer timeout".into())),
        Err(e) => return Err(e),
    };
    let rejected = |reason| Error::RemoteRejected { peer: peer.to_string(), reason };
    match (job.op, frame) {
        (OpKind::Write, Frame::WriteAck { tag: t, error }) if t == tag => error.map_or(Ok(()), |r| Err(rejected(r))),
        (OpKind::Read, Frame::ReadData { tag: t, error }) if t == tag => {
            if let Some(r) = error {
                return Err(rejected(r));
            }
            let chunk = &job.chunks[job.index];
            // SAFETY: local destination regions are guarded for the request's lifetime.
            let mut slices: Vec<IoSliceMut<'_>> = chunk
                .segs
                .iter()
                .map(|o| {
                    IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(o.local_addr as *mut u8, o.len as usize) })
                })
                .collect();
            wire::read_exact_vectored(sock, &mut slices)?;
            Ok(())
        }
        (_, other) => Err(Error::Protocol(format!("unexpected answer {other:?} for message {tag}"))),
    }
}

/// The target's side of one data stream: checks every access against the registry and
/// moves payload straight between the socket and registered memory.
pub fn serve_data_stream(mut sock: TcpStream, registry: &Registry, cfg: &TcpConfig, peer: &str) -> Result<()> {
    let mut zc = ZeroCopySocket::new(&sock, cfg.zerocopy && sock.peer_addr().is_ok_and(zerocopy::worthwhile));
    loop {
        let frame = match wire::read_frame(&mut sock)? {
            Some(f) => f,
            None => return Ok(()),
        };
        match frame {
            Frame::Write { tag, segs } => {
                let total = wire::seg_bytes(&segs)?;
                match check_access(registry, &segs) {
                    Ok(guards) => {
                        // SAFETY: every segment lies in a registered region (checked above)
                        // that cannot be deregistered while `guards` lives.
                        let mut slices: Vec<IoSliceMut<'_>> = segs
                            .iter()
                            .map(|s| {
                                IoSliceMut::new(unsafe {
                                    std::slice::from_raw_parts_mut(s.addr as *mut u8, s.len as usize)
                                })
                            })
                            .collect();
                        wire::read_exact_vectored(&mut sock, &mut slices)?;
                        // Let go of the regions before acknowledging: once the initiator
                        // sees DONE, this agent's owner may deregister them at once.
                        drop(slices);
                        drop(guards);
                        wire::write_frame(&mut sock, &Frame::WriteAck { tag, error: None }, &[])?;
                    }
                    Err(e) => {
                        tracing::warn!(peer, error = %e, "refused a remote write");
                        wire::discard(&mut sock, total)?;
                        wire::write_frame(&mut sock, &Frame::WriteAck { tag, error: Some(e.to_string()) }, &[])?;
                    }
                }
            }
            Frame::Read { tag, segs } => {
                wire::seg_bytes(&segs)?;
                match check_access(registry, &segs) {
                    Ok(_guards) => {
                        // SAFETY: as above, for reading.
                        let payload: Vec<IoSlice<'_>> = segs
                            .iter()
                            .map(|s| {
                                IoSlice::new(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len as usize) })
                            })
                            .collect();
                        zc.write_all(&mut sock, &wire::encode(&Frame::ReadData { tag, error: None }), &payload)?;
                    }
                    Err(e) => {
                        tracing::warn!(peer, error = %e, "refused a remote read");
                        wire::write_frame(&mut sock, &Frame::ReadData { tag, error: Some(e.to_string()) }, &[])?;
                    }
                }
            }
            other => return Err(Error::Protocol(format!("unexpected message on a data stream: {other:?}"))),
        }
    }
}

/// Every segment must lie in a registered host-memory region; returns the guards.
fn check_access(registry: &Registry, segs: &[Seg]) -> Result<Vec<Arc<crate::memory::Region>>> {
    let mut guards: Vec<Arc<crate::memory::Region>> = Vec::new();
    for s in segs {
        if let Some(g) = guards.iter().find(|g| g.info.key == s.region) {
            g.info.check_contains(s.addr, s.len)?;
            continue;
        }
        let g = registry.get_checked(s.region, s.addr, s.len)?;
        if g.info.kind != MemKind::Dram {
            return Err(Error::TransportUnavailable(format!("tcp cannot serve {} memory in this build", g.info.kind)));
        }
        guards.push(g);
    }
    Ok(guards)
}
