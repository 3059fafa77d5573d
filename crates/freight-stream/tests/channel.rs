//! Keyed objects over pipes between agents in one process, over real sockets: mixed
//! sizes, objects larger than the buffer, several senders to one receiver, bad input.

use std::collections::HashMap;
use std::thread;
use std::time::Duration;

use freight_core::{Error, MemKind, TransportKind};
use freight_stream::{Buffer, ChannelReceiver, ChannelSender, PipeConfig, PipeListener, PipeSender};

mod common;
use common::{agent, ends, objects, pattern, Ends};

fn config() -> PipeConfig {
    PipeConfig { timeout: Duration::from_secs(10), ..PipeConfig::default() }
}

fn run(require: Option<TransportKind>, senders: usize, sizes: &[usize], capacity: u64, batch: usize) {
    let rx_agent = agent("ch-rx", require);
    let addr = rx_agent.addresses()[0].clone();
    let listener = PipeListener::new(&rx_agent);
    let handles: Vec<_> = (0..senders)
        .map(|s| {
            let addr = addr.clone();
            let sizes = sizes.to_vec();
            thread::spawn(move || {
                let tx_agent = agent(&format!("ch-tx{s}"), require);
                let pipe = PipeSender::connect(&tx_agent, &addr, &config()).unwrap();
                let channel = ChannelSender::new(pipe, batch, None).unwrap();
                let (_seg, objs) = objects(&tx_agent, &format!("s{s}-"), &sizes);
                channel.send(&objs).unwrap();
                channel.close().unwrap();
            })
        })
        .collect();
    let pipes = (0..senders).map(|_| listener.accept(Buffer::Host { capacity }, &config()).unwrap()).collect();
    let mut receiver = ChannelReceiver::new(pipes, Duration::from_secs(10));
    let mut seen: HashMap<String, (usize, bool)> = HashMap::new();
    while let Some(batch) = receiver.recv(None).unwrap() {
        for o in batch {
            let len = o.len() as usize;
            assert_eq!(o.meta, format!("len={len}").into_bytes());
            assert!(o.bytes().unwrap() == pattern(&o.key, len).as_slice(), "object {} is corrupt", o.key);
            assert!(seen.insert(o.key.clone(), (len, o.is_view())).is_none(), "{} arrived twice", o.key);
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(seen.len(), senders * sizes.len(), "every object arrives");
    for (key, (len, view)) in seen {
        assert_eq!(view, len as u64 <= capacity / 4, "{key}: views for objects that fit a message");
    }
}

#[test]
fn mixed_sizes_and_objects_larger_than_the_buffer_over_shm() {
    let sizes = [1, 1000, 70_000, 5, 300_000, 4096, 123_457, 999, 65_536, 250_000];
    run(Some(TransportKind::Shm), 1, &sizes, 128 << 10, 3);
}

#[test]
fn mixed_sizes_and_objects_larger_than_the_buffer_over_tcp() {
    let sizes = [1, 1000, 70_000, 5, 300_000, 4096, 123_457, 999, 65_536, 250_000];
    run(Some(TransportKind::Tcp), 1, &sizes, 128 << 10, 4);
}

#[test]
fn three_senders_feed_one_receiver() {
    let sizes: Vec<usize> = (0..30).map(|i| 1000 + i * 3000).collect();
    run(None, 3, &sizes, 256 << 10, 5);
}

#[test]
fn bad_batches_are_refused_whole() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("ch-bad-rx", "ch-bad-tx", None);
    let receiver = thread::spawn(move || {
        let pipe = listener.accept(Buffer::Host { capacity: 1 << 16 }, &config()).unwrap();
        let mut channel = ChannelReceiver::new(vec![pipe], Duration::from_secs(10));
        let mut keys = Vec::new();
        while let Some(batch) = channel.recv(None).unwrap() {
            keys.extend(batch.into_iter().map(|o| o.key));
        }
        keys
    });
    let pipe = PipeSender::connect(&tx_agent, &addr, &config()).unwrap();
    let channel = ChannelSender::new(pipe, 2, None).unwrap();
    let (_seg, objs) = objects(&tx_agent, "k", &[10, 20, 30]);
    let mut dup = objs.clone();
    dup[2].key = "k0".into();
    let e = channel.send(&dup).unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    let mut empty = objs.clone();
    empty[1].key = String::new();
    assert!(matches!(channel.send(&empty).unwrap_err(), Error::InvalidArgument(_)));
    let mut zero = objs.clone();
    zero[1].local.len = 0;
    assert!(channel.send(&zero).unwrap_err().to_string().contains("empty"));
    let mut mixed = objs.clone();
    mixed[1].kind = MemKind::Vram;
    assert!(channel.send(&mixed).unwrap_err().to_string().contains("same kind"));
    let mut huge_meta = objs.clone();
    huge_meta[0].meta = vec![0; 2 << 20];
    assert!(channel.send(&huge_meta).unwrap_err().to_string().contains("smaller batch"));
    channel.send(&objs).unwrap();
    channel.close().unwrap();
    assert_eq!(receiver.join().unwrap(), vec!["k0", "k1", "k2"], "only the good batch arrived");
}

#[test]
fn a_sender_that_dies_leaves_the_others_streaming_to_the_end() {
    let rx_agent = agent("ch-die-rx", None);
    let addr = rx_agent.addresses()[0].clone();
    let listener = PipeListener::new(&rx_agent);
    let spawn_sender = |name: &'static str, die: bool| {
        let addr = addr.clone();
        thread::spawn(move || {
            let tx_agent = agent(name, None);
            let channel =
                ChannelSender::new(PipeSender::connect(&tx_agent, &addr, &config()).unwrap(), 2, None).unwrap();
            let (_seg, objs) = objects(&tx_agent, &format!("{name}-"), &[1_000, 2_000, 3_000, 4_000]);
            channel.send(&objs[..2]).unwrap();
            channel.flush().unwrap();
            if die {
                thread::sleep(Duration::from_millis(300));
                tx_agent.close();
                return;
            }
            thread::sleep(Duration::from_millis(1_000));
            channel.send(&objs[2..]).unwrap();
            channel.close().unwrap();
        })
    };
    let senders = [spawn_sender("dies", true), spawn_sender("lives", false)];
    let pipes = (0..2).map(|_| listener.accept(Buffer::Host { capacity: 1 << 20 }, &config()).unwrap()).collect();
    let mut receiver = ChannelReceiver::new(pipes, Duration::from_secs(10));
    let (mut keys, mut errors) = (Vec::new(), Vec::new());
    loop {
        match receiver.recv(None) {
            Ok(Some(batch)) => keys.extend(batch.into_iter().map(|o| o.key.clone())),
            Ok(None) => break,
            // More than one error: the stream would never end (each recv times out).
            Err(e) if !errors.is_empty() => panic!("{e}, after {errors:?}"),
            Err(e) => errors.push(e),
        }
    }
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(matches!(errors[0], Error::PeerDisconnected { .. }), "{}", errors[0]);
    keys.sort();
    assert_eq!(keys, ["dies-0", "dies-1", "lives-0", "lives-1", "lives-2", "lives-3"], "the stream ends, whole");
    for s in senders {
        s.join().unwrap();
    }
}

#[test]
fn a_malformed_message_cuts_its_sender_off_before_its_space_goes_back() {
    let Ends { rx: _rx_agent, tx: tx_agent, addr, listener } = ends("ch-bad-rx", "ch-bad-tx", None);
    let sender = thread::spawn(move || {
        let pipe = PipeSender::connect(&tx_agent, &addr, &config()).unwrap();
        let (_seg, objs) = objects(&tx_agent, "x", &[100]);
        let list = freight_core::DescList::from_descs(MemKind::Dram, [objs[0].local]).unwrap();
        // Not a channel header.
        pipe.send(&list, vec![0xff; 7]).unwrap();
        pipe.drain()
    });
    let pipe = listener.accept(Buffer::Host { capacity: 1 << 20 }, &config()).unwrap();
    let mut receiver = ChannelReceiver::new(vec![pipe], Duration::from_secs(10));
    let Err(e) = receiver.recv(None) else { panic!("a malformed message must fail recv") };
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("malformed"), "{e}");
    assert!(receiver.recv(None).unwrap().is_none(), "its only sender is cut off: the stream ended");
    // The sender hears why, not a credit that would tell it the message was taken.
    let e = sender.join().unwrap().unwrap_err();
    assert!(matches!(e, Error::PeerDisconnected { .. }) && e.to_string().contains("malformed"), "{e}");
}
