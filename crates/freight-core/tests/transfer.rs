//! Two agents in one process, talking over real sockets and real shared mappings.

use std::time::Duration;

use freight_core::{Agent, AgentConfig, Error, MemKind, OpKind, Status, TransportKind};

#[path = "support/buffers.rs"]
mod buffers;
use buffers::list;

const T: Option<Duration> = Some(Duration::from_secs(20));

fn agents(cfg: AgentConfig) -> (Agent, Agent) {
    let a = Agent::new("initiator", cfg.clone()).unwrap();
    let b = Agent::new("target", cfg).unwrap();
    (a, b)
}

/// Writes a pattern from `a` to `b` and reads it back, over whatever path is chosen.
fn roundtrip(cfg: AgentConfig, expect: TransportKind, size: usize) {
    let (a, b) = agents(cfg);
    let src = a.alloc(size).unwrap();
    let dst = b.alloc(size).unwrap();
    let back = a.alloc(size).unwrap();
    // SAFETY: test buffers we own.
    let s = unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), size) };
    for (i, x) in s.iter_mut().enumerate() {
        *x = (i * 7 % 251) as u8;
    }
    a.register(MemKind::Dram, src.addr(), size as u64, 0).unwrap();
    a.register(MemKind::Dram, back.addr(), size as u64, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), size as u64, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    assert_eq!(a.path_to("target").unwrap().transport, expect);

    let req = a
        .transfer(
            OpKind::Write,
            &list(src.addr(), size as u64),
            "target",
            &list(dst.addr(), size as u64),
            Some(b"w".to_vec()),
        )
        .unwrap();
    assert_eq!(req.path().transport, expect);
    assert_eq!(req.wait(T), Status::Done);
    let d = unsafe { std::slice::from_raw_parts(dst.as_ptr(), size) };
    assert_eq!(d, &s[..]);
    let n = b.wait_notifs(Duration::from_secs(5));
    assert_eq!(n.len(), 1);
    assert_eq!((n[0].from.as_str(), n[0].msg.as_slice()), ("initiator", &b"w"[..]));

    let req = a
        .transfer(OpKind::Read, &list(back.addr(), size as u64), "target", &list(dst.addr(), size as u64), None)
        .unwrap();
    assert_eq!(req.wait(T), Status::Done);
    assert_eq!(unsafe { std::slice::from_raw_parts(back.as_ptr(), size) }, &s[..]);
}

#[test]
fn shm_small_and_large() {
    roundtrip(AgentConfig::default(), TransportKind::Shm, 4096);
    roundtrip(AgentConfig::default(), TransportKind::Shm, 24 << 20);
}

#[test]
fn tcp_small_and_large() {
    let cfg = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    roundtrip(cfg.clone(), TransportKind::Tcp, 4096);
    roundtrip(cfg, TransportKind::Tcp, 24 << 20);
}

/// Small requests from several threads at once, some written by the posting thread (an
/// idle stream) and some by the streams' sender threads, interleaved with large ones:
/// every block lands where its own request sent it, and reads back whole.
#[test]
fn tcp_small_requests_from_many_threads_each_land_whole() {
    const THREADS: usize = 6;
    const ROUNDS: usize = 60;
    const BLOCK: usize = 4096;
    const LARGE: usize = 256 << 10;
    let cfg = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    let (a, b) = agents(cfg);
    let per_thread = ROUNDS * BLOCK + LARGE;
    let size = THREADS * per_thread;
    let (src, dst, back) = (a.alloc(size).unwrap(), b.alloc(size).unwrap(), a.alloc(size).unwrap());
    a.register(MemKind::Dram, src.addr(), size as u64, 0).unwrap();
    a.register(MemKind::Dram, back.addr(), size as u64, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), size as u64, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    // SAFETY: test buffers we own; each thread writes only its own part of `src`.
    let s = unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), size) };
    for (i, x) in s.iter_mut().enumerate() {
        *x = (i * 13 % 253) as u8;
    }
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (a, src, dst, back) = (&a, src.addr(), dst.addr(), back.addr());
            scope.spawn(move || {
                let base = (t * per_thread) as u64;
                // Posts `len` bytes between our `local` and the target's `remote`.
                let post = |op, local: u64, remote: u64, len: usize| {
                    a.transfer(op, &list(local, len as u64), "target", &list(remote, len as u64), None).unwrap()
                };
                for r in 0..ROUNDS {
                    let off = base + (r * BLOCK) as u64;
                    let w = post(OpKind::Write, src + off, dst + off, BLOCK);
                    if r % 20 == 0 {
                        // A large one now and then keeps the sender threads busy meanwhile.
                        let large = base + (ROUNDS * BLOCK) as u64;
                        assert_eq!(post(OpKind::Write, src + large, dst + large, LARGE).wait(T), Status::Done);
                    }
                    assert_eq!(w.wait(T), Status::Done);
                    assert_eq!(post(OpKind::Read, back + off, dst + off, BLOCK).wait(T), Status::Done);
                }
            });
        }
    });
    // SAFETY: every request is done.
    let (d, k) =
        unsafe { (std::slice::from_raw_parts(dst.as_ptr(), size), std::slice::from_raw_parts(back.as_ptr(), size)) };
    assert!(d == &s[..], "a block landed somewhere else than its request sent it");
    for t in 0..THREADS {
        let part = t * per_thread..t * per_thread + ROUNDS * BLOCK;
        assert!(k[part.clone()] == s[part], "thread {t} read back other bytes than it wrote");
    }
}

/// An address of this host that is not loopback, if it has one (a route lookup only:
/// connecting a UDP socket sends nothing).
fn host_address() -> Option<std::net::IpAddr> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    probe.connect("192.0.2.1:9").ok()?;
    Some(probe.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

#[test]
fn tcp_to_a_host_address_sends_zero_copy_and_loses_nothing() {
    let Some(ip) = host_address() else {
        eprintln!("SKIPPED: this host has no address besides loopback, so zero-copy sends are never tried");
        return;
    };
    let cfg = AgentConfig { listen: format!("{ip}:0"), require: Some(TransportKind::Tcp), ..Default::default() };
    assert!(cfg.tcp.zerocopy, "zero-copy must be on by default");
    roundtrip(cfg, TransportKind::Tcp, 24 << 20);
}

#[test]
fn unregistered_and_out_of_bounds_are_refused() {
    let (a, b) = agents(AgentConfig::default());
    let src = a.alloc(8192).unwrap();
    let dst = b.alloc(8192).unwrap();
    a.register(MemKind::Dram, src.addr(), 4096, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let e = a.prepare_local(&list(src.addr() + 4096, 16)).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    let e = a.prepare_local(&list(src.addr() + 4000, 200)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    let e = a.prepare_remote("target", &list(dst.addr() + 4090, 16)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    let e = a.prepare_remote("nobody", &list(dst.addr(), 16)).unwrap_err();
    assert!(matches!(e, Error::UnknownPeer(_)), "{e}");
    let l = a.prepare_local(&list(src.addr(), 16)).unwrap();
    let r = a.prepare_remote("target", &list(dst.addr(), 32)).unwrap();
    assert!(matches!(a.make_request(OpKind::Write, &l, None, &r, None, None), Err(Error::InvalidArgument(_))));
}

#[test]
fn busy_memory_cannot_be_deregistered_and_requests_repost() {
    let cfg = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    let (a, b) = agents(cfg);
    let size = 64 << 20;
    let src = a.alloc(size).unwrap();
    let dst = b.alloc(size).unwrap();
    let k = a.register(MemKind::Dram, src.addr(), size as u64, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), size as u64, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let l = a.prepare_local(&list(src.addr(), size as u64)).unwrap();
    let r = a.prepare_remote("target", &list(dst.addr(), size as u64)).unwrap();
    let req = a.make_request(OpKind::Write, &l, None, &r, None, None).unwrap();
    assert_eq!(req.status(), Status::Idle);
    for _ in 0..3 {
        req.post().unwrap();
        if req.status() == Status::Pending {
            assert!(matches!(a.deregister(k), Err(Error::RegionBusy { .. })));
            assert!(matches!(req.post(), Err(Error::InvalidState(_))));
        }
        assert_eq!(req.wait(T), Status::Done);
    }
    a.deregister(k).unwrap();
    assert!(matches!(req.post(), Err(Error::InvalidState(_))));
}

#[test]
fn a_dead_peer_fails_requests_instead_of_hanging() {
    let cfg =
        AgentConfig { require: Some(TransportKind::Tcp), peer_timeout: Duration::from_secs(2), ..Default::default() };
    let (a, b) = agents(cfg);
    let src = a.alloc(1 << 20).unwrap();
    let dst = b.alloc(1 << 20).unwrap();
    a.register(MemKind::Dram, src.addr(), 1 << 20, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), 1 << 20, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    let req =
        a.transfer(OpKind::Write, &list(src.addr(), 1 << 20), "target", &list(dst.addr(), 1 << 20), None).unwrap();
    assert_eq!(req.wait(T), Status::Done);
    b.close();
    drop(b);
    let start = std::time::Instant::now();
    let outcome = a
        .transfer(OpKind::Write, &list(src.addr(), 1 << 20), "target", &list(dst.addr(), 1 << 20), None)
        .map(|r| r.wait(T));
    match outcome {
        Err(Error::PeerDisconnected { .. }) | Ok(Status::Error(Error::PeerDisconnected { .. })) => {}
        other => panic!("expected a disconnection error, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn wrong_secret_is_refused() {
    let (a, b) = agents(AgentConfig::default());
    let dst = b.alloc(4096).unwrap();
    b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    let mut md = freight_proto::metadata::AgentMetadata::decode(&b.metadata()).unwrap();
    md.secret = [0; 16];
    a.add_peer(&md.encode()).unwrap();
    let e = a.notify("target", b"hi".to_vec()).unwrap_err();
    assert!(e.to_string().contains("wrong secret"), "{e}");
}

#[test]
fn a_target_asleep_in_wait_notifs_is_woken_by_a_same_host_sender() {
    let (a, b) = agents(AgentConfig::default());
    a.add_peer(&b.metadata()).unwrap();
    // The first notification sets the outbox up; the later ones find it drained, with the
    // target asleep again, and must ring. (`wait_notifs` looks at the outbox only when it
    // starts: without the ring it would sleep the whole 10 s.)
    std::thread::scope(|s| {
        for round in 0..5u8 {
            let waiter = s.spawn(|| {
                let start = std::time::Instant::now();
                (b.wait_notifs(Duration::from_secs(10)), start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(100));
            a.notify("target", vec![round]).unwrap();
            let (got, waited) = waiter.join().unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!((got[0].from.as_str(), got[0].msg.as_slice()), ("initiator", &[round][..]));
            assert!(waited < Duration::from_secs(2), "round {round}: woke after {waited:?}");
        }
    });
}

#[test]
fn notifications_to_another_host_go_over_tcp_in_order() {
    let (a, b) = agents(AgentConfig::default());
    let mut md = freight_proto::metadata::AgentMetadata::decode(&b.metadata()).unwrap();
    md.host.boot_id = "another-kernel".into();
    a.add_peer(&md.encode()).unwrap();
    for i in 0..100u8 {
        a.notify("target", vec![i]).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 100 {
        let n = b.wait_notifs(Duration::from_secs(5));
        assert!(!n.is_empty(), "only {} of 100 arrived", got.len());
        got.extend(n.into_iter().map(|n| n.msg[0]));
    }
    assert_eq!(got, (0..100).collect::<Vec<u8>>());
}

/// A one-message tcp write to a same-host peer carries its notification with its data.
/// The notification must still come after that data, and after every notification sent
/// before it through the outbox, with many requests in flight at once; a write the
/// target refuses delivers none.
#[test]
fn tcp_write_notifications_follow_their_data_and_the_notifications_before_them() {
    const N: usize = 64;
    const LEN: usize = 64 << 10;
    let cfg = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    let (a, b) = agents(cfg);
    let src = a.alloc(N * LEN).unwrap();
    let dst = b.alloc(N * LEN).unwrap();
    // SAFETY: test buffers we own; block i holds the byte i + 1.
    let s = unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), N * LEN) };
    for (i, block) in s.chunks_mut(LEN).enumerate() {
        block.fill(i as u8 + 1);
    }
    a.register(MemKind::Dram, src.addr(), (N * LEN) as u64, 0).unwrap();
    let dst_key = b.register(MemKind::Dram, dst.addr(), (N * LEN) as u64, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    // Sets the outbox up. Once the target is back from waiting, the sender stops ringing
    // and the outbox is read only when the target polls (below): a notification that
    // came with data would overtake the ones waiting in the outbox, were they not
    // drained first.
    a.notify("target", b"hello".to_vec()).unwrap();
    assert_eq!(b.wait_notifs(Duration::from_secs(5))[0].msg, b"hello");
    let at = |i: usize| (i * LEN) as u64;
    let mut requests = Vec::new();
    for i in 0..N {
        a.notify("target", format!("before {i}").into_bytes()).unwrap();
        let notif = Some(format!("data {i}").into_bytes());
        let r = a.transfer(
            OpKind::Write,
            &list(src.addr() + at(i), LEN as u64),
            "target",
            &list(dst.addr() + at(i), LEN as u64),
            notif,
        );
        requests.push(r.unwrap());
        // Most writes land while their "before" waits in the outbox for the next poll.
        std::thread::sleep(Duration::from_micros(500));
    }
    let mut before = [false; N];
    let mut data = 0;
    std::thread::sleep(Duration::from_millis(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while data < N {
        assert!(std::time::Instant::now() < deadline, "only {data} of {N} write notifications arrived");
        let got = b.get_notifs();
        if got.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        for n in got {
            let msg = String::from_utf8(n.msg).unwrap();
            if let Some(i) = msg.strip_prefix("before ") {
                before[i.parse::<usize>().unwrap()] = true;
            } else if let Some(i) = msg.strip_prefix("data ") {
                let i: usize = i.parse().unwrap();
                assert!(before[i], "write {i}'s notification overtook the one sent before it");
                // SAFETY: the target's buffer; write i is done with it once notified.
                let block = unsafe { std::slice::from_raw_parts(dst.as_ptr().add(i * LEN), LEN) };
                assert!(block.iter().all(|&x| x == i as u8 + 1), "write {i} notified before its data was in place");
                data += 1;
            }
        }
    }
    for r in &requests {
        assert_eq!(r.wait(T), Status::Done);
    }

    b.deregister(dst_key).unwrap();
    // The target refuses it, or the initiator already heard of the region's end.
    let refused = Some(b"refused".to_vec());
    if let Ok(r) = a.transfer(OpKind::Write, &list(src.addr(), 16), "target", &list(dst.addr(), 16), refused) {
        assert!(matches!(r.wait(T), Status::Error(_)), "a write into deregistered memory must fail");
    }
    let late = b.wait_notifs(Duration::from_millis(200));
    assert!(late.iter().all(|n| n.msg != b"refused"), "a refused write delivered its notification");
}

/// Connection set-up is counted per peer: one control connection and one tcp connection
/// of `streams` data streams, each with its handshake, however many requests use them.
#[test]
fn connections_to_a_peer_are_counted_and_timed() {
    let mut cfg = AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() };
    cfg.tcp.streams = 3;
    let (a, b) = agents(cfg);
    let src = a.alloc(4096).unwrap();
    let dst = b.alloc(4096).unwrap();
    a.register(MemKind::Dram, src.addr(), 4096, 0).unwrap();
    b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    assert_eq!(a.connection_stats("target").unwrap(), freight_core::ConnectionStats::default());
    for _ in 0..5 {
        let r =
            a.transfer(OpKind::Write, &list(src.addr(), 4096), "target", &list(dst.addr(), 4096), Some(b"n".to_vec()));
        assert_eq!(r.unwrap().wait(T), Status::Done);
    }
    let s = a.connection_stats("target").unwrap();
    assert_eq!((s.control_connections, s.tcp_connections, s.handshakes), (1, 1, 4), "{s:?}");
    assert!(s.setup_us > 0 && s.last_setup_us > 0 && s.last_setup_us <= s.setup_us, "{s:?}");
    assert!(matches!(a.connection_stats("nobody"), Err(Error::UnknownPeer(_))));
}

/// A connection that has not said who it is cannot make the listener wait for (and
/// allocate) a large first frame: it is dropped at once, and the agent still serves.
#[test]
fn an_oversized_hello_is_dropped_at_once() {
    use std::io::{Read, Write};
    let (a, b) = agents(AgentConfig::default());
    let addr = b.addresses()[0].clone();
    let mut raw = std::net::TcpStream::connect(&addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let started = std::time::Instant::now();
    raw.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    let mut byte = [0u8; 1];
    // Closed (0 bytes or a reset) without waiting for the megabyte announced.
    assert!(matches!(raw.read(&mut byte), Ok(0) | Err(_)));
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    a.add_peer(&b.metadata()).unwrap();
    a.notify("target", b"still here".to_vec()).unwrap();
    let got = b.wait_notifs(Duration::from_secs(5));
    assert_eq!(got.first().map(|n| n.msg.as_slice()), Some(b"still here".as_slice()));
}

/// A hello trickled a byte at a time does not hold the listener's thread for ever: the
/// connect timeout bounds the whole hello, not each read.
#[test]
fn a_hello_must_arrive_whole_within_the_connect_timeout() {
    use std::io::{Read, Write};
    let cfg = AgentConfig { connect_timeout: Duration::from_millis(600), ..Default::default() };
    let (_a, b) = agents(cfg);
    let mut raw = std::net::TcpStream::connect(&b.addresses()[0]).unwrap();
    let started = std::time::Instant::now();
    raw.write_all(&200u32.to_le_bytes()).unwrap();
    let mut reader = raw.try_clone().unwrap();
    reader.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let trickle = std::thread::spawn(move || {
        // One byte every 150 ms: each read alone stays well within the timeout.
        while started.elapsed() < Duration::from_secs(5) && raw.write_all(&[0]).is_ok() {
            std::thread::sleep(Duration::from_millis(150));
        }
    });
    let mut byte = [0u8; 1];
    assert!(matches!(reader.read(&mut byte), Ok(0) | Err(_)));
    let closed_after = started.elapsed();
    assert!(closed_after < Duration::from_secs(3), "the trickled hello was served for {closed_after:?}");
    trickle.join().unwrap();
}

#[test]
fn pinning_to_no_cores_is_refused() {
    let mut cfg = AgentConfig::default();
    cfg.tcp.pin = freight_core::Pinning::Cores(vec![]);
    let e = Agent::new("pinned", cfg).err().expect("refused");
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("at least one core"), "{e}");
}

/// Metadata read before a revocation (kept by the application, or fetched while the
/// region went away) must not bring the revoked region back when it is added again.
#[test]
fn metadata_older_than_a_revocation_does_not_bring_the_region_back() {
    let (a, b) = agents(AgentConfig::default());
    let dst = b.alloc(4096).unwrap();
    let key = b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    let old = b.metadata();
    a.add_peer(&old).unwrap();
    // Opens the control link, which carries revocations.
    a.notify("target", b"hello".to_vec()).unwrap();
    a.prepare_remote("target", &list(dst.addr(), 4096)).unwrap();
    b.deregister(key).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while a.prepare_remote("target", &list(dst.addr(), 4096)).is_ok() {
        assert!(std::time::Instant::now() < deadline, "the revocation never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    a.add_peer(&old).unwrap();
    let e = a.prepare_remote("target", &list(dst.addr(), 4096)).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    // Registered again (a new key), the memory is reachable through fresh metadata.
    b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    a.prepare_remote("target", &list(dst.addr(), 4096)).unwrap();
}

/// A region revoked after this agent read the owner's metadata, but before it opened
/// the control link revocations travel on, is not written: the link opens with the
/// owner's live regions. Before, the write went over shm into memory the owner had
/// deregistered (but not freed), and reported Done.
#[test]
fn a_region_revoked_before_the_control_link_opened_is_not_written() {
    let (a, b) = agents(AgentConfig::default());
    let src = a.alloc(4096).unwrap();
    buffers::fill(&src, 1);
    a.register(MemKind::Dram, src.addr(), 4096, 0).unwrap();
    let dst = b.alloc(4096).unwrap();
    let (gone, kept) = (b.register(MemKind::Dram, dst.addr(), 2048, 0).unwrap(), dst.addr() + 2048);
    b.register(MemKind::Dram, kept, 2048, 0).unwrap();
    a.add_peer(&b.metadata()).unwrap();
    assert_eq!(a.connection_stats("target").unwrap().control_connections, 0);
    b.deregister(gone).unwrap();

    let write = |at: u64| {
        a.transfer(OpKind::Write, &list(src.addr(), 2048), "target", &list(at, 2048), None).and_then(|r| {
            match r.wait(T) {
                Status::Done => Ok(r.path().transport),
                other => Err(Error::Io(format!("{other:?}"))),
            }
        })
    };
    let e = write(dst.addr()).expect_err("the revoked region was written");
    assert!(e.to_string().contains(&format!("region {gone} was deregistered")), "{e}");
    assert!(buffers::bytes(&dst).iter().all(|&x| x == 0), "the deregistered memory was written");
    assert_eq!(a.connection_stats("target").unwrap().control_connections, 1);
    // The link is up, and the region that is still registered is written through it.
    assert_eq!(write(kept).unwrap(), TransportKind::Shm);
    assert_eq!(&buffers::bytes(&dst)[2048..], &buffers::bytes(&src)[..2048]);
    // Metadata read before the revocation does not bring the region back.
    let e = a.prepare_remote("target", &list(dst.addr(), 2048)).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
}

/// A peer whose connection is slow to set up (its listener accepts and never answers)
/// holds up only what needs that connection: adding and using other peers goes on
/// meanwhile, and so do adding that peer's metadata again and checking its health (a
/// server sweeping its clients for dead ones must not wait out one client's dial).
#[test]
fn a_slow_dial_to_one_peer_holds_up_no_other() {
    let cfg = AgentConfig { connect_timeout: Duration::from_secs(3), ..Default::default() };
    let a = Agent::new("initiator", cfg.clone()).unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ghost = Agent::new("ghost", cfg.clone()).unwrap();
    let mut md = freight_proto::metadata::AgentMetadata::decode(&ghost.metadata()).unwrap();
    md.addresses = vec![silent.local_addr().unwrap().to_string()];
    let md = md.encode();
    a.add_peer(&md).unwrap();
    let other = Agent::new("other", cfg).unwrap();
    let dst = other.alloc(4096).unwrap();
    other.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
    std::thread::scope(|s| {
        // Dials the ghost's control link: waits out the handshake.
        let dialing = s.spawn(|| a.notify("ghost", b"hello".to_vec()));
        std::thread::sleep(Duration::from_millis(200));
        let started = std::time::Instant::now();
        a.add_peer(&md).unwrap();
        a.check_peer("ghost").unwrap();
        a.add_peer(&other.metadata()).unwrap();
        a.prepare_remote("other", &list(dst.addr(), 4096)).unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "waited {took:?} for the ghost's dial");
        assert!(dialing.join().unwrap().is_err(), "the ghost never answered");
    });
}

/// `open_path` makes the connections the first transfer would otherwise make, on the
/// path `path_to` names; the transfer then dials nothing.
#[test]
fn open_path_dials_what_the_first_transfer_would() {
    for (cfg, expect) in [
        (AgentConfig { require: Some(TransportKind::Tcp), ..Default::default() }, TransportKind::Tcp),
        (AgentConfig::default(), TransportKind::Shm),
    ] {
        let (a, b) = agents(cfg);
        let (src, dst) = (a.alloc(4096).unwrap(), b.alloc(4096).unwrap());
        buffers::fill(&src, 3);
        a.register(MemKind::Dram, src.addr(), 4096, 0).unwrap();
        b.register(MemKind::Dram, dst.addr(), 4096, 0).unwrap();
        a.add_peer(&b.metadata()).unwrap();
        assert_eq!(a.connection_stats("target").unwrap().handshakes, 0);
        assert_eq!(a.open_path("target").unwrap().transport, expect);
        let opened = a.connection_stats("target").unwrap();
        let dialled = if expect == TransportKind::Tcp { opened.tcp_connections } else { opened.control_connections };
        assert_eq!(dialled, 1, "{expect:?}: {opened:?}");
        let req = a.transfer(OpKind::Write, &list(src.addr(), 4096), "target", &list(dst.addr(), 4096), None).unwrap();
        assert_eq!(req.wait(T), Status::Done);
        assert_eq!(buffers::bytes(&dst), buffers::bytes(&src));
        assert_eq!(a.connection_stats("target").unwrap(), opened, "{expect:?}: the transfer dialled again");
        assert!(matches!(a.open_path("nobody"), Err(Error::UnknownPeer(_))));
    }
}

/// An agent that disconnects a peer hangs up the connections that peer opened to it:
/// the peer learns at once that it was dropped, instead of talking on unanswered.
#[test]
fn a_disconnected_peer_learns_it_at_once() {
    let (a, b) = agents(AgentConfig::default());
    a.add_peer(&b.metadata()).unwrap();
    b.add_peer(&a.metadata()).unwrap();
    a.notify("target", b"hello".to_vec()).unwrap();
    b.disconnect_peer("initiator");
    assert!(matches!(b.check_peer("initiator"), Err(Error::UnknownPeer(_))));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while a.check_peer("target").is_ok() {
        assert!(std::time::Instant::now() < deadline, "the peer never learnt it was disconnected");
        std::thread::sleep(Duration::from_millis(5));
    }
    let e = a.notify("target", b"anyone?".to_vec()).unwrap_err();
    assert!(matches!(e, Error::PeerDisconnected { .. }), "{e}");
    // Disconnecting an agent that is no peer and opened nothing is harmless.
    b.disconnect_peer("nobody");
}
