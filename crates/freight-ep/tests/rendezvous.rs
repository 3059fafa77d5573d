//! Rank coordination over real sockets: threads play the ranks. The etcd tests start a real
//! etcd per test on free loopback ports and skip, with a note on stderr, when none is installed.
//!
//! What both backends must do alike is written once, as `assert_*` helpers generic over
//! [`Group`]; each backend's tests join their groups and hand them to those helpers, then check
//! what only that backend does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use freight_core::{Error, Result};
use freight_ep::rendezvous::{EtcdGroup, EtcdOptions, Group, RankServer, ServerGroup, RENDEZVOUS_LOST};

const JOIN: Duration = Duration::from_secs(3);
const COLLECTIVE: Duration = Duration::from_secs(3);
/// For collectives that must fail long before their timeout.
const LONG: Duration = Duration::from_secs(4);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Joins every rank of `world` at once (each from its own thread, as they would race) with
/// `join(rank)`; returns the groups in rank order.
fn join_concurrently<G: Send>(world: usize, join: impl Fn(usize) -> Result<G> + Sync) -> Vec<G> {
    let join = &join;
    thread::scope(|s| {
        let handles: Vec<_> = (0..world).map(|r| s.spawn(move || join(r).unwrap())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f(group)` on every group in its own thread; returns the results in rank order.
fn on_each<G: Sync, T: Send>(groups: &[G], f: impl Fn(&G) -> T + Sync) -> Vec<T> {
    thread::scope(|s| {
        let handles: Vec<_> = groups.iter().map(|g| s.spawn(|| f(g))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A hook that counts its calls and records the rank it was given.
fn counting_hook(group: &impl Group) -> Arc<(AtomicUsize, AtomicUsize)> {
    let seen = Arc::new((AtomicUsize::new(0), AtomicUsize::new(usize::MAX)));
    let s = seen.clone();
    group.on_dead(Box::new(move |rank, _reason| {
        s.0.fetch_add(1, Ordering::SeqCst);
        s.1.store(rank, Ordering::SeqCst);
    }));
    seen
}

fn blob(rank: usize, round: usize) -> Vec<u8> {
    // Sizes differ per rank and round, including empty and > 64 KiB.
    let len = match (rank + round) % 4 {
        0 => 0,
        1 => 7,
        2 => 1000,
        _ => 70_000 + rank,
    };
    (0..len).map(|i| (i * 31 + rank * 7 + round) as u8).collect()
}

/// The message of a `Timeout`; panics on any other outcome.
fn timeout_message(res: Result<()>) -> String {
    match res {
        Err(Error::Timeout(msg)) => msg,
        other => panic!("expected a timeout, got {other:?}"),
    }
}

/// Checks that `res` is a `RemoteRejected` whose reason contains `why`; returns who refused.
fn assert_rejected<G>(res: Result<G>, why: &str) -> String {
    match res {
        Err(Error::RemoteRejected { peer, reason }) => {
            assert!(reason.contains(why), "{reason}");
            peer
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
}

// ---------------------------------------------------------------------------------------
// What every backend must do, given its joined groups

/// `rounds` all_gathers on every rank at once: each rank gets every rank's blob, in rank
/// order, every round.
fn assert_all_gather_returns_blobs_in_rank_order<G: Group>(groups: &[G], rounds: usize) {
    let results = on_each(groups, |g| {
        (0..rounds).map(|round| g.all_gather(&blob(g.rank(), round), COLLECTIVE).unwrap()).collect::<Vec<_>>()
    });
    for per_rank in results {
        for (round, got) in per_rank.iter().enumerate() {
            let want: Vec<Vec<u8>> = (0..groups.len()).map(|r| blob(r, round)).collect();
            assert_eq!(got, &want, "round {round}");
        }
    }
}

/// No rank has seen a death; then every rank leaves.
fn assert_none_dead_then_leave<G: Group>(groups: &[G]) {
    for g in groups {
        assert_eq!(g.dead(), None);
        g.leave().unwrap();
    }
}

/// After a first barrier, the last rank is dropped without a leave while the others wait in
/// an all_gather: each of them must fail with its death within `noticed_within`, and have
/// its death hook fired once, naming it. Returns the survivors, in rank order.
fn assert_dropped_rank_is_reported<G: Group>(mut groups: Vec<G>, noticed_within: Duration) -> Vec<G> {
    on_each(&groups, |g| g.barrier(COLLECTIVE).unwrap());
    let doomed = groups.pop().unwrap();
    let dead = doomed.rank();
    let hooks: Vec<_> = groups.iter().map(counting_hook).collect();

    let outcome = thread::scope(|s| {
        let waiting: Vec<_> = groups
            .iter()
            .map(|g| {
                s.spawn(move || {
                    let started = Instant::now();
                    (g.all_gather(b"pending", LONG), started.elapsed())
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(100));
        // No leave: a crash, as far as the others can tell (an etcd group revokes its lease).
        drop(doomed);
        waiting.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for (res, took) in outcome {
        match res {
            Err(Error::PeerDisconnected { peer, reason }) => {
                assert_eq!(peer, format!("rank {dead}"));
                assert!(reason.contains("without a leave"), "{reason}");
            }
            other => panic!("expected rank {dead}'s death, got {other:?}"),
        }
        assert!(took < noticed_within, "death noticed only after {took:?}");
    }
    for (g, hook) in groups.iter().zip(&hooks) {
        assert_eq!(hook.0.load(Ordering::SeqCst), 1);
        assert_eq!(hook.1.load(Ordering::SeqCst), dead);
        assert_eq!(g.dead().map(|(r, _)| r), Some(dead));
    }
    groups
}

/// After a first barrier, rank 1 of two leaves cleanly. `settle` later, rank 0 has seen no
/// death, and a collective that needs rank 1 fails fast, naming it, instead of timing out.
/// Returns rank 0, still joined.
fn assert_clean_leave_is_not_a_death<G: Group>(mut groups: Vec<G>, settle: Duration) -> G {
    on_each(&groups, |g| g.barrier(COLLECTIVE).unwrap());
    let leaver = groups.pop().unwrap();
    let stayer = groups.pop().unwrap();
    let hook = counting_hook(&stayer);
    leaver.leave().unwrap();
    drop(leaver);
    thread::sleep(settle);
    assert_eq!(stayer.dead(), None);
    assert_eq!(hook.0.load(Ordering::SeqCst), 0);
    let started = Instant::now();
    match stayer.barrier(LONG) {
        Err(Error::InvalidState(msg)) => assert!(msg.contains("rank 1 left"), "{msg}"),
        other => panic!("expected a failure naming the departed rank, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    stayer
}

/// With ranks 0 and 1 of three joined, rank 0's first barrier times out after `timeout`,
/// naming the ranks it waits for and that rank 2 has not joined. Returns the message.
fn assert_barrier_times_out_naming_the_unjoined_rank<G: Group>(r0: &G, timeout: Duration) -> String {
    let started = Instant::now();
    let msg = timeout_message(r0.barrier(timeout));
    assert!(msg.contains("waiting for ranks 1, 2 (rank 2 has not joined)"), "{msg}");
    assert!(started.elapsed() < Duration::from_secs(2));
    msg
}

// ---------------------------------------------------------------------------------------
// rank server

fn join_all(server: SocketAddr, world: usize) -> Vec<ServerGroup> {
    join_concurrently(world, |r| ServerGroup::join(server, r, world, JOIN, None))
}

#[test]
fn ranks_join_in_any_order_even_before_the_server_starts() {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let world = 3;
    // Ranks 2 and 0 start first and keep retrying; the server comes up 300 ms later; rank 1 last.
    let early: Vec<_> = [2, 0]
        .into_iter()
        .map(|r| thread::spawn(move || (r, ServerGroup::join(addr, r, world, JOIN, None).unwrap())))
        .collect();
    thread::sleep(Duration::from_millis(300));
    let server = RankServer::start(addr, world, None).unwrap();
    assert_eq!(server.addr(), addr);
    let late = ServerGroup::join(addr, 1, world, JOIN, None).unwrap();
    let mut groups: Vec<_> = early.into_iter().map(|h| h.join().unwrap()).collect();
    groups.push((1, late));
    groups.sort_by_key(|(r, _)| *r);
    let groups: Vec<ServerGroup> = groups.into_iter().map(|(_, g)| g).collect();
    for (r, g) in groups.iter().enumerate() {
        assert_eq!((g.rank(), g.world()), (r, world));
    }
    let results = on_each(&groups, |g| g.all_gather(&[g.rank() as u8], COLLECTIVE).unwrap());
    for got in results {
        assert_eq!(got, vec![vec![0], vec![1], vec![2]]);
    }
    for g in &groups {
        g.leave().unwrap();
    }
}

#[test]
fn all_gather_returns_blobs_in_rank_order_over_many_rounds() {
    let server = RankServer::start(loopback(), 4, None).unwrap();
    let groups = join_all(server.addr(), 4);
    assert_all_gather_returns_blobs_in_rank_order(&groups, 6);
    assert_none_dead_then_leave(&groups);
}

#[test]
fn barrier_waits_for_the_slowest_rank() {
    let server = RankServer::start(loopback(), 3, None).unwrap();
    let groups = join_all(server.addr(), 3);
    let started = Instant::now();
    let waited = on_each(&groups, |g| {
        if g.rank() == 1 {
            thread::sleep(Duration::from_millis(300));
        }
        g.barrier(COLLECTIVE).unwrap();
        started.elapsed()
    });
    for w in waited {
        assert!(w >= Duration::from_millis(280), "barrier returned after {w:?}");
    }
    // Barriers and all_gathers share the numbering.
    let got = on_each(&groups, |g| g.all_gather(b"x", COLLECTIVE).unwrap());
    assert!(got.iter().all(|blobs| blobs == &vec![b"x".to_vec(); 3]));
}

#[test]
fn a_dropped_rank_is_reported_dead_quickly() {
    let server = RankServer::start(loopback(), 3, None).unwrap();
    let survivors = assert_dropped_rank_is_reported(join_all(server.addr(), 3), Duration::from_secs(1));
    for g in &survivors {
        // Later collectives fail at once, and late hooks fire at once.
        let started = Instant::now();
        assert!(matches!(g.barrier(LONG), Err(Error::PeerDisconnected { .. })));
        assert!(started.elapsed() < Duration::from_millis(100));
        let late = counting_hook(g);
        assert_eq!(late.1.load(Ordering::SeqCst), 2);
    }
}

#[test]
fn a_clean_leave_is_not_a_death() {
    let server = RankServer::start(loopback(), 2, None).unwrap();
    let stayer = assert_clean_leave_is_not_a_death(join_all(server.addr(), 2), Duration::from_millis(200));
    assert_eq!(stayer.dead(), None);
    stayer.leave().unwrap();
    // After leaving, this rank's own calls fail rather than hang.
    assert!(matches!(stayer.barrier(COLLECTIVE), Err(Error::InvalidState(_))));
}

#[test]
fn the_server_hosts_a_new_group_after_every_rank_has_gone() {
    let server = RankServer::start(loopback(), 2, None).unwrap();
    for _run in 0..2 {
        let groups = join_all(server.addr(), 2);
        let got = on_each(&groups, |g| g.all_gather(&[g.rank() as u8], COLLECTIVE).unwrap());
        assert!(got.iter().all(|blobs| blobs == &vec![vec![0], vec![1]]));
        for g in &groups {
            g.leave().unwrap();
        }
    }
}

#[test]
fn a_taken_rank_is_rejected() {
    let server = RankServer::start(loopback(), 2, None).unwrap();
    let _first = ServerGroup::join(server.addr(), 0, 2, JOIN, None).unwrap();
    let peer = assert_rejected(ServerGroup::join(server.addr(), 0, 2, JOIN, None), "rank 0 is already taken");
    assert_eq!(peer, "rank server");
}

#[test]
fn a_world_size_mismatch_is_rejected() {
    let server = RankServer::start(loopback(), 2, None).unwrap();
    let peer = assert_rejected(ServerGroup::join(server.addr(), 0, 3, JOIN, None), "world size 3");
    assert_eq!(peer, "rank server");
}

#[test]
fn invalid_ranks_and_worlds_are_refused_locally() {
    let server = RankServer::start(loopback(), 2, None).unwrap();
    for (rank, world) in [(2, 2), (5, 2), (0, 0)] {
        let res = ServerGroup::join(server.addr(), rank, world, JOIN, None);
        assert!(matches!(res, Err(Error::InvalidArgument(_))), "rank {rank} world {world}");
    }
    assert!(matches!(RankServer::start(loopback(), 0, None), Err(Error::InvalidArgument(_))));
}

#[test]
fn a_collective_times_out_naming_the_missing_rank() {
    let server = RankServer::start(loopback(), 3, None).unwrap();
    let r0 = ServerGroup::join(server.addr(), 0, 3, JOIN, None).unwrap();
    let r1 = ServerGroup::join(server.addr(), 1, 3, JOIN, None).unwrap();
    let short = Duration::from_millis(300);
    // Collective 0: rank 2 has not joined.
    let msg = assert_barrier_times_out_naming_the_unjoined_rank(&r0, short);
    assert!(msg.contains("collective 0"), "{msg}");
    assert!(msg.ends_with("waiting for ranks 1, 2 (rank 2 has not joined)"), "{msg}");
    let msg = timeout_message(r1.barrier(short));
    assert!(msg.ends_with("waiting for rank 2 (rank 2 has not joined)"), "{msg}");

    // Rank 2 joins late: its collective 0 completes at once (the others' timed-out
    // contributions still count), then it skips collective 1, which times out for the others.
    let r2 = ServerGroup::join(server.addr(), 2, 3, JOIN, None).unwrap();
    r2.barrier(short).unwrap();
    let res = on_each(&[&r0, &r1], |g| g.barrier(short));
    for r in res {
        let msg = timeout_message(r);
        assert!(
            msg.ends_with("collective 1 did not complete within 300ms on rank 0 of 3: waiting for rank 2")
                || msg.ends_with("collective 1 did not complete within 300ms on rank 1 of 3: waiting for rank 2"),
            "{msg}"
        );
    }
    // The numbering stayed aligned: once rank 2 catches up, the group works again.
    r2.barrier(short).unwrap();
    let got = on_each(&[&r0, &r1, &r2], |g| g.all_gather(&[g.rank() as u8], COLLECTIVE).unwrap());
    assert!(got.iter().all(|blobs| blobs == &vec![vec![0], vec![1], vec![2]]));
}

#[test]
fn an_interrupted_join_or_collective_ends_at_once_and_the_group_stays_in_step() {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let started = Instant::now();
    let res = freight_core::interrupt::interruptible(|| true, || ServerGroup::join(addr, 0, 1, LONG, None));
    assert!(matches!(res, Err(Error::Interrupted(_))), "{:?}", res.err());
    assert!(started.elapsed() < Duration::from_secs(2));

    let server = RankServer::start(loopback(), 2, None).unwrap();
    let r0 = ServerGroup::join(server.addr(), 0, 2, JOIN, None).unwrap();
    let started = Instant::now();
    let res = freight_core::interrupt::interruptible(|| true, || r0.barrier(LONG));
    assert!(matches!(res, Err(Error::Interrupted(_))), "{res:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    // As after a timeout, the interrupted collective is spent and the numbering holds.
    let r1 = ServerGroup::join(server.addr(), 1, 2, JOIN, None).unwrap();
    r1.barrier(COLLECTIVE).unwrap();
    let got = on_each(&[&r0, &r1], |g| g.all_gather(&[g.rank() as u8], COLLECTIVE).unwrap());
    assert!(got.iter().all(|blobs| blobs == &vec![vec![0], vec![1]]));
}

#[test]
fn a_join_times_out_when_no_server_appears() {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let started = Instant::now();
    let res = ServerGroup::join(addr, 0, 1, Duration::from_millis(300), None);
    assert!(matches!(res, Err(Error::Timeout(_))), "{:?}", res.err());
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_stopped_server_fails_collectives_at_once() {
    let server = RankServer::start(loopback(), 2, None).unwrap();
    let groups = join_all(server.addr(), 2);
    let hook = counting_hook(&groups[0]);
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        let g = &groups[0];
        s.spawn(move || {
            let started = Instant::now();
            tx.send((g.barrier(LONG), started.elapsed())).unwrap();
        });
        thread::sleep(Duration::from_millis(100));
        drop(server);
    });
    let (res, took) = rx.recv().unwrap();
    assert!(matches!(&res, Err(Error::PeerDisconnected { peer, .. }) if peer == "rank server"), "{res:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    // Not a rank death: nobody is reported dead. But the death hooks (the buffers' abort
    // words) fire, so that GPU waits on the peers end now rather than at their timeout.
    assert_eq!(groups[0].dead(), None);
    assert_eq!(hook.0.load(Ordering::SeqCst), 1);
    assert_eq!(hook.1.load(Ordering::SeqCst), RENDEZVOUS_LOST);
}

// ---------------------------------------------------------------------------------------
// etcd

#[path = "../../freight-core/tests/support/etcd.rs"]
mod etcd_support;
use etcd_support::{free_port, Etcd};

/// Short lease and poll so that deaths show within a second or two.
fn fast() -> EtcdOptions {
    EtcdOptions {
        ttl: Duration::from_secs(1),
        poll: Duration::from_millis(100),
        call_timeout: Duration::from_secs(2),
        ..EtcdOptions::default()
    }
}

fn etcd_join_all(etcd: &Etcd, group: &str, world: usize) -> Vec<EtcdGroup> {
    let eps = etcd.endpoints();
    join_concurrently(world, |r| EtcdGroup::join_with(&eps, group, r, world, JOIN, &fast()))
}

#[test]
fn etcd_all_gather_returns_blobs_in_rank_order_over_many_rounds() {
    let Some(etcd) = Etcd::start("etcd_all_gather_returns_blobs_in_rank_order_over_many_rounds") else {
        return;
    };
    let groups = etcd_join_all(&etcd, "gather", 3);
    assert_all_gather_returns_blobs_in_rank_order(&groups, 5);
    on_each(&groups, |g| g.barrier(COLLECTIVE).unwrap());
    assert_none_dead_then_leave(&groups);
}

#[test]
fn etcd_a_dropped_rank_is_reported_dead_quickly() {
    let Some(etcd) = Etcd::start("etcd_a_dropped_rank_is_reported_dead_quickly") else {
        return;
    };
    let survivors = assert_dropped_rank_is_reported(etcd_join_all(&etcd, "drop", 3), Duration::from_millis(1500));
    for g in &survivors {
        assert!(matches!(g.barrier(LONG), Err(Error::PeerDisconnected { .. })));
    }
    // A late joiner learns of the death from the survivors' verdict.
    let late = EtcdGroup::join_with(&etcd.endpoints(), "drop", 2, 3, JOIN, &fast());
    assert!(matches!(late, Err(Error::RemoteRejected { .. })), "{:?}", late.err());
}

#[test]
fn etcd_a_crashed_rank_is_reported_dead_after_its_lease_runs_out() {
    let Some(etcd) = Etcd::start("etcd_a_crashed_rank_is_reported_dead_after_its_lease_runs_out") else {
        return;
    };
    let mut groups = etcd_join_all(&etcd, "crash", 2);
    on_each(&groups, |g| g.barrier(COLLECTIVE).unwrap());
    let survivor = groups.remove(0);
    let hook = counting_hook(&survivor);
    let crashed = Instant::now();
    groups.pop().unwrap().simulate_crash();
    // Longer than the lease's expiry takes on a busy two-core machine (the whole test
    // suite beside it): the death must come from the lease, not from this timeout.
    match survivor.barrier(Duration::from_secs(12)) {
        Err(Error::PeerDisconnected { peer, .. }) => assert_eq!(peer, "rank 1"),
        other => panic!("expected rank 1's death, got {other:?}"),
    }
    let took = crashed.elapsed();
    // Not at once (nothing revoked the lease), but soon: etcd raises the 1 s TTL to its
    // minimum of 1.5 s and reaps expired leases every 0.5 s; plus one 100 ms poll (about
    // 2.5 s alone; a fresh-clone CI run under load once took past 4 s).
    assert!(took >= Duration::from_millis(500) && took < Duration::from_secs(8), "{took:?}");
    assert_eq!(hook.0.load(Ordering::SeqCst), 1);
}

#[test]
fn etcd_a_clean_leave_is_not_a_death() {
    let Some(etcd) = Etcd::start("etcd_a_clean_leave_is_not_a_death") else {
        return;
    };
    // Longer than a lease: the left marker must outlive it for the watcher to see it.
    let settle = Duration::from_millis(1500);
    let stayer = assert_clean_leave_is_not_a_death(etcd_join_all(&etcd, "leave", 2), settle);
    stayer.leave().unwrap();
}

#[test]
fn etcd_taken_rank_world_mismatch_and_bad_arguments_are_rejected() {
    let Some(etcd) = Etcd::start("etcd_taken_rank_world_mismatch_and_bad_arguments_are_rejected") else {
        return;
    };
    let eps = etcd.endpoints();
    let join = |group: &str, rank, world| EtcdGroup::join_with(&eps, group, rank, world, JOIN, &fast());
    let _first = join("reject", 0, 2).unwrap();
    assert_rejected(join("reject", 0, 2), "already taken");
    assert_rejected(join("reject", 1, 3), "world size 3");
    for (group, rank, world) in [("reject", 2, 2), ("reject", 0, 0), ("", 0, 1), ("a/b", 0, 1)] {
        let res = join(group, rank, world);
        assert!(matches!(res, Err(Error::InvalidArgument(_))), "{group:?} {rank} {world}");
    }
}

#[test]
fn etcd_a_collective_times_out_naming_the_missing_rank() {
    let Some(etcd) = Etcd::start("etcd_a_collective_times_out_naming_the_missing_rank") else {
        return;
    };
    let eps = etcd.endpoints();
    let r0 = EtcdGroup::join_with(&eps, "timeout", 0, 3, JOIN, &fast()).unwrap();
    let _r1 = EtcdGroup::join_with(&eps, "timeout", 1, 3, JOIN, &fast()).unwrap();
    assert_barrier_times_out_naming_the_unjoined_rank(&r0, Duration::from_millis(400));
}

#[test]
fn etcd_join_fails_within_its_timeout_when_etcd_is_down() {
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let started = Instant::now();
    let res = EtcdGroup::join_with(&[endpoint], "nobody", 0, 1, Duration::from_millis(500), &fast());
    assert!(matches!(res, Err(Error::Etcd(_) | Error::Timeout(_))), "{:?}", res.err());
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
}

/// The blobs the ranks swap open their GPU memory to whoever holds them: a server with
/// a token lets in only the ranks that present it, and says why to the others.
#[test]
fn a_server_with_a_token_lets_in_only_ranks_that_present_it() {
    let server = RankServer::start(loopback(), 2, Some("ep-token")).unwrap();
    for presented in [None, Some("guess")] {
        let e = ServerGroup::join(server.addr(), 0, 2, JOIN, presented).err().expect("refused");
        assert!(e.to_string().contains("requires a token"), "{e}");
    }
    let addr = server.addr();
    let r1 = thread::spawn(move || ServerGroup::join(addr, 1, 2, JOIN, Some("ep-token")).unwrap());
    let r0 = ServerGroup::join(addr, 0, 2, JOIN, Some("ep-token")).unwrap();
    let r1 = r1.join().unwrap();
    let t = thread::spawn(move || r1.all_gather(b"one", JOIN).unwrap());
    assert_eq!(r0.all_gather(b"zero", JOIN).unwrap(), vec![b"zero".to_vec(), b"one".to_vec()]);
    t.join().unwrap();
    assert!(matches!(RankServer::start(loopback(), 2, Some("")), Err(Error::InvalidArgument(_))));
}
