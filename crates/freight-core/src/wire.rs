//! Messages between agents and their framing.
//!
//! Every frame is a little-endian u32 header length, then a postcard-encoded [`Frame`];
//! `Write` and `ReadData` are followed by raw payload bytes (the sum of their segment
//! lengths), which travel straight from and into registered memory.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::metadata::HostIdentity;

/// 2: notification outboxes in shared memory (`Outbox`, `OutboxReply`, `Wake`).
/// 3: a one-message write carries its notification (`Write::notif`).
/// 4: the fabric exchange (`Role::Fabric`, `Fabric*` frames).
/// 5: landing buffers lent for staging over the fabric (`FabricDocks`, `FabricLand`...).
pub const PROTOCOL_VERSION: u16 = 5;
/// Headers larger than this are a protocol violation (metadata replies are the largest).
pub const MAX_HEADER: usize = 130 << 20;
/// A single frame may carry at most this much payload.
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// Segments per frame: bounded by the kernel's iovec limit (one slot for the header).
pub const MAX_SEGS: usize = 1023;
/// Notification messages larger than this are refused.
pub const MAX_NOTIF: usize = 16 << 20;

/// What a connection is for, announced in its first frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Notifications and revocations between two agents.
    Control,
    /// One tcp data stream.
    Data { index: u32 },
    /// A one-shot metadata fetch (listener exchange).
    Metadata,
    /// The fabric transport's set-up: endpoint addresses and region keys.
    Fabric,
}

/// A remote range named by region key and address, checked by the owner on arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seg {
    pub region: u64,
    pub addr: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    Hello {
        version: u16,
        role: Role,
        from_name: String,
        from_id: u64,
        /// The target agent's id as the initiator knows it (catches stale metadata).
        target_id: u64,
        /// The target's secret from its metadata, or the metadata token for `Role::Metadata`.
        token: Vec<u8>,
    },
    Welcome {
        agent_id: u64,
    },
    Refused {
        reason: String,
    },
    Write {
        tag: u64,
        segs: Vec<Seg>,
        /// The request's notification, when this message is the whole request: the
        /// target queues it once the payload is in place (after the notifications the
        /// sender queued before it), without waiting for the initiator to learn of it.
        notif: Option<Vec<u8>>,
    },
    WriteAck {
        tag: u64,
        error: Option<String>,
    },
    Read {
        tag: u64,
        segs: Vec<Seg>,
    },
    ReadData {
        tag: u64,
        error: Option<String>,
    },
    Notify {
        msg: Vec<u8>,
    },
    /// The owner withdrew a region (sent to peers that might map it).
    Revoke {
        region: u64,
    },
    Metadata {
        bytes: Vec<u8>,
    },
    /// The sender's notification ring for this control connection, in a shared segment
    /// that `host.pid` holds open as `fd` (same host only; see docs/engine.md).
    /// Every later notification on this connection goes through the ring.
    Outbox {
        host: HostIdentity,
        fd: i32,
        len: u64,
    },
    /// The target's answer to `Outbox`: `None` once it reads the ring, else why not.
    OutboxReply {
        error: Option<String>,
    },
    /// The sender wrote to its ring after the target had drained it: the target may be
    /// asleep and must look.
    Wake,
    /// Opens the fabric exchange: the initiator's libfabric provider.
    FabricHello {
        provider: String,
    },
    /// The target's endpoint address on each of its rails, and whether its memory is
    /// addressed by virtual address (else by offset into the region).
    FabricWelcome {
        provider: String,
        rails: Vec<Vec<u8>>,
        virt_addr: bool,
    },
    /// Asks for the keys of regions the initiator is about to read or write.
    FabricKeys {
        regions: Vec<u64>,
    },
    /// One key per target rail for each region asked, in order; or why not.
    FabricKeysReply {
        keys: Vec<Vec<u64>>,
        error: Option<String>,
    },
    /// Opens a relay connection of the fabric exchange: the initiator asks to borrow
    /// `count` landing buffers (docks) of `size` bytes, for memory the provider cannot
    /// reach one-sided (the target's GPU memory).
    FabricDocks {
        count: u32,
        size: u64,
    },
    /// Per dock: where the initiator addresses it (its virtual address, or 0 where
    /// memory is addressed by offset) and its key on each target rail; or why not.
    FabricDocksReply {
        docks: Vec<(u64, Vec<u64>)>,
        error: Option<String>,
    },
    /// The initiator wrote `seg.len` bytes into dock `dock`: copy them to `seg`.
    FabricLand {
        token: u64,
        dock: u32,
        seg: Seg,
    },
    /// Copy `seg` into dock `dock`, for the initiator to read.
    FabricLift {
        token: u64,
        dock: u32,
        seg: Seg,
    },
    /// The copy of `token` is done, or why it was refused.
    FabricDocked {
        token: u64,
        error: Option<String>,
    },
}

impl Frame {
    /// Bytes of payload that follow this frame on the wire (segment lists are checked
    /// against the protocol limits on the way).
    pub fn payload_len(&self) -> Result<u64> {
        match self {
            Frame::Write { segs, .. } => seg_bytes(segs),
            Frame::Read { segs, .. } => seg_bytes(segs).map(|_| 0),
            _ => Ok(0),
        }
    }
}

/// Total bytes of `segs`, refusing what no honest peer sends.
pub fn seg_bytes(segs: &[Seg]) -> Result<u64> {
    if segs.len() > MAX_SEGS {
        return Err(Error::Protocol(format!("{} segments in one frame (max {MAX_SEGS})", segs.len())));
    }
    let mut total = 0u64;
    for s in segs {
        total = total
            .checked_add(s.len)
            .filter(|&t| t <= MAX_PAYLOAD)
            .ok_or_else(|| Error::Protocol(format!("frame payload exceeds {MAX_PAYLOAD} bytes")))?;
    }
    Ok(total)
}

/// Encodes a frame with its length prefix.
pub fn encode(frame: &Frame) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    let mut out = postcard::to_extend(frame, std::mem::take(&mut out)).expect("frames always serialize");
    let n = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&n.to_le_bytes());
    out
}

/// Decodes a frame header (without the length prefix).
pub fn decode(bytes: &[u8]) -> Result<Frame> {
    let (frame, rest) =
        postcard::take_from_bytes::<Frame>(bytes).map_err(|e| Error::Protocol(format!("bad frame: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::Protocol(format!("{} trailing bytes after frame", rest.len())));
    }
    let notif = match &frame {
        Frame::Notify { msg } => Some(msg),
        Frame::Write { notif, .. } => notif.as_ref(),
        _ => None,
    };
    if let Some(msg) = notif.filter(|m| m.len() > MAX_NOTIF) {
        return Err(Error::Protocol(format!("notification of {} bytes (max {MAX_NOTIF})", msg.len())));
    }
    Ok(frame)
}

/// Takes one complete frame header from the front of `buf`, if it holds one (for
/// readers that receive whatever has arrived rather than block for a whole frame).
pub fn take_frame(buf: &mut Vec<u8>) -> Result<Option<Frame>> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let n = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if n > MAX_HEADER {
        return Err(Error::Protocol(format!("frame header of {n} bytes (max {MAX_HEADER})")));
    }
    if buf.len() < 4 + n {
        return Ok(None);
    }
    let frame = decode(&buf[4..4 + n])?;
    buf.drain(..4 + n);
    Ok(Some(frame))
}

/// Reads one frame header. `Ok(None)` on a clean end of stream before any byte.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>> {
    read_frame_within(r, MAX_HEADER)
}

/// The largest hello: its names, ids and token, with room to spare. What a connection
/// says before it is authenticated must not make the listener allocate much.
pub const MAX_HELLO: usize = 64 << 10;

/// [`read_frame`] for a frame whose header may take at most `most` bytes.
pub fn read_frame_within(r: &mut impl Read, most: usize) -> Result<Option<Frame>> {
    let mut len = [0u8; 4];
    if !read_exact_or_eof(r, &mut len)? {
        return Ok(None);
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > most {
        return Err(Error::Protocol(format!("frame header of {n} bytes (max {most})")));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf)?;
    decode(&buf).map(Some)
}

/// Reads one frame header from `sock` if the whole of it has arrived already, without
/// ever blocking (for a server with other work to do meanwhile). `Ok(None)`: not all of
/// it is there yet (or the peer closed; the next blocking read says so).
pub fn try_read_frame(sock: &mut TcpStream) -> Result<Option<Frame>> {
    let mut len = [0u8; 4];
    if peek_now(sock, &mut len)? < len.len() {
        return Ok(None);
    }
    let n = u32::from_le_bytes(len) as usize;
    if n <= MAX_HEADER {
        let mut whole = vec![0u8; 4 + n];
        if peek_now(sock, &mut whole)? < whole.len() {
            return Ok(None);
        }
    }
    // All there (or oversized, which `read_frame` refuses): this read does not block.
    read_frame(sock)
}

/// Copies what has arrived, up to `buf.len()` bytes, without taking it off the socket.
fn peek_now(sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length; the descriptor is the socket's.
    let n = unsafe {
        libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    if n >= 0 {
        return Ok(n as usize);
    }
    match io::Error::last_os_error() {
        e if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(0),
        e => Err(e),
    }
}

fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8]) -> Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(Error::Io("connection closed inside a frame".into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Writes a frame header followed by `payload`, with as few syscalls as the kernel allows.
pub fn write_frame(w: &mut impl Write, frame: &Frame, payload: &[IoSlice<'_>]) -> Result<()> {
    let header = encode(frame);
    let mut slices = Vec::with_capacity(payload.len() + 1);
    slices.push(IoSlice::new(&header));
    slices.extend_from_slice(payload);
    write_all_vectored(w, &mut slices)?;
    Ok(())
}

/// `write_all` for a list of slices (std's version is unstable).
pub fn write_all_vectored(w: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while writing")),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `read_exact` into a list of slices: one `readv` per kernel wake-up, not per slice.
pub fn read_exact_vectored(r: &mut impl Read, mut slices: &mut [IoSliceMut<'_>]) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match r.read_vectored(slices) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a payload")),
            Ok(n) => IoSliceMut::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and discards `n` payload bytes (a refused write must still be drained).
pub fn discard(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a payload"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_taken_only_once_complete() {
        let mut bytes = encode(&Frame::Notify { msg: b"one".to_vec() });
        bytes.extend(encode(&Frame::Notify { msg: b"two".to_vec() }));
        let mut buf = bytes[..5].to_vec();
        assert_eq!(take_frame(&mut buf).unwrap(), None);
        buf.extend_from_slice(&bytes[5..]);
        assert_eq!(take_frame(&mut buf).unwrap(), Some(Frame::Notify { msg: b"one".to_vec() }));
        assert_eq!(take_frame(&mut buf).unwrap(), Some(Frame::Notify { msg: b"two".to_vec() }));
        assert!(buf.is_empty());
        let mut huge = (MAX_HEADER as u32 + 1).to_le_bytes().to_vec();
        assert!(take_frame(&mut huge).is_err());
    }

    #[test]
    fn a_frame_is_read_without_blocking_only_once_all_of_it_arrived() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut reader, _) = listener.accept().unwrap();
        let first = Frame::Read { tag: 7, segs: vec![Seg { region: 1, addr: 4096, len: 1 << 20 }] };
        let bytes = encode(&first);
        let settle = || std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(try_read_frame(&mut reader).unwrap(), None, "nothing sent yet");
        for cut in [2, bytes.len() - 1] {
            writer.write_all(&bytes[..cut]).unwrap();
            settle();
            assert_eq!(try_read_frame(&mut reader).unwrap(), None, "{cut} of {} bytes", bytes.len());
            writer.write_all(&bytes[cut..]).unwrap();
            settle();
            assert_eq!(try_read_frame(&mut reader).unwrap(), Some(first.clone()));
        }
        // Nothing was taken early: the frame after it reads whole, by blocking read too.
        let second = Frame::WriteAck { tag: 8, error: None };
        writer.write_all(&encode(&second)).unwrap();
        assert_eq!(read_frame(&mut reader).unwrap(), Some(second));
        writer.write_all(&(MAX_HEADER as u32 + 1).to_le_bytes()).unwrap();
        settle();
        assert!(matches!(try_read_frame(&mut reader), Err(Error::Protocol(_))));
    }
    use proptest::prelude::*;

    #[test]
    fn frames_roundtrip_with_payload() {
        let f = Frame::Write {
            tag: 9,
            segs: vec![Seg { region: 1, addr: 0x10, len: 3 }, Seg { region: 1, addr: 0x20, len: 2 }],
            notif: Some(b"layer 3 done".to_vec()),
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &f, &[IoSlice::new(b"abc"), IoSlice::new(b"de")]).unwrap();
        let mut r = &buf[..];
        let got = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(got, f);
        assert_eq!(got.payload_len().unwrap(), 5);
        let (mut a, mut b) = ([0u8; 3], [0u8; 2]);
        read_exact_vectored(&mut r, &mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)]).unwrap();
        assert_eq!((&a, &b), (b"abc", b"de"));
        assert!(read_frame(&mut r).unwrap().is_none());
    }

    #[test]
    fn hostile_sizes_are_refused() {
        let mut huge = (u32::MAX).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert!(matches!(read_frame(&mut &huge[..]), Err(Error::Protocol(_))));
        let segs = vec![Seg { region: 1, addr: 0, len: MAX_PAYLOAD }, Seg { region: 1, addr: 0, len: 1 }];
        assert!(seg_bytes(&segs).is_err());
        let many = vec![Seg { region: 1, addr: 0, len: 1 }; MAX_SEGS + 1];
        assert!(seg_bytes(&many).is_err());
        let big = encode(&Frame::Notify { msg: vec![0; MAX_NOTIF + 1] });
        assert!(matches!(read_frame(&mut &big[..]), Err(Error::Protocol(_))));
        // A frame cut in the middle is an error, not a hang or a panic.
        let bytes = encode(&Frame::Notify { msg: vec![1; 100] });
        assert!(read_frame(&mut &bytes[..50]).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_headers_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
            let mut framed = (bytes.len() as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(&bytes);
            let _ = read_frame(&mut &framed[..]);
        }

        #[test]
        fn notify_roundtrip(msg in prop::collection::vec(any::<u8>(), 0..1000)) {
            let f = Frame::Notify { msg };
            let bytes = encode(&f);
            prop_assert_eq!(read_frame(&mut &bytes[..]).unwrap().unwrap(), f);
        }

        #[test]
        fn doorbell_frames_roundtrip(
            hostname in ".{0,40}",
            boot_id in "[0-9a-f-]{0,36}",
            pid_namespace in any::<u64>(),
            pid in any::<u32>(),
            fd in any::<i32>(),
            len in any::<u64>(),
            error in proptest::option::of(".{0,80}"),
        ) {
            let host = HostIdentity { hostname, boot_id, pid_namespace, pid };
            for f in [Frame::Outbox { host, fd, len }, Frame::OutboxReply { error }, Frame::Wake] {
                let bytes = encode(&f);
                prop_assert_eq!(read_frame(&mut &bytes[..]).unwrap().unwrap(), f.clone());
                prop_assert_eq!(f.payload_len().unwrap(), 0);
                // Cut anywhere, it is an error, not a panic.
                prop_assert!(matches!(read_frame(&mut &bytes[..0]), Ok(None)));
                for cut in 1..bytes.len() {
                    prop_assert!(read_frame(&mut &bytes[..cut]).is_err());
                }
            }
        }
    }
}
