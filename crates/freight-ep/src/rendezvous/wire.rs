//! The rank server's wire format: one JSON object per line, tagged by `op`; blobs travel as
//! base64 strings (a third of the size of JSON byte arrays, and no extra dependency).
//! Text lines keep the protocol debuggable with `nc` and the server free of framing state.

use std::io::{self, BufRead, Read};

use freight_core::{Error, Result};
use serde::{Deserialize, Serialize};

/// Bumped on any incompatible change; a join with another version is rejected.
/// 2: a join carries the server's token (empty where it has none).
pub(crate) const PROTOCOL: u32 = 2;

/// Longest accepted line. Blobs are small (IPC handles, host names); this only stops a
/// broken or hostile peer from making the other side buffer without bound.
pub(crate) const MAX_LINE: usize = 64 << 20;

/// Rank → server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum ToServer {
    /// First message on a connection; `token` is the server's (empty: none).
    Join { proto: u32, rank: usize, world: usize, token: String },
    /// This rank's contribution to collective `seq` (0, 1, 2... per rank, in order).
    Gather {
        seq: u64,
        #[serde(with = "b64")]
        blob: Vec<u8>,
    },
    /// Which ranks collective `seq` still waits for; asked after a local timeout.
    Status { seq: u64 },
    /// Clean departure; the server closes the connection after it.
    Leave,
}

/// Server → rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum ToRank {
    Welcome {
        world: usize,
    },
    /// The join was refused; the server closes the connection after it.
    Rejected {
        reason: String,
    },
    /// Collective `seq` completed: every rank's blob, in rank order.
    Gathered {
        seq: u64,
        #[serde(with = "b64_list")]
        blobs: Vec<Vec<u8>>,
    },
    /// Collective `seq` can never complete (a rank left before contributing to it).
    Failed {
        seq: u64,
        reason: String,
    },
    /// Answer to `Status`: ranks that have not contributed to `seq`, and which of those
    /// have not joined at all.
    Status {
        seq: u64,
        missing: Vec<usize>,
        absent: Vec<usize>,
    },
    /// `rank` died; the group is over.
    Dead {
        rank: usize,
        reason: String,
    },
}

/// One message as a line, newline included.
pub(crate) fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>> {
    let mut line = serde_json::to_vec(msg).map_err(|e| Error::Protocol(format!("cannot encode message: {e}")))?;
    line.push(b'\n');
    Ok(line)
}

pub(crate) fn decode<'a, T: Deserialize<'a>>(line: &'a [u8]) -> Result<T> {
    serde_json::from_slice(line).map_err(|e| {
        let shown = String::from_utf8_lossy(&line[..line.len().min(120)]).into_owned();
        Error::Protocol(format!("malformed rendezvous message ({e}): {shown}"))
    })
}

/// Reads one line into `buf` (newline stripped). `Ok(false)` on a clean end of stream;
/// an end of stream mid-line or a line over [`MAX_LINE`] is an error.
pub(crate) fn read_line(reader: &mut impl BufRead, buf: &mut Vec<u8>) -> io::Result<bool> {
    buf.clear();
    let n = reader.by_ref().take(MAX_LINE as u64 + 1).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(false);
    }
    if buf.last() != Some(&b'\n') {
        if buf.len() > MAX_LINE {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("message longer than {MAX_LINE} bytes")));
        }
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed in the middle of a message"));
    }
    buf.pop();
    Ok(true)
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub(crate) fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub(crate) fn base64_decode(text: &str) -> Result<Vec<u8>, String> {
    let bytes = text.as_bytes();
    if !bytes.chunks_exact(4).remainder().is_empty() {
        return Err(format!("base64 length {} is not a multiple of 4", bytes.len()));
    }
    let value = |c: u8| -> Result<u32, String> {
        match c {
            b'A'..=b'Z' => Ok(u32::from(c - b'A')),
            b'a'..=b'z' => Ok(u32::from(c - b'a') + 26),
            b'0'..=b'9' => Ok(u32::from(c - b'0') + 52),
            b'+' => Ok(62),
            b'/' => Ok(63),
            _ => Err(format!("invalid base64 character {:?}", char::from(c))),
        }
    };
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let quads = bytes.len() / 4;
    for (i, quad) in bytes.chunks(4).enumerate() {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != quads) {
            return Err("misplaced base64 padding".into());
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let decoded = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&decoded[..3 - pad]);
    }
    Ok(out)
}

mod b64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::base64_encode(bytes))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        super::base64_decode(&text).map_err(serde::de::Error::custom)
    }
}

mod b64_list {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(blobs: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(blobs.iter().map(|b| super::base64_encode(b)))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        let texts = Vec::<String>::deserialize(d)?;
        texts.iter().map(|t| super::base64_decode(t).map_err(serde::de::Error::custom)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        let vectors = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in vectors {
            assert_eq!(base64_encode(plain.as_bytes()), encoded);
            assert_eq!(base64_decode(encoded).unwrap(), plain.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(base64_decode(&base64_encode(&all)).unwrap(), all);
    }

    #[test]
    fn bad_base64_is_refused() {
        for bad in ["Zg=", "Z===", "Zg==Zm9v", "Zm9*", "Zm 9"] {
            assert!(base64_decode(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn messages_roundtrip_as_single_lines() {
        let msgs = [
            ToRank::Welcome { world: 4 },
            ToRank::Gathered { seq: 7, blobs: vec![vec![], vec![0, 10, 255], b"\n\"x".to_vec()] },
            ToRank::Dead { rank: 2, reason: "gone\nfor good".into() },
            ToRank::Status { seq: 1, missing: vec![3], absent: vec![] },
        ];
        for msg in msgs {
            let line = encode(&msg).unwrap();
            assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
            assert_eq!(decode::<ToRank>(&line[..line.len() - 1]).unwrap(), msg);
        }
        let join = encode(&ToServer::Join { proto: PROTOCOL, rank: 1, world: 2, token: "t".into() }).unwrap();
        assert_eq!(join, b"{\"op\":\"join\",\"proto\":2,\"rank\":1,\"world\":2,\"token\":\"t\"}\n");
        let gather = encode(&ToServer::Gather { seq: 0, blob: b"hi".to_vec() }).unwrap();
        assert_eq!(gather, b"{\"op\":\"gather\",\"seq\":0,\"blob\":\"aGk=\"}\n");
    }

    #[test]
    fn malformed_messages_are_protocol_errors() {
        for bad in [&b"not json"[..], b"{\"op\":\"nope\"}", b"{\"op\":\"gather\",\"seq\":0,\"blob\":\"!!!!\"}"] {
            assert!(matches!(decode::<ToServer>(bad), Err(Error::Protocol(_))));
        }
    }

    #[test]
    fn lines_are_split_and_bounded() {
        let mut input = io::Cursor::new(b"one\ntwo\nthr".to_vec());
        let mut buf = Vec::new();
        assert!(read_line(&mut input, &mut buf).unwrap());
        assert_eq!(buf, b"one");
        assert!(read_line(&mut input, &mut buf).unwrap());
        assert_eq!(buf, b"two");
        assert_eq!(read_line(&mut input, &mut buf).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(!read_line(&mut input, &mut buf).unwrap());
    }
}
