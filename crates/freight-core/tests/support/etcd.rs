//! A real etcd server for tests, started on free loopback ports and removed on drop.
//! Shared by the test suites that need one (`#[path]`-included, so each suite compiles
//! its own copy); tests skip with a note on stderr where no etcd binary exists.
#![allow(dead_code)] // each suite uses a part

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use freight_core::exchange::etcd::EtcdDirectory;

/// A running etcd server; killed and its data dir removed on drop.
pub struct Etcd {
    child: Child,
    dir: PathBuf,
    pub endpoint: String,
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
    pub fn start(test: &str) -> Option<Etcd> {
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
                Duration::from_secs(10),
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

    /// Its client URL, as the etcd clients take endpoints.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint.clone()]
    }
}

fn find_etcd() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join("etcd"))
        .find(|bin| bin.is_file())
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
