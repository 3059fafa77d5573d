//! A same-host peer's segments as this agent maps them: never a segment other than the
//! one the metadata names (the owner reuses descriptor numbers), and not kept once the
//! peer revokes the regions in them. Two agents in one process, real segments, real
//! mappings through `/proc/<pid>/fd`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use freight_core::transport::shm::ShmPeer;
use freight_core::{Agent, AgentConfig, Error, MemKind, OpKind, SharedSegment, Status, TransportKind};
use freight_proto::metadata::AgentMetadata;
use freight_proto::region::{RegionInfo, RemoteRegions};

#[path = "support/buffers.rs"]
mod buffers;
use buffers::{bytes, fill, list};

const T: Option<Duration> = Some(Duration::from_secs(20));
const MIB: usize = 1 << 20;

/// Tests here count on which descriptor numbers the process hands out next: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn region(md: &[u8], key: u64) -> RegionInfo {
    AgentMetadata::decode(md).unwrap().regions.into_iter().find(|r| r.key == key).expect("region listed")
}

/// Whether this process has the memfd of segment `id` mapped (anyone's mapping of it).
fn mapped(id: u64) -> bool {
    let name = format!("/memfd:{} (deleted)", SharedSegment::memfd_name(id));
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| l.ends_with(&name))
}

/// Frees `old` (whose regions the owner deregistered) and allocates, through `owner`,
/// a segment of the same size that gets the descriptor number `old` had. Segments that
/// land on lower numbers freed meanwhile are kept aside (returned) so that the number
/// comes round.
fn reuse_descriptor(owner: &Agent, old: Arc<SharedSegment>) -> (Arc<SharedSegment>, Vec<Arc<SharedSegment>>) {
    let (fd, len) = (old.fd(), old.len());
    drop(old);
    let mut aside = Vec::new();
    loop {
        let seg = owner.alloc(len).unwrap();
        if seg.fd() == fd {
            return (seg, aside);
        }
        if seg.fd() > fd {
            // Another thread of the test process (a socket of an agent winding down, say)
            // took the number first: it names something else now, which must be refused
            // all the same.
            eprintln!("descriptor {fd} was taken by something else; the stale mapping is checked against that");
            return (seg, aside);
        }
        assert!(aside.len() < 256, "descriptor {fd} never came round");
        aside.push(seg);
    }
}

/// The defect: an agent that read the owner's metadata before the owner freed a segment
/// (and had no control link yet, so it never heard of the revocation) mapped whatever
/// the descriptor number named now. Here that is the owner's new segment, of the same
/// size: a WRITE to the old region reported Done and overwrote the new segment.
#[test]
fn a_reused_descriptor_is_not_taken_for_the_freed_segment() {
    let _serial = serial();
    for (cfg, label) in [
        (AgentConfig { require: Some(TransportKind::Shm), ..Default::default() }, "shm required"),
        (AgentConfig::default(), "path chosen"),
    ] {
        let a = Agent::new("initiator", cfg.clone()).unwrap();
        let b = Agent::new("target", cfg).unwrap();
        let src = a.alloc(MIB).unwrap();
        fill(&src, 1);
        a.register(MemKind::Dram, src.addr(), MIB as u64, 0).unwrap();

        let old = b.alloc(MIB).unwrap();
        let old_key = b.register(MemKind::Dram, old.addr(), MIB as u64, 0).unwrap();
        let stale_md = b.metadata();
        let stale = region(&stale_md, old_key);
        // No control link: add_peer only reads the metadata.
        a.add_peer(&stale_md).unwrap();
        assert_eq!(a.connection_stats("target").unwrap().control_connections, 0);

        // The owner frees the segment (its revocation reaches nobody) and its next
        // segment gets the same descriptor number.
        b.deregister(old_key).unwrap();
        let old_fd = old.fd();
        let old_addr = old.addr();
        let (new, _aside) = reuse_descriptor(&b, old);
        let reused = new.fd() == old_fd;
        assert_eq!(new.len(), MIB);
        fill(&new, 99);
        let before = bytes(&new).to_vec();
        let new_key = b.register(MemKind::Dram, new.addr(), MIB as u64, 0).unwrap();
        if reused {
            assert_eq!(region(&b.metadata(), new_key).shared.unwrap().fd, stale.shared.unwrap().fd);
        }

        // A WRITE to the old region must fail, wherever it fails, and touch nothing.
        let outcome =
            a.transfer(OpKind::Write, &list(src.addr(), MIB as u64), "target", &list(old_addr, MIB as u64), None);
        // The bytes first: before the fix, the WRITE went over shm, said Done, and
        // overwrote the new segment.
        let (failed, report) = match outcome {
            Err(e) => (true, e.to_string()),
            Ok(req) => {
                let status = req.wait(T);
                let report = format!("{status:?} over {}: {}", req.path().transport, req.path().reason);
                (matches!(status, Status::Error(_)) && req.path().transport != TransportKind::Shm, report)
            }
        };
        assert!(bytes(&new) == before.as_slice(), "{label}: the new segment was written ({report})");
        assert!(failed, "{label}: the write to a freed region did not fail: {report}");
        // Refused for what it is, naming the descriptor, wherever the refusal surfaced
        // (shm required: the request cannot be made; otherwise the path report says why
        // shm was not taken, and the target refuses the region over tcp).
        assert!(report.contains(&format!("/fd/{old_fd}")), "{label}: {report}");
        assert!(report.contains("stale") || !reused, "{label}: {report}");
        assert!(bytes(&src).iter().enumerate().all(|(i, &x)| x == ((i + 1) * 7 % 251) as u8));

        // The new region itself, through fresh metadata, is reachable as usual.
        a.add_peer(&b.metadata()).unwrap();
        if a.path_to("target").unwrap().transport == TransportKind::Shm {
            let req = a
                .transfer(OpKind::Write, &list(src.addr(), MIB as u64), "target", &list(new.addr(), MIB as u64), None)
                .unwrap();
            assert_eq!(req.wait(T), Status::Done, "{label}");
            assert!(bytes(&new) == bytes(&src), "{label}");
        }
    }
}

/// The check itself, where the shm transport maps (`probe`, and `remote_base`, which
/// programs are compiled with): the descriptor must be the named segment's memfd, of
/// its length.
#[test]
fn only_the_named_segment_is_mapped() {
    let _serial = serial();
    let b = Agent::new("owner", AgentConfig::default()).unwrap();
    let old = b.alloc(MIB).unwrap();
    let old_key = b.register(MemKind::Dram, old.addr(), MIB as u64, 0).unwrap();
    let stale = region(&b.metadata(), old_key);
    b.deregister(old_key).unwrap();
    let old_fd = old.fd();
    let (new, _aside) = reuse_descriptor(&b, old);
    let reused = new.fd() == old_fd;
    let new_key = b.register(MemKind::Dram, new.addr(), MIB as u64, 0).unwrap();
    let fresh = region(&b.metadata(), new_key);

    let peer = ShmPeer::new("peer", std::process::id());
    let e = peer.probe(&stale).unwrap_err();
    assert!(matches!(e, Error::TransportUnavailable(_)), "{e}");
    let m = e.to_string();
    let seg = stale.shared.unwrap().segment;
    assert!(!reused || (m.contains(&format!("not shared segment {seg}")) && m.contains("stale")), "{m}");
    assert!(peer.remote_base(&stale).is_err());
    assert_eq!(peer.mapped_segments(), 0, "a refused segment is not cached");

    // The right segment maps, and the same memory is seen through the mapping.
    let (m, base) = peer.remote_base(&fresh).unwrap();
    fill(&new, 5);
    // SAFETY: inside the mapping (base turns the peer's addresses into ours).
    let seen = unsafe { std::slice::from_raw_parts(base.wrapping_add(fresh.addr as usize) as *const u8, 64) };
    assert_eq!(seen, &bytes(&new)[..64]);
    drop(m);

    // Right name, wrong length: not that segment either (a fresh view each time: no cache).
    let mut longer = fresh.clone();
    longer.shared.as_mut().unwrap().segment_len += 4096;
    assert!(ShmPeer::new("peer", std::process::id()).probe(&longer).is_err());
    let mut shorter = fresh.clone();
    shorter.len = 4096;
    shorter.shared.as_mut().unwrap().segment_len = 8192;
    assert!(ShmPeer::new("peer", std::process::id())
        .probe(&shorter)
        .unwrap_err()
        .to_string()
        .contains("not the advertised"));
    // A descriptor that is no memfd (stdin, say), or none at all.
    let mut stdin = fresh.clone();
    stdin.shared.as_mut().unwrap().fd = 0;
    assert!(ShmPeer::new("peer", std::process::id()).probe(&stdin).is_err());
    let mut closed = fresh.clone();
    closed.shared.as_mut().unwrap().fd = 1 << 20;
    assert!(ShmPeer::new("peer", std::process::id()).probe(&closed).is_err());
}

/// The leak: mappings of segments whose regions the peer revoked are let go, except
/// that whoever holds one (a compiled program, a copy in flight) keeps it mapped.
#[test]
fn mappings_of_revoked_segments_are_let_go_once_unused() {
    let _serial = serial();
    let b = Agent::new("owner", AgentConfig::default()).unwrap();
    let (one, two) = (b.alloc(MIB).unwrap(), b.alloc(MIB).unwrap());
    let k1 = b.register(MemKind::Dram, one.addr(), 4096, 0).unwrap();
    let k1b = b.register(MemKind::Dram, one.addr() + 4096, 4096, 0).unwrap();
    let k2 = b.register(MemKind::Dram, two.addr(), MIB as u64, 0).unwrap();
    let md = AgentMetadata::decode(&b.metadata()).unwrap();
    let mut regions = RemoteRegions::new(&md.regions);
    let peer = ShmPeer::new("peer", std::process::id());
    for r in regions.iter() {
        peer.probe(r).unwrap();
    }
    assert_eq!(peer.mapped_segments(), 2);
    let seg1 = regions.get(k1).unwrap().shared.unwrap().segment;

    // As a program does: it holds the mapping while it lives.
    let (held, _) = peer.remote_base(regions.get(k1).unwrap()).unwrap();
    let held_at = held.addr();

    // A revocation of one of two regions in a segment leaves the segment mapped.
    regions.remove(k1);
    assert_eq!(peer.forget_unused(regions.iter()), 0);
    assert_eq!(peer.mapped_segments(), 2);
    // The last one: the cache lets go of it, the holder keeps it mapped.
    regions.remove(k1b);
    assert_eq!(peer.forget_unused(regions.iter()), 1);
    assert_eq!(peer.mapped_segments(), 1);
    assert_eq!(held.addr(), held_at);
    let maps = || std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(maps().lines().any(|l| l.starts_with(&format!("{held_at:x}-"))), "still held, still mapped");
    drop(held);
    assert!(!maps().lines().any(|l| l.starts_with(&format!("{held_at:x}-"))), "unmapped with its last holder");
    // The owner still has its own mapping of the segment; ours is gone.
    b.deregister(k1).unwrap();
    b.deregister(k1b).unwrap();
    drop(one);
    assert!(!mapped(seg1), "nothing maps the freed segment any more");

    // A refresh that lists nothing shared (every region revoked) empties the cache.
    regions.remove(k2);
    assert_eq!(peer.forget_unused(regions.iter()), 1);
    assert_eq!(peer.mapped_segments(), 0);
    // And a region still listed is mapped again on demand.
    let md = AgentMetadata::decode(&b.metadata()).unwrap();
    peer.probe(md.regions.iter().find(|r| r.key == k2).unwrap()).unwrap();
    assert_eq!(peer.mapped_segments(), 1);
    drop(two);
}

/// End to end: after a peer revokes the regions of a segment it then frees, this agent
/// no longer maps it (before, the mapping stayed until the peer was removed). Needs
/// `Peer::close_unused_imports` (peer.rs) to call `ShmPeer::forget_unused`.
#[test]
fn an_agent_unmaps_a_segment_its_peer_revoked_and_freed() {
    let _serial = serial();
    let a = Agent::new("initiator", AgentConfig::default()).unwrap();
    let b = Agent::new("target", AgentConfig::default()).unwrap();
    let src = a.alloc(MIB).unwrap();
    a.register(MemKind::Dram, src.addr(), MIB as u64, 0).unwrap();
    let dst = b.alloc(MIB).unwrap();
    let key = b.register(MemKind::Dram, dst.addr(), MIB as u64, 0).unwrap();
    let segment = region(&b.metadata(), key).shared.unwrap().segment;
    a.add_peer(&b.metadata()).unwrap();
    let req = a
        .transfer(OpKind::Write, &list(src.addr(), MIB as u64), "target", &list(dst.addr(), MIB as u64), None)
        .unwrap();
    assert_eq!(req.path().transport, TransportKind::Shm);
    assert_eq!(req.wait(T), Status::Done);
    drop(req); // its program held the mapping too

    // The transfer opened the control link, which carries the revocation.
    b.deregister(key).unwrap();
    let dst_addr = dst.addr();
    drop(dst); // the owner's own mapping goes with it
    let revoked = || a.prepare_remote("target", &list(dst_addr, 64)).is_err();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !revoked() || mapped(segment) {
        assert!(Instant::now() < deadline, "segment {segment} is still mapped here (revocation seen: {})", revoked());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The owner swaps a registered segment's descriptor for a file of its own making: the
/// same memfd name, the same length, but no seals, so that it could shrink it under our
/// mapping and crash us at the next copy. It is refused, and nothing is cached.
#[test]
fn a_look_alike_segment_without_seals_is_not_mapped() {
    let _serial = serial();
    let b = Agent::new("owner", AgentConfig::default()).unwrap();
    let seg = b.alloc(MIB).unwrap();
    let key = b.register(MemKind::Dram, seg.addr(), MIB as u64, 0).unwrap();
    let info = region(&b.metadata(), key);
    let name = std::ffi::CString::new(SharedSegment::memfd_name(info.shared.unwrap().segment)).unwrap();
    // SAFETY: plain syscalls on descriptors this test owns; the segment's own mapping
    // stays valid when its descriptor is replaced (its Drop then closes the look-alike).
    unsafe {
        let fake = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC);
        assert!(fake >= 0);
        assert_eq!(libc::ftruncate(fake, MIB as libc::off_t), 0);
        assert_eq!(libc::dup2(fake, seg.fd()), seg.fd());
        libc::close(fake);
    }
    let peer = ShmPeer::new("owner", std::process::id());
    let e = peer.probe(&info).unwrap_err();
    assert!(matches!(e, Error::TransportUnavailable(_)), "{e}");
    assert!(e.to_string().contains("not sealed against shrinking"), "{e}");
    assert_eq!(peer.mapped_segments(), 0);
}
