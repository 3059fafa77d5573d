//! The keyed store between agents in one process, over real sockets: puts committed in
//! batches arrive whole and can be got, checked and freed while more stream in; a full
//! store, a vanished sender and bad puts give clear errors and lose nothing committed.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use freight_core::{Agent, Error, MemKind, TransportKind};
use freight_stream::{
    Buffer, ChannelReceiver, ChannelSender, PipeConfig, PipeListener, PipeSender, StoreReceiver, StoreSender,
};

mod common;
use common::{agent, objects, pattern};

const WAIT: Duration = Duration::from_secs(10);

fn config() -> PipeConfig {
    PipeConfig { timeout: WAIT, ..PipeConfig::default() }
}

/// A store on `rx` fed by one pipe of `capacity` bytes, and the sender that feeds it.
fn connect(
    rx: &Arc<Agent>,
    tx: &Arc<Agent>,
    capacity: u64,
    store_capacity: Option<u64>,
    commit: usize,
) -> (StoreReceiver, StoreSender) {
    let listener = PipeListener::new(rx);
    let addr = rx.addresses()[0].clone();
    let tx = tx.clone();
    let sender = thread::spawn(move || {
        let pipe = PipeSender::connect(&tx, &addr, &config()).unwrap();
        StoreSender::new(ChannelSender::new(pipe, 16, None).unwrap(), commit).unwrap()
    });
    let pipe = listener.accept(Buffer::Host { capacity }, &config()).unwrap();
    let store = StoreReceiver::new(ChannelReceiver::new(vec![pipe], WAIT), store_capacity);
    (store, sender.join().unwrap())
}

fn put_and_get(require: TransportKind) {
    let (rx, tx) = (agent("st-rx", Some(require)), agent("st-tx", Some(require)));
    let (store, mut sender) = connect(&rx, &tx, 256 << 10, None, 32);
    // 100 objects, 35 MB: far more than the buffer, with some larger than it.
    let sizes: Vec<usize> = (0..100).map(|i| if i % 25 == 7 { 600_000 } else { 1 + i * 3_331 }).collect();
    let (_seg, objs) = objects(&tx, "kv-", &sizes);
    let mut commits = Vec::new();
    for (i, o) in objs.iter().enumerate() {
        if let Some(stats) = sender.put(o.clone()).unwrap() {
            // A commit returns once the receiver holds every object in it.
            assert!(store.contains(&o.key) && store.received() as usize > i);
            commits.push(stats);
        }
    }
    assert_eq!(commits.len(), 3, "every 32 puts commit");
    assert_eq!(sender.pending(), 4);
    sender.close().unwrap();
    store.wait_closed(WAIT).unwrap();
    assert_eq!(commits.iter().map(|c| c.objects).sum::<usize>(), 96);
    assert!(commits.iter().all(|c| c.bytes > 0 && c.transfer > Duration::ZERO && c.transfer_gbps() > 0.0));
    assert_eq!(store.len(), 100);
    assert_eq!(store.bytes(), sizes.iter().sum::<usize>() as u64);
    for (o, &len) in objs.iter().zip(&sizes) {
        let got = store.get(&o.key).unwrap_or_else(|| panic!("{} is missing", o.key));
        assert_eq!(got.meta, format!("len={len}").into_bytes());
        assert!(got.data.bytes().unwrap() == pattern(&o.key, len).as_slice(), "{} is corrupt", o.key);
    }
    let gone = store.remove("kv-0").unwrap();
    assert!(!store.contains("kv-0") && store.get("kv-0").is_none() && store.remove("kv-0").is_none());
    assert_eq!(store.bytes(), sizes.iter().sum::<usize>() as u64 - gone.len());
    // The removed object's memory lives as long as someone holds it.
    assert_eq!(gone.data.bytes().unwrap(), pattern("kv-0", 1).as_slice());
}

#[test]
fn puts_arrive_whole_and_are_got_by_key_over_shm() {
    put_and_get(TransportKind::Shm);
}

#[test]
fn puts_arrive_whole_and_are_got_by_key_over_tcp() {
    put_and_get(TransportKind::Tcp);
}

#[test]
fn a_key_put_again_replaces_the_object() {
    let (rx, tx) = (agent("st-re-rx", None), agent("st-re-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, None, 4);
    let (_a, first) = objects(&tx, "k", &[100, 200]);
    let (_b, second) = objects(&tx, "k", &[300]);
    for o in first {
        sender.put(o).unwrap();
    }
    sender.commit().unwrap().unwrap();
    sender.put(second[0].clone()).unwrap();
    sender.commit().unwrap();
    store.wait_for(&["k0", "k1"], WAIT).unwrap();
    assert_eq!(store.get("k0").unwrap().len(), 300);
    assert_eq!(store.bytes(), 500);
    assert_eq!(store.received(), 3);
    assert!(sender.commit().unwrap().is_none(), "nothing queued, nothing sent");
}

#[test]
fn a_full_batch_goes_out_before_its_commit() {
    let (rx, tx) = (agent("st-early-rx", None), agent("st-early-tx", None));
    // Batches of 16 (see `connect`), commits of 100.
    let (store, mut sender) = connect(&rx, &tx, 1 << 20, None, 100);
    let sizes = vec![5_000; 20];
    let (_seg, objs) = objects(&tx, "e", &sizes);
    for o in &objs {
        assert!(sender.put(o.clone()).unwrap().is_none(), "no commit before 100 puts");
    }
    // The first 16 reach the receiver without a commit; the other 4 wait for one.
    let early: Vec<String> = (0..16).map(|i| format!("e{i}")).collect();
    store.wait_for(&early.iter().map(String::as_str).collect::<Vec<_>>(), WAIT).unwrap();
    thread::sleep(Duration::from_millis(100));
    assert_eq!(store.len(), 16, "only full batches go out early");
    assert_eq!(sender.pending(), 20, "early batches stay queued until their commit");
    let stats = sender.commit().unwrap().expect("a commit of 20");
    assert_eq!((stats.objects, stats.bytes), (20, 100_000));
    assert_eq!(store.len(), 20);
    for (o, &len) in objs.iter().zip(&sizes) {
        assert!(store.get(&o.key).unwrap().data.bytes().unwrap() == pattern(&o.key, len).as_slice());
    }
}

/// A sender and the bare channel under it, whose test reads (and so releases) when
/// it likes: a sealed commit is held only once its messages are released.
fn connect_bare(rx: &Arc<Agent>, tx: &Arc<Agent>, commit: usize) -> (ChannelReceiver, StoreSender) {
    let listener = PipeListener::new(rx);
    let addr = rx.addresses()[0].clone();
    let tx = tx.clone();
    let sender = thread::spawn(move || {
        let pipe = PipeSender::connect(&tx, &addr, &config()).unwrap();
        StoreSender::new(ChannelSender::new(pipe, 4, None).unwrap(), commit).unwrap()
    });
    let pipe = listener.accept(Buffer::Host { capacity: 1 << 20 }, &config()).unwrap();
    (ChannelReceiver::new(vec![pipe], WAIT), sender.join().unwrap())
}

#[test]
fn sealed_commits_go_out_at_once_and_are_held_in_order() {
    let (rx, tx) = (agent("st-seal-rx", None), agent("st-seal-tx", None));
    let (mut channel, mut sender) = connect_bare(&rx, &tx, 100);
    let sizes = [3_000, 5_000, 7_000, 11_000, 13_000, 17_000];
    let (_seg, objs) = objects(&tx, "s", &sizes);
    for o in &objs[..4] {
        sender.queue(o.clone()).unwrap();
    }
    assert!(sender.seal().unwrap());
    for o in &objs[4..] {
        sender.queue(o.clone()).unwrap();
    }
    assert!(sender.seal().unwrap());
    assert!(!sender.seal().unwrap(), "nothing queued, nothing sealed");
    // Nothing is read yet: both commits are on their way, neither is held.
    assert_eq!((sender.sealed(), sender.pending()), (2, 6));
    assert!(sender.poll().unwrap().is_empty());
    assert_eq!(sender.pending_keys().collect::<Vec<_>>(), ["s0", "s1", "s2", "s3", "s4", "s5"]);
    let mut got = Vec::new();
    while got.len() < objs.len() {
        for object in channel.recv(Some(WAIT)).unwrap().expect("the stream goes on") {
            let len = sizes[got.len()];
            assert!(object.bytes().unwrap() == pattern(&object.key, len).as_slice(), "{} is corrupt", object.key);
            got.push(object.key.clone());
        }
    }
    let first = sender.wait_oldest().unwrap().expect("the first commit");
    let second = sender.wait_oldest().unwrap().expect("the second commit");
    assert_eq!(first.keys, ["s0", "s1", "s2", "s3"]);
    assert_eq!((first.stats.objects, first.stats.bytes), (4, 26_000));
    assert_eq!(second.keys, ["s4", "s5"]);
    assert_eq!((second.stats.objects, second.stats.bytes), (2, 30_000));
    assert!(sender.wait_oldest().unwrap().is_none());
    assert!(sender.poll().unwrap().is_empty());
    assert_eq!((sender.sealed(), sender.pending()), (0, 0));
}

#[test]
fn a_polled_commit_is_reported_once_its_receiver_released_it() {
    let (rx, tx) = (agent("st-poll-rx", None), agent("st-poll-tx", None));
    let (mut channel, mut sender) = connect_bare(&rx, &tx, 100);
    let (_seg, objs) = objects(&tx, "p", &[4_000, 4_000]);
    sender.queue(objs[0].clone()).unwrap();
    sender.seal().unwrap();
    let object = channel.recv(Some(WAIT)).unwrap().expect("one batch").pop().unwrap();
    thread::sleep(Duration::from_millis(50));
    assert!(sender.poll().unwrap().is_empty(), "the receiver still holds p0");
    drop(object);
    let deadline = std::time::Instant::now() + WAIT;
    let held = loop {
        let held = sender.poll().unwrap();
        if !held.is_empty() || std::time::Instant::now() > deadline {
            break held;
        }
        thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].keys, ["p0"]);
    assert_eq!(sender.sealed(), 0);
}

#[test]
fn sealed_commits_a_receiver_never_took_stay_queued() {
    let (rx, tx) = (agent("st-unseal-rx", None), agent("st-unseal-tx", None));
    let (channel, mut sender) = connect_bare(&rx, &tx, 100);
    let (_seg, objs) = objects(&tx, "u", &[1_000, 2_000, 3_000]);
    sender.queue(objs[0].clone()).unwrap();
    sender.queue(objs[1].clone()).unwrap();
    sender.seal().unwrap();
    // u1 again replaces its sealed copy; u2 is new.
    sender.queue(objs[1].clone()).unwrap();
    sender.queue(objs[2].clone()).unwrap();
    drop(channel);
    let e = sender.wait_oldest().unwrap_err();
    assert!(matches!(e, Error::PeerDisconnected { .. }), "{e}");
    assert_eq!(sender.sealed(), 0);
    assert_eq!(sender.pending_keys().collect::<Vec<_>>(), ["u0", "u1", "u2"], "nothing is lost unnoticed");
    assert_eq!(sender.discard_pending(), ["u0", "u1", "u2"]);
    assert_eq!(sender.pending(), 0);
}

#[test]
fn a_full_store_fails_the_commit_and_keeps_what_it_holds() {
    let (rx, tx) = (agent("st-full-rx", None), agent("st-full-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, Some(10_000), 2);
    let (_seg, objs) = objects(&tx, "f", &[4_000, 4_000, 4_000, 4_000]);
    sender.put(objs[0].clone()).unwrap();
    sender.put(objs[1].clone()).unwrap().expect("a commit of two");
    sender.put(objs[2].clone()).unwrap();
    let e = sender.put(objs[3].clone()).unwrap_err();
    assert!(e.to_string().contains("out of space"), "{e}");
    assert_eq!(sender.pending_keys().collect::<Vec<_>>(), ["f2", "f3"], "the failed commit stays queued");
    // A caller that will put them again from fresh memory drops them instead.
    assert_eq!(sender.discard_pending(), ["f2", "f3"]);
    assert_eq!(sender.pending(), 0);
    sender.put(objs[2].clone()).unwrap();
    assert_eq!(sender.pending_keys().collect::<Vec<_>>(), ["f2"], "a discarded key may be put again");
    let e = store.wait_closed(WAIT).unwrap_err();
    assert!(matches!(e, Error::NoSpace(_)), "{e}");
    assert_eq!(store.len(), 2);
    assert_eq!(store.get("f1").unwrap().data.bytes().unwrap(), pattern("f1", 4_000).as_slice());
}

#[test]
fn a_sender_that_vanishes_fails_the_waiting_receiver() {
    let (rx, tx) = (agent("st-gone-rx", None), agent("st-gone-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, None, 8);
    let (_seg, objs) = objects(&tx, "g", &[1_000, 2_000]);
    sender.put(objs[0].clone()).unwrap();
    sender.commit().unwrap();
    tx.close();
    let started = std::time::Instant::now();
    let e = store.wait_for(&["g0", "g1"], Duration::from_secs(60)).unwrap_err();
    assert!(matches!(e, Error::PeerDisconnected { .. } | Error::Io(_)), "{e}");
    assert!(started.elapsed() < Duration::from_secs(40), "an error within the pipe's timeout, not a hang");
    assert!(store.contains("g0"), "what was committed stays");
}

#[test]
fn bad_puts_are_refused_and_lose_nothing() {
    let (rx, tx) = (agent("st-bad-rx", None), agent("st-bad-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, None, 8);
    let (_seg, objs) = objects(&tx, "b", &[10, 20]);
    sender.put(objs[0].clone()).unwrap();
    let e = sender.put(objs[0].clone()).unwrap_err();
    assert!(e.to_string().contains("already waiting"), "{e}");
    let mut empty_key = objs[1].clone();
    empty_key.key.clear();
    assert!(matches!(sender.put(empty_key).unwrap_err(), Error::InvalidArgument(_)));
    let mut empty = objs[1].clone();
    empty.local.len = 0;
    assert!(sender.put(empty).unwrap_err().to_string().contains("empty"));
    let mut gpu = objs[1].clone();
    gpu.kind = MemKind::Vram;
    assert!(sender.put(gpu).unwrap_err().to_string().contains("commit first"));
    sender.put(objs[1].clone()).unwrap();
    sender.close().unwrap();
    store.wait_closed(WAIT).unwrap();
    let mut keys = store.keys();
    keys.sort();
    assert_eq!(keys, ["b0", "b1"]);
    let e = store.wait_for(&["b0", "never"], WAIT).unwrap_err();
    assert!(e.to_string().contains("closed before"), "{e}");
}

#[test]
fn a_sender_dropped_before_its_commit_does_not_end_the_stream_cleanly() {
    let (rx, tx) = (agent("st-drop-rx", None), agent("st-drop-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, None, 8);
    let (_seg, objs) = objects(&tx, "d", &[1_000, 2_000, 3_000]);
    sender.put(objs[0].clone()).unwrap();
    sender.commit().unwrap();
    sender.put(objs[1].clone()).unwrap();
    sender.put(objs[2].clone()).unwrap();
    drop(sender);
    let e = store.wait_closed(WAIT).unwrap_err();
    assert!(e.to_string().contains("not committed"), "{e}");
    assert!(store.contains("d0"), "what was committed stays");
}

#[test]
fn closing_a_store_ends_a_wait_on_another_thread_and_keeps_what_it_holds() {
    let (rx, tx) = (agent("st-close-rx", None), agent("st-close-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, None, 8);
    let (_seg, objs) = objects(&tx, "c", &[1_000]);
    sender.put(objs[0].clone()).unwrap();
    sender.commit().unwrap();
    let store = Arc::new(store);
    let waiting = {
        let store = store.clone();
        thread::spawn(move || {
            let started = std::time::Instant::now();
            (store.wait_for(&["never"], Duration::from_secs(60)).unwrap_err(), started.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(200));
    store.close();
    let (e, waited) = waiting.join().unwrap();
    assert!(matches!(e, Error::InvalidState(_)), "{e}");
    assert!(waited < Duration::from_secs(5), "the wait went on after close: {waited:?}");
    assert!(store.contains("c0"), "what was committed stays");
}

#[test]
fn an_interrupted_commit_stays_sealed_and_a_later_wait_sees_it_held() {
    let (rx, tx) = (agent("st-int-rx", None), agent("st-int-tx", None));
    // A bare channel: nothing is released until this test receives it.
    let (mut channel, mut sender) = connect_bare(&rx, &tx, 100);
    let (_seg, objs) = objects(&tx, "i", &[1_000, 2_000]);
    for o in &objs {
        sender.queue(o.clone()).unwrap();
    }
    assert!(sender.seal().unwrap());
    let e = freight_core::interrupt::interruptible(|| true, || sender.commit().unwrap_err());
    assert!(matches!(e, Error::Interrupted(_)), "{e}");
    assert_eq!((sender.sealed(), sender.pending()), (1, 2), "an interrupted wait queued the commit again");
    let got = channel.recv(None).unwrap().unwrap();
    assert_eq!(got.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), ["i0", "i1"]);
    drop(got);
    assert!(sender.commit().unwrap().is_some_and(|s| s.objects == 2), "the commit went once, and is held");
}

#[test]
fn a_put_whose_early_batch_fails_stays_queued_and_its_commit_sends_it() {
    let (rx, tx) = (agent("st-early-fail-rx", None), agent("st-early-fail-tx", None));
    let listener = PipeListener::new(&rx);
    let addr = rx.addresses()[0].clone();
    let sender = {
        let tx = tx.clone();
        // Short: the put below waits this long for room that never comes.
        let short = PipeConfig { timeout: Duration::from_secs(1), ..PipeConfig::default() };
        thread::spawn(move || {
            let pipe = PipeSender::connect(&tx, &addr, &short).unwrap();
            // Batches of one: every put sends its object at once.
            StoreSender::new(ChannelSender::new(pipe, 1, None).unwrap(), 100).unwrap()
        })
    };
    let pipe = listener.accept(Buffer::Host { capacity: 64 << 10 }, &config()).unwrap();
    let mut channel = ChannelReceiver::new(vec![pipe], WAIT);
    let mut sender = sender.join().unwrap();
    // Messages of a quarter of the buffer: four objects fill it, held until read.
    let (_seg, objs) = objects(&tx, "q", &[16 << 10; 5]);
    for o in &objs[..4] {
        assert!(sender.put(o.clone()).unwrap().is_none());
    }
    let e = sender.put(objs[4].clone()).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert_eq!(sender.pending_keys().collect::<Vec<_>>(), ["q0", "q1", "q2", "q3", "q4"], "q4 stays queued");
    let e = sender.put(objs[4].clone()).unwrap_err();
    assert!(e.to_string().contains("already waiting"), "{e}");
    let reader = thread::spawn(move || {
        let mut keys = Vec::new();
        while let Some(objects) = channel.recv(Some(WAIT)).unwrap() {
            keys.extend(objects.into_iter().map(|o| o.key.clone()));
        }
        keys
    });
    let stats = sender.commit().unwrap().expect("a commit");
    assert_eq!(stats.objects, 5, "the commit carries the object whose put failed");
    sender.close().unwrap();
    assert_eq!(reader.join().unwrap(), ["q0", "q1", "q2", "q3", "q4"]);
}

#[test]
fn waits_longer_than_the_clock_reaches_are_long_waits_not_panics() {
    let (rx, tx) = (agent("st-forever-rx", None), agent("st-forever-tx", None));
    let (store, mut sender) = connect(&rx, &tx, 64 << 10, None, 8);
    let (_seg, objs) = objects(&tx, "l", &[1_000, 2_000]);
    sender.put(objs[0].clone()).unwrap();
    sender.commit().unwrap();
    store.wait_for(&["l0"], Duration::MAX).unwrap();
    store.wait_received(1, Duration::MAX).unwrap();
    let (mut channel, mut sender) = connect_bare(&rx, &tx, 8);
    sender.queue(objs[1].clone()).unwrap();
    sender.seal().unwrap();
    let objects = channel.recv(Some(Duration::MAX)).unwrap().expect("a batch");
    assert_eq!(objects[0].key, "l1");
}
