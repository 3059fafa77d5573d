//! The agent's listener: accepts control, data and metadata connections from peers,
//! authenticates them ([`freight_proto::hello`]), and serves each on its own thread
//! (blocking I/O, no polling). What it serves is [`Served`], all it may touch of the
//! agent; its sockets and connections are [`Server`]'s.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::Instant;

use parking_lot::Mutex;

use crate::config::AgentConfig;
use crate::frame_io;
use crate::inbox::Inbox;
use crate::net::tune;
use crate::transport::fabric::serve_fabric;
use crate::transport::tcp::serve_data_stream;
use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Frame, Role};
use freight_proto::hello::{self, Verdict};

mod connections;
mod served;

use connections::Handshake;
pub use connections::{Server, MAX_HANDSHAKES};
pub use served::Served;

/// Binds `addr` and serves it until the agent shuts down.
pub fn listen(agent: &Arc<Served>, addr: &str) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr).map_err(|e| Error::Io(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener.local_addr()?;
    warn_if_exposed(&agent.name, bound, &agent.config);
    let accept = listener.try_clone()?;
    agent.server.listeners.lock().push((bound, listener));
    let weak = Arc::downgrade(agent);
    thread::Builder::new().name("freight-accept".into()).spawn(move || accept_loop(accept, weak))?;
    tracing::info!(agent = %agent.name, %bound, "listening");
    Ok(bound)
}

/// A listener that other hosts can reach and no token guards is worth a warning: who
/// may connect, and what they get.
fn warn_if_exposed(agent: &str, bound: SocketAddr, config: &AgentConfig) {
    if bound.ip().is_loopback() || config.token.is_some() {
        return;
    }
    if config.serve_metadata {
        tracing::warn!(
            agent,
            %bound,
            "listening beyond loopback without a token: anyone who reaches this address can ask for this \
             agent's metadata, whose secret lets them read and write every region it registers \
             (give it a token: AgentConfig.token; or listen on loopback)"
        );
    } else {
        tracing::warn!(
            agent,
            %bound,
            "listening beyond loopback without a token: connections are guarded by the secret alone, which \
             crosses the network in the clear (give it a token: AgentConfig.token)"
        );
    }
}

fn accept_loop(listener: TcpListener, agent: Weak<Served>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if agent.upgrade().is_none_or(|a| a.is_closed()) {
                    tracing::debug!(error = %e, "listener closed");
                    return;
                }
                // Out of descriptors or memory, a connection reset before it was taken:
                // the agent must stay reachable once that passes.
                tracing::warn!(error = %e, "accepting a connection failed; trying again");
                thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let Some(a) = agent.upgrade() else { return };
        if a.is_closed() {
            return;
        }
        let Some(handshake) = Handshake::begin(&a.server.handshakes) else {
            if let Some(held_back) = a.server.refusals.let_through(Instant::now()) {
                tracing::warn!(
                    most = MAX_HANDSHAKES,
                    held_back,
                    "too many connections awaiting their hello; dropped a new one"
                );
            }
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        };
        // The agent may close between the check above and here: `admit` then refuses.
        let Some(id) = a.server.admit(&stream) else {
            if a.is_closed() {
                return;
            }
            continue;
        };
        let weak = agent.clone();
        let spawned = thread::Builder::new().name("freight-conn".into()).spawn(move || {
            if let Err(e) = serve_connection(stream, &weak, id, handshake) {
                tracing::debug!(error = %e, "inbound connection ended");
            }
            if let Some(a) = weak.upgrade() {
                a.server.forget(id);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to serve an inbound connection; dropping it");
            a.server.forget(id);
        }
    }
}

/// The agent, while it serves; an error once it closed (or went away).
fn serving(agent: &Weak<Served>) -> Result<Arc<Served>> {
    agent.upgrade().filter(|a| !a.is_closed()).ok_or_else(|| Error::Io("agent closed".into()))
}

fn serve_connection(mut stream: TcpStream, agent: &Weak<Served>, id: u64, handshake: Handshake) -> Result<()> {
    let served = serving(agent)?;
    let (timeout, peer_timeout) = (served.config.connect_timeout, served.config.peer_timeout);
    tune(&stream, peer_timeout)?;
    // Unauthenticated so far: a bounded hello that must arrive whole within the connect
    // timeout (not merely byte by byte), and answers that cannot block for ever.
    stream.set_write_timeout(Some(peer_timeout))?;
    let first = frame_io::read_frame_within(&mut Deadline::after(&stream, timeout), frame::MAX_HELLO)?;
    drop(handshake);
    let said = match &first {
        Some(Frame::Hello { from_name, role, .. }) => Some((from_name.clone(), *role)),
        _ => None,
    };
    let gate = served.gate();
    let verdict = hello::judge(&gate, first);
    let (role, from_name) = match &verdict {
        Verdict::Admit { role, from } => (*role, from.clone()),
        Verdict::Metadata => {
            let answer = hello::answer(&gate, &verdict, || served.metadata_bytes());
            return frame_io::write_frame(&mut stream, &answer, &[]);
        }
        Verdict::Refuse { reason, unauthenticated } => {
            if *unauthenticated {
                // Logged, at most once a second: whoever fails to authenticate.
                if let Some(held_back) = served.server.refusals.let_through(Instant::now()) {
                    let (from_name, role) = said.unzip();
                    let from = stream.peer_addr().ok();
                    tracing::warn!(?from_name, ?from, ?role, held_back, "refused a connection: {reason}");
                }
            }
            return refuse(&mut stream, reason);
        }
    };
    if served.is_closed() {
        return refuse(&mut stream, "the agent is closed");
    }
    served.server.name(id, &from_name);
    frame_io::write_frame(&mut stream, &hello::answer(&gate, &verdict, Vec::new), &[])?;
    // The connection holds the agent weakly from here on: an agent closed or dropped
    // while a peer stays connected is not kept alive by it.
    let tcp_pin = served.config.tcp.pin.clone();
    drop(served);
    stream.set_read_timeout(None)?;
    match role {
        Role::Control => serve_control(stream, agent, &from_name, id),
        Role::Data { index } => {
            freight_host::nic::pin_stream_thread(&tcp_pin, index as usize, stream.local_addr().ok(), None);
            let a = serving(agent)?;
            let deliver = |msg| a.server.inboxes.try_deliver_after(&from_name, msg, &a.notifs);
            // Idle between messages without a deadline; within one, `peer_timeout`.
            let open = || !a.is_closed();
            serve_data_stream(stream, &a.registry, &a.config.tcp, &from_name, peer_timeout, open, deliver)
        }
        Role::Fabric => {
            let a = serving(agent)?;
            serve_fabric(stream, &a.registry, a.fabric.as_deref(), &from_name)
        }
        Role::Metadata => unreachable!("a metadata request is answered above, never admitted"),
    }
}

/// Reads from a socket until a deadline: each read waits only for the time left.
struct Deadline<'a> {
    stream: &'a TcpStream,
    at: std::time::Instant,
}

impl<'a> Deadline<'a> {
    fn after(stream: &'a TcpStream, timeout: std::time::Duration) -> Deadline<'a> {
        Deadline { stream, at: crate::interrupt::deadline_after(timeout) }
    }
}

impl std::io::Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the hello did not arrive in time"));
        }
        self.stream.set_read_timeout(Some(left))?;
        std::io::Read::read(&mut self.stream, buf)
    }
}

fn refuse(stream: &mut TcpStream, reason: &str) -> Result<()> {
    frame_io::write_frame(stream, &Frame::Refused { reason: reason.into() }, &[])?;
    Err(Error::Auth(reason.into()))
}

/// Delivers notifications in the order they arrive on this (ordered) connection.
fn serve_control(stream: TcpStream, agent: &Weak<Served>, from: &str, id: u64) -> Result<()> {
    let writer = Arc::new(Mutex::new(stream.try_clone()?));
    let host = match agent.upgrade().filter(|a| !a.is_closed()) {
        Some(a) => {
            a.server.take_up_control(id, from, &writer, &a.registry)?;
            a.host.clone()
        }
        None => return Ok(()),
    };
    let inbox = Arc::new(Inbox::new(from, stream, writer, host));
    let result = read_notifications(&inbox, agent);
    if let Some(a) = agent.upgrade() {
        a.server.inboxes.remove(&inbox);
    }
    result
}

/// Sleeps until bytes arrive, then reads them (unless an application thread polling for
/// notifications got there first), until the peer closes the connection.
fn read_notifications(inbox: &Arc<Inbox>, agent: &Weak<Served>) -> Result<()> {
    match agent.upgrade().filter(|a| !a.is_closed()) {
        Some(a) => a.server.inboxes.add(inbox.clone()),
        None => return Ok(()),
    }
    let fd = inbox.fd();
    loop {
        crate::inbox::wait_readable(fd)?;
        let Some(a) = agent.upgrade() else { return Ok(()) };
        if !inbox.pump(&a.notifs)? {
            return Ok(());
        }
    }
}
