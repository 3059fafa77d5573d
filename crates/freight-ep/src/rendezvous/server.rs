//! The rank server: a thin TCP shell around [`Collector`]. One thread accepts, one thread per
//! connection reads; replies are written by whichever thread produced them, under the hub
//! lock, so every rank sees messages in the order the collector decided them. A connection
//! that ends without a `leave` (process exit, crash, broken link found by TCP keep-alive)
//! makes its rank dead, which the collector broadcasts to the rest.
//!
//! Serving continues after a group ends: once every rank has joined and gone, the next
//! joins form a new group (see [`Collector`]); the server stops only when dropped.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use freight_core::{Error, Result};
use parking_lot::Mutex;

use super::collector::{Collector, Sends};
use super::wire::{decode, encode, read_line, ToRank, ToServer};

/// How long a new connection may take to send its join.
const JOIN_WAIT: Duration = Duration::from_secs(10);
/// A rank that does not drain its socket for this long is cut off (and thus dead), so one
/// stuck process cannot stall the server for everyone.
const WRITE_WAIT: Duration = Duration::from_secs(10);
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(10);

/// A rank server for one world size; see the module docs. Stops, closing every connection
/// and joining its threads, when dropped.
pub struct RankServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    /// What every join must present, where the server was given one.
    token: Option<String>,
    stop: AtomicBool,
    hub: Mutex<Hub>,
    conns: Mutex<Conns>,
}

/// Protocol state and the write side of every joined rank's connection.
struct Hub {
    collector: Collector,
    /// rank → (connection id, stream).
    writers: HashMap<usize, (u64, TcpStream)>,
}

/// Every open connection, so that shutdown can unblock and join their threads.
#[derive(Default)]
struct Conns {
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl RankServer {
    /// Binds `addr` (port 0 picks a free one; see [`addr`](Self::addr)) and serves groups of
    /// `world` ranks. With a `token`, only a rank that presents it may join: the blobs the
    /// ranks swap (CUDA IPC handles) open their GPU memory to whoever holds them, so a
    /// server that other processes can reach needs one (see docs/ep.md, "Trust").
    pub fn start(addr: SocketAddr, world: usize, token: Option<&str>) -> Result<RankServer> {
        if world == 0 {
            return Err(Error::InvalidArgument("rank server for world size 0".into()));
        }
        if token == Some("") {
            return Err(Error::InvalidArgument(
                "an empty token lets every rank in: give a non-empty one, or none".into(),
            ));
        }
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::Io(format!("cannot bind the rank server to {addr}: {e}")))?;
        // Non-blocking so the accept loop can notice shutdown without a wake-up connection.
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            token: token.map(str::to_owned),
            stop: AtomicBool::new(false),
            hub: Mutex::new(Hub { collector: Collector::new(world), writers: HashMap::new() }),
            conns: Mutex::new(Conns::default()),
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("freight-rank-server".into())
                .spawn(move || accept_loop(&shared, &listener))?
        };
        tracing::info!(%addr, world, "rank server listening");
        Ok(RankServer { addr, shared, acceptor: Some(acceptor) })
    }

    /// The address ranks should connect to (with the real port when port 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for RankServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // First the acceptor, so that no connection is added after the snapshot below.
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        let (streams, threads) = {
            let mut conns = self.shared.conns.lock();
            (conns.streams.drain().map(|(_, s)| s).collect::<Vec<_>>(), std::mem::take(&mut conns.threads))
        };
        for stream in &streams {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for thread in threads {
            let _ = thread.join();
        }
        tracing::info!(addr = %self.addr, "rank server stopped");
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(e) = spawn_conn(shared, stream, peer) {
                    tracing::warn!(%peer, error = %e, "cannot serve a rank connection");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::warn!(error = %e, "rank server accept failed");
                std::thread::sleep(ACCEPT_POLL * 10);
            }
        }
    }
}

fn spawn_conn(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) -> Result<()> {
    stream.set_nonblocking(false)?;
    tune(&stream);
    stream.set_write_timeout(Some(WRITE_WAIT))?;
    let mut conns = shared.conns.lock();
    let id = conns.next_id;
    conns.next_id += 1;
    conns.streams.insert(id, stream.try_clone()?);
    let thread = {
        let shared = shared.clone();
        std::thread::Builder::new().name(format!("freight-rank-conn-{id}")).spawn(move || {
            serve(&shared, id, stream, peer);
            shared.conns.lock().streams.remove(&id);
        })
    };
    match thread {
        Ok(thread) => {
            conns.threads.retain(|t| !t.is_finished());
            conns.threads.push(thread);
            Ok(())
        }
        Err(e) => {
            conns.streams.remove(&id);
            Err(e.into())
        }
    }
}

/// Low latency for the small messages, and TCP keep-alive so that a peer host that vanishes
/// without a FIN is still found dead within seconds rather than hours.
pub(crate) fn tune(stream: &TcpStream) {
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_tcp_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(2))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    if let Err(e) = sock.set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "cannot enable TCP keep-alive on a rendezvous connection");
    }
}

/// One connection, from its join to its end.
fn serve(shared: &Shared, id: u64, stream: TcpStream, peer: SocketAddr) {
    let mut reader = match stream.try_clone() {
        Ok(s) => BufReader::new(s),
        Err(e) => {
            tracing::warn!(%peer, error = %e, "cannot read from a rank connection");
            return;
        }
    };
    let mut line = Vec::new();
    let (rank, world, proto) = match handshake(&stream, &mut reader, &mut line, shared.token.as_deref()) {
        Ok(join) => join,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "dropping a connection that did not join");
            if let Error::Auth(reason) = e {
                if let Ok(msg) = encode(&ToRank::Rejected { reason }) {
                    let _ = (&stream).write_all(&msg);
                }
            }
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    };
    {
        let mut hub = shared.hub.lock();
        match hub.collector.join(rank, world, proto) {
            Ok(sends) => match stream.try_clone() {
                Ok(writer) => {
                    hub.writers.insert(rank, (id, writer));
                    deliver(&mut hub, sends);
                    tracing::info!(%peer, rank, world, generation = hub.collector.generation(), "rank joined");
                }
                Err(e) => {
                    let out = hub.collector.disconnect(rank, &format!("rank server I/O error: {e}"));
                    deliver(&mut hub, out);
                    return;
                }
            },
            Err(reason) => {
                drop(hub);
                tracing::warn!(%peer, rank, world, %reason, "join refused");
                if let Ok(msg) = encode(&ToRank::Rejected { reason }) {
                    let _ = (&stream).write_all(&msg);
                }
                let _ = stream.shutdown(Shutdown::Write);
                return;
            }
        }
    }

    let ending = loop {
        match read_line(&mut reader, &mut line) {
            Ok(true) => {}
            Ok(false) => break Some("connection closed without a leave (process exited or crashed)".to_owned()),
            Err(e) => break Some(format!("connection lost: {e}")),
        }
        let msg = match decode::<ToServer>(&line) {
            Ok(msg) => msg,
            Err(e) => break Some(e.to_string()),
        };
        let mut hub = shared.hub.lock();
        let sends = match msg {
            ToServer::Gather { seq, blob } => match hub.collector.contribute(rank, seq, blob) {
                Ok(sends) => sends,
                Err(violation) => break Some(format!("protocol error: {violation}")),
            },
            ToServer::Status { seq } => hub.collector.status(rank, seq),
            ToServer::Leave => {
                forget_writer(&mut hub, rank, id);
                let sends = hub.collector.leave(rank);
                deliver(&mut hub, sends);
                tracing::info!(rank, "rank left");
                break None;
            }
            ToServer::Join { .. } => break Some("protocol error: second join on one connection".to_owned()),
        };
        deliver(&mut hub, sends);
    };

    if let Some(reason) = ending {
        if shared.stop.load(Ordering::SeqCst) {
            tracing::debug!(rank, "rank connection closed by server shutdown");
        } else {
            let mut hub = shared.hub.lock();
            if forget_writer(&mut hub, rank, id) {
                let sends = hub.collector.disconnect(rank, &reason);
                deliver(&mut hub, sends);
            }
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads the join; nothing else is accepted first, and not after [`JOIN_WAIT`]. A join
/// without the server's token (where it has one) is refused before anything about it
/// is looked at.
fn handshake(
    stream: &TcpStream,
    reader: &mut BufReader<TcpStream>,
    line: &mut Vec<u8>,
    token: Option<&str>,
) -> Result<(usize, usize, u32)> {
    stream.set_read_timeout(Some(JOIN_WAIT))?;
    if !read_line(reader, line)? {
        return Err(Error::Protocol("connection closed before joining".into()));
    }
    let msg = decode::<ToServer>(line)?;
    stream.set_read_timeout(None)?;
    match msg {
        ToServer::Join { proto, rank, world, token: presented } => {
            if let Some(t) = token {
                if !freight_core::same_secret(t.as_bytes(), presented.as_bytes()) {
                    let why = if presented.is_empty() { "none was presented" } else { "the one presented is wrong" };
                    return Err(Error::Auth(format!("this rank server requires a token and {why}")));
                }
            }
            Ok((rank, world, proto))
        }
        other => Err(Error::Protocol(format!("expected a join first, got {other:?}"))),
    }
}

/// Drops `rank`'s writer if it is still this connection's (it may already belong to a new
/// group's rank after a restart). Returns whether it was.
fn forget_writer(hub: &mut Hub, rank: usize, id: u64) -> bool {
    match hub.writers.get(&rank) {
        Some((owner, _)) if *owner == id => {
            hub.writers.remove(&rank);
            true
        }
        _ => false,
    }
}

fn deliver(hub: &mut Hub, sends: Sends) {
    for send in sends {
        let line = match encode(&send.msg) {
            Ok(line) => line,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a rank server message");
                continue;
            }
        };
        for rank in send.to {
            let Some((_, stream)) = hub.writers.get(&rank) else { continue };
            if let Err(e) = (&*stream).write_all(&line) {
                // Closing it makes its reader thread report the rank dead.
                tracing::warn!(rank, error = %e, "cannot write to rank; closing its connection");
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }
}
