//! The fabric transport for real, through Debian's libfabric with its tcp and shm
//! providers (no RDMA hardware needed). Skipped, with the reason, where libfabric is not
//! installed.

use std::time::Duration;

use freight_core::transport::fabric;
use freight_core::{Agent, AgentConfig, Desc, DescList, Error, FabricConfig, MemKind, OpKind, Status, TransportKind};
use rand::{Rng, SeedableRng};

const T: Option<Duration> = Some(Duration::from_secs(20));

fn libfabric() -> bool {
    match fabric::available() {
        Ok(_) => true,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            false
        }
    }
}

fn config(provider: &str, domains: &[&str], chunk_size: u64) -> AgentConfig {
    AgentConfig {
        require: Some(TransportKind::Fabric),
        fabric: FabricConfig {
            provider: Some(provider.into()),
            domains: domains.iter().map(|d| d.to_string()).collect(),
            chunk_size,
            ..FabricConfig::default()
        },
        ..Default::default()
    }
}

/// `cfg` with the peer's host memory staged through its docks, as its GPU memory is.
fn through_docks(mut cfg: AgentConfig) -> AgentConfig {
    cfg.fabric.stage_remote_host = true;
    cfg
}

/// Host memory that is not in a shared segment: only a network transport reaches it.
struct Buffer(Vec<u8>);

impl Buffer {
    fn new(len: usize, seed: u64) -> Buffer {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Buffer((0..len).map(|_| rng.random()).collect())
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

fn list(descs: &[(u64, u64)]) -> DescList {
    DescList::from_descs(MemKind::Dram, descs.iter().map(|&(addr, len)| Desc { addr, len, dev: 0 })).unwrap()
}

/// Random blocks of 1 byte to 6 MiB at random offsets, in random order: the same
/// blocks on both sides, with the target side shuffled.
fn scattered(rng: &mut impl Rng, local: u64, remote: u64, room: u64) -> (DescList, DescList, Vec<(u64, u64, u64)>) {
    let mut blocks = Vec::new();
    let mut at = 0u64;
    while at < room {
        let len = match rng.random_range(0..4) {
            0 => rng.random_range(1..64),
            1 => rng.random_range(1..64 << 10),
            2 => rng.random_range(1..1 << 20),
            _ => rng.random_range(1..6 << 20),
        }
        .min(room - at);
        blocks.push((at, len));
        at += len + rng.random_range(0..4096);
    }
    let mut targets: Vec<(u64, u64)> = blocks.clone();
    // Pair each local block with a target block of the same length elsewhere.
    use rand::seq::SliceRandom;
    targets.shuffle(rng);
    let mut cursor = 0u64;
    let plan: Vec<(u64, u64, u64)> = targets
        .iter()
        .map(|&(src, len)| {
            let dst = cursor;
            cursor += len + 64;
            (src, dst, len)
        })
        .filter(|&(_, dst, len)| dst + len <= room + (room / 2))
        .collect();
    let l = list(&plan.iter().map(|&(s, _, n)| (local + s, n)).collect::<Vec<_>>());
    let r = list(&plan.iter().map(|&(_, d, n)| (remote + d, n)).collect::<Vec<_>>());
    (l, r, plan)
}

/// Writes scattered blocks to the target (with a notification) and reads them back,
/// checking every byte, with `provider` over `domains` (`docked`: through the target's
/// landing buffers).
fn scattered_roundtrip(provider: &str, domains: &[&str], chunk_size: u64, docked: bool) {
    let room = 24u64 << 20;
    let cfg = config(provider, domains, chunk_size);
    let a = Agent::new("initiator", if docked { through_docks(cfg) } else { cfg }).unwrap();
    let b = Agent::new("target", config(provider, domains, chunk_size)).unwrap();
    let src = Buffer::new(room as usize, 7);
    let mut dst = Buffer::new((room + room / 2) as usize, 8);
    let mut back = Buffer::new(room as usize, 9);
    a.register(MemKind::Dram, src.addr(), room, 0).unwrap();
    a.register(MemKind::Dram, back.addr(), room, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), room + room / 2, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let path = a.path_to("target").unwrap();
    assert_eq!(path.transport, TransportKind::Fabric);
    assert!(path.reason.contains("required by configuration") && path.reason.contains(provider), "{}", path.reason);

    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for round in 0..3u8 {
        dst.0.fill(0xA5);
        back.0.fill(0x5A);
        let (l, r, plan) = scattered(&mut rng, src.addr(), dst.addr(), room);
        let w = a.transfer(OpKind::Write, &l, "target", &r, Some(vec![round])).unwrap();
        assert_eq!(w.wait(T), Status::Done, "write, round {round}");
        let n = b.wait_notifs(Duration::from_secs(5));
        assert_eq!(n.iter().map(|n| n.msg.clone()).collect::<Vec<_>>(), vec![vec![round]]);
        for &(s, d, len) in &plan {
            let (s, d, len) = (s as usize, d as usize, len as usize);
            assert!(dst.0[d..d + len] == src.0[s..s + len], "block at {s} -> {d} (+{len}) differs");
        }
        let back_list = list(&plan.iter().map(|&(s, _, n)| (back.addr() + s, n)).collect::<Vec<_>>());
        let rd = a.transfer(OpKind::Read, &back_list, "target", &r, None).unwrap();
        assert_eq!(rd.wait(T), Status::Done, "read, round {round}");
        for &(s, _, len) in &plan {
            let (s, len) = (s as usize, len as usize);
            assert!(back.0[s..s + len] == src.0[s..s + len], "read back block at {s} (+{len}) differs");
        }
    }
    // The exchange, and the relay once where the target stages: reused every round.
    let stats = a.connection_stats("target").unwrap();
    let fabric_connections = if docked { 2 } else { 1 };
    assert_eq!((stats.fabric_connections, stats.tcp_connections), (fabric_connections, 0), "{stats:?}");
}

#[test]
fn the_tcp_provider_moves_scattered_blocks_both_ways() {
    if libfabric() {
        scattered_roundtrip("tcp", &["lo"], 4 << 20, false);
    }
}

#[test]
fn two_rails_share_a_transfer() {
    if libfabric() {
        scattered_roundtrip("tcp", &["lo", "lo"], 256 << 10, false);
    }
}

#[test]
fn the_shm_provider_moves_scattered_blocks_both_ways() {
    if libfabric() {
        scattered_roundtrip("shm", &[], 4 << 20, false);
    }
}

/// Memory the provider cannot reach one-sided goes through the peer's landing buffers
/// (here host memory, forced there; GPU memory takes this path in the GPU suite): more
/// chunks than docks, both ways, every byte checked.
#[test]
fn the_peer_stages_its_memory_through_landing_buffers() {
    if libfabric() {
        scattered_roundtrip("tcp", &["lo"], 1 << 20, true);
    }
}

#[test]
fn two_rails_share_staged_transfers() {
    if libfabric() {
        scattered_roundtrip("tcp", &["lo", "lo"], 256 << 10, true);
    }
}

#[test]
fn a_software_provider_is_not_chosen_unasked() {
    if !libfabric() {
        return;
    }
    let cfg = AgentConfig { require: None, ..config("tcp", &["lo"], 1 << 20) };
    let a = Agent::new("initiator", cfg.clone()).unwrap();
    let b = Agent::new("target", cfg).unwrap();
    let dst = Buffer::new(4096, 1);
    b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let path = a.path_to("target").unwrap();
    assert_eq!(path.transport, TransportKind::Tcp, "{}", path.reason);
    assert!(
        path.reason.contains("fabric: provider tcp;ofi_rxm") && path.reason.contains("no RDMA hardware"),
        "{}",
        path.reason
    );
}

#[test]
fn bad_set_ups_are_refused_with_the_reason() {
    if !libfabric() {
        return;
    }
    let e = Agent::new("x", config("no-such-provider", &[], 1 << 20)).err().unwrap();
    assert!(matches!(&e, Error::TransportUnavailable(m) if m.contains("no-such-provider")), "{e}");
    let e = Agent::new("x", config("tcp", &["no-such-nic"], 1 << 20)).err().unwrap();
    assert!(e.to_string().contains("no-such-nic") && e.to_string().contains("lo"), "{e}");
    let e = Agent::new("x", config("tcp", &["lo"], 0)).err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A peer without fabric: required fabric cannot reach it.
    let a = Agent::new("initiator", config("tcp", &["lo"], 1 << 20)).unwrap();
    let b = Agent::new("target", AgentConfig::default()).unwrap();
    let dst = Buffer::new(4096, 1);
    b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let e = a.path_to("target").unwrap_err().to_string();
    assert!(e.contains("required transport fabric") && e.contains("the peer does not serve it"), "{e}");
}

/// An initiator and a target over the tcp provider, and a `len`-byte WRITE between them
/// that completed once (`docked`: through the target's landing buffers): (initiator,
/// target, the target region's key, request, buffers).
fn written_once(len: u64, docked: bool) -> (Agent, Agent, u64, freight_core::Request, [Buffer; 2]) {
    let cfg = config("tcp", &["lo"], 1 << 20);
    let a = Agent::new("initiator", if docked { through_docks(cfg) } else { cfg }).unwrap();
    let b = Agent::new("target", config("tcp", &["lo"], 1 << 20)).unwrap();
    let (src, dst) = (Buffer::new(len as usize, 1), Buffer::new(len as usize, 2));
    a.register(MemKind::Dram, src.addr(), len, 0).unwrap();
    let key = b.register(MemKind::Dram, dst.addr(), len, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let l = a.prepare_local(&list(&[(src.addr(), len)])).unwrap();
    let r = a.prepare_remote("target", &list(&[(dst.addr(), len)])).unwrap();
    let req = a.make_request(OpKind::Write, &l, None, &r, None, None).unwrap();
    req.post().unwrap();
    assert_eq!(req.wait(T), Status::Done);
    (a, b, key, req, [src, dst])
}

/// Memory the target deregistered is out of reach at once: its registrations are gone,
/// so even an initiator that has not heard of it yet gets an error, not the bytes. A
/// staged write is refused by the target's registry the same way.
#[test]
fn deregistered_memory_is_refused_by_the_provider() {
    if !libfabric() {
        return;
    }
    for docked in [false, true] {
        let (_a, b, key, req, _buffers) = written_once(1 << 16, docked);
        b.deregister(key).unwrap();
        req.post().unwrap();
        match req.wait(T) {
            // Staged, the target's registry refuses the copy (or the initiator heard of
            // the revocation first); direct, the provider refuses the access.
            Status::Error(Error::RemoteRejected { reason, .. }) if docked => assert!(
                reason.contains(&format!("unknown region key {key}")) || reason.contains("deregistered"),
                "{reason}"
            ),
            Status::Error(Error::RemoteRejected { reason, .. }) => assert!(reason.starts_with("fabric:"), "{reason}"),
            other => panic!("expected a rejection (docked: {docked}), got {other:?}"),
        }
    }
}

/// Read-only memory is read over fabric, and a WRITE into it is refused even from a
/// peer that forged metadata saying otherwise: directly by the provider (the region's
/// registration grants no remote writes), staged by the target's registry.
#[test]
fn read_only_memory_is_refused_to_writers_forged_or_not() {
    if !libfabric() {
        return;
    }
    for docked in [false, true] {
        let initiator = |name: &str| {
            let cfg = config("tcp", &["lo"], 1 << 20);
            Agent::new(name, if docked { through_docks(cfg) } else { cfg }).unwrap()
        };
        let a = initiator("initiator");
        let b = Agent::new("target", config("tcp", &["lo"], 1 << 20)).unwrap();
        let len = 1u64 << 16;
        let (src, frozen, back) =
            (Buffer::new(len as usize, 1), Buffer::new(len as usize, 2), Buffer::new(len as usize, 3));
        a.register(MemKind::Dram, src.addr(), len, 0).unwrap();
        a.register(MemKind::Dram, back.addr(), len, 0).unwrap();
        b.register_read_only(MemKind::Dram, frozen.addr(), len, 0).unwrap();
        a.add_peer(&b.metadata()).unwrap();
        let read =
            a.transfer(OpKind::Read, &list(&[(back.addr(), len)]), "target", &list(&[(frozen.addr(), len)]), None);
        assert_eq!(read.unwrap().wait(T), Status::Done);
        assert_eq!(back.0, frozen.0);
        let honest =
            a.transfer(OpKind::Write, &list(&[(src.addr(), len)]), "target", &list(&[(frozen.addr(), len)]), None);
        assert!(matches!(honest, Err(Error::RemoteRejected { .. })), "docked {docked}: {:?}", honest.err());
        let mut md = freight_proto::metadata::AgentMetadata::decode(&b.metadata()).unwrap();
        md.regions.iter_mut().for_each(|r| r.read_only = false);
        // An agent that knows the region refuses metadata that changes it; one that
        // learns the forged metadata first is stopped by the target.
        assert!(matches!(a.add_peer(&md.encode()), Err(Error::Metadata(_))), "docked {docked}");
        let forger = initiator("forger");
        forger.register(MemKind::Dram, src.addr(), len, 0).unwrap();
        forger.add_peer(&md.encode()).unwrap();
        let forged =
            forger.transfer(OpKind::Write, &list(&[(src.addr(), len)]), "target", &list(&[(frozen.addr(), len)]), None);
        match forged.unwrap().wait(T) {
            Status::Error(Error::RemoteRejected { .. }) => {}
            other => panic!("a forged WRITE into read-only memory (docked: {docked}) gave {other:?}"),
        }
        assert_eq!(back.0, frozen.0, "the read-only memory changed");
    }
}

/// A target that went away fails transfers to it; nothing hangs.
#[test]
fn a_dead_peer_fails_transfers() {
    if !libfabric() {
        return;
    }
    for docked in [false, true] {
        let (_a, b, _key, req, _buffers) = written_once(1 << 20, docked);
        drop(b);
        std::thread::sleep(Duration::from_millis(200));
        match req.post().map(|_| req.wait(T)) {
            Err(e) | Ok(Status::Error(e)) => {
                assert!(matches!(e, Error::PeerDisconnected { .. } | Error::RemoteRejected { .. }), "{e}")
            }
            Ok(other) => panic!("a write to a closed agent ended {other:?} (docked: {docked})"),
        }
    }
}

/// A target that goes away while a request's chunks are on the wire and in its docks:
/// the request fails, within the timeout, whatever step each chunk was at.
#[test]
fn a_peer_dying_mid_transfer_fails_it_without_hanging() {
    if !libfabric() {
        return;
    }
    for docked in [false, true] {
        let (a, b, _key, req, buffers) = written_once(64 << 20, docked);
        req.post().unwrap();
        drop(b);
        let started = std::time::Instant::now();
        match req.wait(T) {
            // It may also have been quick enough to finish first.
            Status::Done => eprintln!("finished before the target went (docked: {docked})"),
            Status::Error(e) => {
                assert!(matches!(e, Error::PeerDisconnected { .. } | Error::RemoteRejected { .. }), "{e}")
            }
            other => panic!("a transfer to a dying agent ended {other:?} (docked: {docked})"),
        }
        assert!(started.elapsed() < Duration::from_secs(15), "no hang (docked: {docked})");
        // The initiator is intact: its memory can be deregistered and it closes.
        drop(req);
        drop(a);
        drop(buffers);
    }
}

/// A private region works as the local side of its owner's transfers over fabric (its
/// registration grants local access only), and no peer reaches it: a peer that forged
/// metadata naming it gets no key for it.
#[test]
fn private_memory_is_a_local_side_only() {
    if !libfabric() {
        return;
    }
    let a = Agent::new("initiator", config("tcp", &["lo"], 1 << 20)).unwrap();
    let b = Agent::new("target", config("tcp", &["lo"], 1 << 20)).unwrap();
    let len = 1u64 << 16;
    let (pool, open, src) = (Buffer::new(len as usize, 1), Buffer::new(len as usize, 2), Buffer::new(len as usize, 3));
    let pool_key = a.register_private(MemKind::Dram, pool.addr(), len, 0).unwrap();
    b.register(MemKind::Dram, open.addr(), len, 0).unwrap();
    a.register(MemKind::Dram, src.addr(), len, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let write = a.transfer(OpKind::Write, &list(&[(pool.addr(), len)]), "target", &list(&[(open.addr(), len)]), None);
    assert_eq!(write.unwrap().wait(T), Status::Done);
    assert_eq!(open.0, pool.0, "the private pool's bytes did not arrive");
    // The peer's view, forged to list the private pool as if it were public.
    let mut md = freight_proto::metadata::AgentMetadata::decode(&a.metadata()).unwrap();
    let mut forged = md.regions[0].clone();
    forged.key = pool_key;
    forged.addr = pool.addr();
    forged.len = len;
    forged.shared = None;
    md.regions.push(forged);
    let b_src = Buffer::new(len as usize, 4);
    b.register(MemKind::Dram, b_src.addr(), len, 0).unwrap();
    b.add_peer(&md.encode()).unwrap();
    let before = pool.0.clone();
    let attempt =
        b.transfer(OpKind::Write, &list(&[(b_src.addr(), len)]), "initiator", &list(&[(pool.addr(), len)]), None);
    match attempt.map(|r| r.wait(T)) {
        Err(Error::RemoteRejected { .. }) | Ok(Status::Error(Error::RemoteRejected { .. })) => {}
        other => panic!("a write into a private region gave {other:?}"),
    }
    assert_eq!(pool.0, before, "the private pool changed");
}

/// A small request to one peer is not held up behind a long one to another: the rail's
/// thread serves destinations in turn, so the small one's operation goes out while the
/// long one's are still waiting for room at the provider. Judged by order, not by
/// time (a loaded machine slows both alike): the small one is done while the long one
/// is still under way, which a queue in arrival order would never allow.
#[test]
fn a_small_request_overtakes_a_long_one_to_another_peer() {
    if !libfabric() {
        return;
    }
    // Small operations, so that the long request has far more than the provider's queue
    // takes at once.
    let chunk = 16u64 << 10;
    let a = Agent::new("initiator", config("tcp", &["lo"], chunk)).unwrap();
    let far = Agent::new("far", config("tcp", &["lo"], chunk)).unwrap();
    let near = Agent::new("near", config("tcp", &["lo"], chunk)).unwrap();
    let long = 128u64 << 20;
    let (src, sink) = (Buffer::new(long as usize, 1), Buffer::new(long as usize, 2));
    let (small_src, small_sink) = (Buffer::new(4096, 3), Buffer::new(4096, 4));
    a.register(MemKind::Dram, src.addr(), long, 0).unwrap();
    a.register(MemKind::Dram, small_src.addr(), 4096, 0).unwrap();
    far.register(MemKind::Dram, sink.addr(), long, 0).unwrap();
    near.register(MemKind::Dram, small_sink.addr(), 4096, 0).unwrap();
    a.add_peer(&far.metadata()).unwrap();
    a.add_peer(&near.metadata()).unwrap();
    let small = a
        .transfer(OpKind::Write, &list(&[(small_src.addr(), 4096)]), "near", &list(&[(small_sink.addr(), 4096)]), None)
        .unwrap();
    // Both connections open before the clock starts.
    assert_eq!(small.wait(T), Status::Done);
    let started = std::time::Instant::now();
    let big =
        a.transfer(OpKind::Write, &list(&[(src.addr(), long)]), "far", &list(&[(sink.addr(), long)]), None).unwrap();
    small.post().unwrap();
    assert_eq!(small.wait(T), Status::Done);
    let small_took = started.elapsed();
    let long_when_small_done = big.status();
    assert_eq!(big.wait(T), Status::Done);
    let big_took = started.elapsed();
    eprintln!("small {small_took:?}, long {big_took:?}");
    assert!(sink.0 == src.0 && small_sink.0 == small_src.0);
    assert_eq!(
        long_when_small_done,
        Status::Pending,
        "the small request ({small_took:?}) finished only after the long one ({big_took:?})"
    );
}
