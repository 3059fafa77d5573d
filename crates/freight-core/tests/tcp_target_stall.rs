//! A tcp target facing an initiator that stalls inside a message (stopped by SIGSTOP,
//! its host gone): the target must not keep the regions the message names guarded, or
//! its serving thread blocked, beyond the peer timeout; and a data stream that merely
//! idles between messages must not time out. The initiator here is a raw socket that
//! speaks the data-stream protocol (`freight_proto::data_stream`), so that it can stop halfway.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread::sleep;
use std::time::{Duration, Instant};

use freight_core::frame_io;
use freight_core::{Agent, AgentConfig, Desc, DescList, Error, MemKind, OpKind, Status, TransportKind};
use freight_proto::frame::{self, Frame, Role, Seg, PROTOCOL_VERSION};
use freight_proto::metadata::AgentMetadata;

#[path = "support/buffers.rs"]
mod buffers;
use buffers::bytes;

const PEER_TIMEOUT: Duration = Duration::from_secs(1);
const LEN: usize = 1 << 20;

fn target() -> Agent {
    Agent::new("target", AgentConfig { peer_timeout: PEER_TIMEOUT, ..Default::default() }).unwrap()
}

/// A target with `len` bytes of registered memory: the agent, the memory, its key.
fn target_with_region(len: usize) -> (Agent, std::sync::Arc<freight_core::SharedSegment>, u64) {
    let target = target();
    let dst = target.alloc(len).unwrap();
    let key = target.register(MemKind::Dram, dst.addr(), len as u64, 0).unwrap();
    (target, dst, key)
}

/// Opens a data stream to `target` as an initiator would, up to its welcome.
fn data_stream(target: &Agent) -> TcpStream {
    let md = AgentMetadata::decode(&target.metadata()).unwrap();
    let mut raw = TcpStream::connect(&md.addresses[0]).unwrap();
    // Only so that a failing test ends: the target never waits this long.
    raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let hello = Frame::Hello {
        version: PROTOCOL_VERSION,
        role: Role::Data { index: 0 },
        from_name: "stalling".into(),
        from_id: 7,
        target_id: md.agent_id,
        secret: md.secret.to_vec(),
        token: Vec::new(),
    };
    raw.write_all(&frame::encode(&hello)).unwrap();
    match frame_io::read_frame(&mut raw).unwrap() {
        Some(Frame::Welcome { agent_id }) => assert_eq!(agent_id, md.agent_id),
        other => panic!("expected a welcome, got {other:?}"),
    }
    raw
}

fn write_header(tag: u64, key: u64, addr: u64, len: u64) -> Vec<u8> {
    frame::encode(&Frame::Write { tag, segs: vec![Seg { region: key, addr, len }], notif: None })
}

/// One whole WRITE of `payload`, and its acknowledgement.
fn write_whole(raw: &mut TcpStream, tag: u64, key: u64, addr: u64, payload: &[u8]) {
    let mut msg = write_header(tag, key, addr, payload.len() as u64);
    msg.extend_from_slice(payload);
    raw.write_all(&msg).unwrap();
    match frame_io::read_frame(raw).unwrap() {
        Some(Frame::WriteAck { tag: t, error: None }) => assert_eq!(t, tag),
        other => panic!("expected the write acknowledged, got {other:?}"),
    }
}

/// Whether the target dropped the stream: the end of it or a reset, not our own timeout.
fn dropped_by_target(raw: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match raw.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}

/// Deregisters `key` as soon as the target lets it go; how long that took.
fn deregister_when_free(target: &Agent, key: u64, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        match target.deregister(key) {
            Ok(()) => return started.elapsed(),
            Err(Error::RegionBusy { .. }) if started.elapsed() < within => sleep(Duration::from_millis(20)),
            Err(e) => panic!("the region is still guarded after {:?}: {e}", started.elapsed()),
        }
    }
}

#[test]
fn a_write_stalled_inside_its_payload_lets_the_region_go_after_the_peer_timeout() {
    let (target, dst, key) = target_with_region(LEN);
    let mut raw = data_stream(&target);
    // The stream is served: a whole write lands.
    write_whole(&mut raw, 1, key, dst.addr(), &[0xab; 4096]);
    assert!(bytes(&dst)[..4096].iter().all(|&b| b == 0xab));

    // A megabyte announced, 4 KiB sent, then silence, the connection still up.
    let mut msg = write_header(2, key, dst.addr(), LEN as u64);
    msg.extend_from_slice(&[0xcd; 4096]);
    raw.write_all(&msg).unwrap();
    let stalled = Instant::now();
    sleep(PEER_TIMEOUT / 3);
    // The target is inside the payload, holding the region (the defect left it so for
    // as long as TCP keepalive took to declare the peer dead: hours).
    let busy = target.deregister(key).unwrap_err();
    assert!(matches!(busy, Error::RegionBusy { key: k, .. } if k == key), "{busy}");

    let waited = deregister_when_free(&target, key, Duration::from_secs(3) + PEER_TIMEOUT);
    let after = stalled.elapsed();
    assert!(after >= PEER_TIMEOUT, "let go after {after:?}, before the peer timeout");
    assert!(after < PEER_TIMEOUT * 4, "let go after {after:?} ({waited:?} waiting)");
    // The stream was dropped, not resynchronised somewhere inside the payload.
    assert!(dropped_by_target(&mut raw), "the stalled stream is still open");
    assert_eq!(target.registered_regions(), 0);
}

/// Stalling inside a header (no region named yet) ends the stream too, and the target
/// goes on serving new streams.
#[test]
fn a_message_stalled_inside_its_header_ends_the_stream() {
    let (target, dst, key) = target_with_region(4096);
    let mut raw = data_stream(&target);
    let header = write_header(1, key, dst.addr(), 4096);
    raw.write_all(&header[..header.len() - 2]).unwrap();
    let stalled = Instant::now();
    assert!(dropped_by_target(&mut raw), "the stalled stream is still open");
    let after = stalled.elapsed();
    assert!(after >= PEER_TIMEOUT && after < PEER_TIMEOUT * 4, "dropped after {after:?}");
    let mut fresh = data_stream(&target);
    write_whole(&mut fresh, 1, key, dst.addr(), &[7; 4096]);
}

/// The peer timeout bounds a message, not the time between messages.
#[test]
fn an_idle_data_stream_outlives_the_peer_timeout() {
    let (target, dst, key) = target_with_region(4096);
    let mut raw = data_stream(&target);
    write_whole(&mut raw, 1, key, dst.addr(), &[1; 4096]);
    sleep(PEER_TIMEOUT * 5 / 2);
    write_whole(&mut raw, 2, key, dst.addr(), &[2; 4096]);
    assert!(bytes(&dst).iter().all(|&b| b == 2));
    target.deregister(key).unwrap();
}

/// The same through a real initiator: its pooled tcp streams idle longer than the
/// target's peer timeout and still carry the next transfer.
#[test]
fn agents_transfer_again_after_idling_longer_than_the_peer_timeout() {
    let config = || AgentConfig { require: Some(TransportKind::Tcp), peer_timeout: PEER_TIMEOUT, ..Default::default() };
    let initiator = Agent::new("initiator", config()).unwrap();
    let target = Agent::new("target", config()).unwrap();
    let src = initiator.alloc(LEN).unwrap();
    let dst = target.alloc(LEN).unwrap();
    initiator.register(MemKind::Dram, src.addr(), LEN as u64, 0).unwrap();
    target.register(MemKind::Dram, dst.addr(), LEN as u64, 0).unwrap();
    initiator.add_peer(&target.metadata()).unwrap();
    let list = |addr| DescList::from_descs(MemKind::Dram, [Desc { addr, len: LEN as u64, dev: 0 }]).unwrap();
    for round in 1..=2u8 {
        // SAFETY: our own buffer; no transfer is running.
        unsafe { std::ptr::write_bytes(src.as_ptr(), round, LEN) };
        let r = initiator.transfer(OpKind::Write, &list(src.addr()), "target", &list(dst.addr()), None).unwrap();
        assert_eq!(r.wait(Some(Duration::from_secs(20))), Status::Done, "round {round}");
        assert!(bytes(&dst).iter().all(|&b| b == round), "round {round}");
        if round == 1 {
            sleep(PEER_TIMEOUT * 5 / 2);
        }
    }
}
