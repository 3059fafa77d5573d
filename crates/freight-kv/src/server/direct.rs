//! Serving direct connections ([`crate::direct`]): a listener beside the engine's, and
//! a thread per connection that opens with a live session's id and secret and then
//! carries out that client's requests in turns, against the same index and pool as the
//! worker.
//!
//! Guards: a connection must name its session within [`OPEN_WAIT`] or is closed, and
//! one whose client takes no bytes for [`WRITE_WAIT`] is closed too; at
//! most [`MAX_CONNECTIONS`] are open at once and [`PER_SESSION`] per session; a message
//! longer than the protocol allows, one that does not decode, or one with another
//! session's token closes the connection (a PUT's value bytes that follow could not be
//! told from the next request). A PUT cut short frees its reserved slots, so the key
//! keeps its old value. A session's end closes its connections.

use std::collections::HashMap;
use std::io::{BufReader, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use freight_core::frame_io::{discard, read_exact_vectored};
use freight_core::transport::zerocopy::{self, SendMode, ZeroCopySocket};
use freight_core::{Error, Result};
use parking_lot::Mutex;

use super::sessions::Shared;
use crate::direct::{declared_len, length_prefix, Open, ACCEPTED, OPEN_LEN, REFUSED};
use crate::service::{GetPlan, PutPlan};
use crate::wire::{self, FailCode, Outcome, Reply};

/// How long a new connection has to name its session.
pub const OPEN_WAIT: Duration = Duration::from_secs(2);
/// How long an answer may wait for a client to take its bytes: a client that stops
/// reading loses its connection then, and the values it was sent their pins.
pub const WRITE_WAIT: Duration = Duration::from_secs(30);
/// Direct connections open at once, all clients together: each holds a thread.
pub const MAX_CONNECTIONS: usize = 1024;
/// Direct connections of one session (a client opens one; a few more allow for
/// reconnects that overlap the old one's close).
pub const PER_SESSION: usize = 4;

/// The open direct connections, by session: a session's end shuts them down.
#[derive(Default)]
pub(crate) struct Connections {
    by_session: Mutex<HashMap<u64, Vec<(u64, TcpStream)>>>,
    open: AtomicUsize,
    next: AtomicUsize,
}

impl Connections {
    /// Shuts down every direct connection of session `id`: their threads see the end of
    /// the stream and finish.
    pub(crate) fn close_session(&self, id: u64) {
        if let Some(conns) = self.by_session.lock().remove(&id) {
            for (_, s) in conns {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    fn close_all(&self) {
        for (_, conns) in self.by_session.lock().drain() {
            for (_, s) in conns {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// Enters a connection under its session; refused (with why) when the session has
    /// its fill or the socket cannot be kept for closing it later.
    fn enter(&self, session: u64, sock: &TcpStream) -> std::result::Result<u64, String> {
        let mut by_session = self.by_session.lock();
        let conns = by_session.entry(session).or_default();
        if conns.len() >= PER_SESSION {
            return Err(format!("this session has {PER_SESSION} direct connections open already"));
        }
        let kept = sock.try_clone().map_err(|e| format!("the server cannot keep this connection: {e}"))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed) as u64;
        conns.push((id, kept));
        Ok(id)
    }

    fn leave(&self, session: u64, id: u64) {
        let mut by_session = self.by_session.lock();
        if let Some(conns) = by_session.get_mut(&session) {
            conns.retain(|(c, _)| *c != id);
            if conns.is_empty() {
                by_session.remove(&session);
            }
        }
    }
}

/// The listener and its accepting thread.
pub(super) struct Listener {
    /// Until [`Listener::serve`] takes it.
    listener: Option<TcpListener>,
    addresses: Vec<String>,
    bound: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Listens on `ip` (a free port), where the engine's agent listens too. `advertised`
    /// are the engine's addresses: the same hosts, this port.
    pub(super) fn bind(ip: IpAddr, advertised: &[String]) -> Result<Listener> {
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::Io(format!("cannot listen on {ip} for direct connections: {e}")))?;
        let bound = listener.local_addr().map_err(|e| Error::Io(e.to_string()))?;
        let addresses = if ip.is_unspecified() {
            advertised
                .iter()
                .filter_map(|a| a.parse::<SocketAddr>().ok())
                .map(|a| SocketAddr::new(a.ip(), bound.port()).to_string())
                .collect()
        } else {
            vec![bound.to_string()]
        };
        Ok(Listener { listener: Some(listener), addresses, bound, thread: None })
    }

    /// Starts accepting connections.
    pub(super) fn serve(&mut self, shared: Arc<Shared>) -> Result<()> {
        let listener = self.listener.take().expect("served once");
        let thread = std::thread::Builder::new()
            .name("freight-kv-direct".into())
            .spawn(move || accept(shared, listener))
            .map_err(|e| Error::Io(format!("cannot start the direct connections' listener: {e}")))?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Where clients reach it.
    pub(super) fn addresses(&self) -> &[String] {
        &self.addresses
    }

    /// Stops accepting (the server's stop flag is set) and closes every connection.
    pub(super) fn stop(&mut self, shared: &Shared) {
        // Wakes the accepting thread, which then sees the stop flag.
        let Some(thread) = self.thread.take() else { return };
        let wake = match self.bound.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), self.bound.port()),
            IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), self.bound.port()),
            _ => self.bound,
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        let _ = thread.join();
        shared.direct.close_all();
    }
}

fn accept(shared: Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let sock = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "accepting a direct connection failed");
                continue;
            }
        };
        if shared.direct.open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            shared.direct.open.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(peer = ?sock.peer_addr().ok(), limit = MAX_CONNECTIONS, "refused a direct connection: too many open");
            continue;
        }
        let shared = shared.clone();
        let spawned = std::thread::Builder::new().name("freight-kv-direct-conn".into()).spawn({
            let shared = shared.clone();
            move || {
                let peer = sock.peer_addr().ok();
                if let Err(e) = serve(&shared, sock) {
                    tracing::debug!(?peer, error = %e, "a direct connection ended");
                }
                shared.direct.open.fetch_sub(1, Ordering::AcqRel);
            }
        });
        if let Err(e) = spawned {
            shared.direct.open.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(error = %e, "cannot start a thread for a direct connection");
        }
    }
}

/// One connection, from its opening to its end.
fn serve(shared: &Shared, mut sock: TcpStream) -> Result<()> {
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(OPEN_WAIT))?;
    let mut open = [0u8; OPEN_LEN];
    sock.read_exact(&mut open)?;
    let session = match Open::decode(&open).and_then(|o| session_of(shared, &o)) {
        Ok(s) => s,
        Err(why) => {
            tracing::warn!(peer = ?sock.peer_addr().ok(), %why, "refused a direct connection");
            return refuse(&mut sock, &why);
        }
    };
    let conn = match shared.direct.enter(session.id, &sock) {
        Ok(conn) => conn,
        Err(why) => return refuse(&mut sock, &why),
    };
    // The session may have ended between the lookup and the entry: then nobody would
    // close this connection.
    if session_of(shared, &session.open).is_err() {
        shared.direct.leave(session.id, conn);
        return refuse(&mut sock, "the session ended");
    }
    let served = (|| {
        sock.write_all(&[ACCEPTED])?;
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(Some(WRITE_WAIT))?;
        tracing::debug!(client = session.id, "direct connection opened");
        let reader = BufReader::with_capacity(READ_BUFFER, sock.try_clone()?);
        let zc = ZeroCopySocket::new(&sock, true);
        Turns { shared, session: &session, sock, reader, zc, held: None }.run()
    })();
    shared.direct.leave(session.id, conn);
    served
}

/// The session a connection opened for.
struct Session {
    id: u64,
    open: Open,
}

fn session_of(shared: &Shared, open: &Open) -> std::result::Result<Session, String> {
    match shared.clients.lock().find(open.client_id, &open.session_token) {
        Some(_) => Ok(Session { id: open.client_id, open: open.clone() }),
        None => Err(format!("no session {} with that secret", open.client_id)),
    }
}

fn refuse(sock: &mut TcpStream, why: &str) -> Result<()> {
    let why = &why.as_bytes()[..why.len().min(1024)];
    let mut answer = vec![REFUSED];
    answer.extend_from_slice(&(why.len() as u16).to_le_bytes());
    answer.extend_from_slice(why);
    let _ = sock.write_all(&answer);
    Ok(())
}

/// What one read of a connection may take in: a request and a small PUT's value, in
/// one system call. Larger values are read straight into their slots (a buffer as
/// large as they are would take them in first and copy them again).
const READ_BUFFER: usize = 8 << 10;

/// The requests of one connection, in turns.
struct Turns<'a> {
    shared: &'a Shared,
    session: &'a Session,
    /// Written to; read through `reader`.
    sock: TcpStream,
    reader: BufReader<TcpStream>,
    zc: ZeroCopySocket,
    /// A GET whose values went without a copy: the kernel reads them from the pool when
    /// the client reads, so their pins stay until the client's next message (or the
    /// connection's end) shows that it has.
    held: Option<GetPlan>,
}

impl Turns<'_> {
    fn run(mut self) -> Result<()> {
        let ended = self.turns();
        if let Some(plan) = self.held.take() {
            let served = if ended.is_ok() { Ok(()) } else { Err(Error::Io("the connection ended".into())) };
            plan.finish(&mut self.shared.index.lock(), served);
        }
        ended
    }

    fn turns(&mut self) -> Result<()> {
        loop {
            // The kernel's reports on `MSG_ZEROCOPY` sends would wake a plain read.
            if self.zc.mode() == SendMode::MsgZeroCopy && self.reader.buffer().is_empty() {
                self.zc.wait_readable(&self.sock)?;
            }
            let mut prefix = [0u8; 4];
            match self.reader.read(&mut prefix[..1])? {
                0 => return Ok(()),
                _ => self.reader.read_exact(&mut prefix[1..])?,
            }
            if let Some(plan) = self.held.take() {
                plan.finish(&mut self.shared.index.lock(), Ok(()));
            }
            let len = declared_len(prefix).map_err(Error::Protocol)?;
            let mut body = vec![0u8; len];
            self.reader.read_exact(&mut body)?;
            let request = match wire::Request::decode(&body) {
                Some(Ok((token, request))) if freight_core::same_secret(&token, &self.session.open.session_token) => {
                    request
                }
                Some(Ok(_)) => return Err(Error::Auth("a request with another session's token".into())),
                Some(Err(e)) => return Err(e),
                None => return Err(Error::Protocol("a message that is no KV request".into())),
            };
            if self.shared.stop.load(Ordering::Acquire) {
                let refused = Outcome::Failed { code: FailCode::Refused, error: "the server is shutting down".into() };
                let reply = Reply { first_id: request.first_id(), outcomes: vec![refused; request.len()] };
                self.answer(&reply, &[])?;
                return Ok(());
            }
            match request {
                wire::Request::Get { first_id, items } => self.get(first_id, &items)?,
                wire::Request::Put { first_id, ttl_ms, items } => self.put(first_id, ttl_ms, &items)?,
            }
        }
    }

    fn get(&mut self, first_id: u64, items: &[(Vec<u8>, wire::Buffer)]) -> Result<()> {
        let plan = GetPlan::new(&mut self.shared.index.lock(), items, self.shared.now_ms());
        let reply = Reply { first_id, outcomes: plan.outcomes().to_vec() };
        // SAFETY: each slot is pinned by `plan` until it finishes, after the send (and,
        // for values the kernel reads later, after the client's next message).
        let values: Vec<IoSlice<'_>> =
            plan.copies.iter().map(|&(slot, _)| IoSlice::new(unsafe { self.shared.pool_slice(slot) })).collect();
        let bytes: usize = values.iter().map(|v| v.len()).sum();
        let sent = self.answer(&reply, &values);
        drop(values);
        match sent {
            Err(e) => {
                plan.finish(&mut self.shared.index.lock(), Err(Error::Io(e.to_string())));
                Err(e)
            }
            Ok(()) if self.zc.mode() != SendMode::Copy && bytes >= zerocopy::MIN_BYTES => {
                self.held = Some(plan);
                Ok(())
            }
            Ok(()) => {
                plan.finish(&mut self.shared.index.lock(), Ok(()));
                Ok(())
            }
        }
    }

    fn put(&mut self, first_id: u64, ttl_ms: u64, items: &[(Vec<u8>, wire::Buffer)]) -> Result<()> {
        let now = self.shared.now_ms();
        let plan = PutPlan::new(&mut self.shared.index.lock(), items, ttl_ms, now);
        let read = self.read_values(&plan, items);
        let failed = read.as_ref().err().map(|e| Error::Io(e.to_string()));
        let outcomes = plan.finish(&mut self.shared.index.lock(), failed.map_or(Ok(()), Err), now);
        read?;
        self.answer(&Reply { first_id, outcomes }, &[])
    }

    /// Reads each item's value into its reserved slot, or past it where it was refused.
    fn read_values(&mut self, plan: &PutPlan, items: &[(Vec<u8>, wire::Buffer)]) -> Result<()> {
        let (shared, reader) = (self.shared, &mut self.reader);
        let mut slots: Vec<IoSliceMut<'_>> = Vec::new();
        for (i, (_, buffer)) in items.iter().enumerate() {
            match plan.slot(i) {
                // SAFETY: a slot reserved for this PUT alone; nothing reads it before the
                // PUT commits.
                Some(slot) => slots.push(IoSliceMut::new(unsafe { shared.pool_slice_mut(slot) })),
                None => {
                    read_exact_vectored(reader, &mut slots)?;
                    slots.clear();
                    discard(reader, buffer.len)?;
                }
            }
        }
        read_exact_vectored(reader, &mut slots)?;
        Ok(())
    }

    /// Writes a reply and the values that follow it.
    fn answer(&mut self, reply: &Reply, values: &[IoSlice<'_>]) -> Result<()> {
        let body = reply.encode();
        let mut header = Vec::with_capacity(4 + body.len());
        header.extend_from_slice(&length_prefix(body.len()));
        header.extend_from_slice(&body);
        self.zc.write_all(&mut self.sock, &header, values).map_err(Error::from)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use super::super::test_support::{agent, test_server as server, UNCHECKED};
    use super::super::Server;
    use super::*;
    use crate::direct::length_prefix;
    use crate::wire::{Buffer, SessionToken};
    use freight_core::MemKind;

    fn connect(s: &Server) -> TcpStream {
        let sock = TcpStream::connect(s.shared.direct_addresses[0].as_str()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        sock
    }

    /// A session of an agent standing in for a client: its id and secret.
    fn session(s: &Server) -> (u64, SessionToken, freight_core::Agent) {
        let client = agent(&format!("direct-{}", rand::random::<u32>()));
        let opened = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        (opened.id, opened.token, client)
    }

    /// Opens a connection for a session; returns the server's answer byte.
    fn open(s: &Server, id: u64, token: SessionToken) -> (TcpStream, u8) {
        let mut sock = connect(s);
        sock.write_all(&Open { client_id: id, session_token: token }.encode()).unwrap();
        let mut answer = [0u8; 1];
        sock.read_exact(&mut answer).unwrap();
        (sock, answer[0])
    }

    fn refusal(sock: &mut TcpStream) -> String {
        let mut len = [0u8; 2];
        sock.read_exact(&mut len).unwrap();
        let mut why = vec![0u8; u16::from_le_bytes(len) as usize];
        sock.read_exact(&mut why).unwrap();
        String::from_utf8(why).unwrap()
    }

    /// The server closed the connection: a read finds its end (or a reset).
    fn closed(sock: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        matches!(sock.read(&mut byte), Ok(0) | Err(_))
    }

    fn put_bytes(token: &SessionToken, first_id: u64, key: &[u8], len: u64) -> Vec<u8> {
        let buffer = Buffer { kind: MemKind::Dram, addr: 0x1000, len, dev: 0 };
        let body = wire::Request::Put { first_id, ttl_ms: 0, items: vec![(key.to_vec(), buffer)] }.encode(token);
        let mut out = length_prefix(body.len()).to_vec();
        out.extend_from_slice(&body);
        out
    }

    fn read_reply(sock: &mut TcpStream) -> Reply {
        let mut prefix = [0u8; 4];
        sock.read_exact(&mut prefix).unwrap();
        let mut body = vec![0u8; declared_len(prefix).unwrap()];
        sock.read_exact(&mut body).unwrap();
        Reply::decode(&body).unwrap().unwrap()
    }

    fn stored(s: &Server, key: &[u8]) -> bool {
        s.shared.index.lock().exists(key, s.shared.now_ms())
    }

    #[test]
    fn a_connection_without_a_live_session_and_its_secret_is_refused_and_closed() {
        let s = server();
        let (id, token, _client) = session(&s);
        for (id, token, why) in [(id, [0; 16], "no session"), (id + 1, token, "no session")] {
            let (mut sock, answer) = open(&s, id, token);
            assert_eq!(answer, REFUSED);
            assert!(refusal(&mut sock).contains(why));
            assert!(closed(&mut sock));
        }
        let mut sock = connect(&s);
        sock.write_all(&[b'G'; OPEN_LEN]).unwrap();
        let mut answer = [0u8; 1];
        sock.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], REFUSED);
        assert!(refusal(&mut sock).contains("not a freight KV direct connection"));
        let (_, answer) = open(&s, id, token);
        assert_eq!(answer, ACCEPTED, "the session's own secret opens it");
    }

    #[test]
    fn a_connection_that_names_no_session_in_time_is_closed() {
        let s = server();
        let mut sock = connect(&s);
        let started = Instant::now();
        sock.write_all(b"fkv").unwrap();
        assert!(closed(&mut sock));
        let waited = started.elapsed();
        assert!(waited >= OPEN_WAIT - Duration::from_millis(100) && waited < OPEN_WAIT * 3, "{waited:?}");
    }

    #[test]
    fn a_session_opens_a_few_connections_at_most_and_its_end_closes_them() {
        let s = server();
        let (id, token, client) = session(&s);
        let mut open_ones: Vec<TcpStream> = (0..PER_SESSION)
            .map(|_| open(&s, id, token))
            .map(|(sock, a)| {
                assert_eq!(a, ACCEPTED);
                sock
            })
            .collect();
        let (mut extra, answer) = open(&s, id, token);
        assert_eq!(answer, REFUSED);
        assert!(refusal(&mut extra).contains("direct connections open already"));
        s.shared.end_session_of(client.name(), "test");
        for sock in &mut open_ones {
            assert!(closed(sock), "a connection of an ended session stays open");
        }
        let (_, answer) = open(&s, id, token);
        assert_eq!(answer, REFUSED, "an ended session opens none");
    }

    #[test]
    fn a_message_past_the_limit_or_of_another_session_closes_the_connection_and_changes_nothing() {
        let s = server();
        let (id, token, _client) = session(&s);
        let (mut sock, _) = open(&s, id, token);
        sock.write_all(&(freight_proto::frame::MAX_NOTIF as u32 + 1).to_le_bytes()).unwrap();
        assert!(closed(&mut sock));
        let (other_id, other_token, _other) = session(&s);
        let (mut sock, _) = open(&s, other_id, other_token);
        let mut forged = put_bytes(&token, 1, b"forged", 4);
        forged.extend_from_slice(b"evil");
        sock.write_all(&forged).unwrap();
        assert!(closed(&mut sock));
        assert!(!stored(&s, b"forged"));
        // The server serves on.
        let (mut sock, _) = open(&s, id, token);
        let mut put = put_bytes(&token, 2, b"fine", 4);
        put.extend_from_slice(b"good");
        sock.write_all(&put).unwrap();
        assert!(matches!(read_reply(&mut sock).outcomes[..], [Outcome::Stored { .. }]));
    }

    /// A PUT whose value bytes stop short: the key keeps its old value, and the
    /// reservation is freed.
    #[test]
    fn a_put_cut_short_stores_nothing_and_frees_its_slot() {
        let s = server();
        let (id, token, _client) = session(&s);
        let (mut sock, _) = open(&s, id, token);
        let mut put = put_bytes(&token, 1, b"k", 3);
        put.extend_from_slice(b"old");
        sock.write_all(&put).unwrap();
        assert!(matches!(read_reply(&mut sock).outcomes[..], [Outcome::Stored { .. }]));
        let mut cut = put_bytes(&token, 2, b"k", 4096);
        cut.extend_from_slice(&[7u8; 100]);
        sock.write_all(&cut).unwrap();
        drop(sock);
        let until = Instant::now() + Duration::from_secs(10);
        while s.shared.index.lock().stats().pending_puts != 0 {
            assert!(Instant::now() < until, "the cut PUT's slot is still reserved");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (mut sock, _) = open(&s, id, token);
        let buffer = Buffer { kind: MemKind::Dram, addr: 0x1000, len: 4096, dev: 0 };
        let body = wire::Request::Get { first_id: 3, items: vec![(b"k".to_vec(), buffer)] }.encode(&token);
        sock.write_all(&length_prefix(body.len())).unwrap();
        sock.write_all(&body).unwrap();
        assert!(matches!(read_reply(&mut sock).outcomes[..], [Outcome::Found { len: 3, .. }]));
        let mut value = [0u8; 3];
        sock.read_exact(&mut value).unwrap();
        assert_eq!(&value, b"old");
    }
}
