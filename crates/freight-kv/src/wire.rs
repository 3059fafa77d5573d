//! The data plane's messages. A client sends each request to the server as an engine
//! notification; the server moves the values itself (a GET writes the value into the
//! client's buffer, a PUT reads it from there into a slot of the pool) and answers with
//! a notification, which for a GET rides on the transfer and so arrives only after the
//! bytes have landed.
//!
//! A request is a batch of one or more keys of one kind; its items get consecutive ids
//! from `first_id`, and the reply carries one outcome per item in the same order.
//! Every message starts with [`MAGIC`] and a version byte, so that a server can tell its
//! clients' messages from anything else an engine peer might send, and refuse a
//! message of another version by name instead of misreading it. Versions are agreed on
//! before any of these messages: a client states its [`VERSION`] in its Hello, and the
//! server refuses a session of another one. A request that still does not decode is
//! answered with a [`FailCode::Protocol`] failure where its session token and
//! `first_id` can be read (see [`Request::recover_head`]) and the token is its sender's
//! session's, so that its client fails at once instead of waiting out its timeout; the
//! server only logs one whose head is lost, or whose token is not its sender's.
//!
//! A request also carries its session's token, right after the version byte: the
//! engine names the agent a notification came from as that agent introduced itself,
//! and any client knows the server's secret, so the name alone does not show whose
//! session a request belongs to. The server carries out, and answers, only requests
//! whose token is that of the named agent's session: an answer to a request its client
//! never made would be taken as the answer to one it did make.
//!
//! A request and its reply each travel as one engine notification, so each must fit
//! [`MAX_NOTIF`]: [`notification_batches`] cuts a batch into requests that do.

use std::ops::Range;

use freight_core::{Desc, Error, MemKind, Result};
use freight_proto::frame::MAX_NOTIF;
use serde::{Deserialize, Serialize};

/// The first bytes of every data-plane message.
pub const MAGIC: [u8; 3] = *b"fkv";
/// This protocol's version, the byte after [`MAGIC`]. 2: requests carry their session's
/// token.
pub const VERSION: u8 = 2;

/// The longest key, in bytes (a hash or a path, not a value).
pub const MAX_KEY: usize = 4096;

/// A session's secret, as the control plane hands it out.
pub type SessionToken = [u8; 16];

/// A notification the server sends a client as its session opens, so that its agent
/// connects to the client's then, on the control plane's thread, rather than on the
/// data-plane worker at the first reply. Not a data-plane message: clients drop it.
pub const WELCOME: &[u8] = b"freight-kv welcome";

/// Client memory registered with the client's agent: where a GET puts a value, or where
/// a PUT's value is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub kind: MemKind,
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
}

impl Buffer {
    pub fn desc(&self) -> Desc {
        Desc { addr: self.addr, len: self.len, dev: self.dev }
    }

    /// The first `len` bytes.
    pub fn prefix(&self, len: u64) -> Buffer {
        Buffer { len, ..*self }
    }
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Each key's value into its buffer.
    Get { first_id: u64, items: Vec<(Vec<u8>, Buffer)> },
    /// Each buffer becomes its key's value (all of the buffer), expiring after `ttl_ms`
    /// (0: never).
    Put { first_id: u64, ttl_ms: u64, items: Vec<(Vec<u8>, Buffer)> },
}

impl Request {
    pub fn first_id(&self) -> u64 {
        match self {
            Request::Get { first_id, .. } | Request::Put { first_id, .. } => *first_id,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Request::Get { items, .. } | Request::Put { items, .. } => items.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What happened to one item of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// GET: the value (`len` bytes) is in the item's buffer.
    Found { len: u64, version: u64 },
    /// GET: no such key (or it expired).
    Missing,
    /// PUT: the key now has this value.
    Stored { version: u64 },
    /// GET: the value does not fit the item's buffer.
    TooLarge { value: u64, buffer: u64 },
    /// The server refused or failed the item; `error` says why.
    Failed { code: FailCode, error: String },
}

/// Why an item failed, for the client to raise the matching error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailCode {
    /// The pool cannot hold the value (eviction off, or everything pinned).
    NoSpace,
    /// Something about the item is wrong (an empty key, a zero-length value...).
    Invalid,
    /// The server could not move the bytes (the client's memory, the engine).
    Transfer,
    /// The client never said hello, or the server is shutting down.
    Refused,
    /// The request did not decode: the reply has this one outcome, whatever the number
    /// of items the request had.
    Protocol,
}

impl FailCode {
    /// The engine error a client of `server` raises for this code.
    pub fn error(self, server: &str, message: String) -> Error {
        match self {
            FailCode::NoSpace => Error::NoSpace(message),
            FailCode::Invalid => Error::InvalidArgument(message),
            FailCode::Transfer => Error::Io(format!("the KV server could not move the value: {message}")),
            FailCode::Refused => Error::RemoteRejected { peer: server.into(), reason: message },
            FailCode::Protocol => Error::Protocol(format!("the KV server could not read the request: {message}")),
        }
    }
}

/// The server's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub first_id: u64,
    pub outcomes: Vec<Outcome>,
}

/// [`MAGIC`], the version, `head` (a request's session token), then `value`.
fn encode<T: Serialize>(head: &[u8], value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.extend_from_slice(head);
    postcard::to_extend(value, out).expect("data-plane messages always serialize")
}

/// What follows the version byte. `None` when `bytes` is not a data-plane message at
/// all (another kind of notification); an error when it is one of another version.
fn body<'a>(bytes: &'a [u8], what: &str) -> Option<Result<&'a [u8]>> {
    let rest = bytes.strip_prefix(&MAGIC[..])?;
    Some(match rest.split_first() {
        Some((&VERSION, body)) => Ok(body),
        Some((v, _)) => Err(Error::Protocol(format!("KV {what} of protocol version {v}; this side speaks {VERSION}"))),
        None => Err(Error::Protocol(format!("truncated KV {what}"))),
    })
}

fn decode<'a, T: Deserialize<'a>>(body: &'a [u8], whole: usize, what: &str) -> Result<T> {
    postcard::from_bytes(body).map_err(|e| Error::Protocol(format!("malformed KV {what} ({whole} bytes): {e}")))
}

/// A request's session token, and the rest of its body.
fn split_token(body: &[u8]) -> Option<(SessionToken, &[u8])> {
    let token = body.get(..16)?.try_into().ok()?;
    Some((token, &body[16..]))
}

impl Request {
    /// The request as `session` sends it.
    pub fn encode(&self, session: &SessionToken) -> Vec<u8> {
        encode(session, self)
    }

    /// The session token the request came with, and the request.
    pub fn decode(bytes: &[u8]) -> Option<Result<(SessionToken, Request)>> {
        Some(body(bytes, "request")?.and_then(|b| {
            let (token, rest) = split_token(b).ok_or_else(|| Error::Protocol("truncated KV request".into()))?;
            Ok((token, decode(rest, bytes.len(), "request")?))
        }))
    }

    /// The session token and `first_id` of a request of this version whose body does not
    /// decode as a whole (cut short, an unknown item...): the token comes first, and both
    /// kinds of request start with their `first_id`, right after their tag.
    pub fn recover_head(bytes: &[u8]) -> Option<(SessionToken, u64)> {
        /// The leading fields of [`Request`]'s variants, in its order.
        #[derive(Deserialize)]
        enum Head {
            Get { first_id: u64 },
            Put { first_id: u64 },
        }
        let body = bytes.strip_prefix(&MAGIC[..])?.strip_prefix(&[VERSION])?;
        let (token, body) = split_token(body)?;
        match postcard::take_from_bytes::<Head>(body).ok()?.0 {
            Head::Get { first_id } | Head::Put { first_id } => Some((token, first_id)),
        }
    }
}

/// The most bytes postcard takes for a `u64` (a varint of 7 bits a byte).
const MAX_VARINT: usize = 10;

/// The most bytes of a request besides its items: magic, version, token, the variant's
/// tag, `first_id`, `ttl_ms` and the number of items.
const REQUEST_HEAD_MAX: usize = MAGIC.len() + 1 + 16 + 4 * MAX_VARINT;

/// The most bytes of an item of a request besides its key's bytes: the key's length and
/// a [`Buffer`] (its kind's tag, address, length and device).
const REQUEST_ITEM_MAX: usize = 5 * MAX_VARINT;

/// The most bytes of a reply besides its outcomes: magic, version, `first_id` and the
/// number of outcomes.
const REPLY_HEAD_MAX: usize = MAGIC.len() + 1 + 2 * MAX_VARINT;

/// The most bytes of one outcome once [`Reply::encode`] has dropped failures' reasons:
/// the tag and two `u64`s ([`Outcome::Found`], [`Outcome::TooLarge`]).
const REPLY_ITEM_MAX: usize = 1 + 2 * MAX_VARINT;

/// Cuts a batch of items, given by their keys' lengths, into runs of consecutive items
/// whose request and whose reply each fit one notification: the engine refuses a larger
/// one outright. Bounds rather than exact sizes decide, so a run may stop short of the
/// limit. An item whose key alone is past the limit is a run of its own (its request is
/// refused).
pub fn notification_batches(key_lens: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let room = MAX_NOTIF - REQUEST_HEAD_MAX.max(REPLY_HEAD_MAX);
    let mut runs = Vec::new();
    let (mut start, mut end, mut size) = (0, 0, 0);
    for len in key_lens {
        let item = len.saturating_add(REQUEST_ITEM_MAX).max(REPLY_ITEM_MAX);
        if end > start && size + item > room {
            runs.push(start..end);
            (start, size) = (end, 0);
        }
        size = size.saturating_add(item);
        end += 1;
    }
    if end > start {
        runs.push(start..end);
    }
    runs
}

impl Reply {
    /// The reply's bytes, within a notification's limit: where many failed items'
    /// reasons would go past it, each keeps only its first bytes, or none (the code
    /// still says what went wrong).
    pub fn encode(&self) -> Vec<u8> {
        let bytes = encode(&[], self);
        if bytes.len() <= MAX_NOTIF {
            return bytes;
        }
        for keep in [64, 0] {
            let mut shorter = self.clone();
            for o in &mut shorter.outcomes {
                if let Outcome::Failed { error, .. } = o {
                    let mut end = keep.min(error.len());
                    while !error.is_char_boundary(end) {
                        end -= 1;
                    }
                    error.truncate(end);
                }
            }
            let bytes = encode(&[], &shorter);
            if bytes.len() <= MAX_NOTIF || keep == 0 {
                return bytes;
            }
        }
        unreachable!("the loop returns on its last pass")
    }

    pub fn decode(bytes: &[u8]) -> Option<Result<Reply>> {
        Some(body(bytes, "reply")?.and_then(|b| decode(b, bytes.len(), "reply")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: SessionToken = [7; 16];

    fn buf(addr: u64, len: u64) -> Buffer {
        Buffer { kind: MemKind::Dram, addr, len, dev: 0 }
    }

    #[test]
    fn a_reply_of_many_failures_fits_a_notification() {
        let failed = Outcome::Failed { code: FailCode::NoSpace, error: "é".repeat(200) };
        let reply = Reply { first_id: 1, outcomes: vec![failed; 60_000] };
        let bytes = reply.encode();
        assert!(bytes.len() <= MAX_NOTIF, "{}", bytes.len());
        let back = Reply::decode(&bytes).unwrap().unwrap();
        assert_eq!(back.outcomes.len(), 60_000);
        assert!(matches!(&back.outcomes[0], Outcome::Failed { code: FailCode::NoSpace, error } if error.len() <= 64));
        let small =
            Reply { first_id: 2, outcomes: vec![Outcome::Failed { code: FailCode::Invalid, error: "why".into() }] };
        assert_eq!(Reply::decode(&small.encode()).unwrap().unwrap(), small, "a small reply is kept whole");
    }

    #[test]
    fn requests_and_replies_survive_the_wire() {
        let get = Request::Get { first_id: 7, items: vec![(b"a".to_vec(), buf(4096, 10)), (vec![0; 300], buf(1, 2))] };
        let put = Request::Put { first_id: 9, ttl_ms: 300_000, items: vec![(b"k".to_vec(), buf(8192, 1 << 30))] };
        for r in [get, put] {
            assert_eq!(Request::decode(&r.encode(&TOKEN)).unwrap().unwrap(), (TOKEN, r));
        }
        let reply = Reply {
            first_id: 7,
            outcomes: vec![
                Outcome::Found { len: 10, version: 3 },
                Outcome::Missing,
                Outcome::TooLarge { value: 100, buffer: 2 },
                Outcome::Failed { code: FailCode::NoSpace, error: "out of memory".into() },
            ],
        };
        assert_eq!(Reply::decode(&reply.encode()).unwrap().unwrap(), reply);
    }

    #[test]
    fn other_notifications_are_not_mistaken_for_requests() {
        assert!(Request::decode(b"hello").is_none());
        assert!(Request::decode(b"").is_none());
    }

    #[test]
    fn malformed_or_foreign_version_messages_are_refused_by_name() {
        let mut bytes = Request::Get { first_id: 1, items: vec![] }.encode(&TOKEN);
        bytes[MAGIC.len()] = 9;
        let e = Request::decode(&bytes).unwrap().unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        let good = Request::Put { first_id: 1, ttl_ms: 0, items: vec![(b"k".to_vec(), buf(1, 1))] }.encode(&TOKEN);
        let e = Request::decode(&good[..good.len() - 3]).unwrap().unwrap_err();
        assert!(e.to_string().contains("malformed KV request"), "{e}");
        let e = Request::decode(&MAGIC).unwrap().unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let e = Request::decode(&good[..MAGIC.len() + 10]).unwrap().unwrap_err();
        assert!(e.to_string().contains("truncated KV request"), "a token cut short: {e}");
    }

    #[test]
    fn the_head_of_a_request_that_does_not_decode_is_recovered_where_it_can_be() {
        let put = Request::Put { first_id: 300, ttl_ms: 5, items: vec![(b"k".to_vec(), buf(1, 1))] }.encode(&TOKEN);
        let cut = &put[..put.len() - 3];
        assert!(matches!(Request::decode(cut), Some(Err(_))));
        assert_eq!(Request::recover_head(cut), Some((TOKEN, 300)));
        let get = Request::Get { first_id: 7, items: vec![] }.encode(&TOKEN);
        let mut bad = get.clone();
        bad.push(0xff);
        bad.push(0xff);
        assert_eq!(Request::recover_head(&get), Some((TOKEN, 7)));
        assert_eq!(Request::recover_head(&bad), Some((TOKEN, 7)));
        // Another version may lay its fields out otherwise; a cut tag leaves nothing.
        let mut other = get.clone();
        other[MAGIC.len()] = VERSION + 1;
        assert_eq!(Request::recover_head(&other), None);
        assert_eq!(Request::recover_head(&get[..MAGIC.len() + 1]), None);
        assert_eq!(Request::recover_head(&get[..MAGIC.len() + 1 + 16]), None, "a token without an id");
        assert_eq!(Request::recover_head(b"hello"), None);
        assert!(Reply::decode(WELCOME).is_none(), "the welcome is no reply");
    }

    /// Items at their largest: every field a `u64` of ten varint bytes.
    fn widest(key_len: usize) -> (Vec<u8>, Buffer) {
        (vec![b'k'; key_len], Buffer { kind: MemKind::File, addr: u64::MAX, len: u64::MAX, dev: u64::MAX })
    }

    #[test]
    fn each_batch_of_the_widest_items_fits_a_notification_as_request_and_reply() {
        for key_len in [1, 100, MAX_KEY] {
            let n = MAX_NOTIF / key_len + 10;
            let runs = notification_batches(std::iter::repeat(key_len).take(n));
            assert!(runs.len() > 1, "{key_len}: {n} items take more than one request");
            assert_eq!(runs.first().map(|r| r.start), Some(0));
            assert!(runs.windows(2).all(|w| w[0].end == w[1].start), "the runs cover every item in order");
            assert_eq!(runs.last().map(|r| r.end), Some(n));
            let longest = runs.iter().map(ExactSizeIterator::len).max().unwrap();
            let put = Request::Put { first_id: u64::MAX, ttl_ms: u64::MAX, items: vec![widest(key_len); longest] };
            assert!(put.encode(&TOKEN).len() <= MAX_NOTIF, "{key_len}: a request of {longest} items");
            let found = Outcome::Found { len: u64::MAX, version: u64::MAX };
            let reply = Reply { first_id: u64::MAX, outcomes: vec![found; longest] };
            assert!(reply.encode().len() <= MAX_NOTIF, "{key_len}: a reply of {longest} items");
        }
        assert!(notification_batches([]).is_empty());
        assert_eq!(notification_batches([MAX_NOTIF, 1]), vec![0..1, 1..2], "a key past the limit goes alone");
    }

    #[test]
    fn fail_codes_map_to_the_engine_errors() {
        assert!(matches!(FailCode::NoSpace.error("s", "x".into()), Error::NoSpace(_)));
        assert!(matches!(FailCode::Invalid.error("s", "x".into()), Error::InvalidArgument(_)));
        assert!(matches!(FailCode::Refused.error("s", "x".into()), Error::RemoteRejected { peer, .. } if peer == "s"));
        assert!(matches!(FailCode::Protocol.error("s", "x".into()), Error::Protocol(_)));
    }
}
