//! Read-only memory: peers read it, nothing writes it. Two agents in one process over
//! real sockets and real shared mappings, as in `private.rs`.

use std::time::Duration;

use freight_core::{Agent, AgentConfig, Error, MemKind, OpKind, SharedSegment, Status, TransportKind};
use freight_proto::metadata::AgentMetadata;

#[path = "support/buffers.rs"]
mod buffers;
use buffers::{bytes, fill, list};

const T: Option<Duration> = Some(Duration::from_secs(20));
const SIZE: usize = 64 << 10;

/// An owner with a read-only and a writable region, and a peer that knows them.
struct Pair {
    peer: Agent,
    owner: Agent,
    frozen: std::sync::Arc<SharedSegment>,
    open: std::sync::Arc<SharedSegment>,
    src: std::sync::Arc<SharedSegment>,
    dst: std::sync::Arc<SharedSegment>,
}

fn pair(cfg: AgentConfig) -> Pair {
    let peer = Agent::new("peer", cfg.clone()).unwrap();
    let owner = Agent::new("owner", cfg).unwrap();
    let (frozen, open) = (owner.alloc(SIZE).unwrap(), owner.alloc(SIZE).unwrap());
    fill(&frozen, 5);
    owner.register_read_only(MemKind::Dram, frozen.addr(), SIZE as u64, 0).unwrap();
    owner.register(MemKind::Dram, open.addr(), SIZE as u64, 0).unwrap();
    let (src, dst) = (peer.alloc(SIZE).unwrap(), peer.alloc(SIZE).unwrap());
    fill(&src, 9);
    peer.register(MemKind::Dram, src.addr(), SIZE as u64, 0).unwrap();
    peer.register(MemKind::Dram, dst.addr(), SIZE as u64, 0).unwrap();
    peer.add_peer(&owner.metadata()).unwrap();
    Pair { peer, owner, frozen, open, src, dst }
}

fn read_only_memory_is_read_and_never_written(cfg: AgentConfig, expect: TransportKind) {
    let p = pair(cfg);
    let before = bytes(&p.frozen).to_vec();
    let n = SIZE as u64;
    // Read: as any region.
    let req = p.peer.transfer(OpKind::Read, &list(p.dst.addr(), n), "owner", &list(p.frozen.addr(), n), None).unwrap();
    assert_eq!(req.path().transport, expect);
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(bytes(&p.dst), &before[..]);
    // Written: refused by the peer before anything moves.
    let err = p.peer.transfer(OpKind::Write, &list(p.src.addr(), n), "owner", &list(p.frozen.addr(), n), None).err();
    assert!(
        matches!(&err, Some(Error::RemoteRejected { reason, .. }) if reason.contains("read-only")),
        "a WRITE into read-only memory was not refused: {err:?}"
    );
    // The owner's own READ into it: refused too.
    let src = p.peer.metadata();
    p.owner.add_peer(&src).unwrap();
    let err = p.owner.transfer(OpKind::Read, &list(p.frozen.addr(), n), "peer", &list(p.src.addr(), n), None).err();
    assert!(matches!(&err, Some(Error::InvalidArgument(m)) if m.contains("read-only")), "{err:?}");
    // The writable neighbour still takes writes.
    let req = p.peer.transfer(OpKind::Write, &list(p.src.addr(), n), "owner", &list(p.open.addr(), n), None).unwrap();
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(bytes(&p.open), bytes(&p.src));
    assert_eq!(bytes(&p.frozen), &before[..]);
}

#[test]
fn read_only_memory_over_shm() {
    read_only_memory_is_read_and_never_written(AgentConfig::default(), TransportKind::Shm);
}

#[test]
fn read_only_memory_over_tcp() {
    let tcp = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    read_only_memory_is_read_and_never_written(tcp, TransportKind::Tcp);
}

#[test]
fn a_peer_that_forges_writable_metadata_is_refused_by_the_tcp_target() {
    let tcp = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    let p = pair(tcp.clone());
    let before = bytes(&p.frozen).to_vec();
    // A peer rewrites what the owner said of the region. One that knew the region
    // refuses the change...
    let mut md = AgentMetadata::decode(&p.owner.metadata()).unwrap();
    md.regions.iter_mut().for_each(|r| r.read_only = false);
    assert!(matches!(p.peer.add_peer(&md.encode()), Err(Error::Metadata(_))));
    // ...so the forger is an agent that never saw the true metadata.
    let forger = Agent::new("forger", tcp).unwrap();
    let src = forger.alloc(SIZE).unwrap();
    fill(&src, 9);
    forger.register(MemKind::Dram, src.addr(), SIZE as u64, 0).unwrap();
    forger.add_peer(&md.encode()).unwrap();
    let n = SIZE as u64;
    let req = forger.transfer(OpKind::Write, &list(src.addr(), n), "owner", &list(p.frozen.addr(), n), None).unwrap();
    match req.wait(T) {
        Status::Error(Error::RemoteRejected { reason, .. }) => assert!(reason.contains("read-only"), "{reason}"),
        other => panic!("the target took a WRITE into read-only memory: {other:?}"),
    }
    assert_eq!(bytes(&p.frozen), &before[..]);
    // The connection still serves honest work.
    let req = forger.transfer(OpKind::Write, &list(src.addr(), n), "owner", &list(p.open.addr(), n), None).unwrap();
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(bytes(&p.open), bytes(&p.src));
}
