//! The target's side of a tcp data stream: every access is checked against the
//! registry, and payload moves straight between the socket and registered host memory,
//! or through pinned bounce buffers where GPU memory is involved.
//!
//! READs of GPU memory are pipelined: while one answer's pieces are being copied out of
//! the GPU, the server takes the next READ if it has arrived already and starts its
//! copies too, so the copy engines work while the socket sends (the initiator's sending
//! threads do the same for WRITEs).
//!
//! A stream may idle between messages for as long as its initiator likes, but once a
//! message has begun, every read and write of it is bounded by the peer timeout: an
//! initiator that stalls inside a WRITE (stopped, or its host gone) would otherwise keep
//! this thread in `readv`, and the regions it names guarded, until TCP keepalive gave up.

use std::io::{IoSlice, IoSliceMut};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use super::TcpConfig;
use crate::frame_io;
use crate::memory::{Region, Registry};
use crate::transport::gpu_bounce::{self, Alternating, Piece};
use crate::transport::zerocopy::ZeroCopySocket;
use freight_cuda::bounce::Bounce;
use freight_proto::data_stream::{self, Message};
use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Seg};
use freight_proto::region::MemKind;

/// A notification that rides on a write goes to `deliver` once the payload is in place,
/// and not at all if the write was refused.
///
/// Serves messages until the peer closes the stream, or `open` says that the agent no
/// longer serves. Waiting for a message has no deadline; each read and write inside one
/// must make progress within `stall` (the agent's peer timeout), else the stream is
/// dropped, with the guards of the message it was in.
pub fn serve_data_stream(
    mut sock: TcpStream,
    registry: &Registry,
    cfg: &TcpConfig,
    peer: &str,
    stall: Duration,
    open: impl Fn() -> bool,
    deliver: impl Fn(Vec<u8>) -> Result<()>,
) -> Result<()> {
    // Bounds every read from here on; the wait for the next message is a poll, which
    // the timeout does not touch. (Writes are bounded by the listener already.)
    sock.set_read_timeout(Some(stall))?;
    let served = serve_messages(&mut sock, registry, cfg, peer, open, deliver);
    if let Err(Error::Timeout(e)) = &served {
        // A timed-out read (EAGAIN) or write is a dead stream, never retried: the peer
        // cannot be resynchronised in the middle of a message.
        tracing::warn!(peer, timeout = ?stall, error = %e, "the peer stalled inside a message; dropped its data stream");
    }
    served
}

fn serve_messages(
    sock: &mut TcpStream,
    registry: &Registry,
    cfg: &TcpConfig,
    peer: &str,
    open: impl Fn() -> bool,
    deliver: impl Fn(Vec<u8>) -> Result<()>,
) -> Result<()> {
    let mut zc = ZeroCopySocket::new(sock, cfg.zerocopy);
    let mut incoming: Option<Bounce> = None;
    let mut outgoing = Alternating::default();
    // A message read early, while a READ's copies ran.
    let mut ahead: Option<Message> = None;
    loop {
        let message = match ahead.take() {
            Some(m) => m,
            None => {
                // Idle: sleep until the next message (or the end of the stream) begins,
                // however long that takes. From its first byte on, reads time out.
                zc.wait_readable(sock)?;
                match frame_io::read_frame(sock)? {
                    Some(f) => Message::parse(f)?,
                    None => return Ok(()),
                }
            }
        };
        if !open() {
            // The agent closed while this stream was connected: nothing more goes into
            // or out of its memory.
            return Ok(());
        }
        match message {
            Message::Write { tag, segs, notif, len } => {
                let placed = receive_write(sock, registry, &segs, len, &mut incoming)?;
                let outcome = data_stream::settle_write(placed, notif, &deliver);
                if let Err(e) = &outcome {
                    tracing::warn!(peer, error = %e, "refused a remote write");
                }
                frame_io::write_frame(sock, &data_stream::write_ack(tag, &outcome), &[])?;
            }
            Message::Read { tag, segs, len } => {
                let mut answer = Answer::start(registry, tag, segs, len, &mut outgoing);
                loop {
                    // While this answer's GPU bytes are gathered, take the next READ if it
                    // is here already, and start gathering its bytes too.
                    let next = answer.is_staged().then(|| frame_io::try_read_frame(sock)).transpose()?.flatten();
                    let following = match next.map(Message::parse).transpose()? {
                        Some(Message::Read { tag, segs, len }) => {
                            Some(Answer::start(registry, tag, segs, len, &mut outgoing))
                        }
                        other => {
                            ahead = other;
                            None
                        }
                    };
                    answer.send(sock, &mut zc, &mut outgoing, peer)?;
                    match following {
                        Some(next) => answer = next,
                        None => break,
                    }
                }
            }
        }
    }
}

/// Takes a WRITE's payload off the socket into the memory it names. The outer error
/// means the stream failed; the inner one that this write was refused (its payload was
/// read and dropped, so the stream stays in step).
fn receive_write(
    sock: &mut TcpStream,
    registry: &Registry,
    segs: &[Seg],
    total: u64,
    bounce: &mut Option<Bounce>,
) -> Result<Result<()>> {
    match check_access(registry, segs, true) {
        Ok((guards, Some(pieces))) => {
            let outcome = gpu_bounce::receive(sock, bounce, &pieces, total)?;
            drop(guards);
            Ok(outcome)
        }
        Ok((guards, None)) => {
            // SAFETY: every segment lies in a registered region (checked above) that
            // cannot be deregistered while `guards` lives.
            let mut slices: Vec<IoSliceMut<'_>> = segs
                .iter()
                .map(|s| IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(s.addr as *mut u8, s.len as usize) }))
                .collect();
            frame_io::read_exact_vectored(sock, &mut slices)?;
            // Let go of the regions before acknowledging: once the initiator sees DONE,
            // this agent's owner may deregister them at once.
            drop(slices);
            drop(guards);
            Ok(Ok(()))
        }
        Err(e) => {
            frame_io::discard(sock, total)?;
            Ok(Err(e))
        }
    }
}

/// One READ being answered: the regions it reads, held until its bytes are out, and the
/// bounce slot its GPU pieces are being gathered into.
struct Answer {
    tag: u64,
    segs: Vec<Seg>,
    total: usize,
    /// The guards and the slot (`None`: host memory, sent from where it lies), or why
    /// the READ is refused.
    access: Result<(Vec<Arc<Region>>, Option<usize>)>,
}

impl Answer {
    /// Checks the access and queues the GPU copies, if any.
    fn start(registry: &Registry, tag: u64, segs: Vec<Seg>, total: u64, staging: &mut Alternating) -> Answer {
        let access = check_access(registry, &segs, false).and_then(|(guards, pieces)| match pieces {
            Some(pieces) => Ok((guards, Some(staging.gather(&pieces)?))),
            None => Ok((guards, None)),
        });
        Answer { tag, segs, total: total as usize, access }
    }

    /// Whether copies out of the GPU are running for this answer.
    fn is_staged(&self) -> bool {
        matches!(self.access, Ok((_, Some(_))))
    }

    /// Sends the payload (once its copies are done), or the refusal. Errors: the stream failed.
    fn send(self, sock: &mut TcpStream, zc: &mut ZeroCopySocket, staging: &mut Alternating, peer: &str) -> Result<()> {
        let Answer { tag, segs, total, access } = self;
        let refused = match access {
            Ok((_guards, Some(slot))) => match staging.ready(slot, total) {
                Ok(bytes) => {
                    // The bounce buffer is reused two answers later: an ordinary send.
                    let header = frame::encode(&data_stream::read_data(tag, &Ok(())));
                    frame_io::write_all_vectored(sock, &mut [IoSlice::new(&header), IoSlice::new(bytes)])?;
                    None
                }
                Err(e) => Some(e),
            },
            Ok((_guards, None)) => {
                // SAFETY: every segment lies in a registered region that `_guards` keeps.
                let payload: Vec<IoSlice<'_>> = segs
                    .iter()
                    .map(|s| IoSlice::new(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len as usize) }))
                    .collect();
                zc.write_all(sock, &frame::encode(&data_stream::read_data(tag, &Ok(()))), &payload)?;
                None
            }
            Err(e) => Some(e),
        };
        if let Some(e) = refused {
            tracing::warn!(peer, error = %e, "refused a remote read");
            frame_io::write_frame(sock, &data_stream::read_data(tag, &Err(e)), &[])?;
        }
        Ok(())
    }
}

/// The guards on a message's regions, and its pieces where GPU memory is involved.
type Access = (Vec<Arc<Region>>, Option<Vec<Piece>>);

/// Every segment must lie in a registered public region of host or GPU memory,
/// writable where the peer would `write` it (a private region is refused as an unknown
/// key by `get_checked`); returns the
/// guards and, where GPU memory is involved, the segments as pieces with the GPU behind
/// each one (host-memory messages, the common case, need no pieces).
fn check_access(registry: &Registry, segs: &[Seg], write: bool) -> Result<Access> {
    let mut guards: Vec<Arc<Region>> = Vec::new();
    for s in segs {
        match guards.iter().find(|g| g.info.key == s.region) {
            Some(g) => g.info.check_contains(s.addr, s.len)?,
            None => {
                let g = registry.get_checked(s.region, s.addr, s.len, write)?;
                if !matches!(g.info.kind, MemKind::Dram | MemKind::Vram) {
                    return Err(Error::TransportUnavailable(format!(
                        "tcp cannot serve {} memory in this build",
                        g.info.kind
                    )));
                }
                guards.push(g);
            }
        }
    }
    if guards.iter().all(|g| g.info.kind == MemKind::Dram) {
        return Ok((guards, None));
    }
    let mut pieces = Vec::with_capacity(segs.len());
    for s in segs {
        let g = guards.iter().find(|g| g.info.key == s.region).expect("every segment has its guard");
        let gpu = if g.info.kind == MemKind::Vram { Some(gpu_bounce::gpu_of(&g.info)?) } else { None };
        pieces.push(Piece { addr: s.addr, len: s.len, gpu });
    }
    Ok((guards, Some(pieces)))
}
