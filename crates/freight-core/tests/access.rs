//! Who may connect to an agent: a token, where one is configured, on every connection
//! (metadata requests included); no metadata at all from a listener told not to serve
//! it. Two agents in one process, real sockets.

use std::time::Duration;

use freight_core::{Agent, AgentConfig, Error, MemKind, OpKind, Status, TransportKind};
use freight_proto::metadata::AgentMetadata;

#[path = "support/buffers.rs"]
mod buffers;
use buffers::{bytes, fill, list};

const T: Option<Duration> = Some(Duration::from_secs(20));
const TOKEN: &[u8] = b"the-token";

fn guarded(name: &str) -> Agent {
    Agent::new(name, AgentConfig { token: Some(TOKEN.to_vec()), ..Default::default() }).unwrap()
}

fn auth_error(e: &Error) -> &str {
    match e {
        Error::Auth(m) => m,
        other => panic!("expected an authentication error, got {other:?}"),
    }
}

#[test]
fn a_guarded_listener_hands_out_metadata_only_for_its_token() {
    let target = guarded("target");
    let a = Agent::new("initiator", AgentConfig::default()).unwrap();
    let addr = target.addresses()[0].clone();
    let none = a.connect(&addr, None).unwrap_err();
    assert!(auth_error(&none).contains("no token was presented"), "{none}");
    let wrong = a.connect(&addr, Some(b"guess")).unwrap_err();
    assert!(auth_error(&wrong).contains("token presented is wrong"), "{wrong}");
    assert!(a.peers().is_empty(), "nothing was added from a refusal");
    assert_eq!(a.connect(&addr, Some(TOKEN)).unwrap(), "target");
}

/// Metadata that reached an initiator some other way (an etcd directory anyone may
/// read, a log) holds the secret, but not the token: no connection opens with it.
#[test]
fn the_secret_without_the_token_opens_no_connection() {
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        let target = guarded("target");
        let dst = target.alloc(1 << 20).unwrap();
        target.register(MemKind::Dram, dst.addr(), 1 << 20, 0).unwrap();
        let cfg = AgentConfig { require: Some(transport), ..Default::default() };
        let a = Agent::new("initiator", cfg).unwrap();
        let src = a.alloc(1 << 20).unwrap();
        fill(&src, 3);
        a.register(MemKind::Dram, src.addr(), 1 << 20, 0).unwrap();

        a.add_peer(&target.metadata()).unwrap();
        let e = a.notify("target", b"hello".to_vec()).unwrap_err();
        assert!(auth_error(&e).contains("requires a token"), "{transport}: {e}");
        let req = a.transfer(OpKind::Write, &list(src.addr(), 1 << 20), "target", &list(dst.addr(), 1 << 20), None);
        let failed = match req {
            Err(e) => e,
            Ok(r) => match r.wait(T) {
                Status::Error(e) => e,
                other => panic!("{transport}: a write without the token ended as {other:?}"),
            },
        };
        assert!(failed.to_string().contains("requires a token"), "{transport}: {failed}");
        assert!(bytes(&dst).iter().all(|&b| b == 0), "{transport}: nothing was written");

        // The same metadata with the token: every connection presents it.
        a.add_peer_with_token(&target.metadata(), Some(TOKEN)).unwrap();
        a.notify("target", b"hello".to_vec()).unwrap();
        let req =
            a.transfer(OpKind::Write, &list(src.addr(), 1 << 20), "target", &list(dst.addr(), 1 << 20), None).unwrap();
        assert_eq!(req.wait(T), Status::Done, "{transport}");
        assert_eq!(bytes(&dst), bytes(&src), "{transport}");
        let got = target.wait_notifs(Duration::from_secs(5));
        assert_eq!(got.len(), 1, "only the notification sent with the token arrived");
    }
}

#[test]
fn connect_keeps_the_token_for_the_connections_after_it() {
    let target = guarded("target");
    let a = Agent::new("initiator", AgentConfig::default()).unwrap();
    a.connect(&target.addresses()[0], Some(TOKEN)).unwrap();
    a.notify("target", b"one".to_vec()).unwrap();
    // A refresh without naming the token again uses the one the peer was added with.
    a.refresh_peer("target", None).unwrap();
    a.notify("target", b"two".to_vec()).unwrap();
    let mut got = Vec::new();
    while got.len() < 2 {
        let more = target.wait_notifs(Duration::from_secs(5));
        assert!(!more.is_empty(), "notifications lost: {got:?}");
        got.extend(more.into_iter().map(|n| n.msg));
    }
    assert_eq!(got, vec![b"one".to_vec(), b"two".to_vec()]);
}

#[test]
fn a_listener_that_serves_no_metadata_refuses_every_request_for_it() {
    for token in [None, Some(TOKEN.to_vec())] {
        let cfg = AgentConfig { serve_metadata: false, token: token.clone(), ..Default::default() };
        let target = Agent::new("quiet", cfg).unwrap();
        let a = Agent::new("initiator", AgentConfig::default()).unwrap();
        let e = a.connect(&target.addresses()[0], token.as_deref()).unwrap_err();
        assert!(auth_error(&e).contains("does not hand out its metadata"), "{e}");
        // Metadata handed over another way still works.
        a.add_peer_with_token(&target.metadata(), token.as_deref()).unwrap();
        a.notify("quiet", b"hi".to_vec()).unwrap();
        assert_eq!(target.wait_notifs(Duration::from_secs(5)).len(), 1);
    }
}

#[test]
fn tokens_that_guard_nothing_are_refused_at_creation() {
    for (token, why) in
        [(vec![], "AgentConfig.token is empty"), (vec![1; freight_core::config::MAX_TOKEN + 1], "at most")]
    {
        let cfg = AgentConfig { token: Some(token), ..Default::default() };
        match Agent::new("t", cfg) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(why), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("an agent started with a token that guards nothing"),
        }
    }
}

/// A hello is answered after the token is checked, so a wrong token says nothing
/// about the secret or the agent id (and a right one still needs both).
#[test]
fn with_the_token_a_wrong_secret_or_a_stale_id_is_still_refused() {
    let target = guarded("target");
    let a = Agent::new("initiator", AgentConfig::default()).unwrap();
    let mut md = AgentMetadata::decode(&target.metadata()).unwrap();
    md.secret = [0; 16];
    a.add_peer_with_token(&md.encode(), Some(TOKEN)).unwrap();
    let e = a.notify("target", b"x".to_vec()).unwrap_err();
    assert!(auth_error(&e).contains("wrong secret"), "{e}");
    let mut md = AgentMetadata::decode(&target.metadata()).unwrap();
    md.agent_id ^= 2;
    a.add_peer_with_token(&md.encode(), Some(TOKEN)).unwrap();
    let e = a.notify("target", b"x".to_vec()).unwrap_err();
    assert!(e.to_string().contains("stale metadata"), "{e}");
}
