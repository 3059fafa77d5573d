//! The tcp transport: several streams per peer, large requests striped across them,
//! small blocks batched into one message, payload sent from and received into registered
//! memory directly (writev/readv, no staging copy; large payloads leave without a copy
//! at all, see [`super::zerocopy`]).
//!
//! Each stream has a sender thread (takes chunks, writes requests) and a receiver thread
//! (reads the answers). A stream's answers come back in order, so the receiver learns
//! what to expect from a bounded queue the sender fills: its capacity is the window.
//!
//! GPU memory, on either side, passes through pinned bounce buffers (see
//! [`super::staged`]); such payloads are sent with ordinary copies, since a bounce
//! buffer is reused as soon as its message is out. READ answers for GPU memory land in
//! two buffers in turn, so that copying one into the GPU overlaps reading the next. The
//! target's side is [`serve`].

use std::io::{IoSlice, IoSliceMut};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender, TryRecvError};
use parking_lot::Mutex;

use crate::frame_io;
use crate::tracker::Tracker;
use crate::transport::staged::{Alternating, GpuRegions, Landing, Piece};
use crate::transport::zerocopy::ZeroCopySocket;
use freight_host::nic::{self, Pinning};
use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Frame, Seg};
use freight_proto::op::OpKind;
use freight_proto::plan::Chunk;

mod serve;
pub use serve::serve_data_stream;

/// Tunables of the tcp transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Parallel data streams per peer.
    pub streams: usize,
    /// Largest message payload; large copies are split into chunks of this size.
    pub chunk_size: u64,
    /// Chunks in flight per stream before the sender waits for answers.
    pub window: usize,
    /// Local addresses to bind data streams to, round-robin (several NICs). Empty: one
    /// per local NIC whose subnet holds one of the peer's addresses (every NIC that
    /// reaches it directly), or, where none does, wherever the kernel routes.
    pub local_addrs: Vec<std::net::IpAddr>,
    /// Where the streams' sender and receiver threads run (see [`Pinning`]).
    pub pin: Pinning,
    /// Send payloads of 64 KiB and more without copying them: `MSG_ZEROCOPY` towards
    /// other hosts, splicing within this host (see [`super::zerocopy`]).
    pub zerocopy: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            streams: 4,
            chunk_size: 1 << 20,
            window: 8,
            local_addrs: Vec::new(),
            pin: Pinning::default(),
            zerocopy: true,
        }
    }
}

/// One unit of work for a stream: chunk `index` of a request's chunk list.
struct Job {
    op: OpKind,
    chunks: Arc<Vec<Chunk>>,
    index: usize,
    tracker: Arc<Tracker>,
    /// The request's local GPU regions, if it has any.
    gpu: Option<Arc<GpuRegions>>,
    /// The request's notification, carried by its only chunk (see [`TcpConn::submit`]).
    notif: Option<Vec<u8>>,
}

impl Job {
    fn chunk(&self) -> &Chunk {
        &self.chunks[self.index]
    }

    /// The local side of the chunk, with the GPU of each piece.
    fn local_pieces(&self) -> Vec<Piece> {
        let gpu = |region| self.gpu.as_ref().and_then(|g| g.device(region));
        self.chunk().segs.iter().map(|o| Piece { addr: o.local_addr, len: o.len, gpu: gpu(o.local_region) }).collect()
    }

    fn staged(&self) -> bool {
        self.gpu.as_ref().is_some_and(|g| self.chunk().segs.iter().any(|o| g.device(o.local_region).is_some()))
    }
}

/// Why a connection stopped working, shared by all its threads.
#[derive(Default)]
pub struct Health {
    dead: Mutex<Option<String>>,
    /// The connection's sockets, shut down together when it dies: a stream whose
    /// sibling failed must not leave its peer blocked writing answers nobody reads.
    sockets: Mutex<Vec<TcpStream>>,
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

    /// Shuts `sock` down along with the others when the connection dies.
    pub fn watch(&self, sock: TcpStream) {
        // Registered before looking: a death marked meanwhile finds it in the list.
        let mut sockets = self.sockets.lock();
        if self.dead.lock().is_some() {
            let _ = sock.shutdown(Shutdown::Both);
        }
        sockets.push(sock);
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
            drop(d);
            for s in self.sockets.lock().iter() {
                let _ = s.shutdown(Shutdown::Both);
            }
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
    next: AtomicUsize,
    health: Arc<Health>,
}

impl TcpConn {
    /// Starts the threads of already-connected data streams.
    /// `gpu_node` is the NUMA node of the GPU whose memory the connection was opened for
    /// (threads go there where their NIC has no node).
    pub fn start(
        peer: &str,
        sockets: Vec<TcpStream>,
        cfg: &TcpConfig,
        timeout: Duration,
        health: Arc<Health>,
        gpu_node: Option<u32>,
    ) -> Result<TcpConn> {
        let mut streams = Vec::with_capacity(sockets.len());
        for (i, sock) in sockets.into_iter().enumerate() {
            let (job_tx, job_rx) = unbounded::<Job>();
            let (exp_tx, exp_rx) = bounded::<(u64, Job)>(cfg.window.max(1));
            let writer = sock.try_clone()?;
            // A chunk larger than the socket buffers to a peer that stopped reading
            // fails within the timeout instead of blocking the stream for ever.
            writer.set_write_timeout(Some(timeout))?;
            let zc = ZeroCopySocket::new(&writer, cfg.zerocopy);
            let reader = sock.try_clone()?;
            reader.set_read_timeout(Some(timeout))?;
            let (h1, h2) = (health.clone(), health.clone());
            let (p1, p2) = (peer.to_string(), peer.to_string());
            let (pin1, pin2, local) = (cfg.pin.clone(), cfg.pin.clone(), sock.local_addr().ok());
            thread::Builder::new().name(format!("freight-tcp-tx{i}")).spawn(move || {
                nic::pin_stream_thread(&pin1, 2 * i, local, gpu_node);
                send_loop(writer, zc, job_rx, exp_tx, h1, p1)
            })?;
            thread::Builder::new().name(format!("freight-tcp-rx{i}")).spawn(move || {
                nic::pin_stream_thread(&pin2, 2 * i + 1, local, gpu_node);
                receive_loop(reader, exp_rx, h2, p2)
            })?;
            streams.push(job_tx);
            health.watch(sock);
        }
        Ok(TcpConn { peer: peer.to_string(), streams, next: AtomicUsize::new(0), health })
    }

    pub fn dead_reason(&self) -> Option<String> {
        self.health.reason()
    }

    /// Queues every chunk of a request; the tracker must expect `chunks.len()` parts.
    /// `gpu` names the request's local GPU regions, which are staged. `notif` rides on
    /// the message of a one-chunk WRITE (the caller checks both): the target queues it
    /// as soon as the payload is in place, a round trip before the answer gets back.
    pub fn submit(
        &self,
        op: OpKind,
        chunks: Arc<Vec<Chunk>>,
        tracker: &Arc<Tracker>,
        gpu: Option<Arc<GpuRegions>>,
        mut notif: Option<Vec<u8>>,
    ) {
        debug_assert!(notif.is_none() || (op == OpKind::Write && chunks.len() == 1));
        let n = self.streams.len();
        // Start where the previous request stopped so that small requests spread out.
        let start = self.next.fetch_add(chunks.len(), Ordering::Relaxed);
        for index in 0..chunks.len() {
            let job = Job {
                op,
                chunks: chunks.clone(),
                index,
                tracker: tracker.clone(),
                gpu: gpu.clone(),
                notif: notif.take(),
            };
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
        // The health shuts every stream's socket down with it.
        self.health.close(reason);
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

/// Starts gathering a WRITE chunk that holds GPU memory; returns its slot (`None`:
/// nothing to stage, the payload goes straight from registered memory).
fn start_staging(staging: &mut Alternating, job: &Job) -> Result<Option<usize>> {
    if job.op != OpKind::Write || !job.staged() {
        return Ok(None);
    }
    staging.gather(&job.local_pieces()).map(Some)
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
    let mut staging = Alternating::default();
    let mut ahead: Option<(Job, Result<Option<usize>>)> = None;
    loop {
        let (mut job, slot) = match ahead.take() {
            Some(next) => next,
            None => match jobs.recv() {
                Ok(job) => {
                    let slot = start_staging(&mut staging, &job);
                    (job, slot)
                }
                Err(_) => break,
            },
        };
        if matches!(slot, Ok(Some(_))) {
            if let Ok(next) = jobs.try_recv() {
                let next_slot = start_staging(&mut staging, &next);
                ahead = Some((next, next_slot));
            }
        }
        if let Some(reason) = health.reason() {
            job.tracker.finish_part(Err(Error::PeerDisconnected { peer: peer.clone(), reason }));
            continue;
        }
        let notif = job.notif.take();
        let chunk = job.chunk();
        let staged_payload = matches!(slot, Ok(Some(_)));
        let payload = match slot.and_then(|s| s.map(|s| staging.ready(s, chunk.bytes as usize)).transpose()) {
            Ok(Some(bytes)) => vec![IoSlice::new(bytes)],
            // SAFETY: the request holds guards on the local regions until every chunk has
            // been answered, so the memory stays registered and mapped while we read it.
            Ok(None) if job.op == OpKind::Write => chunk
                .segs
                .iter()
                .map(|o| IoSlice::new(unsafe { std::slice::from_raw_parts(o.local_addr as *const u8, o.len as usize) }))
                .collect(),
            Ok(None) => Vec::new(),
            Err(e) => {
                // Staging failed before anything was sent: only this chunk fails.
                job.tracker.finish_part(Err(e));
                continue;
            }
        };
        tag += 1;
        let frame = match job.op {
            OpKind::Write => Frame::Write { tag, segs: segs_of(chunk), notif },
            OpKind::Read => Frame::Read { tag, segs: segs_of(chunk) },
        };
        let header = frame::encode(&frame);
        let result = if staged_payload {
            // A bounce buffer is reused once this returns: no zero-copy for it.
            let mut slices = vec![IoSlice::new(&header)];
            slices.extend(payload);
            frame_io::write_all_vectored(&mut sock, &mut slices)
        } else {
            zc.write_all(&mut sock, &header, &payload)
        };
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

/// Reads a stream's answers in order. A READ into GPU memory is finished only once its
/// copies out of the bounce buffer are done; they run while the next answer is read.
fn receive_loop(mut sock: TcpStream, expect: Receiver<(u64, Job)>, health: Arc<Health>, peer: String) {
    let mut landing: Landing<Job> = Landing::default();
    let finish = |job: Job, outcome: Result<()>| job.tracker.finish_part(outcome);
    loop {
        let (tag, job) = match expect.try_recv() {
            Ok(next) => next,
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => {
                // Nothing more to read yet: what is still being copied must not wait.
                landing.settle(finish);
                match expect.recv() {
                    Ok(next) => next,
                    Err(_) => break,
                }
            }
        };
        let outcome = match health.reason() {
            Some(reason) => Err(Error::PeerDisconnected { peer: peer.clone(), reason }),
            // The peer's refusal or a failed local copy fails this chunk only; anything
            // else leaves the stream out of step, so the connection goes.
            None => receive_answer(&mut sock, tag, &job, &peer, &mut landing).unwrap_or_else(|e| {
                health.kill(e.to_string());
                let _ = sock.shutdown(Shutdown::Both);
                Err(match e {
                    Error::PeerDisconnected { .. } => e,
                    other => Error::PeerDisconnected { peer: peer.clone(), reason: other.to_string() },
                })
            }),
        };
        if outcome.is_ok() && job.op == OpKind::Read && job.staged() {
            landing.hold(job, finish);
        } else {
            landing.settle(finish);
            finish(job, outcome);
        }
    }
    landing.settle(finish);
}

/// Reads the answer for one chunk. The outer error means the stream failed; the inner
/// one that only this chunk did.
fn receive_answer(
    sock: &mut TcpStream,
    tag: u64,
    job: &Job,
    peer: &str,
    landing: &mut Landing<Job>,
) -> Result<Result<()>> {
    let frame = match frame_io::read_frame(sock) {
        Ok(Some(f)) => f,
        Ok(None) => return Err(Error::Io("the peer closed the connection".into())),
        Err(Error::Timeout(_)) => return Err(Error::Timeout("no answer from the peer within the peer timeout".into())),
        Err(e) => return Err(e),
    };
    let rejected = |reason| Error::RemoteRejected { peer: peer.to_string(), reason };
    match (job.op, frame) {
        (OpKind::Write, Frame::WriteAck { tag: t, error }) if t == tag => {
            Ok(error.map_or(Ok(()), |r| Err(rejected(r))))
        }
        (OpKind::Read, Frame::ReadData { tag: t, error }) if t == tag => {
            if let Some(r) = error {
                return Ok(Err(rejected(r)));
            }
            let chunk = job.chunk();
            if job.staged() {
                return landing.receive(sock, &job.local_pieces(), chunk.bytes);
            }
            // SAFETY: local destination regions are guarded for the request's lifetime.
            let mut slices: Vec<IoSliceMut<'_>> = chunk
                .segs
                .iter()
                .map(|o| {
                    IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(o.local_addr as *mut u8, o.len as usize) })
                })
                .collect();
            frame_io::read_exact_vectored(sock, &mut slices)?;
            Ok(Ok(()))
        }
        (_, other) => Err(Error::Protocol(format!("unexpected answer {other:?} for message {tag}"))),
    }
}
