//! EtcdDirectory against a real etcd server started per test on free loopback ports.
//! Tests that need the server skip (with a visible note on stderr) when no etcd binary exists.
#![cfg(feature = "etcd")]

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use freight_core::exchange::etcd::EtcdDirectory;
use freight_core::Error;

const TIMEOUT: Duration = Duration::from_secs(2);
const TTL: Duration = Duration::from_secs(10);

/// A running etcd server; killed and its data dir removed on drop.
struct Etcd {
    child: Child,
    dir: PathBuf,
    endpoint: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Etcd {
    /// Starts etcd, or returns None (after saying so) when it is not installed.
    fn start(test: &str) -> Option<Etcd> {
        let Some(bin) = find_etcd() else {
            // Straight to stderr: libtest captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "{test}: skipped: etcd not installed");
            return None;
        };
        // Ports are found free and then released, so another process may grab one before
        // etcd binds it; retry on a fresh pair in that case.
        for _ in 0..3 {
            if let Some(etcd) = Self::try_start(&bin) {
                return Some(etcd);
            }
        }
        panic!("etcd did not start; see the logs above");
    }

    fn try_start(bin: &Path) -> Option<Etcd> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "freight-etcd-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new(bin)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut etcd = Etcd { child, dir, endpoint };

        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = etcd.child.try_wait().unwrap() {
                let log = std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
                eprintln!("etcd exited with {status}:\n{log}");
                return None;
            }
            let probe = EtcdDirectory::connect(
                std::slice::from_ref(&etcd.endpoint),
                "/probe/",
                TTL,
                Duration::from_millis(500),
            );
            if probe.is_ok() {
                return Some(etcd);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = etcd.child.kill();
        let log = std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
        panic!("etcd at {} did not answer within 10 s:\n{log}", etcd.endpoint);
    }

    fn directory(&self, prefix: &str, ttl: Duration) -> EtcdDirectory {
        EtcdDirectory::connect(std::slice::from_ref(&self.endpoint), prefix, ttl, TIMEOUT).unwrap()
    }
}

fn find_etcd() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join("etcd"))
        .find(|bin| bin.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn publish_fetch_list_withdraw_roundtrip() {
    let Some(etcd) = Etcd::start("publish_fetch_list_withdraw_roundtrip") else {
        return;
    };
    let dir = etcd.directory("/freight/roundtrip/", TTL);
    // A second connection sees what the first publishes; the prefix gets its '/' added.
    let other = etcd.directory("/freight/roundtrip", TTL);
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
fn wait_for_sees_a_later_publish() {
    let Some(etcd) = Etcd::start("wait_for_sees_a_later_publish") else {
        return;
    };
    let waiter = etcd.directory("/freight/wait/", TTL);

    let started = Instant::now();
    let err = waiter.wait_for("nobody", Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());

    let publisher = etcd.directory("/freight/wait/", TTL);
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
    let observer = etcd.directory("/freight/lease/", TTL);
    let doomed = etcd.directory("/freight/lease/", Duration::from_secs(2));
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
    let dir = etcd.directory("/freight/names/", TTL);
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
