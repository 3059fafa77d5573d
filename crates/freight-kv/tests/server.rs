//! The server and its clients in one process, over real sockets: the control plane on
//! gRPC, the data plane through the engine (shm between agents of one host, or tcp).

use std::time::Duration;

use freight_core::{AgentConfig, Error, TransportKind};
use freight_kv::{Client, ClientConfig, Server, ServerConfig};

fn server(memory: u64, evict: bool) -> Server {
    Server::start(ServerConfig { listen: "127.0.0.1:0".into(), memory_bytes: memory, evict, ..Default::default() })
        .expect("server starts")
}

fn client(server: &Server, buffer: u64) -> Client {
    client_over(server, buffer, None)
}

fn client_over(server: &Server, buffer: u64, require: Option<TransportKind>) -> Client {
    let engine = AgentConfig { require, ..Default::default() };
    Client::connect(ClientConfig { server: server.url(), buffer_bytes: buffer, engine, ..Default::default() })
        .expect("client connects")
}

/// A client the server reaches over tcp, on its direct connection or (`direct` false)
/// through the engine.
fn tcp_client(server: &Server, buffer: u64, direct: bool) -> Client {
    let engine =
        AgentConfig { require: Some(TransportKind::Tcp), transports: vec![TransportKind::Tcp], ..Default::default() };
    let c = Client::connect(ClientConfig {
        server: server.url(),
        buffer_bytes: buffer,
        engine,
        direct,
        ..Default::default()
    })
    .expect("client connects");
    assert_eq!(c.direct(), direct);
    c
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn put_get_exists_delete_round_trip() {
    let s = server(64 << 20, true);
    let mut c = client(&s, 8 << 20);
    let v = value(1, 100_000);
    let version = c.put(b"alpha", &v, Duration::ZERO).unwrap();
    assert_eq!(c.get(b"alpha").unwrap().as_deref(), Some(&v[..]));
    assert_eq!(c.get(b"missing").unwrap(), None);
    assert_eq!(c.exists(&[b"alpha", b"missing"]).unwrap(), vec![true, false]);
    // A new value is a new version, and readers see all of it.
    let w = value(2, 10);
    assert!(c.put(b"alpha", &w, Duration::ZERO).unwrap() > version);
    assert_eq!(c.get(b"alpha").unwrap().as_deref(), Some(&w[..]));
    assert_eq!(c.delete(&[b"alpha", b"alpha"]).unwrap(), vec![true, false]);
    assert_eq!(c.get(b"alpha").unwrap(), None);
    let stats = c.stats().unwrap();
    assert_eq!((stats.hits, stats.misses, stats.keys, stats.clients), (2, 2, 0, 1));
    c.close().unwrap();
}

#[test]
fn values_from_one_byte_to_the_buffer_size_over_shm_tcp_and_direct() {
    let s = server(64 << 20, true);
    let clients = [
        ("shm", client_over(&s, 4 << 20, Some(TransportKind::Shm))),
        ("tcp", tcp_client(&s, 4 << 20, false)),
        ("direct", tcp_client(&s, 4 << 20, true)),
    ];
    assert!(!clients[0].1.direct(), "a client on shared memory needs no direct connection");
    for (how, mut c) in clients {
        for (i, len) in [1usize, 63, 64, 65, 4096, 65_535, 65_536, 1 << 20, 4 << 20].into_iter().enumerate() {
            let key = format!("{how}-{len}");
            let v = value(i as u8, len);
            c.put(key.as_bytes(), &v, Duration::ZERO).unwrap();
            let same = c.get_with(key.as_bytes(), |got| got == &v[..]).unwrap();
            assert_eq!(same, Some(true), "{key}");
        }
    }
    // Every value was read once and counted once, those sent without a copy included:
    // the server counts such a value once the client's next message, or its
    // connection's end, shows that it was read.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.stats().hits < 27 {
        assert!(std::time::Instant::now() < deadline, "{:?}", s.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    let stats = s.stats();
    assert_eq!((stats.hits, stats.misses), (27, 0));
}

/// Batches, misses, refusals and values too large for their share, each answered item
/// by item on the direct connection as through the engine.
#[test]
fn the_direct_connection_answers_batches_item_by_item() {
    let s = server(2 << 20, false);
    let mut c = tcp_client(&s, 1 << 20, true);
    let (a, b, big) = (value(3, 1000), value(4, 70_000), value(5, 400_000));
    let versions = c.put_batch(&[(b"a", &a), (b"", b"x"), (b"b", &b), (b"big", &big)], Duration::ZERO).unwrap();
    assert!(versions[0].is_ok() && versions[2].is_ok() && versions[3].is_ok(), "{versions:?}");
    assert!(matches!(&versions[1], Err(Error::InvalidArgument(m)) if m.contains("empty key")), "{versions:?}");
    // Three keys share the 1 MiB buffer: 349,504 bytes each, too few for "big".
    let got = c.get_batch(&[b"a", b"nope", b"big", b"b"]).unwrap();
    assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&a[..]));
    assert_eq!(got[1].as_ref().unwrap(), &None);
    assert!(matches!(&got[2], Err(Error::InvalidArgument(m)) if m.contains("400000")), "{:?}", got[2]);
    assert_eq!(got[3].as_ref().unwrap().as_deref(), Some(&b[..]));
    // A full pool refuses a value and reads past its bytes: the next item still lands.
    let huge = value(6, 900_000);
    let versions = c.put_batch(&[(b"huge", &huge[..]), (b"c", &a[..])], Duration::ZERO).unwrap();
    assert!(versions[0].is_ok() || matches!(&versions[0], Err(Error::NoSpace(_))), "{versions:?}");
    for _ in 0..8 {
        let _ = c.put(b"filler", &huge, Duration::ZERO);
    }
    let crowd: Vec<Vec<u8>> = (0..12).map(|i| format!("crowd-{i}").into_bytes()).collect();
    let items: Vec<(&[u8], &[u8])> = crowd.iter().map(|k| (&k[..], &b[..])).collect();
    let results = c.put_batch(&items, Duration::ZERO).unwrap();
    assert!(results.iter().any(|r| matches!(r, Err(Error::NoSpace(_)))), "the pool never filled");
    assert_eq!(c.get(b"c").unwrap().as_deref(), Some(&a[..]), "the connection goes on in step");
}

#[test]
fn batches_answer_each_item() {
    let s = server(64 << 20, true);
    let mut c = client(&s, 1 << 20);
    let (a, b) = (value(3, 1000), value(4, 2000));
    let versions = c.put_batch(&[(b"a", &a), (b"b", &b), (b"", b"x")], Duration::ZERO).unwrap();
    assert!(versions[0].is_ok() && versions[1].is_ok());
    assert!(matches!(&versions[2], Err(Error::InvalidArgument(m)) if m.contains("empty key")), "{versions:?}");
    let got = c.get_batch(&[b"a", b"nope", b"b"]).unwrap();
    assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&a[..]));
    assert_eq!(got[1].as_ref().unwrap(), &None);
    assert_eq!(got[2].as_ref().unwrap().as_deref(), Some(&b[..]));
}

#[test]
fn a_value_larger_than_the_clients_buffer_names_both_sizes() {
    let s = server(64 << 20, true);
    let mut big = client(&s, 4 << 20);
    big.put(b"big", &value(5, 3 << 20), Duration::ZERO).unwrap();
    let mut small = client(&s, 1 << 20);
    let e = small.get(b"big").unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains(&(3 << 20).to_string()) && m.contains(&(1 << 20).to_string())),
        "{e}"
    );
    let e = small.put(b"too-big", &value(6, 2 << 20), Duration::ZERO).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("buffer")), "{e}");
}

#[test]
fn a_full_pool_without_eviction_says_out_of_memory_and_keeps_what_it_has() {
    let s = server(1 << 20, false);
    let mut c = client(&s, 1 << 20);
    let v = value(7, 400 << 10);
    c.put(b"one", &v, Duration::ZERO).unwrap();
    c.put(b"two", &v, Duration::ZERO).unwrap();
    let e = c.put(b"three", &v, Duration::ZERO).unwrap_err();
    assert!(
        matches!(&e, Error::NoSpace(m) if m.contains("out of memory") && m.contains(&(1u64 << 20).to_string())),
        "{e}"
    );
    assert_eq!(c.get(b"one").unwrap().as_deref(), Some(&v[..]));
    assert_eq!(c.get(b"three").unwrap(), None);
}

#[test]
fn a_full_pool_with_eviction_drops_the_least_recently_used() {
    let s = server(1 << 20, true);
    let mut c = client(&s, 1 << 20);
    let v = value(8, 400 << 10);
    c.put(b"old", &v, Duration::ZERO).unwrap();
    c.put(b"newer", &v, Duration::ZERO).unwrap();
    assert!(c.get(b"old").unwrap().is_some()); // now "newer" is the least recently used
    c.put(b"newest", &v, Duration::ZERO).unwrap();
    assert_eq!(c.exists(&[b"old", b"newer", b"newest"]).unwrap(), vec![true, false, true]);
    assert_eq!(c.stats().unwrap().evictions, 1);
}

#[test]
fn values_expire_after_their_ttl() {
    let s = server(8 << 20, true);
    let mut c = client(&s, 1 << 20);
    c.put(b"short", b"gone soon", Duration::from_millis(150)).unwrap();
    c.put(b"forever", b"stays", Duration::ZERO).unwrap();
    assert!(c.get(b"short").unwrap().is_some());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(c.get(b"short").unwrap(), None);
    assert_eq!(c.get(b"forever").unwrap().as_deref(), Some(&b"stays"[..]));
}

#[test]
fn concurrent_writers_never_tear_a_value() {
    let s = server(64 << 20, true);
    let len = 256 << 10;
    let writers: Vec<_> = (0..2u8)
        .map(|w| {
            let url = s.url();
            std::thread::spawn(move || {
                let mut c =
                    Client::connect(ClientConfig { server: url, buffer_bytes: 1 << 20, ..Default::default() }).unwrap();
                for _ in 0..40 {
                    c.put(b"contended", &vec![w + 1; len], Duration::ZERO).unwrap();
                }
            })
        })
        .collect();
    let mut reader = client(&s, 1 << 20);
    let mut seen = 0;
    while writers.iter().any(|w| !w.is_finished()) || seen == 0 {
        if let Some(ok) = reader
            .get_with(b"contended", |v| v.len() == len && v.iter().all(|&b| b == v[0]) && (v[0] == 1 || v[0] == 2))
            .unwrap()
        {
            assert!(ok, "a reader saw a mix of two values");
            seen += 1;
        }
    }
    for w in writers {
        w.join().unwrap();
    }
    assert!(seen > 0);
}

#[test]
fn a_client_that_goes_away_is_dropped_and_the_server_keeps_serving() {
    let s = server(8 << 20, true);
    let mut keeper = client(&s, 1 << 20);
    keeper.put(b"k", b"v", Duration::ZERO).unwrap();
    {
        let mut gone = client(&s, 1 << 20);
        gone.put(b"g", b"w", Duration::ZERO).unwrap();
        drop(gone); // no goodbye
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while keeper.stats().unwrap().clients != 1 {
        assert!(std::time::Instant::now() < deadline, "the server still counts the dropped client");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(keeper.get(b"g").unwrap().as_deref(), Some(&b"w"[..]), "its values stay");
    assert_eq!(keeper.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
}

#[test]
fn no_server_and_bad_settings_are_clear_errors() {
    let started = std::time::Instant::now();
    let no_server = ClientConfig {
        server: "http://127.0.0.1:1".into(),
        connect_for: Duration::from_millis(300),
        ..Default::default()
    };
    let e = Client::connect(no_server).err().unwrap();
    assert!(e.to_string().contains("cannot reach the KV server at http://127.0.0.1:1"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "gave up after its patience");
    let e = Client::connect(ClientConfig { server: "not a url".into(), ..Default::default() }).err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = Server::start(ServerConfig { listen: "localhost".into(), ..Default::default() }).err().unwrap();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("IP:PORT")), "{e}");
    let e = Server::start(ServerConfig { memory_bytes: 0, listen: "127.0.0.1:0".into(), ..Default::default() })
        .err()
        .unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

#[test]
fn a_cluster_member_on_every_interface_must_say_where_clients_reach_it() {
    for listen in ["0.0.0.0:0", "[::]:0"] {
        let e = Server::start(ServerConfig {
            listen: listen.into(),
            etcd: Some(freight_kv::EtcdConfig::new(vec!["http://127.0.0.1:1".into()])),
            ..Default::default()
        })
        .err()
        .unwrap();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("advertise")), "{listen}: {e}");
    }
    let e = Server::start(ServerConfig {
        listen: "0.0.0.0:0".into(),
        etcd: Some(freight_kv::EtcdConfig::new(vec!["http://127.0.0.1:1".into()])),
        advertise: Some("0.0.0.0".into()),
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("unspecified")), "{e}");
}

#[test]
fn a_client_waits_for_a_server_that_is_starting() {
    // Take a free port, start the client first, then the server on that port.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let client = std::thread::spawn(move || {
        Client::connect(ClientConfig { server: url, buffer_bytes: 1 << 20, ..Default::default() })
    });
    std::thread::sleep(Duration::from_millis(300));
    let s = Server::start(ServerConfig {
        listen: format!("127.0.0.1:{port}"),
        memory_bytes: 1 << 20,
        ..Default::default()
    })
    .unwrap();
    let mut c = client.join().unwrap().expect("connected once the server was up");
    c.put(b"k", b"v", Duration::ZERO).unwrap();
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    drop(s);
}

#[test]
fn a_stopped_server_turns_waits_into_errors_not_hangs() {
    let s = server(8 << 20, true);
    let mut c = Client::connect(ClientConfig {
        server: s.url(),
        buffer_bytes: 1 << 20,
        timeout: Duration::from_secs(3),
        connect_for: Duration::from_millis(500),
        ..Default::default()
    })
    .unwrap();
    c.put(b"k", b"v", Duration::ZERO).unwrap();
    s.shutdown();
    let started = std::time::Instant::now();
    assert!(c.get(b"k").is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_server_with_a_token_refuses_clients_without_it() {
    let s = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory_bytes: 1 << 20,
        token: Some("s3cret".into()),
        ..Default::default()
    })
    .unwrap();
    for token in [None, Some("wrong".to_string())] {
        let e = Client::connect(ClientConfig { server: s.url(), buffer_bytes: 1 << 20, token, ..Default::default() })
            .err()
            .unwrap();
        assert!(matches!(&e, Error::Auth(m) if m.contains("token")), "{e}");
    }
    let mut c = Client::connect(ClientConfig {
        server: s.url(),
        buffer_bytes: 1 << 20,
        token: Some("s3cret".into()),
        ..Default::default()
    })
    .unwrap();
    c.put(b"k", b"v", Duration::ZERO).unwrap();
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(c.stats().unwrap().keys, 1);
    let e = Client::connect(ClientConfig { server: s.url(), token: Some("bad\nline".into()), ..Default::default() })
        .err()
        .unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

#[test]
fn prometheus_metrics_count_what_happened() {
    let s = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory_bytes: 1 << 20,
        metrics_listen: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let mut c = client(&s, 1 << 20);
    c.put(b"k", b"value", Duration::ZERO).unwrap();
    c.get(b"k").unwrap();
    c.get(b"nope").unwrap();
    let text = http_get(s.metrics_addr().expect("metrics are served"), "/metrics");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    for line in ["freight_kv_hits_total 1", "freight_kv_misses_total 1", "freight_kv_keys 1", "freight_kv_clients 1"] {
        assert!(text.contains(&format!("\n{line}\n")), "no {line:?} in:\n{text}");
    }
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn a_client_reconnects_to_a_restarted_server_which_starts_empty() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = || ServerConfig { listen: format!("127.0.0.1:{port}"), memory_bytes: 1 << 20, ..Default::default() };
    let first = Server::start(config()).unwrap();
    let mut c = client(&first, 1 << 20);
    c.put(b"before", b"restart", Duration::ZERO).unwrap();
    first.shutdown();
    let _second = Server::start(config()).unwrap();
    assert_eq!(c.get(b"before").unwrap(), None, "the cache lives in memory: a new server has nothing");
    c.put(b"after", b"restart", Duration::ZERO).unwrap();
    assert_eq!(c.get(b"after").unwrap().as_deref(), Some(&b"restart"[..]));
    assert_eq!(c.stats().unwrap().clients, 1);
}

#[test]
fn tls_on_the_control_plane() {
    let key = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    let (cert_pem, key_pem) = (key.cert.pem(), key.signing_key.serialize_pem());
    let s = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory_bytes: 1 << 20,
        tls: Some(freight_kv::TlsIdentity { cert_pem: cert_pem.clone().into(), key_pem: key_pem.into() }),
        ..Default::default()
    })
    .unwrap();
    assert!(s.url().starts_with("https://"), "{}", s.url());
    let mut c = Client::connect(ClientConfig {
        server: s.url(),
        buffer_bytes: 1 << 20,
        tls_ca_pem: Some(cert_pem.into()),
        ..Default::default()
    })
    .unwrap();
    c.put(b"k", b"over tls", Duration::ZERO).unwrap();
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"over tls"[..]));
    // Without the authority to trust, or with another one, no session.
    let e = Client::connect(ClientConfig { server: s.url(), ..Default::default() }).err().unwrap();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("https")), "{e}");
    let other = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let e = Client::connect(ClientConfig {
        server: s.url(),
        tls_ca_pem: Some(other.cert.pem().into()),
        connect_for: Duration::from_millis(300),
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("cannot reach"), "{e}");
    // Plain http to a TLS server does not get through either.
    let plain = s.url().replacen("https", "http", 1);
    let e = Client::connect(ClientConfig {
        server: plain,
        timeout: Duration::from_secs(3),
        connect_for: Duration::from_millis(300),
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(!matches!(e, Error::InvalidArgument(_)), "{e}");
}

#[test]
fn a_get_into_gpu_memory_without_cuda_says_why_and_the_client_goes_on() {
    if freight_cuda::available() {
        eprintln!("skipped: CUDA is available here (the GPU suite covers GPU destinations)");
        return;
    }
    let s = server(1 << 20, true);
    let mut c = client(&s, 1 << 16);
    c.put(b"k", &value(3, 100), Duration::ZERO).unwrap();
    let err = c.get_to_gpu(b"k", 0x1000, 100, 0).unwrap_err();
    assert!(err.to_string().to_lowercase().contains("cuda"), "{err}");
    assert_eq!(c.get(b"k").unwrap(), Some(value(3, 100)));
}

/// A process that never presented the server's token finds the client's data-plane
/// listener (it can see the port) and asks it for the agent's metadata, whose secret
/// would let it read and write the client's receive buffer: nothing is handed out, with
/// the server's token or without (another client holds that one too), and the client's
/// values stay whole. A client that presents a token to a server without one (it was
/// in its environment) works as any other.
#[test]
fn a_clients_data_plane_hands_nothing_to_a_stranger() {
    use freight_core::Agent;
    let kv = Some("kv-secret".to_string());
    for (server_token, token) in [(None, None), (None, kv.clone()), (kv.clone(), kv.clone())] {
        let s = Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            memory_bytes: 16 << 20,
            token: server_token,
            ..Default::default()
        })
        .unwrap();
        let mut c = Client::connect(ClientConfig {
            server: s.url(),
            buffer_bytes: 1 << 20,
            token: token.clone(),
            ..Default::default()
        })
        .unwrap();
        let v = value(7, 4096);
        c.put(b"k", &v, Duration::ZERO).unwrap();
        let stranger = Agent::new("stranger", AgentConfig::default()).unwrap();
        for addr in c.engine_addresses() {
            for presented in [None, token.as_deref().map(str::as_bytes), Some(&b"guess"[..])] {
                match stranger.connect(&addr, presented) {
                    Err(Error::Auth(m)) => {
                        assert!(m.contains("does not hand out its metadata") || m.contains("requires a token"), "{m}")
                    }
                    other => panic!("the client's listener answered a stranger ({presented:?}): {other:?}"),
                }
            }
        }
        assert!(stranger.peers().is_empty());
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&v[..]), "the client works on");
    }
}
