//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-*`: one
//! honest message of each kind, as the fuzzer's starting point (it finds the rest).
//!
//!     cargo run -p freight-fuzz --example seeds

use std::fs;
use std::path::{Path, PathBuf};

use freight_kv::wire::{Buffer, FailCode, Outcome, Reply, Request};
use freight_proto::frame::{self, Frame, Role, Seg};
use freight_proto::metadata::{AgentMetadata, HostIdentity};
use freight_proto::notif_ring::{Producer, HEADER};
use freight_proto::region::MemKind;
use freight_stream::proto::{Msg, WireSlot};
use freight_stream::BufferInfo;

fn corpus(target: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn seed(target: &str, name: &str, bytes: &[u8]) {
    fs::write(corpus(target).join(format!("seed-{name}")), bytes).unwrap();
}

fn main() {
    let host = HostIdentity { hostname: "h".into(), boot_id: "b".into(), pid_namespace: 4026531836, pid: 77 };
    let seg = Seg { region: 3, addr: 4096, len: 64 };
    let frames = [
        (
            "hello",
            Frame::Hello {
                version: frame::PROTOCOL_VERSION,
                role: Role::Data { index: 2 },
                from_name: "prefill-0".into(),
                from_id: 9,
                target_id: 11,
                secret: vec![1; 16],
                token: b"token".to_vec(),
            },
        ),
        ("welcome", Frame::Welcome { agent_id: 11 }),
        ("refused", Frame::Refused { reason: "wrong secret".into() }),
        ("write", Frame::Write { tag: 5, segs: vec![seg, seg], notif: Some(b"layer 3".to_vec()) }),
        ("write-ack", Frame::WriteAck { tag: 5, error: Some("out of bounds".into()) }),
        ("read", Frame::Read { tag: 6, segs: vec![seg] }),
        ("read-data", Frame::ReadData { tag: 6, error: None }),
        ("notify", Frame::Notify { msg: b"done".to_vec() }),
        ("revoke", Frame::Revoke { region: 3 }),
        ("metadata", Frame::Metadata { bytes: b"FRMD\x03\x00".to_vec() }),
        ("outbox", Frame::Outbox { host, fd: 7, len: 1 << 20 }),
        ("outbox-reply", Frame::OutboxReply { error: None }),
        ("wake", Frame::Wake),
        ("fabric-keys", Frame::FabricKeys { regions: vec![1, 2, 3] }),
        ("fabric-keys-reply", Frame::FabricKeysReply { keys: vec![Some(vec![7, 8]), None], error: None }),
        ("fabric-land", Frame::FabricLand { token: 1, dock: 2, seg }),
        ("live-regions", Frame::LiveRegions { regions: vec![1, 3] }),
    ];
    let mut stream = Vec::new();
    for (name, f) in &frames {
        let bytes = frame::encode(f);
        seed("frame", name, &bytes[4..]);
        seed("frame", &format!("{name}-framed"), &bytes);
        stream.extend_from_slice(&bytes);
    }
    seed("frame", "stream-of-every-kind", &stream);

    // freight-core's own decoder corpus holds metadata of every kind of region; it is
    // the seed here too.
    let sample =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../freight-core/tests/corpus/metadata/ok-host-and-gpu-regions");
    let md = AgentMetadata::decode(&fs::read(&sample).unwrap()).unwrap();
    seed("metadata", "three-regions", &md.encode());
    seed("metadata", "no-regions", &AgentMetadata { regions: vec![], ..md.clone() }.encode());

    let token = [7u8; 16];
    let buffer = Buffer { kind: MemKind::Dram, addr: 1 << 20, len: 4096, dev: 0 };
    let get = Request::Get { first_id: 1, items: vec![(b"layer-0".to_vec(), buffer), (b"k".to_vec(), buffer)] };
    let put = Request::Put { first_id: 3, ttl_ms: 300_000, items: vec![(b"layer-1".to_vec(), buffer)] };
    seed("kv_request", "get", &get.encode(&token));
    seed("kv_request", "put", &put.encode(&token));
    let reply = Reply {
        first_id: 1,
        outcomes: vec![
            Outcome::Found { len: 4096, version: 9 },
            Outcome::Missing,
            Outcome::Stored { version: 10 },
            Outcome::TooLarge { value: 1 << 20, buffer: 4096 },
            Outcome::Failed { code: FailCode::NoSpace, error: "the pool is full".into() },
        ],
    };
    seed("kv_reply", "every-outcome", &reply.encode());

    let lines: [&[u8]; 8] = [
        br#"{"op":"join","proto":2,"rank":0,"world":2,"token":"t"}"#,
        br#"{"op":"gather","seq":3,"blob":"aGFuZGxl"}"#,
        br#"{"op":"status","seq":3}"#,
        br#"{"op":"leave"}"#,
        br#"{"op":"welcome","world":2}"#,
        br#"{"op":"gathered","seq":3,"blobs":["aGFuZGxl","","YQ=="]}"#,
        br#"{"op":"status","seq":3,"missing":[1],"absent":[]}"#,
        br#"{"op":"dead","rank":1,"reason":"connection closed"}"#,
    ];
    for (i, line) in lines.iter().enumerate() {
        seed("rendezvous", &format!("line-{i}"), line);
    }
    seed("rendezvous", "stream", &lines.join(&b'\n').iter().copied().chain(*b"\n").collect::<Vec<u8>>());

    // A ring of the smallest capacity with a few records in it, as a producer wrote them:
    // the first byte says "header as laid out, capacity 1024".
    let mut memory = vec![0u64; (HEADER + 1024) / 8];
    // SAFETY: the memory outlives the producer, which is dropped at the end of the block.
    unsafe {
        let mut p = Producer::init(memory.as_mut_ptr().cast(), HEADER + 1024).unwrap();
        for msg in [&b"one"[..], &[5u8; 300], b"", &[6u8; 700]] {
            let mut sent = 0;
            p.write(msg, &mut sent);
        }
    }
    let bytes: Vec<u8> = memory.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut ring = vec![1u8];
    ring.extend_from_slice(&bytes);
    seed("outbox", "four-records", &ring);
    // ...and a patch after it: the producer's position moved on.
    ring.extend_from_slice(&[0, 0, 8]);
    ring.extend_from_slice(&2000u64.to_le_bytes());
    seed("outbox", "four-records-then-a-patch", &ring);

    let info = BufferInfo { kind: MemKind::Vram, addr: 1 << 40, len: 4 << 30, dev: 1 };
    let msgs = [
        ("open", Msg::Open { pipe: 7, addresses: vec!["127.0.0.1:9".into()] }),
        ("accept", Msg::Accept { pipe: 7, buffer: info, credit_batch: 1 << 30 }),
        ("data", Msg::Data { pipe: 7, slot: WireSlot { seq: 3, start: 4096, len: 256 }, len: 10, tag: b"k".to_vec() }),
        ("credit", Msg::Credit { pipe: 7, upto: 1 << 20 }),
        ("close", Msg::Close { pipe: 7, messages: 12 }),
        ("abort", Msg::Abort { pipe: 7, reason: "gone".into() }),
    ];
    for (name, m) in &msgs {
        seed("pipe", name, &m.encode());
    }
    println!("seeds written under fuzz/corpus/");
}
