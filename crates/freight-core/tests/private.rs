//! Private memory: registered for the owner's own transfers, invisible and untouchable
//! for peers. Two agents in one process, talking over real sockets and real shared
//! mappings (as in `transfer.rs`).

use std::time::Duration;

use freight_core::{Agent, AgentConfig, Error, MemKind, OpKind, SharedSegment, Status, TransportKind};
use freight_proto::metadata::AgentMetadata;
use freight_proto::region::RegionInfo;

#[path = "support/buffers.rs"]
mod buffers;
use buffers::{bytes, fill, list, set};

const T: Option<Duration> = Some(Duration::from_secs(20));

fn tcp() -> AgentConfig {
    AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() }
}

fn keys(md: &[u8]) -> Vec<u64> {
    AgentMetadata::decode(md).unwrap().regions.iter().map(|r| r.key).collect()
}

/// The reason a tcp target gave for refusing a request.
fn refusal(status: Status) -> String {
    match status {
        Status::Error(Error::RemoteRejected { peer, reason }) => {
            assert_eq!(peer, "server");
            reason
        }
        other => panic!("expected the target to refuse, got {other:?}"),
    }
}

#[test]
fn private_regions_are_not_in_metadata() {
    let client = Agent::new("client", AgentConfig::default()).unwrap();
    let server = Agent::new("server", AgentConfig::default()).unwrap();
    let public = server.alloc(4096).unwrap();
    let pool = server.alloc(1 << 20).unwrap();
    let pk = server.register(MemKind::Dram, public.addr(), 4096, 0).unwrap();
    let before = server.metadata();
    let k = server.register_private(MemKind::Dram, pool.addr(), 1 << 20, 0).unwrap();
    assert_eq!(server.registered_regions(), 2);
    // The metadata does not change at all: no key, address or shared segment of the pool.
    assert_eq!(server.metadata(), before);
    let md = AgentMetadata::decode(&server.metadata()).unwrap();
    assert_eq!(keys(&server.metadata()), vec![pk]);
    assert!(md.regions.iter().all(|r| r.key != k && r.addr != pool.addr()));
    assert!(md.regions.iter().all(|r| r.shared.is_some_and(|s| s.segment_len == 4096)));

    // A peer cannot even name the pool.
    client.add_peer(&server.metadata()).unwrap();
    let e = client.prepare_remote("server", &list(pool.addr(), 64)).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    let src = client.alloc(4096).unwrap();
    client.register(MemKind::Dram, src.addr(), 4096, 0).unwrap();
    let e = client
        .transfer(OpKind::Write, &list(src.addr(), 64), "server", &list(pool.addr(), 64), None)
        .err()
        .expect("the pool is not the client's to write");
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    // What it may target still works.
    let req =
        client.transfer(OpKind::Write, &list(src.addr(), 4096), "server", &list(public.addr(), 4096), None).unwrap();
    assert_eq!(req.wait(T), Status::Done);
}

#[test]
fn a_forged_private_key_is_refused_like_an_unknown_key_over_tcp() {
    let client = Agent::new("client", tcp()).unwrap();
    let server = Agent::new("server", tcp()).unwrap();
    let size = 64 << 10;
    let pool = server.alloc(size).unwrap();
    let stranger = server.alloc(size).unwrap(); // never registered
    fill(&pool, 3);
    let pool_bytes = bytes(&pool).to_vec();
    let k = server.register_private(MemKind::Dram, pool.addr(), size as u64, 0).unwrap();
    let unknown = k + 1000;

    // A hostile client that guessed the key and the address forges the metadata, with a
    // range twice as long as the pool (an out-of-bounds probe must learn nothing either).
    let mut md = AgentMetadata::decode(&server.metadata()).unwrap();
    let forged = |key, addr| RegionInfo {
        key,
        kind: MemKind::Dram,
        addr,
        len: 2 * size as u64,
        dev: 0,
        shared: None,
        gpu: None,
        read_only: false,
    };
    md.regions.push(forged(k, pool.addr()));
    md.regions.push(forged(unknown, stranger.addr()));
    client.add_peer(&md.encode()).unwrap();
    assert_eq!(client.path_to("server").unwrap().transport, TransportKind::Tcp);

    let src = client.alloc(2 * size).unwrap();
    fill(&src, 11);
    let dst = client.alloc(2 * size).unwrap();
    set(&dst, |_| 0xee);
    client.register(MemKind::Dram, src.addr(), 2 * size as u64, 0).unwrap();
    client.register(MemKind::Dram, dst.addr(), 2 * size as u64, 0).unwrap();

    let attempt = |op, local: &SharedSegment, remote: u64, len: u64| {
        let req = client.transfer(op, &list(local.addr(), len), "server", &list(remote, len), None).unwrap();
        assert_eq!(req.path().transport, TransportKind::Tcp);
        refusal(req.wait(T))
    };
    for (op, local) in [(OpKind::Write, &src), (OpKind::Read, &dst)] {
        for len in [64, size as u64, 2 * size as u64] {
            let private = attempt(op, local, pool.addr(), len);
            let not_there = attempt(op, local, stranger.addr(), len);
            assert_eq!(private, Error::UnknownRegion(k).to_string(), "{op:?} of {len} bytes");
            assert_eq!(not_there, Error::UnknownRegion(unknown).to_string());
            // Word for word the same refusal, but for the key the client named itself.
            assert_eq!(private.replace(&k.to_string(), "KEY"), not_there.replace(&unknown.to_string(), "KEY"));
        }
    }
    // Nothing moved either way.
    assert_eq!(bytes(&pool), &pool_bytes[..]);
    assert!(bytes(&dst).iter().all(|&x| x == 0xee));
    assert!(bytes(&stranger).iter().all(|&x| x == 0));

    // The connection is still good for honest work, and the owner still uses its pool.
    let public = server.alloc(4096).unwrap();
    server.register(MemKind::Dram, public.addr(), 4096, 0).unwrap();
    client.refresh_peer("server", None).unwrap();
    let req =
        client.transfer(OpKind::Write, &list(src.addr(), 4096), "server", &list(public.addr(), 4096), None).unwrap();
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(bytes(&public), &bytes(&src)[..4096]);
    assert_eq!(bytes(&pool), &pool_bytes[..]);
}

/// The server's private pool as the local side of WRITE (pool -> client) and READ
/// (client -> pool), over the transport `cfg` leads to.
fn serve_from_private_pool(cfg: AgentConfig, expect: TransportKind, size: usize) {
    let client = Agent::new("client", cfg.clone()).unwrap();
    let server = Agent::new("server", cfg).unwrap();
    let pool = server.alloc(2 * size).unwrap();
    let (value, upload) = (pool.addr(), pool.addr() + size as u64);
    fill(&pool, 5);
    let key = server.register_private(MemKind::Dram, pool.addr(), 2 * size as u64, 0).unwrap();
    let inbox = client.alloc(size).unwrap();
    let outbox = client.alloc(size).unwrap();
    fill(&outbox, 17);
    client.register(MemKind::Dram, inbox.addr(), size as u64, 0).unwrap();
    client.register(MemKind::Dram, outbox.addr(), size as u64, 0).unwrap();
    server.add_peer(&client.metadata()).unwrap();
    assert_eq!(server.path_to("client").unwrap().transport, expect);

    // GET: the server writes a value from its pool into the client's buffer.
    let req = server
        .transfer(
            OpKind::Write,
            &list(value, size as u64),
            "client",
            &list(inbox.addr(), size as u64),
            Some(b"get".to_vec()),
        )
        .unwrap();
    assert_eq!(req.path().transport, expect);
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(bytes(&inbox), &bytes(&pool)[..size]);
    let n = client.wait_notifs(Duration::from_secs(5));
    assert_eq!((n.len(), n[0].from.as_str(), n[0].msg.as_slice()), (1, "server", &b"get"[..]));

    // PUT: the server reads the client's buffer into its pool, with a reusable request.
    let l = server.prepare_local(&list(upload, size as u64)).unwrap();
    let r = server.prepare_remote("client", &list(outbox.addr(), size as u64)).unwrap();
    let req = server.make_request(OpKind::Read, &l, None, &r, None, None).unwrap();
    assert_eq!(req.path().transport, expect);
    for round in 0..2 {
        fill(&outbox, 17 + round);
        req.post().unwrap();
        assert_eq!(req.wait(T), Status::Done);
        assert_eq!(&bytes(&pool)[size..], bytes(&outbox), "round {round}");
    }

    // Deregistration as usual; the prepared request then refuses to post.
    server.deregister(key).unwrap();
    assert_eq!(server.registered_regions(), 0);
    assert!(matches!(req.post(), Err(Error::InvalidState(_))));
    let e = server.prepare_local(&list(value, 16)).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    assert!(matches!(server.deregister(key), Err(Error::UnknownRegion(_))));
}

#[test]
fn the_owner_serves_from_its_private_pool_over_tcp() {
    serve_from_private_pool(tcp(), TransportKind::Tcp, 4096);
    serve_from_private_pool(tcp(), TransportKind::Tcp, 8 << 20);
}

#[test]
fn the_owner_serves_from_its_private_pool_over_shm() {
    serve_from_private_pool(AgentConfig::default(), TransportKind::Shm, 4096);
    serve_from_private_pool(AgentConfig::default(), TransportKind::Shm, 8 << 20);
}

#[test]
fn deregistered_private_memory_can_be_registered_again_either_way() {
    let client = Agent::new("client", tcp()).unwrap();
    let server = Agent::new("server", tcp()).unwrap();
    let pool = server.alloc(4096).unwrap();
    let k = server.register_private(MemKind::Dram, pool.addr(), 4096, 0).unwrap();
    let e = server.register(MemKind::Dram, pool.addr(), 16, 0).unwrap_err();
    assert!(matches!(e, Error::Overlap { existing, .. } if existing == k), "{e}");
    server.deregister(k).unwrap();
    assert!(keys(&server.metadata()).is_empty());

    // Made public, the same memory is listed and served like any region.
    let pk = server.register(MemKind::Dram, pool.addr(), 4096, 0).unwrap();
    assert_eq!(keys(&server.metadata()), vec![pk]);
    let src = client.alloc(4096).unwrap();
    fill(&src, 1);
    client.register(MemKind::Dram, src.addr(), 4096, 0).unwrap();
    client.add_peer(&server.metadata()).unwrap();
    let req =
        client.transfer(OpKind::Write, &list(src.addr(), 4096), "server", &list(pool.addr(), 4096), None).unwrap();
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(bytes(&pool), bytes(&src));

    // Made private again, it is gone from the metadata, and refused on the wire to a peer
    // that forges it back into its view.
    server.deregister(pk).unwrap();
    let k2 = server.register_private(MemKind::Dram, pool.addr(), 4096, 0).unwrap();
    assert!(keys(&server.metadata()).is_empty());
    let mut md = AgentMetadata::decode(&server.metadata()).unwrap();
    md.regions.push(RegionInfo {
        key: k2,
        kind: MemKind::Dram,
        addr: pool.addr(),
        len: 4096,
        dev: 0,
        shared: None,
        gpu: None,
        read_only: false,
    });
    client.add_peer(&md.encode()).unwrap();
    let before = bytes(&pool).to_vec();
    fill(&src, 2);
    let req =
        client.transfer(OpKind::Write, &list(src.addr(), 4096), "server", &list(pool.addr(), 4096), None).unwrap();
    assert_eq!(refusal(req.wait(T)), Error::UnknownRegion(k2).to_string());
    assert_eq!(bytes(&pool), &before[..]);
}
