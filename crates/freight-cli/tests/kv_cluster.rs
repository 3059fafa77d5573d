//! Three `freight serve` processes sharing a key space through a real etcd; one is
//! killed, and clients carry on: keys on the others are read as before, keys that were
//! on the dead one are misses, not errors.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use freight_kv::{ClusterClient, ClusterConfig, EtcdConfig};

const ETCD: &str = "/usr/bin/etcd";

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start_etcd(dir: &std::path::Path) -> (Proc, String) {
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let child = Command::new(ETCD)
        .args(["--data-dir", dir.to_str().unwrap(), "--listen-client-urls", &url, "--advertise-client-urls", &url])
        .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .env("ETCD_UNSUPPORTED_ARCH", "arm64")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd starts");
    let proc = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
        assert!(Instant::now() < deadline, "etcd did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    (proc, url)
}

/// A server in the cluster; returns it and its URL (from its "listening on" line).
fn start_server(etcd: &str) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_freight"))
        .args(["serve", "--listen", "127.0.0.1:0", "--memory-mb", "16", "--etcd-endpoints", etcd, "--etcd-ttl", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("freight serve starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).expect("a listening line").to_string();
    (Proc(child), url)
}

#[test]
fn a_killed_member_loses_its_keys_and_nothing_else() {
    if !std::path::Path::new(ETCD).exists() {
        eprintln!("SKIPPED: {ETCD} is missing (apt-get install etcd-server, or scripts/setup.sh)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("freight-kv-etcd-{}", std::process::id()));
    let (_etcd, etcd_url) = start_etcd(&dir);
    let mut servers: Vec<(Proc, String)> = (0..3).map(|_| start_server(&etcd_url)).collect();
    let config = ClusterConfig {
        refresh_every: Duration::from_millis(200),
        ..ClusterConfig::new(EtcdConfig::new(vec![etcd_url.clone()]))
    };
    let mut cluster = ClusterClient::connect(config).unwrap();
    assert_eq!(cluster.members().unwrap().len(), 3);

    let keys: Vec<String> = (0..300).map(|i| format!("key-{i}")).collect();
    for k in &keys {
        cluster.put(k.as_bytes(), format!("value of {k}").as_bytes(), Duration::ZERO).unwrap();
    }
    // Every server holds some of them: ask each directly how many it has.
    let mut held = Vec::new();
    for (_, url) in &servers {
        let mut c = freight_kv::Client::connect(freight_kv::ClientConfig {
            server: url.clone(),
            buffer_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap();
        let on_it: Vec<bool> = c.exists(&keys.iter().map(|k| k.as_bytes()).collect::<Vec<_>>()).unwrap();
        held.push(on_it);
    }
    let counts: Vec<usize> = held.iter().map(|h| h.iter().filter(|&&x| x).count()).collect();
    assert_eq!(counts.iter().sum::<usize>(), 300, "each key on exactly one server: {counts:?}");
    assert!(counts.iter().all(|&n| n > 50), "{counts:?}");

    // Kill the first (no goodbye, no lease revoke).
    let (mut victim, _) = servers.remove(0);
    victim.0.kill().unwrap();
    victim.0.wait().unwrap();
    let started = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let got = cluster.get(k.as_bytes()).expect("a dead member's key is a miss, not an error");
        if held[0][i] {
            assert_eq!(got, None, "{k} was on the killed server");
        } else {
            assert_eq!(got, Some(format!("value of {k}").into_bytes()), "{k} was on a live server");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(30), "reads went on without long stalls");
    // Writes go on too, and the dead member leaves the list once its lease runs out.
    cluster.put(b"after", b"the kill", Duration::ZERO).unwrap();
    assert_eq!(cluster.get(b"after").unwrap().as_deref(), Some(&b"the kill"[..]));
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.members().unwrap().len() != 2 {
        assert!(Instant::now() < deadline, "the killed server is still listed");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);
}
