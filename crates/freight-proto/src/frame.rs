//! Messages between agents and their framing: formats and parses only; reading and
//! writing them on sockets is the engine's (`freight_core::frame_io`).
//!
//! Every frame is a little-endian u32 header length, then a postcard-encoded [`Frame`];
//! `Write` and `ReadData` are followed by raw payload bytes (the sum of their segment
//! lengths), which travel straight from and into registered memory.
//!
//! Invariants, each checked by a test below:
//! - a declared length is judged before anything is allocated for it, against the
//!   largest header an honest peer sends of that kind ([`HEADER_LIMITS`]);
//! - no frame makes its reader allocate for more than [`MAX_SEGS`] segments;
//! - [`FrameBuf`] never moves more bytes than it handed out as frames.

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Error, Result};
use crate::metadata::HostIdentity;

/// 2: notification outboxes in shared memory (`Outbox`, `OutboxReply`, `Wake`).
/// 3: a one-message write carries its notification (`Write::notif`).
/// 4: the fabric exchange (`Role::Fabric`, `Fabric*` frames).
/// 5: landing buffers lent for staging over the fabric (`FabricDocks`, `FabricLand`...).
/// 6: a control connection opens with the target's live regions (`LiveRegions`).
/// 7: GPU memory a fabric target registers (`FI_HMEM`) has keys (`FabricKeysReply`).
/// 8: a hello carries the target's secret and its access token apart (`Hello::secret`,
///    `Hello::token`): an agent with a token wants it on every connection.
pub const PROTOCOL_VERSION: u16 = 8;
/// Headers larger than this are a protocol violation (metadata replies are the largest).
/// Each kind of frame has a smaller bound of its own (see [`HEADER_LIMITS`]).
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
        /// The target's secret from its metadata (empty for `Role::Metadata`, which is
        /// asked before the metadata is known).
        secret: Vec<u8>,
        /// The target's access token, where it was given one (see
        /// `AgentConfig::token`): required on every connection, metadata requests
        /// included. Empty otherwise.
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
        #[serde(deserialize_with = "at_most_max_segs")]
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
        #[serde(deserialize_with = "at_most_max_segs")]
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
    /// For each region asked, in order: one key per target rail, or `None` for GPU
    /// memory the target's provider cannot register (reached through its docks); or why
    /// not.
    FabricKeysReply {
        keys: Vec<Option<Vec<u64>>>,
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
    /// The first frame on a control connection after the welcome: the keys of the
    /// target's public regions as the connection was taken up. Revocations from then on
    /// follow on the connection; a region the initiator knows of but not listed here was
    /// revoked before it.
    LiveRegions {
        regions: Vec<u64>,
    },
}

/// The longest encoding of a segment list: its length, then three u64 varints a segment.
const MAX_SEG_LIST: usize = 10 + MAX_SEGS * 3 * 10;
/// Room for a frame's kind, numbers, options and length prefixes.
const FIELDS: usize = 64;
/// Frames of a reason, a few names and numbers: far more than any agent sends.
const SMALL: usize = 1 << 20;
/// Fabric frames whose lists grow with the rails and docks of a link (tens of entries).
const RAIL_LISTS: usize = 64 << 10;
/// Frames whose lists grow with the regions one transfer names, or one agent holds
/// (over a million keys).
const REGION_LISTS: usize = 16 << 20;

/// Per kind of frame (in the order of [`Frame`]'s variants, whose index starts the
/// encoding), its name and the largest header an honest peer sends of it. A declared
/// length is checked against it before anything is allocated, so that what a peer
/// declares cannot cost more memory than a legal frame of that kind.
pub const HEADER_LIMITS: [(&str, usize); 23] = [
    ("Hello", MAX_HELLO),
    ("Welcome", FIELDS),
    ("Refused", SMALL),
    ("Write", FIELDS + MAX_SEG_LIST + MAX_NOTIF),
    ("WriteAck", SMALL),
    ("Read", FIELDS + MAX_SEG_LIST),
    ("ReadData", SMALL),
    ("Notify", FIELDS + MAX_NOTIF),
    ("Revoke", FIELDS),
    ("Metadata", MAX_HEADER),
    ("Outbox", SMALL),
    ("OutboxReply", SMALL),
    ("Wake", FIELDS),
    ("FabricHello", SMALL),
    ("FabricWelcome", RAIL_LISTS),
    ("FabricKeys", REGION_LISTS),
    ("FabricKeysReply", REGION_LISTS),
    ("FabricDocks", FIELDS),
    ("FabricDocksReply", RAIL_LISTS),
    ("FabricLand", FIELDS),
    ("FabricLift", FIELDS),
    ("FabricDocked", SMALL),
    ("LiveRegions", REGION_LISTS),
];

/// The largest header a control connection carries (`Notify`, `Outbox`, `Wake`).
pub const MAX_CONTROL_HEADER: usize = FIELDS + MAX_NOTIF;

/// Refuses a header of `n` bytes that starts with `first` (its kind) if no honest frame
/// of that kind is that long, or longer than `most`.
fn check_header(n: usize, first: u8, most: usize) -> Result<()> {
    let Some(&(kind, limit)) = HEADER_LIMITS.get(first as usize) else {
        return Err(Error::Protocol(format!("bad frame: unknown kind {first}")));
    };
    let limit = limit.min(most);
    if n > limit {
        return Err(Error::Protocol(format!("{kind} frame header of {n} bytes (max {limit})")));
    }
    Ok(())
}

/// Decodes a segment list, refusing more than [`MAX_SEGS`] segments as soon as they are
/// declared: a frame cannot make its reader allocate for more.
fn at_most_max_segs<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<Seg>, D::Error> {
    struct Segs;
    impl<'de> Visitor<'de> for Segs {
        type Value = Vec<Seg>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "at most {MAX_SEGS} segments")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Vec<Seg>, A::Error> {
            let declared = seq.size_hint().unwrap_or(0);
            if declared > MAX_SEGS {
                return Err(de::Error::invalid_length(declared, &self));
            }
            let mut segs = Vec::with_capacity(declared);
            while let Some(seg) = seq.next_element()? {
                if segs.len() == MAX_SEGS {
                    return Err(de::Error::invalid_length(MAX_SEGS + 1, &self));
                }
                segs.push(seg);
            }
            Ok(segs)
        }
    }
    d.deserialize_seq(Segs)
}

/// The number of segments a `Write` or `Read` header declares, read ahead of decoding
/// it only to name the violation (decoding refuses such a list on its own).
fn declared_segs(header: &[u8]) -> Option<u64> {
    let (&kind, mut rest) = header.split_first()?;
    if !matches!(HEADER_LIMITS.get(kind as usize), Some(("Write" | "Read", _))) {
        return None;
    }
    let mut varint = || {
        let mut value = 0u64;
        for i in 0..10 {
            let (&b, more) = rest.split_first()?;
            rest = more;
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    };
    let _tag = varint()?;
    varint()
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
    if let Some(n) = declared_segs(bytes).filter(|&n| n > MAX_SEGS as u64) {
        return Err(Error::Protocol(format!("{n} segments in one frame (max {MAX_SEGS})")));
    }
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

/// Bytes received but not yet taken as frames, for readers that receive whatever has
/// arrived rather than block for a whole frame. Frames are taken from the front by
/// offset, which moves no bytes; what remains moves to the front (when more is added)
/// only once at least as many bytes were taken before it. So the bytes ever moved never
/// exceed the bytes taken, however many frames arrive at a time.
#[derive(Debug)]
pub struct FrameBuf {
    bytes: Vec<u8>,
    /// Where the first frame not yet taken starts.
    start: usize,
    /// The largest header accepted (each kind of frame also has its own bound).
    most: usize,
    /// Bytes moved to the front so far.
    moved: u64,
}

/// A buffer emptied of a frame larger than this gives its memory back.
const KEEP_CAPACITY: usize = 1 << 20;

impl FrameBuf {
    /// A buffer for frames whose headers take at most `most` bytes.
    pub fn new(most: usize) -> FrameBuf {
        FrameBuf { bytes: Vec::new(), start: 0, most: most.min(MAX_HEADER), moved: 0 }
    }

    /// Appends `more`, after dropping the frames taken already if that moves no more
    /// bytes than they took.
    pub fn extend(&mut self, more: &[u8]) {
        let rest = self.len();
        if self.start > 0 && self.start >= rest {
            self.moved += rest as u64;
            self.bytes.copy_within(self.start.., 0);
            self.bytes.truncate(rest);
            self.start = 0;
        }
        self.bytes.extend_from_slice(more);
    }

    /// Takes the next frame if the whole of its header is here. A header that is too
    /// long or does not decode is an error, and stays: taking again fails again.
    pub fn take(&mut self) -> Result<Option<Frame>> {
        let rest = &self.bytes[self.start..];
        let Some(n) = declared_len(rest, self.most)? else {
            return Ok(None);
        };
        let Some(header) = rest.get(4..4 + n) else {
            return Ok(None);
        };
        let frame = decode(header)?;
        self.start += 4 + n;
        if self.start == self.bytes.len() {
            self.start = 0;
            self.bytes.clear();
            if self.bytes.capacity() > KEEP_CAPACITY {
                self.bytes = Vec::new();
            }
        }
        Ok(Some(frame))
    }

    /// Bytes here and not taken yet.
    pub fn len(&self) -> usize {
        self.bytes.len() - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes moved to the front of the buffer so far: never more than were taken.
    pub fn moved(&self) -> u64 {
        self.moved
    }
}

/// The largest hello: its names, ids and token, with room to spare. What a connection
/// says before it is authenticated must not make the listener allocate much.
pub const MAX_HELLO: usize = 64 << 10;

/// What the first bytes of a frame (`prefix`: its 4-byte length, then whatever came
/// after) declare: `Ok(Some(n))`, a header of `n` bytes, judged against `most` and,
/// once its first byte (the kind) is here, against the largest honest frame of that
/// kind; `Ok(None)`: too few bytes to judge yet. Readers call it before they allocate.
pub fn declared_len(prefix: &[u8], most: usize) -> Result<Option<usize>> {
    let Some(len) = prefix.first_chunk::<4>() else {
        return Ok(None);
    };
    let n = u32::from_le_bytes(*len) as usize;
    if n > most {
        return Err(Error::Protocol(format!("frame header of {n} bytes (max {most})")));
    }
    match prefix.get(4) {
        _ if n == 0 => Ok(Some(0)),
        Some(&kind) => check_header(n, kind, most).map(|()| Some(n)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The first frame of `bytes`, as a reader that has received them takes it.
    fn one(bytes: &[u8]) -> Result<Option<Frame>> {
        let mut buf = FrameBuf::new(MAX_HEADER);
        buf.extend(bytes);
        buf.take()
    }

    #[test]
    fn frames_are_taken_only_once_complete() {
        let mut bytes = encode(&Frame::Notify { msg: b"one".to_vec() });
        bytes.extend(encode(&Frame::Notify { msg: b"two".to_vec() }));
        let mut buf = FrameBuf::new(MAX_HEADER);
        buf.extend(&bytes[..5]);
        assert_eq!(buf.take().unwrap(), None);
        buf.extend(&bytes[5..]);
        assert_eq!(buf.take().unwrap(), Some(Frame::Notify { msg: b"one".to_vec() }));
        assert_eq!(buf.take().unwrap(), Some(Frame::Notify { msg: b"two".to_vec() }));
        assert_eq!(buf.take().unwrap(), None);
        assert!(buf.is_empty());
        let mut huge = FrameBuf::new(MAX_HEADER);
        huge.extend(&(MAX_HEADER as u32 + 1).to_le_bytes());
        assert!(matches!(huge.take(), Err(Error::Protocol(_))));
        assert!(matches!(huge.take(), Err(Error::Protocol(_))), "the refusal stays");
    }

    /// Small notifications, as a busy sender's burst brings them, and their bytes.
    fn burst(n: usize) -> (Vec<Frame>, Vec<u8>) {
        let frames: Vec<Frame> = (0..n).map(|i| Frame::Notify { msg: (i as u32).to_le_bytes().to_vec() }).collect();
        let bytes = frames.iter().flat_map(encode).collect();
        (frames, bytes)
    }

    /// Takes every complete frame.
    fn take_all(buf: &mut FrameBuf, out: &mut Vec<Frame>) {
        while let Some(f) = buf.take().unwrap() {
            out.push(f);
        }
    }

    #[test]
    fn taking_a_burst_of_frames_moves_no_bytes() {
        // A quarter of a million notifications at once: taking them is by offset. (With
        // a drain per frame, this moved every later byte again for each frame, about
        // 250k * 2.5 MB / 2 bytes.)
        let (frames, bytes) = burst(250_000);
        let mut buf = FrameBuf::new(MAX_CONTROL_HEADER);
        buf.extend(&bytes);
        // Frames are taken by offset: the bytes after them stay where they are.
        let stored = buf.bytes.as_ptr();
        let mut got = Vec::with_capacity(frames.len());
        for _ in 0..1000 {
            got.extend(buf.take().unwrap());
        }
        let taken: usize = frames[..1000].iter().map(|f| encode(f).len()).sum();
        assert_eq!((buf.start, buf.bytes.as_ptr()), (taken, stored));
        assert!(buf.bytes[buf.start..] == bytes[taken..]);
        take_all(&mut buf, &mut got);
        assert!(got == frames && buf.is_empty());
        assert_eq!(buf.moved(), 0);

        // Received in 16 KiB pieces, as the inbox reads them: only the start of the one
        // frame cut at the end of each piece moves.
        let mut buf = FrameBuf::new(MAX_CONTROL_HEADER);
        let mut got = Vec::with_capacity(frames.len());
        let pieces = bytes.chunks(16 << 10);
        let most = pieces.len() as u64 * encode(&frames[0]).len() as u64;
        for piece in pieces {
            buf.extend(piece);
            take_all(&mut buf, &mut got);
        }
        assert!(got == frames && buf.is_empty());
        assert!(buf.moved() <= most, "moved {} bytes, more than {most}", buf.moved());
    }

    #[test]
    fn a_reader_that_takes_one_frame_at_a_time_moves_no_more_than_it_took() {
        let (frames, bytes) = burst(20_000);
        let mut buf = FrameBuf::new(MAX_CONTROL_HEADER);
        let mut got = Vec::new();
        for piece in bytes.chunks(100) {
            buf.extend(piece);
            got.extend(buf.take().unwrap());
        }
        take_all(&mut buf, &mut got);
        assert!(got == frames && buf.is_empty());
        assert!(buf.moved() <= bytes.len() as u64, "moved {} of {} bytes", buf.moved(), bytes.len());
    }

    #[test]
    fn hostile_sizes_are_refused() {
        let mut huge = (u32::MAX).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert!(matches!(one(&huge), Err(Error::Protocol(_))));
        let segs = vec![Seg { region: 1, addr: 0, len: MAX_PAYLOAD }, Seg { region: 1, addr: 0, len: 1 }];
        assert!(seg_bytes(&segs).is_err());
        let many = vec![Seg { region: 1, addr: 0, len: 1 }; MAX_SEGS + 1];
        assert!(seg_bytes(&many).is_err());
        let big = encode(&Frame::Notify { msg: vec![0; MAX_NOTIF + 1] });
        assert!(matches!(one(&big), Err(Error::Protocol(_))));
    }

    /// The largest frame of each kind an honest peer sends, with the variant's name.
    fn largest_of_each_kind() -> Vec<(&'static str, Frame)> {
        let n = u64::MAX;
        let seg = Seg { region: n, addr: n, len: n };
        let segs = vec![seg; MAX_SEGS];
        let host = HostIdentity { hostname: "h".repeat(255), boot_id: "b".repeat(36), pid_namespace: n, pid: u32::MAX };
        let reason = Some("r".repeat(4096));
        let frames = vec![
            Frame::Hello {
                version: u16::MAX,
                role: Role::Data { index: u32::MAX },
                from_name: "n".repeat(256),
                from_id: n,
                target_id: n,
                secret: vec![0; 4096],
                token: vec![0; 4096],
            },
            Frame::Welcome { agent_id: n },
            Frame::Refused { reason: "r".repeat(4096) },
            Frame::Write { tag: n, segs: segs.clone(), notif: Some(vec![0; MAX_NOTIF]) },
            Frame::WriteAck { tag: n, error: reason.clone() },
            Frame::Read { tag: n, segs },
            Frame::ReadData { tag: n, error: reason.clone() },
            Frame::Notify { msg: vec![0; MAX_NOTIF] },
            Frame::Revoke { region: n },
            // (The largest metadata is checked by arithmetic below.)
            Frame::Metadata { bytes: vec![0; 1000] },
            Frame::Outbox { host, fd: i32::MIN, len: n },
            Frame::OutboxReply { error: reason.clone() },
            Frame::Wake,
            Frame::FabricHello { provider: "p".repeat(256) },
            Frame::FabricWelcome { provider: "p".repeat(256), rails: vec![vec![0; 256]; 32], virt_addr: true },
            Frame::FabricKeys { regions: vec![n; 100_000] },
            Frame::FabricKeysReply { keys: vec![Some(vec![n; 8]); 100_000], error: reason.clone() },
            Frame::FabricDocks { count: u32::MAX, size: n },
            Frame::FabricDocksReply { docks: vec![(n, vec![n; 32]); 64], error: reason.clone() },
            Frame::FabricLand { token: n, dock: u32::MAX, seg },
            Frame::FabricLift { token: n, dock: u32::MAX, seg },
            Frame::FabricDocked { token: n, error: reason },
            Frame::LiveRegions { regions: vec![n; 1_000_000] },
        ];
        // Every variant, named (a new one must be added here and to HEADER_LIMITS).
        frames
            .into_iter()
            .map(|f| {
                let name = match &f {
                    Frame::Hello { .. } => "Hello",
                    Frame::Welcome { .. } => "Welcome",
                    Frame::Refused { .. } => "Refused",
                    Frame::Write { .. } => "Write",
                    Frame::WriteAck { .. } => "WriteAck",
                    Frame::Read { .. } => "Read",
                    Frame::ReadData { .. } => "ReadData",
                    Frame::Notify { .. } => "Notify",
                    Frame::Revoke { .. } => "Revoke",
                    Frame::Metadata { .. } => "Metadata",
                    Frame::Outbox { .. } => "Outbox",
                    Frame::OutboxReply { .. } => "OutboxReply",
                    Frame::Wake => "Wake",
                    Frame::FabricHello { .. } => "FabricHello",
                    Frame::FabricWelcome { .. } => "FabricWelcome",
                    Frame::FabricKeys { .. } => "FabricKeys",
                    Frame::FabricKeysReply { .. } => "FabricKeysReply",
                    Frame::FabricDocks { .. } => "FabricDocks",
                    Frame::FabricDocksReply { .. } => "FabricDocksReply",
                    Frame::FabricLand { .. } => "FabricLand",
                    Frame::FabricLift { .. } => "FabricLift",
                    Frame::FabricDocked { .. } => "FabricDocked",
                    Frame::LiveRegions { .. } => "LiveRegions",
                };
                (name, f)
            })
            .collect()
    }

    #[test]
    fn the_largest_frame_of_every_kind_is_within_its_limit() {
        let all = largest_of_each_kind();
        assert_eq!(all.len(), HEADER_LIMITS.len());
        for (name, frame) in all {
            let bytes = encode(&frame);
            let (kind, limit) = HEADER_LIMITS[bytes[4] as usize];
            assert_eq!(kind, name, "HEADER_LIMITS is in the order of Frame's variants");
            assert!(bytes.len() - 4 <= limit, "{name}: {} bytes, limit {limit}", bytes.len() - 4);
            assert!(limit <= MAX_HEADER);
            assert_eq!(one(&bytes).unwrap(), Some(frame), "{name}");
        }
        // A metadata reply: its kind, the bytes' length, then the bytes.
        assert!(1 + 10 + crate::metadata::MAX_METADATA_BYTES <= HEADER_LIMITS[9].1);
        assert_eq!(MAX_CONTROL_HEADER, HEADER_LIMITS[7].1, "a control connection's largest frame is a notification");
    }

    /// The 5 bytes that declare a header of `n` bytes of the given kind.
    fn declared(n: usize, kind: &str) -> Vec<u8> {
        let mut b = (n as u32).to_le_bytes().to_vec();
        b.push(HEADER_LIMITS.iter().position(|(k, _)| *k == kind).unwrap() as u8);
        b
    }

    #[test]
    fn a_declared_length_over_its_kinds_limit_is_refused_before_the_header_arrives() {
        for kind in ["Write", "Read", "Notify", "WriteAck", "Wake", "Outbox", "FabricKeys"] {
            let limit = HEADER_LIMITS.iter().find(|(k, _)| *k == kind).unwrap().1;
            let prefix = declared(limit + 1, kind);
            let e = declared_len(&prefix, MAX_HEADER).unwrap_err();
            assert!(matches!(&e, Error::Protocol(m) if m.contains(kind)), "{kind}: {e}");
            let mut buf = FrameBuf::new(MAX_HEADER);
            buf.extend(&prefix);
            assert!(matches!(buf.take(), Err(Error::Protocol(_))), "{kind}");
            // Within its limit, the reader goes on to wait for the header.
            assert_eq!(declared_len(&declared(limit, kind), MAX_HEADER).unwrap(), Some(limit));
        }
        // The length alone is judged against the most; the kind once it is here.
        assert_eq!(declared_len(&declared(1000, "Read")[..4], MAX_HEADER).unwrap(), None);
        assert!(declared_len(&(MAX_HEADER as u32 + 1).to_le_bytes(), MAX_HEADER).is_err());
        // An unknown kind is refused at once too.
        assert!(matches!(declared_len(&[9, 0, 0, 0, 200], MAX_HEADER), Err(Error::Protocol(_))));
        // A control connection takes no metadata-sized frame, whatever its kind.
        let mut control = FrameBuf::new(MAX_CONTROL_HEADER);
        control.extend(&declared(MAX_CONTROL_HEADER + 1, "Metadata"));
        assert!(matches!(control.take(), Err(Error::Protocol(_))));
        // A hello is held to what an unauthenticated connection may send.
        assert!(matches!(declared_len(&declared(MAX_HELLO + 1, "Hello"), MAX_HELLO), Err(Error::Protocol(_))));
    }

    #[test]
    fn more_segments_than_a_frame_may_carry_are_refused_while_decoding() {
        let seg = Seg { region: 1, addr: 0, len: 1 };
        let read = |n| Frame::Read { tag: 3, segs: vec![seg; n] };
        let write = |n| Frame::Write { tag: 3, segs: vec![seg; n], notif: None };
        for (ok, too_many) in [(read(MAX_SEGS), read(MAX_SEGS + 1)), (write(MAX_SEGS), write(MAX_SEGS + 1))] {
            assert_eq!(one(&encode(&ok)).unwrap().unwrap(), ok);
            let e = one(&encode(&too_many)).unwrap_err();
            assert!(matches!(&e, Error::Protocol(m) if m.contains("1024 segments")), "{e}");
        }
        // A header as long as a write may be, but declaring millions of (3-byte) segments.
        let limit = HEADER_LIMITS[3].1;
        let mut bytes = declared(limit, "Write");
        bytes.push(0); // tag
        bytes.extend([0xc0, 0x96, 0xb1, 0x02]); // 5,000,000 segments
        bytes.resize(4 + limit, 0);
        let e = one(&bytes).unwrap_err();
        assert!(matches!(&e, Error::Protocol(m) if m.contains("5000000 segments")), "{e}");
        // The list is refused by decoding too, whatever the look-ahead makes of it.
        assert!(postcard::from_bytes::<Frame>(&bytes[4..]).is_err());
        let mut over = encode(&read(MAX_SEGS + 1));
        over.drain(..4);
        assert!(postcard::from_bytes::<Frame>(&over).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_headers_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
            let mut framed = (bytes.len() as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(&bytes);
            let _ = one(&framed);
        }

        #[test]
        fn frames_cut_anywhere_come_out_whole_and_in_order(
            sizes in prop::collection::vec(0usize..3000, 1..60),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..40),
            greedy in any::<bool>(),
        ) {
            let frames: Vec<Frame> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| match n % 7 {
                    0 => Frame::Wake,
                    1 => Frame::Revoke { region: n as u64 },
                    _ => Frame::Notify { msg: vec![i as u8; n] },
                })
                .collect();
            let bytes: Vec<u8> = frames.iter().flat_map(encode).collect();
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            at.push(0);
            at.push(bytes.len());
            at.sort_unstable();
            let mut buf = FrameBuf::new(MAX_CONTROL_HEADER);
            let mut got = Vec::new();
            for piece in at.windows(2) {
                buf.extend(&bytes[piece[0]..piece[1]]);
                if greedy {
                    take_all(&mut buf, &mut got);
                } else {
                    got.extend(buf.take().unwrap());
                }
            }
            take_all(&mut buf, &mut got);
            prop_assert_eq!(got, frames);
            prop_assert!(buf.is_empty());
            prop_assert!(buf.moved() <= bytes.len() as u64);
        }

        #[test]
        fn notify_roundtrip(msg in prop::collection::vec(any::<u8>(), 0..1000)) {
            let f = Frame::Notify { msg };
            let bytes = encode(&f);
            prop_assert_eq!(one(&bytes).unwrap().unwrap(), f);
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
                prop_assert_eq!(one(&bytes).unwrap().unwrap(), f.clone());
                prop_assert_eq!(f.payload_len().unwrap(), 0);
                // Cut anywhere, it is not a frame yet (and no panic).
                for cut in 0..bytes.len() {
                    prop_assert!(matches!(one(&bytes[..cut]), Ok(None)));
                }
            }
        }
    }
}
