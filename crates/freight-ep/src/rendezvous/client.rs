//! A rank's side of the rank server: one connection, one reader thread that routes collective
//! results and death notices to the callers waiting on them.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use freight_core::{interrupt, Error, Result};
use parking_lot::Mutex;

use super::wire::{decode, encode, read_line, ToRank, ToServer, PROTOCOL};
use super::{check_rank, dead_error, describe_missing, DeathHook, Deaths, Group};

/// The server's name in errors.
const SERVER: &str = "rank server";
/// How long a timed-out collective waits for the server to say which ranks are missing.
const STATUS_WAIT: Duration = Duration::from_millis(500);
/// How long `leave` waits for the server to acknowledge by closing the connection.
const LEAVE_WAIT: Duration = Duration::from_secs(2);

/// A rank joined through a [`RankServer`](super::RankServer).
pub struct ServerGroup {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    /// Kept to shut the connection down, which unblocks the reader thread.
    socket: TcpStream,
    reader: Mutex<Option<JoinHandle<()>>>,
    /// Disconnected when the reader thread exits.
    reader_done: Receiver<()>,
}

struct Shared {
    rank: usize,
    world: usize,
    /// Held across assigning a collective number and writing it, so that numbers reach the
    /// server in order even when several threads call collectives.
    writer: Mutex<Writer>,
    state: Mutex<State>,
    deaths: Deaths,
}

struct Writer {
    stream: TcpStream,
    next_seq: u64,
}

type Outcome = Result<Vec<Vec<u8>>>;
/// The server's answer to a status query: (missing, absent) ranks.
type Missing = (Vec<usize>, Vec<usize>);

#[derive(Default)]
struct State {
    /// Collectives waiting for their result.
    pending: HashMap<u64, Sender<Outcome>>,
    /// Timed-out collectives waiting for the server's list of missing ranks.
    status: HashMap<u64, Sender<Missing>>,
    /// Once set, every pending and later collective fails with it. Set under the same lock
    /// that registers collectives, so none can slip in after the failure and hang.
    failure: Option<Error>,
    /// Set by `leave` and drop: the connection is about to end on purpose.
    closing: bool,
}

impl ServerGroup {
    /// Joins as `rank` of `world` through the rank server at `server`, presenting its
    /// `token` where it has one. Keeps trying to connect until `timeout`, so ranks and
    /// server may start in any order; returns once the server has accepted this rank,
    /// without waiting for the others (the first collective does that).
    pub fn join(
        server: SocketAddr,
        rank: usize,
        world: usize,
        timeout: Duration,
        token: Option<&str>,
    ) -> Result<ServerGroup> {
        check_rank(rank, world)?;
        let deadline = Instant::now() + timeout;
        let stream = connect(server, deadline, timeout)?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let join = Join { rank, world, token: token.unwrap_or_default() };
        let welcome = handshake(&stream, &mut reader, &join, deadline, timeout);
        let server_world = match welcome {
            Ok(w) => w,
            Err(e) => {
                let _ = stream.shutdown(Shutdown::Both);
                return Err(e);
            }
        };
        if server_world != world {
            let _ = stream.shutdown(Shutdown::Both);
            return Err(Error::Protocol(format!("rank server welcomed world size {server_world}, not {world}")));
        }
        let shared = Arc::new(Shared {
            rank,
            world,
            writer: Mutex::new(Writer { stream: stream.try_clone()?, next_seq: 0 }),
            state: Mutex::new(State::default()),
            deaths: Deaths::default(),
        });
        let (done_tx, reader_done) = bounded::<()>(0);
        let reader = {
            let shared = shared.clone();
            std::thread::Builder::new().name(format!("freight-rank-{rank}")).spawn(move || {
                read_loop(&shared, reader);
                drop(done_tx);
            })?
        };
        tracing::info!(%server, rank, world, "joined the rank server");
        Ok(ServerGroup { rank, world, shared, socket: stream, reader: Mutex::new(Some(reader)), reader_done })
    }

    /// After a timeout: asks the server which ranks the collective still waits for.
    fn timeout_error(&self, seq: u64, timeout: Duration) -> Error {
        let (tx, rx) = bounded(1);
        self.shared.state.lock().status.insert(seq, tx);
        let sent = self.shared.send(&ToServer::Status { seq });
        let detail = match sent.map(|()| rx.recv_timeout(STATUS_WAIT)) {
            Ok(Ok((missing, absent))) => describe_missing(&missing, &absent),
            _ => "the rank server did not say which ranks are missing".to_owned(),
        };
        self.shared.state.lock().status.remove(&seq);
        Error::Timeout(format!(
            "collective {seq} did not complete within {timeout:?} on rank {} of {}: {detail}",
            self.rank, self.world
        ))
    }

    fn stop_reader(&self) {
        let _ = self.socket.shutdown(Shutdown::Both);
        if let Some(reader) = self.reader.lock().take() {
            let _ = reader.join();
        }
    }
}

impl Group for ServerGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let (seq, rx) = {
            let mut writer = self.shared.writer.lock();
            let (tx, rx) = bounded(1);
            let seq = writer.next_seq;
            {
                let mut state = self.shared.state.lock();
                if let Some(failure) = &state.failure {
                    return Err(failure.clone());
                }
                state.pending.insert(seq, tx);
            }
            writer.next_seq += 1;
            let line = encode(&ToServer::Gather { seq, blob: blob.to_vec() })?;
            if let Err(e) = (&writer.stream).write_all(&line) {
                let err = Error::PeerDisconnected { peer: SERVER.into(), reason: format!("cannot send: {e}") };
                return Err(self.shared.fail(err));
            }
            (seq, rx)
        };
        let deadline = Instant::now() + timeout;
        let waited = interrupt::until(deadline, |slice| match rx.recv_timeout(slice) {
            Ok(outcome) => Ok(Some(outcome)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.shared.failure()),
        });
        match waited {
            Ok(Some(outcome)) => outcome,
            // Like a timeout: the collective is spent (this rank's part counts for
            // the others), and its result, when it comes, is for no one.
            Err(e @ Error::Interrupted(_)) => {
                self.shared.state.lock().pending.remove(&seq);
                Err(e)
            }
            Err(e) => Err(e),
            Ok(None) => {
                // The reader sends while holding the state lock, so a result that raced the
                // deadline is either still pending (removed here) or already in the channel.
                if self.shared.state.lock().pending.remove(&seq).is_none() {
                    if let Ok(outcome) = rx.try_recv() {
                        return outcome;
                    }
                }
                Err(self.timeout_error(seq, timeout))
            }
        }
    }

    fn dead(&self) -> Option<(usize, String)> {
        self.shared.deaths.first()
    }

    fn on_dead(&self, hook: DeathHook) {
        self.shared.deaths.on_dead(hook);
    }

    fn leave(&self) -> Result<()> {
        {
            let mut state = self.shared.state.lock();
            if state.closing {
                return Ok(());
            }
            state.closing = true;
        }
        let sent = self.shared.send(&ToServer::Leave);
        // Half-close: the server reads the leave, then closes its side, which ends our reader.
        let _ = self.socket.shutdown(Shutdown::Write);
        if sent.is_ok() && self.reader_done.recv_timeout(LEAVE_WAIT) == Err(RecvTimeoutError::Timeout) {
            tracing::warn!(rank = self.rank, "rank server did not close the connection after leave");
        }
        self.stop_reader();
        self.shared.fail(Error::InvalidState(format!("rank {} has left the group", self.rank)));
        tracing::info!(rank = self.rank, "left the rank server group");
        sent
    }
}

impl Drop for ServerGroup {
    fn drop(&mut self) {
        self.shared.state.lock().closing = true;
        self.stop_reader();
    }
}

impl Shared {
    fn send(&self, msg: &ToServer) -> Result<()> {
        let line = encode(msg)?;
        let writer = self.writer.lock();
        (&writer.stream)
            .write_all(&line)
            .map_err(|e| Error::PeerDisconnected { peer: SERVER.into(), reason: format!("cannot send: {e}") })
    }

    /// Fails every pending and later collective with `err`, unless something failed them
    /// already; returns the failure in force.
    fn fail(&self, err: Error) -> Error {
        let mut state = self.state.lock();
        let failure = state.failure.get_or_insert(err).clone();
        for (_, tx) in state.pending.drain() {
            let _ = tx.send(Err(failure.clone()));
        }
        failure
    }

    fn failure(&self) -> Error {
        let state = self.state.lock();
        state.failure.clone().unwrap_or_else(|| Error::InvalidState("rendezvous reader stopped".into()))
    }

    /// Handles one message from the server.
    fn route(&self, msg: ToRank) -> Result<()> {
        match msg {
            ToRank::Gathered { seq, blobs } => {
                if blobs.len() != self.world {
                    return Err(Error::Protocol(format!(
                        "collective {seq} came back with {} blobs for world size {}",
                        blobs.len(),
                        self.world
                    )));
                }
                let state = &mut *self.state.lock();
                match state.pending.remove(&seq) {
                    Some(tx) => {
                        let _ = tx.send(Ok(blobs));
                    }
                    None => tracing::debug!(rank = self.rank, seq, "result of an abandoned collective"),
                }
            }
            ToRank::Failed { seq, reason } => {
                let state = &mut *self.state.lock();
                if let Some(tx) = state.pending.remove(&seq) {
                    let _ = tx.send(Err(Error::InvalidState(format!("collective {seq} cannot complete: {reason}"))));
                }
            }
            ToRank::Status { seq, missing, absent } => {
                if let Some(tx) = self.state.lock().status.remove(&seq) {
                    let _ = tx.send((missing, absent));
                }
            }
            ToRank::Dead { rank, reason } => {
                tracing::error!(rank = self.rank, dead = rank, %reason, "a rank of the group died");
                self.fail(dead_error(rank, &reason));
                self.deaths.report(rank, &reason);
            }
            other @ (ToRank::Welcome { .. } | ToRank::Rejected { .. }) => {
                return Err(Error::Protocol(format!("unexpected message after joining: {other:?}")));
            }
        }
        Ok(())
    }
}

/// Connects, retrying refused or failed attempts until `deadline` (the server may not be up).
fn connect(server: SocketAddr, deadline: Instant, timeout: Duration) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = if left.is_zero() {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no time left"))
        } else {
            TcpStream::connect_timeout(&server, left.min(Duration::from_secs(1)))
        };
        match attempt {
            Ok(stream) => {
                super::server::tune(&stream);
                return Ok(stream);
            }
            Err(e) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout(format!(
                        "rank server at {server} not reachable within {timeout:?}: {e}"
                    )));
                }
                tracing::trace!(%server, error = %e, "rank server not reachable yet; retrying");
                std::thread::sleep(backoff.min(left));
                interrupt::check()?;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// Who joins, with what.
struct Join<'a> {
    rank: usize,
    world: usize,
    token: &'a str,
}

/// Sends the join and reads the answer; returns the server's world size.
fn handshake(
    stream: &TcpStream,
    reader: &mut BufReader<TcpStream>,
    join: &Join<'_>,
    deadline: Instant,
    timeout: Duration,
) -> Result<usize> {
    let Join { rank, world, token } = *join;
    let msg = ToServer::Join { proto: PROTOCOL, rank, world, token: token.to_owned() };
    (&*stream).write_all(&encode(&msg)?)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    let mut line = Vec::new();
    let got = read_line(reader, &mut line).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(format!("rank server did not answer the join of rank {rank} within {timeout:?}"))
        }
        _ => Error::PeerDisconnected { peer: SERVER.into(), reason: format!("join failed: {e}") },
    })?;
    if !got {
        return Err(Error::PeerDisconnected { peer: SERVER.into(), reason: "closed the connection on join".into() });
    }
    stream.set_read_timeout(None)?;
    match decode::<ToRank>(&line)? {
        ToRank::Welcome { world } => Ok(world),
        ToRank::Rejected { reason } => Err(Error::RemoteRejected { peer: SERVER.into(), reason }),
        other => Err(Error::Protocol(format!("expected an answer to the join, got {other:?}"))),
    }
}

fn read_loop(shared: &Shared, mut reader: BufReader<TcpStream>) {
    let mut line = Vec::new();
    let end = loop {
        match read_line(&mut reader, &mut line) {
            Ok(true) => {}
            Ok(false) => {
                break Error::PeerDisconnected {
                    peer: SERVER.into(),
                    reason: "the rank server closed the connection".into(),
                }
            }
            Err(e) => break Error::PeerDisconnected { peer: SERVER.into(), reason: format!("connection lost: {e}") },
        }
        if let Err(e) = decode::<ToRank>(&line).and_then(|msg| shared.route(msg)) {
            break e;
        }
    };
    if shared.state.lock().closing {
        tracing::debug!(rank = shared.rank, "rank server connection closed by this rank");
        return;
    }
    let already = shared.state.lock().failure.is_some();
    if !already {
        tracing::error!(rank = shared.rank, error = %end, "lost the rank server; failing every collective");
    }
    // Deaths can no longer be heard of: waits on the peers (GPU kernels polling their
    // memory) must end now, not at their timeout. Before the collectives fail, so that a
    // caller that sees their error finds the waits already ended.
    shared.deaths.lost(&format!("the rank server was lost ({end})"));
    shared.fail(end);
}
