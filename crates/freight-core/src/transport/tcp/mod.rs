//! The tcp transport: several streams per peer, large requests striped across them,
//! small blocks batched into one message, payload sent from and received into registered
//! memory directly (writev/readv, no staging copy; large payloads leave without a copy
//! at all, see [`super::zerocopy`]).
//!
//! Each stream has a sender thread (takes chunks, writes messages) and a receiver
//! thread (reads the answers). Their bookkeeping is one [`Initiator`] per stream, which
//! both share under a lock: tags, the window of messages in flight, which message an
//! answer settles, and what a failed stream fails (the protocol's state machine,
//! [`freight_proto::data_stream`]). The threads do the I/O and wait for each other
//! through it: the sender for room in the window, the receiver for a message to await.
//!
//! A small one-message request posted to an idle stream is written by the posting
//! thread itself ([`TcpConn::submit`]): waking the sender thread would cost more than
//! writing a few KiB, on a small host a third of a 4 KiB WRITE's round trip. Whoever
//! writes holds the stream's [`Writer`] from framing a message to handing it over, so
//! messages never interleave on the wire.
//!
//! GPU memory, on either side, passes through pinned bounce buffers (see
//! [`super::gpu_bounce`]); such payloads are sent with ordinary copies, since a bounce
//! buffer is reused as soon as its message is out. READ answers for GPU memory land in
//! two buffers in turn, so that copying one into the GPU overlaps reading the next. The
//! target's side is [`serve`].

use std::io::{IoSlice, IoSliceMut};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use crate::frame_io;
use crate::tracker::Tracker;
use crate::transport::gpu_bounce::{Alternating, GpuRegions, Landing, Piece};
use crate::transport::zerocopy::ZeroCopySocket;
use freight_host::nic::{self, Pinning};
use freight_proto::data_stream::{remote_segs, Answer, Initiator};
use freight_proto::error::{Error, Result};
use freight_proto::frame;
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

/// The largest chunk the posting thread writes itself (see [`TcpConn::submit`]): under
/// the size that leaves without a copy, and small enough that writing it into an idle
/// socket's buffer does not block.
const INLINE_MAX: u64 = 32 << 10;

/// The initiator's side of a tcp connection to one peer.
pub struct TcpConn {
    peer: String,
    streams: Vec<StreamHandle>,
    next: AtomicUsize,
    health: Arc<Health>,
}

/// A stream as the posting thread sees it: its sender thread's queue, and the stream
/// itself, for writing a small message without that thread.
struct StreamHandle {
    jobs: Sender<Job>,
    stream: Arc<Stream>,
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
            let writer = sock.try_clone()?;
            // A chunk larger than the socket buffers to a peer that stopped reading
            // fails within the timeout instead of blocking the stream for ever.
            writer.set_write_timeout(Some(timeout))?;
            let zc = ZeroCopySocket::new(&writer, cfg.zerocopy);
            let stream = Arc::new(Stream::new(peer, cfg.window, Writer { sock: writer, zc }));
            let reader = sock.try_clone()?;
            reader.set_read_timeout(Some(timeout))?;
            let (h1, h2) = (health.clone(), health.clone());
            let (s1, s2) = (stream.clone(), stream.clone());
            let (pin1, pin2, local) = (cfg.pin.clone(), cfg.pin.clone(), sock.local_addr().ok());
            thread::Builder::new().name(format!("freight-tcp-tx{i}")).spawn(move || {
                nic::pin_stream_thread(&pin1, 2 * i, local, gpu_node);
                send_loop(job_rx, &s1, &h1);
                s1.sender_gone();
            })?;
            thread::Builder::new().name(format!("freight-tcp-rx{i}")).spawn(move || {
                nic::pin_stream_thread(&pin2, 2 * i + 1, local, gpu_node);
                receive_loop(reader, &s2, &h2)
            })?;
            streams.push(StreamHandle { jobs: job_tx, stream });
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
    ///
    /// A request of one chunk of host memory up to [`INLINE_MAX`], for a stream with
    /// nothing queued, nothing in flight and no message being written, is written here,
    /// on the caller's thread; anything else goes to the streams' sender threads.
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
        if chunks.len() == 1 && gpu.is_none() && chunks[0].bytes <= INLINE_MAX {
            let handle = &self.streams[start % n];
            if handle.jobs.is_empty() {
                let job = Job { op, chunks: chunks.clone(), index: 0, tracker: tracker.clone(), gpu: None, notif };
                match handle.stream.try_send_now(job, &self.health) {
                    Ok(()) => return,
                    Err(job) => notif = job.notif,
                }
            }
        }
        for index in 0..chunks.len() {
            let job = Job {
                op,
                chunks: chunks.clone(),
                index,
                tracker: tracker.clone(),
                gpu: gpu.clone(),
                notif: notif.take(),
            };
            if let Err(e) = self.streams[(start + index) % n].jobs.send(job) {
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

/// One stream's bookkeeping, shared by its sender and receiver threads, and how they
/// wait for each other: the sender for room in the window, the receiver for a message
/// to await (or for the sender to be gone).
struct Stream {
    peer: String,
    state: Mutex<StreamState>,
    changed: Condvar,
    /// The socket's writing side. Lock order: `writer`, then `state`.
    writer: Mutex<Writer>,
}

/// Where a stream's messages are written, by its sender thread or a posting thread.
struct Writer {
    sock: TcpStream,
    zc: ZeroCopySocket,
}

struct StreamState {
    machine: Initiator<Job>,
    /// The sender thread ended: nothing more will be sent.
    sender_gone: bool,
}

impl Stream {
    fn new(peer: &str, window: usize, writer: Writer) -> Stream {
        Stream {
            peer: peer.to_string(),
            state: Mutex::new(StreamState { machine: Initiator::new(peer, window), sender_gone: false }),
            changed: Condvar::new(),
            writer: Mutex::new(writer),
        }
    }

    /// Writes `job` (one chunk of host memory) on the calling thread, where the stream
    /// is idle: its writer free, nothing in flight, the connection alive. Else gives the
    /// job back untouched, for the sender thread.
    fn try_send_now(&self, mut job: Job, health: &Health) -> std::result::Result<(), Job> {
        let Some(mut writer) = self.writer.try_lock() else { return Err(job) };
        {
            let st = self.state.lock();
            if st.sender_gone || st.machine.awaiting() > 0 || !st.machine.has_room() || st.machine.dead().is_some() {
                return Err(job);
            }
        }
        if health.reason().is_some() {
            return Err(job);
        }
        let notif = job.notif.take();
        // SAFETY: `write_message` is done with the payload when it hands the job over.
        let payload = unsafe { host_payload(&job) };
        // Its answer follows within a round trip: the caller's wait polls for it.
        job.tracker.answer_due();
        self.write_message(&mut writer, job, notif, payload, false, health);
        Ok(())
    }

    /// Frames `job`'s chunk (waiting for room in the window), writes it with `payload`
    /// and hands it to the receiver's side. `staged`: the payload is in a bounce buffer,
    /// reused once this returns, so it is not sent without a copy.
    fn write_message(
        &self,
        w: &mut Writer,
        job: Job,
        notif: Option<Vec<u8>>,
        payload: Vec<IoSlice<'_>>,
        staged: bool,
        health: &Health,
    ) {
        let framed = {
            let mut st = self.state.lock();
            self.changed.wait_while(&mut st, |st| !st.machine.has_room());
            st.machine.send(job.op, remote_segs(job.chunk()), notif)
        };
        let (header, message) = match framed {
            Ok((frame, message)) => (frame::encode(&frame), message),
            Err(e) => {
                job.tracker.finish_part(Err(e));
                return;
            }
        };
        let written = if staged {
            let mut slices = vec![IoSlice::new(&header)];
            slices.extend(payload);
            frame_io::write_all_vectored(&mut w.sock, &mut slices)
        } else {
            w.zc.write_all(&mut w.sock, &header, &payload)
        };
        // From here on the receiver owns the chunk's completion (exactly one report per
        // part), unless the stream failed meanwhile.
        let sent = self.state.lock().machine.sent(message, job);
        self.changed.notify_all();
        if let Err((job, e)) = sent {
            job.tracker.finish_part(Err(e));
        }
        if let Err(e) = written {
            self.break_with(health, &w.sock, &Error::Io(format!("write failed: {e}")));
        }
    }

    /// Fails the stream: every message awaiting an answer fails, once.
    fn fail(&self, reason: &str) {
        let failed = self.state.lock().machine.fail(reason);
        self.changed.notify_all();
        for (job, e) in failed {
            job.tracker.finish_part(Err(e));
        }
    }

    /// `e` broke the stream: the whole connection goes (every stream of it), and what
    /// awaits answers here fails with the connection's first reason.
    fn break_with(&self, health: &Health, sock: &TcpStream, e: &Error) -> String {
        health.kill(e.to_string());
        let _ = sock.shutdown(Shutdown::Both);
        let reason = health.reason().unwrap_or_else(|| e.to_string());
        self.fail(&reason);
        reason
    }

    fn sender_gone(&self) {
        self.state.lock().sender_gone = true;
        self.changed.notify_all();
    }

    /// Waits until a message awaits its answer; `false` once none will (the sender is
    /// gone and everything was answered). What `idle` does runs before each wait.
    fn await_message(&self, mut idle: impl FnMut()) -> bool {
        let mut st = self.state.lock();
        while st.machine.awaiting() == 0 && !st.sender_gone {
            drop(st);
            idle();
            st = self.state.lock();
            if st.machine.awaiting() == 0 && !st.sender_gone {
                self.changed.wait(&mut st);
            }
        }
        st.machine.awaiting() > 0
    }
}

/// Starts gathering a WRITE chunk that holds GPU memory; returns its slot (`None`:
/// nothing to stage, the payload goes straight from registered memory).
fn start_staging(staging: &mut Alternating, job: &Job) -> Result<Option<usize>> {
    if job.op != OpKind::Write || !job.staged() {
        return Ok(None);
    }
    staging.gather(&job.local_pieces()).map(Some)
}

/// A chunk's payload straight from registered host memory: a WRITE's bytes, or nothing
/// for a READ. The slices borrow the memory, not the job.
///
/// # Safety
///
/// The slices must be used only until the job is handed to [`Initiator::sent`]: until
/// then the request holds guards on its local regions (it releases them once every
/// chunk has been answered), so the memory stays registered and mapped.
unsafe fn host_payload<'m>(job: &Job) -> Vec<IoSlice<'m>> {
    if job.op != OpKind::Write {
        return Vec::new();
    }
    job.chunk()
        .segs
        .iter()
        // SAFETY: as the caller promises, the memory stays mapped while the slices live.
        .map(|o| IoSlice::new(unsafe { std::slice::from_raw_parts(o.local_addr as *const u8, o.len as usize) }))
        .collect()
}

fn send_loop(jobs: Receiver<Job>, stream: &Stream, health: &Health) {
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
        // While this chunk's GPU bytes are gathered, start gathering the next one's.
        if matches!(slot, Ok(Some(_))) {
            if let Ok(next) = jobs.try_recv() {
                let next_slot = start_staging(&mut staging, &next);
                ahead = Some((next, next_slot));
            }
        }
        if let Some(reason) = health.reason() {
            // Another stream of the connection failed: this one fails too.
            stream.fail(&reason);
        }
        let notif = job.notif.take();
        let staged = matches!(slot, Ok(Some(_)));
        let chunk_bytes = job.chunk().bytes as usize;
        let payload = match slot.and_then(|s| s.map(|s| staging.ready(s, chunk_bytes)).transpose()) {
            Ok(Some(bytes)) => vec![IoSlice::new(bytes)],
            // SAFETY: `write_message` is done with the payload when it hands the job over.
            Ok(None) => unsafe { host_payload(&job) },
            Err(e) => {
                // Staging failed before anything was sent: only this chunk fails.
                job.tracker.finish_part(Err(e));
                continue;
            }
        };
        let mut writer = stream.writer.lock();
        stream.write_message(&mut writer, job, notif, payload, staged, health);
    }
}

/// Reads a stream's answers in order. A READ into GPU memory is finished only once its
/// copies out of the bounce buffer are done; they run while the next answer is read.
fn receive_loop(mut sock: TcpStream, stream: &Stream, health: &Health) {
    let mut landing: Landing<Job> = Landing::default();
    let finish = |job: Job, outcome: Result<()>| job.tracker.finish_part(outcome);
    // Nothing more to read yet: what is still being copied must not wait.
    while stream.await_message(|| landing.settle(finish)) {
        if let Some(reason) = health.reason() {
            stream.fail(&reason);
            continue;
        }
        let answer = read_answer(&mut sock).and_then(|header| {
            let answer = stream.state.lock().machine.receive(header);
            stream.changed.notify_all();
            answer
        });
        let (job, outcome) = match answer {
            Ok(Answer::Settled { job, result }) => (job, result),
            Ok(Answer::Data { job, len }) => match receive_data(&mut sock, &job, len, &mut landing) {
                Ok(()) if job.staged() => {
                    landing.hold(job, finish);
                    continue;
                }
                Ok(()) => (job, Ok(())),
                // A failed local copy fails this chunk only.
                Err(Ok(e)) => (job, Err(e)),
                // The stream is out of step: it fails, and this chunk with it.
                Err(Err(e)) => {
                    let reason = stream.break_with(health, &sock, &e);
                    (job, Err(Error::PeerDisconnected { peer: stream.peer.clone(), reason }))
                }
            },
            Err(e) => {
                stream.break_with(health, &sock, &e);
                continue;
            }
        };
        landing.settle(finish);
        finish(job, outcome);
    }
    landing.settle(finish);
}

/// The next answer's header; an error: the stream failed.
fn read_answer(sock: &mut TcpStream) -> Result<frame::Frame> {
    match frame_io::read_frame(sock) {
        Ok(Some(f)) => Ok(f),
        Ok(None) => Err(Error::Io("the peer closed the connection".into())),
        Err(Error::Timeout(_)) => Err(Error::Timeout("no answer from the peer within the peer timeout".into())),
        Err(e) => Err(e),
    }
}

/// Reads the `len` bytes of a READ's data into the chunk's memory (through the landing
/// buffers where it is GPU memory, whose copies then run on). `Err(Ok(e))`: this chunk
/// failed and the stream is in step; `Err(Err(e))`: the stream failed.
fn receive_data(
    sock: &mut TcpStream,
    job: &Job,
    len: u64,
    landing: &mut Landing<Job>,
) -> std::result::Result<(), Result<Error>> {
    let chunk = job.chunk();
    debug_assert_eq!(len, chunk.bytes, "a READ's data is its chunk's bytes");
    if job.staged() {
        return match landing.receive(sock, &job.local_pieces(), len) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Ok(e)),
            Err(e) => Err(Err(e)),
        };
    }
    // SAFETY: local destination regions are guarded for the request's lifetime.
    let mut slices: Vec<IoSliceMut<'_>> = chunk
        .segs
        .iter()
        .map(|o| IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(o.local_addr as *mut u8, o.len as usize) }))
        .collect();
    frame_io::read_exact_vectored(sock, &mut slices).map_err(|e| Err(e.into()))
}
