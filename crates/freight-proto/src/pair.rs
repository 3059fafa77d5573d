//! Two ends of the protocol in one test: an initiator and a target, each with its own
//! (simulated) memory, joined by a simulated link of several data streams, and stepped
//! by a schedule the test draws. What the engine's sockets and threads do, done one
//! step at a time, in any order the protocol allows: bytes arrive in pieces of any
//! size, streams move at their own pace (so the answers of different streams arrive
//! in any order), a target reads nothing for a while (a slow consumer), or vanishes
//! (the loss of a peer). Only the protocol's own code decides what happens:
//! [`hello`] for the handshake, [`PreparedList`] and [`Plan`] for the copies,
//! [`chunk_ops`] for the messages, [`Initiator`] and [`Message`] for the streams,
//! [`Round`] for each request.
//!
//! What every schedule must show: each request settles exactly once, DONE with its
//! bytes in place or failed with a reason; no stream ever has more than its window of
//! messages awaiting answers; a notification that rides on a write is delivered only
//! once the write's bytes are in the target's memory; a refusal fails its request
//! alone; after the peer is lost, every request not yet answered fails, and none hangs.

use std::collections::VecDeque;

use proptest::prelude::*;

use crate::data_stream::{self, Answer, Initiator, Message};
use crate::desc::DescList;
use crate::error::{Error, Result};
use crate::frame::{self, Frame, Role, Seg, MAX_HEADER};
use crate::hello::{self, Gate, Introduction, Verdict};
use crate::op::OpKind;
use crate::plan::{chunk_ops, Chunk, Plan, PreparedList, RegionSpan};
use crate::region::{MemKind, RegionInfo, RemoteRegions};
use crate::round::{Finishing, Round, Status};

/// Simulated memory: regions of bytes, each at an address, some read-only.
struct Memory {
    regions: Vec<SimRegion>,
}

struct SimRegion {
    key: u64,
    addr: u64,
    bytes: Vec<u8>,
    read_only: bool,
}

impl SimRegion {
    /// What its owner tells peers of it, and checks their accesses against.
    fn info(&self) -> RegionInfo {
        RegionInfo {
            key: self.key,
            kind: MemKind::Dram,
            addr: self.addr,
            len: self.bytes.len() as u64,
            dev: 0,
            shared: None,
            gpu: None,
            read_only: self.read_only,
        }
    }
}

impl Memory {
    fn region(&self, key: u64) -> Option<&SimRegion> {
        self.regions.iter().find(|r| r.key == key)
    }

    /// The target's check of a segment a peer names (what the registry's
    /// `get_checked` does): a known region, in bounds, writable where it is written.
    fn check(&self, segs: &[Seg], write: bool) -> Result<()> {
        for s in segs {
            let info = self.region(s.region).ok_or(Error::UnknownRegion(s.region))?.info();
            info.check_contains(s.addr, s.len)?;
            if write {
                info.check_writable()?;
            }
        }
        Ok(())
    }

    fn bytes(&self, key: u64, addr: u64, len: u64) -> &[u8] {
        let r = self.region(key).expect("checked");
        let at = (addr - r.addr) as usize;
        &r.bytes[at..at + len as usize]
    }

    fn bytes_mut(&mut self, key: u64, addr: u64, len: u64) -> &mut [u8] {
        let r = self.regions.iter_mut().find(|r| r.key == key).expect("checked");
        let at = (addr - r.addr) as usize;
        &mut r.bytes[at..at + len as usize]
    }

    /// What a peer learns of this memory from metadata.
    fn advertised(&self) -> Vec<RegionInfo> {
        self.regions.iter().map(SimRegion::info).collect()
    }

    fn span(&self, addr: u64, len: u64) -> Result<RegionSpan> {
        let r = self
            .regions
            .iter()
            .find(|r| r.addr <= addr && addr + len <= r.addr + r.bytes.len() as u64)
            .ok_or(Error::NotRegistered { kind: "DRAM".into(), addr, len, dev: 0 })?;
        Ok(RegionSpan { key: r.key, start: r.addr, end: r.addr + r.bytes.len() as u64 })
    }
}

/// One direction of a stream: bytes written and not yet arrived, and bytes arrived and
/// not yet read.
#[derive(Default)]
struct Wire {
    in_flight: VecDeque<u8>,
    arrived: Vec<u8>,
}

impl Wire {
    fn write(&mut self, header: &Frame, payload: &[u8]) {
        self.in_flight.extend(frame::encode(header));
        self.in_flight.extend(payload);
    }

    fn deliver(&mut self, n: usize) {
        let n = n.min(self.in_flight.len());
        self.arrived.extend(self.in_flight.drain(..n));
    }

    /// The next header, once it has arrived whole (what a reader's `read_frame` returns).
    fn header(&mut self) -> Result<Option<Frame>> {
        let Some(n) = frame::declared_len(&self.arrived, MAX_HEADER)? else { return Ok(None) };
        if self.arrived.len() < 4 + n {
            return Ok(None);
        }
        let f = frame::decode(&self.arrived[4..4 + n])?;
        self.arrived.drain(..4 + n);
        Ok(Some(f))
    }

    /// `n` bytes of payload, once they have all arrived.
    fn payload(&mut self, n: u64) -> Option<Vec<u8>> {
        (self.arrived.len() as u64 >= n).then(|| self.arrived.drain(..n as usize).collect())
    }
}

/// A part of a request on a stream: request `req`, chunk `chunk`.
type Job = (usize, usize);

/// The target's end of one stream: a message whose payload it still waits for.
#[derive(Default)]
struct TargetEnd {
    waiting: Option<Message>,
}

/// The initiator's end of one stream: parts queued for room in the window, the
/// machine, and the READ whose data it is reading.
struct InitiatorEnd {
    queued: VecDeque<Job>,
    machine: Initiator<Job>,
    reading: Option<(Job, u64)>,
}

struct Request {
    op: OpKind,
    chunks: Vec<Chunk>,
    round: Round<()>,
    notif: Option<Vec<u8>>,
    /// How many times a settled round was seen: exactly once is the rule.
    settled: usize,
    /// Parts reported (each exactly once).
    reports: Vec<usize>,
}

/// The two ends and the link between them.
struct Pair {
    local: Memory,
    remote: Memory,
    /// The initiator's view of the target's regions (its metadata), possibly stale.
    view: RemoteRegions,
    streams: Vec<(InitiatorEnd, TargetEnd, Wire, Wire)>,
    requests: Vec<Request>,
    /// Notifications the target delivered, in order.
    delivered: Vec<Vec<u8>>,
    lost: bool,
}

const LOCAL: u64 = 0x10_0000;
const REMOTE: u64 = 0x20_0000;
const READ_ONLY: u64 = 0x30_0000;
/// Where reads read from (written by nobody) in the target's first region.
const READ_AREA: u64 = 16 << 10;

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(0x9e37_79b9) ^ seed) as u8).collect()
}

impl Pair {
    /// Opens `streams` data streams, each with a hello judged by the target.
    fn new(streams: usize, window: usize) -> Pair {
        let local =
            Memory { regions: vec![SimRegion { key: 1, addr: LOCAL, bytes: pattern(64 << 10, 1), read_only: false }] };
        let remote = Memory {
            regions: vec![
                SimRegion { key: 1, addr: REMOTE, bytes: pattern(32 << 10, 2), read_only: false },
                SimRegion { key: 2, addr: READ_ONLY, bytes: pattern(4 << 10, 3), read_only: true },
            ],
        };
        let mut view = remote.advertised();
        // A region the target had when its metadata was read, and deregistered since.
        view.push(RegionInfo { key: 3, addr: 0x40_0000, len: 4096, ..view[1].clone() });
        let mut pair = Pair {
            local,
            remote,
            view: RemoteRegions::new(&view),
            streams: Vec::new(),
            requests: Vec::new(),
            delivered: Vec::new(),
            lost: false,
        };
        for i in 0..streams {
            let admitted = pair.open(i as u32, TARGET_ID, SECRET);
            assert_eq!(admitted, Ok(()));
            pair.streams.push((
                InitiatorEnd { queued: VecDeque::new(), machine: Initiator::new("target", window), reading: None },
                TargetEnd::default(),
                Wire::default(),
                Wire::default(),
            ));
        }
        pair
    }

    /// The handshake of data stream `index` through a wire of its own: hello, verdict,
    /// answer, the dialler's reading of it.
    fn open(&self, index: u32, target_id: u64, secret: &[u8]) -> Result<()> {
        let intro = Introduction {
            from_name: "initiator".into(),
            from_id: 5,
            target_id,
            secret: secret.to_vec(),
            token: vec![],
        };
        let role = Role::Data { index };
        let (mut there, mut back) = (Wire::default(), Wire::default());
        there.write(&intro.hello(role), &[]);
        there.deliver(usize::MAX);
        let gate = Gate { agent_id: TARGET_ID, secret: SECRET, token: None, serve_metadata: true };
        let verdict = hello::judge(&gate, there.header()?);
        if let Verdict::Admit { role: admitted, from } = &verdict {
            assert_eq!((admitted, from.as_str()), (&role, "initiator"));
        }
        back.write(&hello::answer(&gate, &verdict, Vec::new), &[]);
        back.deliver(usize::MAX);
        hello::dialler_reads(role, back.header()?, "target").map(|_| ())
    }

    /// Prepares and posts a request: its plan cut into messages, spread over the
    /// streams from stream `first` on.
    fn post(
        &mut self,
        op: OpKind,
        local: (u64, u64),
        remote: (u64, u64),
        notif: Option<Vec<u8>>,
        first: usize,
    ) -> usize {
        let list = |(addr, len): (u64, u64)| {
            let mut l = DescList::new(MemKind::Dram);
            l.push(crate::desc::Desc { addr, len, dev: 0 }).unwrap();
            l
        };
        let l = PreparedList::resolve(&list(local), |a, n, _| self.local.span(a, n)).unwrap();
        let r = PreparedList::remote(&list(remote), &self.view).unwrap();
        let plan = Plan::build(&l, None, &r, None).unwrap();
        let chunks = chunk_ops(plan.copies(), 1000, 3);
        let notif = notif.filter(|_| op == OpKind::Write && chunks.len() == 1);
        let mut round = Round::default();
        round.begin(chunks.len() as u64, ()).unwrap();
        let id = self.requests.len();
        let n = self.streams.len();
        for c in 0..chunks.len() {
            self.streams[(first + c) % n].0.queued.push_back((id, c));
        }
        self.requests.push(Request { op, reports: vec![0; chunks.len()], chunks, round, notif, settled: 0 });
        id
    }

    /// A part is done or failed: its request's round hears of it, once.
    fn report(&mut self, (req, chunk): Job, result: Result<()>) {
        let r = &mut self.requests[req];
        r.reports[chunk] += 1;
        assert_eq!(r.reports[chunk], 1, "request {req} part {chunk} reported twice");
        if let Some(Finishing { outcome, .. }) = r.round.report(1, result) {
            r.round.settle(outcome);
            r.settled += 1;
        }
    }

    /// The initiator's sender on stream `s`: sends what the window has room for.
    fn send(&mut self, s: usize) {
        loop {
            let end = &mut self.streams[s].0;
            if !end.machine.has_room() {
                break;
            }
            let Some(job) = end.queued.pop_front() else { break };
            let req = &self.requests[job.0];
            let chunk = &req.chunks[job.1];
            let segs = data_stream::remote_segs(chunk);
            let payload: Vec<u8> = match req.op {
                OpKind::Write => chunk
                    .segs
                    .iter()
                    .flat_map(|o| self.local.bytes(o.local_region, o.local_addr, o.len).to_vec())
                    .collect(),
                OpKind::Read => Vec::new(),
            };
            let (op, notif) = (req.op, req.notif.clone());
            let (header, out) = match self.streams[s].0.machine.send(op, segs, notif) {
                Ok(framed) => framed,
                Err(e) => {
                    self.report(job, Err(e));
                    continue;
                }
            };
            if !self.lost {
                self.streams[s].2.write(&header, &payload);
            }
            if let Err((job, e)) = self.streams[s].0.machine.sent(out, job) {
                self.report(job, Err(e));
            }
            assert!(self.streams[s].0.machine.awaiting() <= WINDOW_MOST, "beyond the window");
        }
    }

    /// The target on stream `s` reads what has arrived and answers it.
    fn serve(&mut self, s: usize) {
        loop {
            let (_, target, to_target, to_initiator) = &mut self.streams[s];
            let message = match target.waiting.take() {
                Some(m) => m,
                None => match to_target.header().unwrap() {
                    Some(h) => Message::parse(h).unwrap(),
                    None => return,
                },
            };
            match message {
                Message::Write { tag, segs, notif, len } => {
                    let Some(payload) = to_target.payload(len) else {
                        target.waiting = Some(Message::Write { tag, segs, notif, len });
                        return;
                    };
                    let placed = self.remote.check(&segs, true).map(|()| {
                        let mut at = 0;
                        for sg in &segs {
                            self.remote
                                .bytes_mut(sg.region, sg.addr, sg.len)
                                .copy_from_slice(&payload[at..at + sg.len as usize]);
                            at += sg.len as usize;
                        }
                    });
                    let (remote, delivered) = (&self.remote, &mut self.delivered);
                    let outcome = data_stream::settle_write(placed, notif, |msg| {
                        // Delivered only with the write's bytes in place.
                        let whole: Vec<u8> =
                            segs.iter().flat_map(|sg| remote.bytes(sg.region, sg.addr, sg.len).to_vec()).collect();
                        assert_eq!(whole, payload, "a notification before its data");
                        delivered.push(msg);
                        Ok(())
                    });
                    self.streams[s].3.write(&data_stream::write_ack(tag, &outcome), &[]);
                }
                Message::Read { tag, segs, len: _ } => {
                    let outcome = self.remote.check(&segs, false);
                    let data: Vec<u8> = match outcome {
                        Ok(()) => {
                            segs.iter().flat_map(|sg| self.remote.bytes(sg.region, sg.addr, sg.len).to_vec()).collect()
                        }
                        Err(_) => Vec::new(),
                    };
                    to_initiator.write(&data_stream::read_data(tag, &outcome), &data);
                }
            }
        }
    }

    /// The initiator's receiver on stream `s` reads the answers that have arrived.
    fn receive(&mut self, s: usize) {
        loop {
            let (end, _, _, wire) = &mut self.streams[s];
            if let Some((job, len)) = end.reading.take() {
                let Some(data) = wire.payload(len) else {
                    end.reading = Some((job, len));
                    return;
                };
                let mut at = 0;
                for o in &self.requests[job.0].chunks[job.1].segs {
                    self.local
                        .bytes_mut(o.local_region, o.local_addr, o.len)
                        .copy_from_slice(&data[at..at + o.len as usize]);
                    at += o.len as usize;
                }
                self.report(job, Ok(()));
                continue;
            }
            let Some(header) = wire.header().unwrap() else { return };
            match end.machine.receive(header).expect("answers in step") {
                Answer::Settled { job, result } => self.report(job, result),
                Answer::Data { job, len } => self.streams[s].0.reading = Some((job, len)),
            }
        }
    }

    /// The peer is gone: its connections close, and everything not answered fails.
    fn lose_peer(&mut self) {
        self.lost = true;
        for s in 0..self.streams.len() {
            let end = &mut self.streams[s].0;
            let mut failed = end.machine.fail("the peer closed the connection");
            if let Some((job, _)) = end.reading.take() {
                failed.push((job, Error::Io("connection closed inside a payload".into())));
            }
            for (job, e) in failed {
                self.report(job, Err(e));
            }
            let (_, _, to_target, to_initiator) = &mut self.streams[s];
            *to_target = Wire::default();
            *to_initiator = Wire::default();
        }
        // What was queued behind the window fails as the sender tries it.
        for s in 0..self.streams.len() {
            self.send(s);
        }
    }

    /// One step of the schedule.
    fn step(&mut self, step: Step) {
        let n = self.streams.len();
        match step {
            Step::Send(s) => self.send(s % n),
            Step::Deliver { stream, back, bytes } if !self.lost => {
                let (_, _, there, back_wire) = &mut self.streams[stream % n];
                if back {
                    back_wire.deliver(bytes)
                } else {
                    there.deliver(bytes)
                }
            }
            Step::Serve(s) if !self.lost => self.serve(s % n),
            Step::Receive(s) if !self.lost => self.receive(s % n),
            Step::LosePeer if !self.lost => self.lose_peer(),
            _ => {}
        }
    }

    /// Runs every stream until nothing moves: what a schedule that stops leaves, done.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if self.requests.iter().all(|r| r.settled == 1) {
                return;
            }
            for s in 0..self.streams.len() {
                self.send(s);
                if !self.lost {
                    self.streams[s].2.deliver(usize::MAX);
                    self.serve(s);
                    self.streams[s].3.deliver(usize::MAX);
                    self.receive(s);
                }
            }
        }
        panic!("requests still pending after the link drained: a hang");
    }
}

const TARGET_ID: u64 = 77;
const SECRET: &[u8] = b"secret-of-target";
const WINDOW_MOST: usize = 4;

#[derive(Debug, Clone)]
enum Step {
    Send(usize),
    Deliver { stream: usize, back: bool, bytes: usize },
    Serve(usize),
    Receive(usize),
    LosePeer,
}

fn steps(lose: bool) -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        4 => (0..4usize).prop_map(Step::Send),
        8 => (0..4usize, any::<bool>(), 1..3000usize).prop_map(|(stream, back, bytes)| Step::Deliver { stream, back, bytes }),
        4 => (0..4usize).prop_map(Step::Serve),
        4 => (0..4usize).prop_map(Step::Receive),
        (if lose { 1 } else { 0 }) => Just(Step::LosePeer),
    ];
    prop::collection::vec(step, 0..300)
}

/// A request a test draws: its direction, its length, what it names at the target.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// Memory the target serves.
    Fine,
    /// Its read-only region (refused for a write).
    ReadOnly,
    /// A region the target deregistered after the initiator read its metadata.
    Gone,
}

fn requests() -> impl Strategy<Value = Vec<(bool, u64, Target, bool)>> {
    let target = prop_oneof![6 => Just(Target::Fine), 1 => Just(Target::ReadOnly), 1 => Just(Target::Gone)];
    prop::collection::vec((any::<bool>(), 1..2500u64, target, any::<bool>()), 1..8)
}

/// Posts the drawn requests on `pair`, each in memory of its own; what each should end as.
fn post_all(pair: &mut Pair, drawn: &[(bool, u64, Target, bool)]) -> Vec<(usize, Option<&'static str>)> {
    let (mut local_at, mut write_at, mut read_at) = (LOCAL, REMOTE, REMOTE + READ_AREA);
    let mut expect = Vec::new();
    for (i, &(write, len, target, notif)) in drawn.iter().enumerate() {
        let op = if write { OpKind::Write } else { OpKind::Read };
        let remote = match target {
            Target::Fine if write => (write_at, len),
            Target::Fine => (read_at, len),
            Target::ReadOnly => (READ_ONLY, len.min(4096)),
            Target::Gone => (0x40_0000, len.min(4096)),
        };
        let len = remote.1;
        let refusal = match (target, write) {
            (Target::Gone, _) => Some("unknown region"),
            (Target::ReadOnly, true) => Some("read-only"),
            _ => None,
        };
        if write {
            write_at += len;
        } else if matches!(target, Target::Fine) {
            read_at += len;
        }
        let notif = notif.then(|| format!("request {i}").into_bytes());
        expect.push((pair.post(op, (local_at, len), remote, notif, i), refusal));
        local_at += len;
    }
    expect
}

/// What every schedule must leave: each request settled once, DONE with its bytes in
/// place or failed for the reason expected; notifications only of writes that landed.
fn check_outcomes(pair: &Pair, expect: &[(usize, Option<&'static str>)]) {
    for &(id, refusal) in expect {
        let r = &pair.requests[id];
        assert_eq!(r.settled, 1, "request {id} settled {} times", r.settled);
        assert!(r.reports.iter().all(|&n| n == 1), "request {id}: parts reported {:?}", r.reports);
        match (r.round.status(), refusal) {
            (Status::Done, None) => {
                for o in r.chunks.iter().flat_map(|c| &c.segs) {
                    assert_eq!(
                        pair.local.bytes(o.local_region, o.local_addr, o.len),
                        pair.remote.bytes(o.remote_region, o.remote_addr, o.len),
                        "request {id}: bytes differ"
                    );
                }
            }
            (Status::Error(Error::RemoteRejected { reason, .. }), Some(why)) => {
                assert!(reason.contains(why), "request {id}: {reason}")
            }
            (Status::Error(Error::PeerDisconnected { .. } | Error::Io(_)), _) if pair.lost => {}
            (status, refusal) => panic!("request {id}: {status:?}, expected {refusal:?} (lost: {})", pair.lost),
        }
    }
    for msg in &pair.delivered {
        let id: usize = std::str::from_utf8(msg).unwrap()["request ".len()..].parse().unwrap();
        assert!(expect[id].1.is_none(), "a refused write's notification was delivered");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any schedule, then the link drains: every request ends as it should.
    #[test]
    fn every_request_settles_once_whatever_the_schedule(
        drawn in requests(),
        schedule in steps(false),
        streams in 1..4usize,
        window in 1..=WINDOW_MOST,
    ) {
        let mut pair = Pair::new(streams, window);
        let expect = post_all(&mut pair, &drawn);
        for step in schedule {
            pair.step(step);
            for (end, ..) in &pair.streams {
                prop_assert!(end.machine.awaiting() <= window);
            }
        }
        pair.drain();
        check_outcomes(&pair, &expect);
        let writes_with_notif = expect.iter().filter(|(id, refusal)| {
            refusal.is_none() && pair.requests[*id].notif.is_some()
        }).count();
        prop_assert_eq!(pair.delivered.len(), writes_with_notif);
    }

    /// The peer may vanish at any point: nothing hangs, nothing is reported twice, and
    /// whatever was not answered fails.
    #[test]
    fn losing_the_peer_fails_what_was_not_answered_and_nothing_hangs(
        drawn in requests(),
        schedule in steps(true),
        streams in 1..4usize,
    ) {
        let mut pair = Pair::new(streams, 2);
        let expect = post_all(&mut pair, &drawn);
        for step in schedule {
            pair.step(step);
        }
        pair.step(Step::LosePeer);
        pair.drain();
        check_outcomes(&pair, &expect);
    }
}

#[test]
fn a_target_that_reads_nothing_holds_each_stream_to_its_window() {
    let mut pair = Pair::new(2, 3);
    let ids: Vec<usize> = (0..4)
        .map(|i| pair.post(OpKind::Write, (LOCAL + i * 4000, 4000), (REMOTE + i * 4000, 4000), None, 0))
        .collect();
    // 16 messages of 1000 bytes over two streams; the target takes nothing.
    for _ in 0..10 {
        for s in 0..2 {
            pair.send(s);
            pair.streams[s].2.deliver(usize::MAX);
        }
    }
    for (end, _, wire, _) in &pair.streams {
        assert_eq!(end.machine.awaiting(), 3, "three messages in flight, no more");
        assert_eq!(end.queued.len(), 5, "the rest wait for room");
        assert!(wire.arrived.len() < 3 * 1100, "only the window's bytes are on the link");
    }
    assert!(pair.requests.iter().all(|r| r.round.status() == &Status::Pending));
    // The target resumes: everything completes.
    pair.drain();
    check_outcomes(&pair, &ids.iter().map(|&id| (id, None)).collect::<Vec<_>>());
}

#[test]
fn a_stale_or_forged_hello_opens_no_stream() {
    let pair = Pair::new(1, 1);
    let e = pair.open(0, TARGET_ID - 1, SECRET).unwrap_err();
    assert!(matches!(&e, Error::Auth(m) if m.contains("stale metadata")), "{e}");
    let e = pair.open(0, TARGET_ID, b"secret-of-someone").unwrap_err();
    assert!(matches!(&e, Error::Auth(m) if m.contains("wrong secret")), "{e}");
}

#[test]
fn a_multi_stream_request_completes_only_when_its_last_part_is_answered() {
    let mut pair = Pair::new(3, 2);
    let id = pair.post(OpKind::Read, (LOCAL, 3000), (REMOTE + READ_AREA, 3000), None, 0);
    // Streams 2 and 1 answer; stream 0 has not yet.
    for s in [2, 1] {
        pair.send(s);
        pair.streams[s].2.deliver(usize::MAX);
        pair.serve(s);
        pair.streams[s].3.deliver(usize::MAX);
        pair.receive(s);
    }
    assert_eq!(pair.requests[id].round.status(), &Status::Pending);
    assert_eq!(pair.requests[id].reports, vec![0, 1, 1]);
    pair.drain();
    check_outcomes(&pair, &[(id, None)]);
}
