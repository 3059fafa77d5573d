//! EtcdDirectory against a real etcd server started per test on free loopback ports.
//! Tests that need the server skip (with a visible note on stderr) when no etcd binary exists.
#![cfg(feature = "etcd")]

use std::net::TcpListener;
use std::time::{Duration, Instant};

use freight_core::exchange::etcd::EtcdDirectory;
use freight_core::Error;

const TIMEOUT: Duration = Duration::from_secs(2);
const TTL: Duration = Duration::from_secs(10);

#[path = "support/etcd.rs"]
mod etcd_support;
use etcd_support::{free_port, Etcd};

/// A directory on `etcd` under `prefix`.
fn directory(etcd: &Etcd, prefix: &str, ttl: Duration) -> EtcdDirectory {
    EtcdDirectory::connect(&etcd.endpoints(), prefix, ttl, TIMEOUT).unwrap()
}

#[test]
fn publish_fetch_list_withdraw_roundtrip() {
    let Some(etcd) = Etcd::start("publish_fetch_list_withdraw_roundtrip") else {
        return;
    };
    let dir = directory(&etcd, "/freight/roundtrip/", TTL);
    // A second connection sees what the first publishes; the prefix gets its '/' added.
    let other = directory(&etcd, "/freight/roundtrip", TTL);
    assert_eq!(other.prefix(), "/freight/roundtrip/");

    assert_eq!(dir.list().unwrap(), Vec::<String>::new());
    assert_eq!(dir.fetch("a").unwrap(), None);
    dir.publish("a", b"alpha").unwrap();
    dir.publish("b", &[0u8, 255, 1, 2]).unwrap();
    assert_eq!(other.fetch("a").unwrap().as_deref(), Some(&b"alpha"[..]));
    assert_eq!(other.fetch("b").unwrap().as_deref(), Some(&[0u8, 255, 1, 2][..]));
    assert_eq!(other.list().unwrap(), vec!["a".to_string(), "b".to_string()]);

    dir.publish("a", b"alpha-2").unwrap();
    assert_eq!(other.fetch("a").unwrap().as_deref(), Some(&b"alpha-2"[..]));

    dir.withdraw("a").unwrap();
    dir.withdraw("a").unwrap(); // absent: still fine
    assert_eq!(other.fetch("a").unwrap(), None);
    assert_eq!(other.list().unwrap(), vec!["b".to_string()]);

    // Dropping revokes the lease: "b" goes at once, not after the 10 s ttl.
    drop(dir);
    assert_eq!(other.fetch("b").unwrap(), None);
    assert!(other.list().unwrap().is_empty());
}

#[test]
fn of_several_claims_of_one_name_exactly_one_wins() {
    let Some(etcd) = Etcd::start("of_several_claims_of_one_name_exactly_one_wins") else {
        return;
    };
    let dirs: Vec<EtcdDirectory> = (0..6).map(|_| directory(&etcd, "/freight/claim/", TTL)).collect();
    let barrier = std::sync::Barrier::new(dirs.len());
    let won: Vec<bool> = std::thread::scope(|s| {
        let claims: Vec<_> = dirs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    d.claim("rank-0", format!("claimant-{i}").as_bytes()).unwrap()
                })
            })
            .collect();
        claims.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(won.iter().filter(|&&w| w).count(), 1, "{won:?}");
    let winner = won.iter().position(|&w| w).unwrap();
    let value = dirs[0].fetch("rank-0").unwrap();
    assert_eq!(value.as_deref(), Some(format!("claimant-{winner}").as_bytes()));
    // A claim of a name this directory published itself loses too: the key exists.
    assert!(!dirs[winner].claim("rank-0", b"again").unwrap());
    // The claimed entry lives under the winner's lease: it goes with the winner.
    let mut dirs = dirs;
    drop(dirs.remove(winner));
    assert_eq!(dirs[0].fetch("rank-0").unwrap(), None);
    assert!(dirs[0].claim("rank-0", b"next").unwrap());
}

#[test]
fn wait_for_sees_a_later_publish() {
    let Some(etcd) = Etcd::start("wait_for_sees_a_later_publish") else {
        return;
    };
    let waiter = directory(&etcd, "/freight/wait/", TTL);

    let started = Instant::now();
    let err = waiter.wait_for("nobody", Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());

    let publisher = directory(&etcd, "/freight/wait/", TTL);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(400));
            publisher.publish("late", b"here").unwrap();
        });
        let started = Instant::now();
        assert_eq!(waiter.wait_for("late", Duration::from_secs(5)).unwrap(), b"here");
        assert!(started.elapsed() >= Duration::from_millis(300), "{:?}", started.elapsed());
    });
    // Already present: returns at once.
    assert_eq!(waiter.wait_for("late", Duration::from_millis(500)).unwrap(), b"here");
}

#[test]
fn lease_expires_after_an_unrevoked_drop() {
    let Some(etcd) = Etcd::start("lease_expires_after_an_unrevoked_drop") else {
        return;
    };
    let observer = directory(&etcd, "/freight/lease/", TTL);
    let doomed = directory(&etcd, "/freight/lease/", Duration::from_secs(2));
    doomed.publish("ghost", b"boo").unwrap();

    // The keep-alive holds the entry well past the 2 s ttl.
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(observer.fetch("ghost").unwrap().as_deref(), Some(&b"boo"[..]));

    // A crash (no revoke): the entry lingers until the ttl runs out, then goes.
    let crashed = Instant::now();
    doomed.forget_without_revoke();
    assert!(observer.fetch("ghost").unwrap().is_some(), "entry removed before the ttl");
    let deadline = crashed + Duration::from_secs(8);
    while observer.fetch("ghost").unwrap().is_some() {
        assert!(Instant::now() < deadline, "entry still present {:?} after the crash", crashed.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(crashed.elapsed() >= Duration::from_secs(1), "gone after only {:?}", crashed.elapsed());
}

#[test]
fn dead_endpoint_fails_within_the_timeout() {
    let timeout = Duration::from_secs(1);
    // Nothing listening: refused.
    let refused = format!("http://127.0.0.1:{}", free_port());
    // Listening but never accepting: TCP connects, etcd never answers (the hang case).
    let silent_socket = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = format!("http://127.0.0.1:{}", silent_socket.local_addr().unwrap().port());
    for endpoint in [refused, silent] {
        let started = Instant::now();
        let res = EtcdDirectory::connect(std::slice::from_ref(&endpoint), "/freight/dead/", TTL, timeout);
        let elapsed = started.elapsed();
        match res {
            Err(Error::Etcd(msg)) => assert!(msg.contains(&endpoint), "{msg}"),
            Err(e) => panic!("{endpoint}: unexpected error {e:?}"),
            Ok(_) => panic!("{endpoint}: connected to a dead endpoint"),
        }
        assert!(elapsed < timeout + Duration::from_millis(1500), "{endpoint}: took {elapsed:?}");
    }
}

#[test]
fn invalid_arguments_are_rejected() {
    let ep = vec!["http://127.0.0.1:1".to_string()];
    for (endpoints, prefix, ttl, timeout) in [
        (vec![], "/p/", TTL, TIMEOUT),
        (ep.clone(), "", TTL, TIMEOUT),
        (ep.clone(), "/p/", Duration::from_millis(500), TIMEOUT),
        (ep.clone(), "/p/", TTL, Duration::ZERO),
    ] {
        let res = EtcdDirectory::connect(&endpoints, prefix, ttl, timeout);
        assert!(matches!(res, Err(Error::InvalidArgument(_))), "{:?}", res.err());
    }

    let Some(etcd) = Etcd::start("invalid_arguments_are_rejected") else {
        return;
    };
    let dir = directory(&etcd, "/freight/names/", TTL);
    let long = "x".repeat(257);
    for bad in ["", "a/b", "/", long.as_str()] {
        let invalid = |r: Result<(), Error>| matches!(r, Err(Error::InvalidArgument(_)));
        assert!(invalid(dir.publish(bad, b"x")), "publish {bad:?}");
        assert!(invalid(dir.fetch(bad).map(drop)), "fetch {bad:?}");
        assert!(invalid(dir.wait_for(bad, Duration::from_millis(10)).map(drop)), "wait_for {bad:?}");
        assert!(invalid(dir.withdraw(bad)), "withdraw {bad:?}");
    }
    dir.publish(&"x".repeat(256), b"ok").unwrap();
    assert_eq!(dir.list().unwrap(), vec!["x".repeat(256)]);
}
