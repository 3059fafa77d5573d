//! Writes the decoder corpus under tests/corpus (run: cargo run -p freight-proto --example gen_corpus).

use std::fs;
use std::path::Path;

use freight_proto::frame::{self, Frame, Role, Seg};
use freight_proto::metadata::{AgentMetadata, HostIdentity};
use freight_proto::region::{GpuLocation, MemKind, RegionInfo, SharedLocation};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let md = AgentMetadata {
        name: "decode".into(),
        agent_id: 7,
        secret: [1; 16],
        host: HostIdentity { hostname: "h".into(), boot_id: "b".into(), pid_namespace: 1, pid: 2 },
        addresses: vec!["127.0.0.1:4000".into(), "[::1]:4000".into()],
        transports: vec!["shm".into(), "tcp".into()],
        regions: vec![
            RegionInfo {
                key: 1,
                kind: MemKind::Dram,
                addr: 4096,
                len: 4096,
                dev: 0,
                shared: None,
                gpu: None,
                read_only: false,
            },
            RegionInfo {
                key: 2,
                kind: MemKind::Dram,
                addr: 1 << 20,
                len: 8192,
                dev: 0,
                shared: Some(SharedLocation { segment: 1, fd: 3, segment_len: 8192, offset: 0 }),
                gpu: None,
                read_only: false,
            },
            RegionInfo {
                key: 3,
                kind: MemKind::Vram,
                addr: 1 << 40,
                len: 1 << 20,
                dev: 0,
                shared: None,
                gpu: Some(GpuLocation {
                    bus_id: "0000:1b:00.0".into(),
                    alloc_base: 1 << 40,
                    alloc_len: 2 << 20,
                    handle: vec![9; 64],
                }),
                read_only: false,
            },
        ],
    };
    let good = md.encode();
    let m = root.join("metadata");
    fs::create_dir_all(&m).unwrap();
    fs::write(m.join("ok-host-and-gpu-regions"), &good).unwrap();
    fs::write(m.join("empty"), b"").unwrap();
    fs::write(m.join("magic-only"), b"FRMD").unwrap();
    fs::write(m.join("truncated-half"), &good[..good.len() / 2]).unwrap();
    fs::write(m.join("truncated-last-byte"), &good[..good.len() - 1]).unwrap();
    let mut v = good.clone();
    v[4] = (freight_proto::metadata::VERSION + 1) as u8;
    fs::write(m.join("future-version"), &v).unwrap();
    let mut v = good.clone();
    v.extend_from_slice(b"junk");
    fs::write(m.join("trailing-junk"), &v).unwrap();
    let mut v = good[..6].to_vec();
    v.extend_from_slice(&[0xff; 32]);
    fs::write(m.join("huge-varint-lengths"), &v).unwrap();
    let mut bad = md.clone();
    bad.regions[1].key = 1;
    fs::write(m.join("duplicate-keys"), bad.encode()).unwrap();
    let mut bad = md.clone();
    bad.regions[0].len = u64::MAX;
    fs::write(m.join("wrapping-region"), bad.encode()).unwrap();
    let mut bad = md.clone();
    bad.regions[1].shared = Some(SharedLocation { segment: 1, fd: 3, segment_len: 100, offset: 0 });
    fs::write(m.join("shared-past-segment"), bad.encode()).unwrap();
    let mut bad = md.clone();
    bad.regions[2].gpu.as_mut().unwrap().handle.truncate(10);
    fs::write(m.join("gpu-handle-too-short"), bad.encode()).unwrap();
    let mut bad = md.clone();
    bad.regions[2].len = 4 << 20;
    fs::write(m.join("gpu-region-past-its-allocation"), bad.encode()).unwrap();
    let mut bad = md.clone();
    bad.addresses = vec!["localhost".into()];
    fs::write(m.join("address-without-port"), bad.encode()).unwrap();
    let mut bad = md;
    bad.name = "\u{7}bell".into();
    fs::write(m.join("control-chars-in-name"), bad.encode()).unwrap();

    let w = root.join("frame");
    fs::create_dir_all(&w).unwrap();
    let hello = frame::encode(&Frame::Hello {
        version: 1,
        role: Role::Data { index: 3 },
        from_name: "a".into(),
        from_id: 1,
        target_id: 2,
        secret: vec![9; 16],
        token: Vec::new(),
    });
    fs::write(w.join("ok-hello"), &hello).unwrap();
    fs::write(
        w.join("ok-write-header"),
        frame::encode(&Frame::Write { tag: 1, segs: vec![Seg { region: 1, addr: 4096, len: 64 }], notif: None }),
    )
    .unwrap();
    fs::write(w.join("ok-notify"), frame::encode(&Frame::Notify { msg: b"layer 3 done".to_vec() })).unwrap();
    fs::write(w.join("header-length-4gib"), [0xff, 0xff, 0xff, 0xff, 0, 0]).unwrap();
    fs::write(w.join("cut-inside-header"), &hello[..hello.len() - 2]).unwrap();
    fs::write(w.join("unknown-variant"), [2, 0, 0, 0, 0x7f, 0]).unwrap();
    let mut v = hello.clone();
    v[0] += 1;
    v.push(0);
    fs::write(w.join("trailing-byte-in-header"), &v).unwrap();
    fs::write(
        w.join("payload-over-limit"),
        frame::encode(&Frame::Write {
            tag: 1,
            segs: vec![Seg { region: 1, addr: 0, len: u64::MAX }, Seg { region: 1, addr: 0, len: 2 }],
            notif: None,
        }),
    )
    .unwrap();
    fs::write(
        w.join("too-many-segments"),
        frame::encode(&Frame::Read { tag: 1, segs: vec![Seg { region: 1, addr: 0, len: 1 }; frame::MAX_SEGS + 1] }),
    )
    .unwrap();
    println!("corpus written to {}", root.display());
}
