//! The initiator's side of staging through a peer's docks ([`super::pipeline`] has the
//! protocol, [`super::dock`] the peer's side).
//!
//! A relay is a second connection of the fabric exchange, opened the first time a
//! request names memory the provider cannot reach one-sided. It borrows the peer's
//! docks, then one thread drives the [`Pipeline`]: it hands wire steps to the rails'
//! threads (whose completions come back as events), sends `FabricLand`/`FabricLift`
//! on the connection, and finishes requests' parts. A second thread reads the peer's
//! answers; the connection closing fails every chunk still moving, at once.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};

use super::progress::{Done, Work};
use super::Fabric;
use crate::frame_io;
use crate::tracker::Tracker;
use freight_cuda::driver::Device;
use freight_proto::error::{Error, Result};
use freight_proto::fabric::pipeline::{Action, Chunk, Pipeline};
use freight_proto::frame::{Frame, Seg};

/// Docks borrowed per peer: enough chunks in flight to keep the rails busy while the
/// peer copies others in or out of its GPU memory.
pub const DOCKS: u32 = 8;

/// The size of the docks asked for: one operation each, within what peers lend.
pub fn dock_size(chunk_size: u64) -> u64 {
    chunk_size.min(super::dock::MAX_DOCK_SIZE)
}

/// One chunk of a request that passes through a dock: the local side as a rail posts it,
/// and the peer's memory as the peer copies it.
#[derive(Clone, Copy)]
pub struct Part {
    pub read: bool,
    pub local: u64,
    pub len: u64,
    /// The GPU holding the local bytes, which then pass through the rail's own staging.
    pub gpu: Option<&'static Device>,
    /// The local registration's descriptor (host memory).
    pub desc: usize,
    pub rail: usize,
    pub seg: Seg,
}

impl Part {
    /// The part in pieces of at most `most` bytes (a dock's size), in order.
    pub fn split(self, most: u64) -> impl Iterator<Item = Part> {
        let starts = (0..self.len).step_by(most.max(1) as usize);
        starts.map(move |at| {
            let len = (self.len - at).min(most);
            Part { local: self.local + at, len, seg: Seg { addr: self.seg.addr + at, len, ..self.seg }, ..self }
        })
    }
}

/// A part of a posted request.
#[derive(Clone)]
pub struct Job {
    pub part: Part,
    pub tracker: Arc<Tracker>,
}

impl Chunk for Job {
    fn reads(&self) -> bool {
        self.part.read
    }
}

/// What the relay's driving thread hears.
pub enum Event {
    Jobs(Vec<Job>),
    /// A rail finished a wire step.
    Wire {
        token: u64,
        result: Result<()>,
    },
    /// The peer answered a `Land` or `Lift`.
    Docked {
        token: u64,
        result: Result<()>,
    },
    /// The connection closed or failed.
    Closed(Error),
    /// The relay is being dropped.
    Stop,
}

/// A peer's dock as this side addresses it.
struct DockAddress {
    remote: u64,
    /// Its key on each of the peer's rails.
    keys: Vec<u64>,
}

pub struct Relay {
    peer: Arc<str>,
    events: Sender<Event>,
    stream: TcpStream,
    threads: Vec<JoinHandle<()>>,
    /// Set once its pipeline closed: no chunk moves through it again.
    closed: Arc<AtomicBool>,
}

impl Relay {
    /// Borrows the peer's docks over `stream` (a fresh, welcomed exchange connection)
    /// and starts the relay's threads. `routes`: per local rail, the peer's address on
    /// it and the peer's rail it pairs with.
    pub fn open(
        mut stream: TcpStream,
        fabric: &Arc<Fabric>,
        routes: Vec<(u64, usize)>,
        peer: Arc<str>,
    ) -> Result<Relay> {
        let size = dock_size(fabric.chunk_size);
        frame_io::write_frame(&mut stream, &Frame::FabricDocks { count: DOCKS, size }, &[])?;
        let docks: Vec<DockAddress> = match frame_io::read_frame(&mut stream)? {
            Some(Frame::FabricDocksReply { docks, error: None }) if docks.len() == DOCKS as usize => {
                docks.into_iter().map(|(remote, keys)| DockAddress { remote, keys }).collect()
            }
            Some(Frame::FabricDocksReply { error: Some(reason), .. }) => {
                return Err(Error::RemoteRejected { peer: peer.to_string(), reason });
            }
            other => return Err(Error::Protocol(format!("fabric: expected docks, got {other:?}"))),
        };
        if docks.iter().any(|d| routes.iter().any(|&(_, rail)| rail >= d.keys.len())) {
            return Err(Error::Protocol(format!("fabric: peer '{peer}' lent docks without a key on every rail")));
        }
        // From here answers come when chunks need them: an idle relay is no failure.
        stream.set_read_timeout(None)?;
        let (events, heard) = unbounded();
        let closed = Arc::new(AtomicBool::new(false));
        let (reading, writing) = (stream.try_clone()?, stream.try_clone()?);
        let driver = Driver {
            pipeline: Pipeline::new(docks.len()),
            docks,
            routes,
            fabric: Arc::downgrade(fabric),
            stream: writing,
            events: events.clone(),
            peer: peer.clone(),
            closed: closed.clone(),
        };
        let driver =
            std::thread::Builder::new().name("freight-fabric-relay".into()).spawn(move || driver.run(heard))?;
        let relay = Relay { peer, events, stream, threads: vec![driver], closed };
        let (events, peer) = (relay.events.clone(), relay.peer.clone());
        // Should this fail, dropping the relay stops the driver and hangs up.
        let reader = std::thread::Builder::new()
            .name("freight-fabric-relay-in".into())
            .spawn(move || read(reading, &events, &peer))?;
        let mut relay = relay;
        relay.threads.push(reader);
        Ok(relay)
    }

    /// Whether it closed (the connection failed or the peer went away): a new relay
    /// must be opened for more chunks.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Fails the chunks it holds (those on the wire once the provider reports them),
    /// and hangs up so that the peer takes its docks back.
    pub fn close(&self, reason: &str) {
        self.closed.store(true, Ordering::Release);
        let e = Error::PeerDisconnected { peer: self.peer.to_string(), reason: reason.to_string() };
        let _ = self.events.send(Event::Closed(e));
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Starts `jobs` (they finish their trackers' parts, with an error if the peer is gone).
    pub fn submit(&self, jobs: Vec<Job>) {
        if let Err(e) = self.events.send(Event::Jobs(jobs)) {
            if let Event::Jobs(jobs) = e.0 {
                for j in jobs {
                    let peer = self.peer.to_string();
                    j.tracker
                        .finish_part(Err(Error::PeerDisconnected { peer, reason: "the fabric relay stopped".into() }));
                }
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.events.send(Event::Stop);
        let _ = self.stream.shutdown(Shutdown::Both);
        for t in self.threads.drain(..) {
            // A request finished by the driver could drop the last handle on it there:
            // that thread must not wait for itself (it ends after this event anyway).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Reads the peer's answers until the connection closes.
fn read(mut stream: TcpStream, events: &Sender<Event>, peer: &str) {
    let gone = |reason: String| Error::PeerDisconnected { peer: peer.to_string(), reason };
    let closed = loop {
        match frame_io::read_frame(&mut stream) {
            Ok(Some(Frame::FabricDocked { token, error })) => {
                let result =
                    error.map_or(Ok(()), |reason| Err(Error::RemoteRejected { peer: peer.to_string(), reason }));
                let _ = events.send(Event::Docked { token, result });
            }
            Ok(Some(other)) => break Error::Protocol(format!("fabric: expected a dock's answer, got {other:?}")),
            Ok(None) => break gone("the peer closed its fabric relay (its agent closed or its process died)".into()),
            Err(e) => break gone(format!("the fabric relay failed: {e}")),
        }
    };
    let _ = events.send(Event::Closed(closed));
}

struct Driver {
    pipeline: Pipeline<Job, Error>,
    docks: Vec<DockAddress>,
    routes: Vec<(u64, usize)>,
    fabric: Weak<Fabric>,
    stream: TcpStream,
    /// Its own queue, for the rails' completions and its own failures.
    events: Sender<Event>,
    peer: Arc<str>,
    closed: Arc<AtomicBool>,
}

/// How long a stopping relay waits for the provider to report chunks still on the wire.
const STOP_GRACE: Duration = Duration::from_secs(2);

impl Driver {
    fn run(mut self, heard: Receiver<Event>) {
        while let Ok(event) = heard.recv() {
            let actions = match event {
                Event::Jobs(jobs) => self.pipeline.push(jobs),
                Event::Wire { token, result } => self.pipeline.wire_done(token, result),
                Event::Docked { token, result } => self.pipeline.docked(token, result),
                Event::Closed(e) => {
                    self.closed.store(true, Ordering::Release);
                    self.pipeline.close(e)
                }
                Event::Stop => return self.stop(&heard),
            };
            self.perform(actions);
        }
    }

    /// The last handle is gone: fails what it holds, giving chunks on the wire a moment
    /// to be reported (their local bytes may move until then).
    fn stop(mut self, heard: &Receiver<Event>) {
        self.closed.store(true, Ordering::Release);
        let closed = Error::PeerDisconnected { peer: self.peer.to_string(), reason: "the local agent closed".into() };
        let actions = self.pipeline.close(closed);
        self.perform(actions);
        let deadline = Instant::now() + STOP_GRACE;
        while self.pipeline.in_flight() > 0 {
            match heard.recv_deadline(deadline) {
                Ok(Event::Wire { token, result }) => {
                    let actions = self.pipeline.wire_done(token, result);
                    self.perform(actions);
                }
                Ok(Event::Jobs(jobs)) => {
                    let actions = self.pipeline.push(jobs);
                    self.perform(actions);
                }
                Ok(_) => {}
                Err(_) => {
                    tracing::warn!(peer = %self.peer, chunks = self.pipeline.in_flight(), "fabric relay stopped with chunks the provider never reported");
                    let actions = self.pipeline.give_up();
                    self.perform(actions);
                    return;
                }
            }
        }
    }

    fn perform(&mut self, actions: Vec<Action<Job, Error>>) {
        for action in actions {
            match action {
                Action::Post { token, dock, chunk } => self.post(token, dock, chunk.part),
                Action::Land { token, dock, chunk } => {
                    self.ask(Frame::FabricLand { token, dock: dock as u32, seg: chunk.part.seg })
                }
                Action::Lift { token, dock, chunk } => {
                    self.ask(Frame::FabricLift { token, dock: dock as u32, seg: chunk.part.seg })
                }
                Action::Finish { chunk, result } => chunk.tracker.finish_part(result),
            }
        }
    }

    /// Hands a wire step to its rail; its completion comes back as an event.
    fn post(&self, token: u64, dock: usize, part: Part) {
        let Some(fabric) = self.fabric.upgrade() else {
            let e =
                Error::PeerDisconnected { peer: self.peer.to_string(), reason: "the fabric transport closed".into() };
            let _ = self.events.send(Event::Wire { token, result: Err(e) });
            return;
        };
        let (dest, peer_rail) = self.routes[part.rail];
        let d = &self.docks[dock];
        fabric.workers[part.rail].submit(vec![Work {
            read: part.read,
            local: part.local,
            len: part.len,
            desc: part.desc,
            dest,
            remote: d.remote,
            key: d.keys[peer_rail],
            done: Done::Relay { events: self.events.clone(), token },
            peer: self.peer.clone(),
            gpu: part.gpu,
        }]);
    }

    /// Sends a `Land` or `Lift`; a failed send closes the relay.
    fn ask(&mut self, frame: Frame) {
        if let Err(e) = frame_io::write_frame(&mut self.stream, &frame, &[]) {
            let e = Error::PeerDisconnected {
                peer: self.peer.to_string(),
                reason: format!("the fabric relay failed: {e}"),
            };
            let _ = self.events.send(Event::Closed(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part longer than a dock goes in dock-sized pieces that tile it on both sides.
    #[test]
    fn parts_are_cut_to_the_docks() {
        let seg = Seg { region: 3, addr: 1 << 40, len: 150 };
        let part = Part { read: true, local: 4096, len: 150, gpu: None, desc: 0, rail: 1, seg };
        let pieces: Vec<Part> = part.split(64).collect();
        let shape: Vec<(u64, u64, u64)> = pieces.iter().map(|p| (p.local, p.seg.addr, p.len)).collect();
        assert_eq!(shape, vec![(4096, 1 << 40, 64), (4160, (1 << 40) + 64, 64), (4224, (1 << 40) + 128, 22)]);
        assert!(pieces.iter().all(|p| p.seg.len == p.len && p.seg.region == 3 && p.read && p.rail == 1));
        assert_eq!(part.split(150).count(), 1);
        assert_eq!(part.split(1 << 30).next().map(|p| p.len), Some(150));
        assert_eq!(dock_size(1 << 40), super::super::dock::MAX_DOCK_SIZE);
    }
}
