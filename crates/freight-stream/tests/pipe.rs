//! Two agents in one process, over real sockets: a pipe carries far more than its
//! buffer, in order and intact, over shm and tcp; bad input and a vanished end give
//! errors, not hangs.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use freight_core::{Agent, Desc, DescList, Error, MemKind, SharedSegment, TransportKind};
use freight_stream::{Buffer, PipeConfig, PipeListener, PipeSender};

mod common;
use common::{agent, ends, Ends};

fn config(timeout_ms: u64) -> PipeConfig {
    PipeConfig { timeout: Duration::from_millis(timeout_ms), ..PipeConfig::default() }
}

/// Registered host memory filled with a pattern that differs per message.
fn source(agent: &Agent, len: usize) -> (Arc<SharedSegment>, DescList) {
    let seg = agent.alloc(len).unwrap();
    agent.register(MemKind::Dram, seg.addr(), len as u64, 0).unwrap();
    let list = DescList::from_descs(MemKind::Dram, [Desc { addr: seg.addr(), len: len as u64, dev: 0 }]).unwrap();
    (seg, list)
}

fn fill(seg: &SharedSegment, len: usize, seed: u64) {
    // SAFETY: the segment is this test's and at least `len` long.
    let bytes = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(31).wrapping_add(seed * 7) as u8;
    }
}

fn expected(len: usize, seed: u64) -> Vec<u8> {
    (0..len).map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed * 7) as u8).collect()
}

fn stream_through(require: Option<TransportKind>) {
    const MSG: usize = 300_000; // not a multiple of the alignment, so slots have gaps
    const COUNT: u64 = 40;
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx", "tx", require);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 1 << 20 }, &config(10_000)).unwrap();
        let mut got = 0;
        while let Some(m) = pipe.recv(None).unwrap() {
            assert_eq!(m.seq(), got);
            assert_eq!(m.tag(), format!("m{got}").as_bytes());
            assert!(m.bytes().unwrap() == expected(MSG, got).as_slice(), "message {got} is corrupt");
            m.release().unwrap();
            got += 1;
        }
        assert!(pipe.finished());
        got
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(10_000)).unwrap();
    let (seg, list) = source(&tx_agent, MSG);
    for i in 0..COUNT {
        fill(&seg, MSG, i);
        pipe.send(&list, format!("m{i}").into_bytes()).unwrap();
        // The source is refilled next round: wait for this write.
        pipe.flush().unwrap();
    }
    pipe.close().unwrap();
    assert_eq!(receiver.join().unwrap(), COUNT);
}

#[test]
fn far_more_than_the_buffer_arrives_in_order_over_shm() {
    stream_through(Some(TransportKind::Shm));
}

#[test]
fn far_more_than_the_buffer_arrives_in_order_over_tcp() {
    stream_through(Some(TransportKind::Tcp));
}

#[test]
fn a_receiver_that_keeps_messages_makes_the_sender_wait_then_time_out() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-hold", "tx-hold", None);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(5_000)).unwrap();
        // Hold both messages: the buffer stays full.
        let a = pipe.recv(None).unwrap().unwrap();
        let b = pipe.recv(None).unwrap().unwrap();
        thread::sleep(Duration::from_millis(800));
        drop((a, b));
        pipe
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(300)).unwrap();
    let (_seg, list) = source(&tx_agent, 2048);
    pipe.send(&list, vec![]).unwrap();
    pipe.send(&list, vec![]).unwrap();
    let e = pipe.send(&list, vec![]).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(e.to_string().contains("no room"), "{e}");
    let _ = receiver.join().unwrap();
}

#[test]
fn bad_input_is_refused_before_anything_is_sent() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-bad", "tx-bad", None);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 8192 }, &config(5_000)).unwrap();
        let m = pipe.recv(None).unwrap().unwrap();
        assert_eq!((m.seq(), m.len()), (0, 10), "the refused sends left no hole in the stream");
        drop(m);
        assert!(pipe.recv(None).unwrap().is_none());
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(5_000)).unwrap();
    let (_seg, list) = source(&tx_agent, 16384);
    let too_big = pipe.send(&list, vec![]).unwrap_err();
    assert!(matches!(too_big, Error::InvalidArgument(_)), "{too_big}");
    let unregistered = DescList::from_descs(MemKind::Dram, [Desc { addr: 0x1000, len: 10, dev: 0 }]).unwrap();
    assert!(matches!(pipe.send(&unregistered, vec![]).unwrap_err(), Error::NotRegistered { .. }));
    let empty = DescList::new(MemKind::Dram);
    assert!(matches!(pipe.send(&empty, vec![]).unwrap_err(), Error::InvalidArgument(_)));
    let ten = DescList::from_descs(MemKind::Dram, [Desc { addr: list.get(0).unwrap().addr, len: 10, dev: 0 }]).unwrap();
    let e = pipe.send_scattered(&ten, &[(0, 0), (0, 10)], vec![]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("empty"), "{e}");
    let e = pipe.send_scattered(&ten, &[(u64::MAX - 4, 10)], vec![]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = pipe.send(&ten, vec![0; freight_proto::frame::MAX_NOTIF]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("tag"), "{e}");
    pipe.send(&ten, vec![]).unwrap();
    pipe.close().unwrap();
    receiver.join().unwrap();
}

#[test]
fn a_receiver_that_goes_away_fails_the_sender_and_vice_versa() {
    // The receiver drops its end mid-stream: the sender learns it.
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-gone", "tx-gone", None);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(5_000)).unwrap();
        drop(pipe.recv(None).unwrap().unwrap());
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(5_000)).unwrap();
    let (_seg, list) = source(&tx_agent, 4096);
    pipe.send(&list, vec![]).unwrap();
    receiver.join().unwrap();
    let e = (0..3).find_map(|_| pipe.send(&list, vec![]).err()).expect("the sender must notice");
    assert!(matches!(e, Error::PeerDisconnected { .. }), "{e}");
    assert!(e.to_string().contains("receiver"), "{e}");

    // A sender agent that closes mid-stream: the receiver does not hang.
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-orphan", "tx-orphan", None);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(3_000)).unwrap();
        drop(pipe.recv(None).unwrap().unwrap());
        pipe.recv(None).map(|m| m.is_some())
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(5_000)).unwrap();
    let (_seg, list) = source(&tx_agent, 1024);
    pipe.send(&list, vec![]).unwrap();
    pipe.flush().unwrap();
    thread::sleep(Duration::from_millis(200));
    tx_agent.close();
    let e = receiver.join().unwrap().unwrap_err();
    assert!(matches!(e, Error::PeerDisconnected { .. } | Error::Timeout(_)), "{e}");
}

#[test]
fn nobody_opening_a_pipe_times_out() {
    let rx_agent = agent("rx-lonely", None);
    let e = PipeListener::new(&rx_agent).accept(Buffer::Host { capacity: 4096 }, &config(200)).err().unwrap();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    let tx_agent = agent("tx-lonely", None);
    // The receiver agent exists but nobody accepts.
    let e = PipeSender::connect(&tx_agent, &rx_agent.addresses()[0], &config(300)).err().unwrap();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
}

#[test]
fn a_sender_that_gave_up_opening_is_not_served_later() {
    let rx_agent = agent("rx-late", None);
    let addr = rx_agent.addresses()[0].clone();
    let listener = PipeListener::new(&rx_agent);
    // Nobody accepts in time: this sender gives up ...
    let quitter = agent("tx-quitter", None);
    let e = PipeSender::connect(&quitter, &addr, &config(300)).err().unwrap();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    thread::sleep(Duration::from_millis(200));
    // ... and the listener, accepting late, serves the next sender instead.
    let sender = thread::spawn(move || {
        let tx_agent = agent("tx-patient", None);
        let pipe = PipeSender::connect(&tx_agent, &addr, &config(5_000)).unwrap();
        let (seg, list) = source(&tx_agent, 100);
        fill(&seg, 100, 9);
        pipe.send(&list, vec![]).unwrap();
        pipe.close().unwrap();
    });
    let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(5_000)).unwrap();
    assert_eq!(pipe.peer(), "tx-patient");
    let m = pipe.recv(None).unwrap().unwrap();
    assert_eq!(m.bytes().unwrap(), expected(100, 9).as_slice());
    drop(m);
    assert!(pipe.recv(None).unwrap().is_none());
    sender.join().unwrap();
}

/// Space another thread frees while the reader waits for the next message is credited
/// at once, even below the credit batch: else a sender waiting for that space and the
/// waiting reader would each wait for the other until they time out.
#[test]
fn space_freed_while_the_reader_waits_reaches_the_sender() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-freed", "tx-freed", None);
    // Credits only once the whole buffer is free, unless the reader waits.
    let cfg = PipeConfig { credit_batch: Some(4096), ..config(3_000) };
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &cfg).unwrap();
        let held: Vec<_> = (0..4).map(|_| pipe.recv(None).unwrap().unwrap()).collect();
        let mut held = held.into_iter();
        let first = held.next().unwrap();
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            drop(first);
        });
        let fifth = pipe.recv(None).map(|m| m.map(|m| m.seq()));
        releaser.join().unwrap();
        drop(held);
        fifth
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(3_000)).unwrap();
    let (_seg, list) = source(&tx_agent, 1000);
    for _ in 0..5 {
        pipe.send(&list, vec![]).unwrap();
    }
    assert_eq!(receiver.join().unwrap().unwrap(), Some(4), "the fifth message arrived");
}

/// While pipes exist their router owns the agent's notification queue; when the last
/// pipe end goes, what it kept that was not a pipe's comes back to the agent.
#[test]
fn other_notifications_come_back_to_the_agent_when_the_pipes_go() {
    let rx_agent = agent("rx-foreign", None);
    let tx_agent = agent("tx-foreign", None);
    let listener = PipeListener::new(&rx_agent);
    let peer = tx_agent.connect(&rx_agent.addresses()[0], None).unwrap();
    tx_agent.notify(&peer, b"not a pipe's".to_vec()).unwrap();
    // The router takes it off the agent's queue meanwhile.
    thread::sleep(Duration::from_millis(300));
    drop(listener);
    let got = rx_agent.wait_notifs(Duration::from_secs(2));
    assert_eq!(got.iter().map(|n| n.msg.as_slice()).collect::<Vec<_>>(), [b"not a pipe's".as_slice()]);
}

#[test]
fn an_interrupted_wait_for_room_leaves_the_pipe_whole() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-int", "tx-int", None);
    let (held_tx, held_rx) = std::sync::mpsc::channel::<()>();
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(10_000)).unwrap();
        // Hold the first two (the buffer is full) until the sender was interrupted.
        let held = (pipe.recv(None).unwrap().unwrap(), pipe.recv(None).unwrap().unwrap());
        held_rx.recv().unwrap();
        drop(held);
        let mut got = 2;
        while let Some(m) = pipe.recv(None).unwrap() {
            assert_eq!(m.seq(), got);
            got += 1;
        }
        got
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(10_000)).unwrap();
    let (_seg, list) = source(&tx_agent, 2048);
    pipe.send(&list, vec![]).unwrap();
    pipe.send(&list, vec![]).unwrap();
    let started = std::time::Instant::now();
    let stop_after = started + Duration::from_millis(300);
    let e = freight_core::interrupt::interruptible(
        move || std::time::Instant::now() > stop_after,
        || pipe.send(&list, vec![]).unwrap_err(),
    );
    assert!(matches!(e, Error::Interrupted(_)), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "the interrupt was not seen within the wait");
    // Nothing was taken or broken: once the receiver frees room the same send goes.
    held_tx.send(()).unwrap();
    pipe.send(&list, vec![]).unwrap();
    pipe.close().unwrap();
    assert_eq!(receiver.join().unwrap(), 3);
}

#[test]
fn an_interrupted_recv_leaves_the_pipe_whole() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-irecv", "tx-irecv", None);
    let sender = thread::spawn(move || {
        let pipe = PipeSender::connect(&tx_agent, &addr, &config(10_000)).unwrap();
        let (_seg, list) = source(&tx_agent, 512);
        thread::sleep(Duration::from_millis(600));
        pipe.send(&list, b"late".to_vec()).unwrap();
        pipe.close().unwrap();
    });
    let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(10_000)).unwrap();
    let e = freight_core::interrupt::interruptible(|| true, || pipe.recv(None).err());
    assert!(matches!(e, Some(Error::Interrupted(_))), "{e:?}");
    let m = pipe.recv(None).unwrap().unwrap();
    assert_eq!(m.tag(), b"late");
    drop(m);
    assert!(pipe.recv(None).unwrap().is_none());
    sender.join().unwrap();
}

#[test]
fn closing_a_receiver_ends_a_recv_waiting_on_another_thread() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-close", "tx-close", None);
    let sender = thread::spawn(move || {
        let pipe = PipeSender::connect(&tx_agent, &addr, &config(2_000)).unwrap();
        (tx_agent, pipe)
    });
    let pipe = Arc::new(listener.accept(Buffer::Host { capacity: 4096 }, &config(10_000)).unwrap());
    let (tx_agent, tx_pipe) = sender.join().unwrap();
    let waiting = {
        let pipe = pipe.clone();
        thread::spawn(move || {
            let started = std::time::Instant::now();
            (pipe.recv(Some(Duration::from_secs(30))).err(), started.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(200));
    pipe.close();
    let (e, waited) = waiting.join().unwrap();
    assert!(matches!(e, Some(Error::InvalidState(_))), "{e:?}");
    assert!(waited < Duration::from_secs(5), "the wait went on after close: {waited:?}");
    // The sender hears that the receiver went away.
    let (_seg, list) = source(&tx_agent, 512);
    let e = tx_pipe.send(&list, vec![]).and_then(|_| tx_pipe.drain()).unwrap_err();
    assert!(e.to_string().contains("the receiver closed the pipe"), "{e}");
}

#[test]
fn aborting_a_sender_ends_a_send_waiting_for_room_on_another_thread() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-abort", "tx-abort", None);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 4096 }, &config(10_000)).unwrap();
        // Holds both messages: the buffer stays full.
        let held = (pipe.recv(None).unwrap().unwrap(), pipe.recv(None).unwrap().unwrap());
        let e = pipe.recv(Some(Duration::from_secs(10))).err();
        drop(held);
        e.expect("the receiver hears of the abort")
    });
    let pipe = Arc::new(PipeSender::connect(&tx_agent, &addr, &config(30_000)).unwrap());
    let (_seg, list) = source(&tx_agent, 2048);
    pipe.send(&list, vec![]).unwrap();
    pipe.send(&list, vec![]).unwrap();
    let waiting = {
        let (pipe, list) = (pipe.clone(), list.clone());
        thread::spawn(move || {
            let started = std::time::Instant::now();
            (pipe.send(&list, vec![]).unwrap_err(), started.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    pipe.abort("the caller gave up");
    assert!(started.elapsed() < Duration::from_secs(1), "abort waited for the send");
    let (e, waited) = waiting.join().unwrap();
    assert!(matches!(e, Error::InvalidState(_)) && e.to_string().contains("the caller gave up"), "{e}");
    assert!(waited < Duration::from_secs(5), "the send went on after the abort: {waited:?}");
    // The receiver hears why, and later sends fail the same way.
    let e = receiver.join().unwrap();
    assert!(e.to_string().contains("the caller gave up"), "{e}");
    assert!(pipe.send(&list, vec![]).unwrap_err().to_string().contains("the caller gave up"));
    // Closing after the abort ends nothing more, and says nothing is wrong.
    pipe.close().unwrap();
}

#[test]
fn closing_after_an_abort_waits_for_the_writes_posted() {
    // Over tcp, where 64 MiB of writes take a while to land.
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-settle", "tx-settle", Some(TransportKind::Tcp));
    const LEN: usize = 16 << 20;
    let receiver = thread::spawn(move || listener.accept(Buffer::Host { capacity: 4 * LEN as u64 }, &config(30_000)));
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(30_000)).unwrap();
    let _rx_pipe = receiver.join().unwrap().unwrap();
    let seg = tx_agent.alloc(LEN).unwrap();
    let key = tx_agent.register(MemKind::Dram, seg.addr(), LEN as u64, 0).unwrap();
    let list = DescList::from_descs(MemKind::Dram, [Desc { addr: seg.addr(), len: LEN as u64, dev: 0 }]).unwrap();
    for _ in 0..4 {
        pipe.send(&list, vec![]).unwrap();
    }
    pipe.abort("the caller gave up");
    pipe.close().unwrap();
    // The caller frees the memory next: no write may still read it.
    tx_agent.deregister(key).unwrap();
}

#[test]
fn a_close_that_cannot_be_sent_breaks_the_pipe_instead_of_ending_it_later() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-close", "tx-close", None);
    let receiver = thread::spawn(move || listener.accept(Buffer::Host { capacity: 4096 }, &config(10_000)));
    let pipe = PipeSender::connect(&tx_agent, &addr, &config(10_000)).unwrap();
    let _rx_pipe = receiver.join().unwrap().unwrap();
    let (_seg, list) = source(&tx_agent, 100);
    pipe.send(&list, vec![]).unwrap();
    pipe.flush().unwrap();
    // The sender can no longer reach the receiver: its Close does not go.
    tx_agent.remove_peer("rx-close").unwrap();
    let e = pipe.close().unwrap_err();
    assert!(matches!(e, Error::UnknownPeer(_)), "{e}");
    // Tried again, or on drop, the close must not take the stream for ended.
    tx_agent.connect(&addr, None).unwrap();
    let again = pipe.close().unwrap_err();
    assert_eq!(again.to_string(), e.to_string(), "the pipe broke with the close's failure");
    assert_eq!(pipe.send(&list, vec![]).unwrap_err().to_string(), e.to_string());
}

#[test]
fn a_credit_asked_for_in_vain_is_asked_for_again() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-sync", "tx-sync", None);
    // Credits as large as the buffer: while a message is held, space freed is credited
    // only when the sender asks for it (or when the receiver is about to wait).
    let rx_config = PipeConfig { credit_batch: Some(4096), ..config(10_000) };
    let receiver = thread::spawn(move || listener.accept(Buffer::Host { capacity: 4096 }, &rx_config));
    let pipe = Arc::new(PipeSender::connect(&tx_agent, &addr, &config(5_000)).unwrap());
    let rx_pipe = receiver.join().unwrap().unwrap();
    let (_seg, list) = source(&tx_agent, 2048);
    pipe.send(&list, vec![]).unwrap();
    pipe.send(&list, vec![]).unwrap();
    let first = rx_pipe.recv(None).unwrap().unwrap();
    let _second = rx_pipe.recv(None).unwrap().unwrap();
    // The buffer is full, and the sender cannot ask for room: its Sync does not go.
    tx_agent.remove_peer("rx-sync").unwrap();
    let e = pipe.send(&list, vec![]).unwrap_err();
    assert!(matches!(e, Error::UnknownPeer(_)), "{e}");
    tx_agent.connect(&addr, None).unwrap();
    let retried = {
        let (pipe, list) = (pipe.clone(), list.clone());
        thread::spawn(move || pipe.send(&list, vec![]))
    };
    // The receiver takes the sender's new Sync while it waits for a message that does
    // not come, then frees what it asked for: the credit goes at once.
    assert!(matches!(rx_pipe.recv(Some(Duration::from_secs(1))), Err(Error::Timeout(_))));
    first.release().unwrap();
    assert_eq!(retried.join().unwrap().unwrap(), 2, "the retried send never asked for room");
}

#[test]
fn waits_longer_than_the_clock_reaches_are_long_waits_not_panics() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("rx-forever", "tx-forever", None);
    let forever = PipeConfig { timeout: Duration::MAX, ..PipeConfig::default() };
    let receiver = {
        let forever = forever.clone();
        thread::spawn(move || listener.accept(Buffer::Host { capacity: 4096 }, &forever))
    };
    let pipe = PipeSender::connect(&tx_agent, &addr, &forever).unwrap();
    let rx_pipe = receiver.join().unwrap().unwrap();
    let (_seg, list) = source(&tx_agent, 100);
    pipe.send(&list, vec![]).unwrap();
    pipe.send(&list, vec![]).unwrap();
    pipe.flush().unwrap();
    rx_pipe.recv(Some(Duration::MAX)).unwrap().expect("the first message").release().unwrap();
    rx_pipe.recv(None).unwrap().expect("the second message").release().unwrap();
    pipe.drain().unwrap();
    pipe.settle_writes().unwrap();
    pipe.close().unwrap();
    assert!(rx_pipe.recv(Some(Duration::MAX)).unwrap().is_none());
}
