//! The decoders that read bytes from a peer, as fuzz targets.
//!
//! Each function here takes any bytes, feeds them to one decoder the way a connection
//! does, and checks what must hold of whatever comes out; it panics only where that
//! breaks (a decoder itself must never panic, allocate without bound, or read outside
//! its input). `fuzz/` (cargo fuzz, nightly) drives each under libFuzzer with the
//! address sanitizer; `tests/corpus.rs` replays the committed corpora
//! (`fuzz/corpus/<target>/`) through the same functions on every `make test`.
//!
//! The invariants, written down once:
//! - **no panic, no unbounded allocation** on any input (the sanitizer and libFuzzer's
//!   memory limit enforce the second while fuzzing);
//! - **round trip**: what decodes encodes to bytes that decode to the same value;
//! - **stream = whole**: a frame read from a stream cut anywhere is the frame decoded
//!   from the whole (frames, rank server lines);
//! - **ring**: the notification ring's reader hands out only messages within its limit,
//!   never reads outside the ring, and once broken stays broken.

use freight_core::frame_io;
use freight_proto::frame::{self, Frame, FrameBuf, MAX_HEADER};
use freight_proto::metadata::AgentMetadata;
use freight_proto::notif_ring::{Consumer, HEADER, LINE};

/// A fuzz target's body: any bytes in, no panic out.
pub type Target = fn(&[u8]);

/// Every target: its name (its directory under `fuzz/corpus/` and its file under
/// `fuzz/fuzz_targets/`) and its body.
pub const TARGETS: &[(&str, Target)] = &[
    ("frame", frame),
    ("metadata", metadata),
    ("kv_request", kv_request),
    ("kv_reply", kv_reply),
    ("rendezvous", rendezvous),
    ("outbox", outbox),
    ("pipe", pipe),
];

/// An agent's frames: one header decoded whole, then the same bytes read as a stream
/// (blocking reads, and a buffer fed in pieces) must give the same frames.
pub fn frame(data: &[u8]) {
    if let Ok(f) = frame::decode(data) {
        let _ = f.payload_len();
        round_trip(&f);
    }
    // As a socket delivers them: frames one after another, each with its length.
    let mut stream = data;
    let mut read = Vec::new();
    while let Ok(Some(f)) = frame_io::read_frame(&mut stream) {
        read.push(f);
    }
    // The same bytes into a buffer in pieces of varying size, as a reader that takes
    // what has arrived does.
    let mut buf = FrameBuf::new(MAX_HEADER);
    let mut taken = Vec::new();
    let mut rest = data;
    let mut piece = 1;
    'feed: while !rest.is_empty() {
        let n = piece.min(rest.len());
        buf.extend(&rest[..n]);
        rest = &rest[n..];
        piece = piece * 3 % 17 + 1;
        loop {
            match buf.take() {
                Ok(Some(f)) => taken.push(f),
                Ok(None) => break,
                Err(_) => break 'feed,
            }
        }
    }
    assert!(buf.moved() <= data.len() as u64, "the buffer moved more bytes than it took");
    let common = read.len().min(taken.len());
    assert_eq!(read[..common], taken[..common], "a stream cut in pieces reads as the whole");
}

fn round_trip(f: &Frame) {
    let bytes = frame::encode(f);
    let again = frame::decode(&bytes[4..]).expect("an encoded frame decodes");
    assert_eq!(&again, f);
}

/// An agent's metadata, from a listener, a directory or an application.
pub fn metadata(data: &[u8]) {
    if let Ok(md) = AgentMetadata::decode(data) {
        md.validate().expect("decoded metadata is valid");
        assert_eq!(AgentMetadata::decode(&md.encode()).expect("encoded metadata decodes"), md);
    }
}

/// A KV client's request, as the server's worker reads it.
pub fn kv_request(data: &[u8]) {
    use freight_kv::wire::Request;
    match Request::decode(data) {
        Some(Ok((token, request))) => {
            let again = Request::decode(&request.encode(&token)).expect("ours").expect("decodes");
            assert_eq!(again, (token, request));
            assert!(Request::recover_head(data).is_some(), "a request that decodes has a head");
        }
        Some(Err(_)) | None => {
            let _ = Request::recover_head(data);
        }
    }
}

/// The KV server's reply, as a client reads it.
pub fn kv_reply(data: &[u8]) {
    use freight_kv::wire::{Outcome, Reply};
    if let Some(Ok(reply)) = Reply::decode(data) {
        let bytes = reply.encode();
        assert!(bytes.len() <= frame::MAX_NOTIF, "a reply always fits one notification");
        // Encoding may shorten failures' reasons to fit; nothing else changes.
        let again = Reply::decode(&bytes).expect("ours").expect("decodes");
        assert_eq!((again.first_id, again.outcomes.len()), (reply.first_id, reply.outcomes.len()));
        for (sent, read) in reply.outcomes.iter().zip(&again.outcomes) {
            match (sent, read) {
                (Outcome::Failed { code: a, error: long }, Outcome::Failed { code: b, error: short }) => {
                    assert!(a == b && long.starts_with(short.as_str()), "{sent:?} came back as {read:?}")
                }
                _ => assert_eq!(sent, read),
            }
        }
    }
}

/// The rank server's lines, one message or a stream of them.
pub fn rendezvous(data: &[u8]) {
    freight_ep::rendezvous::fuzzing::message(data);
    freight_ep::rendezvous::fuzzing::stream(data);
}

/// A notification ring in memory its producer laid out: the first byte picks its
/// capacity (and whether the header is right, so that the fuzzer reaches the records),
/// the next bytes are the memory, the rest patches it between drains, as a producer
/// writing while the consumer reads does.
pub fn outbox(data: &[u8]) {
    let Some((&shape, rest)) = data.split_first() else { return };
    let cap = 1024 + 64 * u64::from(shape >> 2);
    let len = HEADER + cap as usize;
    // A whole number of u64: the ring's memory must be 8-aligned.
    let mut memory = vec![0u64; len / 8];
    // From here on the memory is reached only through `base`, as shared memory is.
    let base: *mut u8 = memory.as_mut_ptr().cast();
    let (fill, mut patches) = rest.split_at(rest.len().min(len));
    // SAFETY: `fill` is at most `len` bytes, the memory's size; the header's words are
    // 8-aligned inside it.
    unsafe {
        std::ptr::copy_nonoverlapping(fill.as_ptr(), base, fill.len());
        if shape & 1 != 0 {
            // A header as a producer lays it out (the fuzzer still sets the positions).
            base.add(2 * LINE).cast::<u64>().write(u64::from_le_bytes(*b"FRTRING1"));
            base.add(2 * LINE + 8).cast::<u64>().write(cap);
        }
    }
    let max_message = if shape & 2 != 0 { 64 } else { 1 << 16 };
    // SAFETY: the memory is `len` bytes, 8-aligned, and outlives the consumer.
    let Ok(mut ring) = (unsafe { Consumer::attach(base, len, max_message) }) else { return };
    let mut broken = false;
    let mut drain = |ring: &mut Consumer| {
        let result = ring.drain(|m| assert!(m.len() <= max_message, "a message over the limit came out"));
        assert!(!(broken && result.is_ok()), "a broken ring stays broken");
        broken |= result.is_err();
    };
    drain(&mut ring);
    // Each patch: a u16 offset into the memory, a length byte, then that many bytes.
    while let [lo, hi, n, more @ ..] = patches {
        let at = usize::from(u16::from_le_bytes([*lo, *hi])) % len;
        let n = usize::from(*n).min(more.len()).min(len - at);
        // SAFETY: `[at, at + n)` lies inside the memory.
        unsafe { std::ptr::copy_nonoverlapping(more.as_ptr(), base.add(at), n) };
        patches = &more[n..];
        drain(&mut ring);
    }
    drop(ring);
    drop(memory);
}

/// The stream crate's pipe messages (engine notifications between a pipe's two ends).
pub fn pipe(data: &[u8]) {
    use freight_stream::proto::Msg;
    if let Some(Ok(msg)) = Msg::decode(data) {
        assert_eq!(Msg::decode(&msg.encode()).expect("ours").expect("decodes"), msg);
    }
}
