//! One tcp data stream's exchange, at both ends, without sockets.
//!
//! The initiator sends messages: a WRITE's header and then its payload (the bytes its
//! segments name), or a READ's header. The target answers each one, in order: a
//! `WriteAck`, or a `ReadData` header and then the payload it asked for. Either answer
//! may carry a refusal (memory not registered, out of bounds, read-only...), which
//! fails that message only. The engine's tcp transport drives an [`Initiator`] with a
//! sender and a receiver thread per stream, and reads a target's messages with
//! [`Message::parse`] (`freight_core::transport::tcp`).
//!
//! Invariants (tested here, and through a simulated link in [`crate::pair`]):
//! - a message is framed ([`Initiator::send`]) and, once it is on the wire, awaits its
//!   answer ([`Initiator::sent`]); the caller's `J` joins it only then, so nothing that
//!   fails the stream meanwhile can finish a message whose bytes are still being written;
//! - every message given to [`Initiator::sent`] comes back exactly once: answered
//!   ([`Initiator::receive`]) or failed with its stream ([`Initiator::fail`]), or at once
//!   where the stream failed while it was written;
//! - at most the window of messages is in flight at once, being written or awaiting its
//!   answer ([`Initiator::has_room`]);
//! - answers come in the order of the messages, with their tags; an answer that is not
//!   the one expected next leaves the stream out of step, and the stream (with every
//!   message awaiting an answer on it) fails;
//! - a refusal fails its message only: the stream stays in step, since a refused
//!   WRITE's payload is still read (and dropped) by the target;
//! - a notification riding on a WRITE is delivered once the payload is in place, and
//!   only then; never for a refused WRITE ([`settle_write`]).

use std::collections::VecDeque;

use crate::error::{Error, Result};
use crate::frame::{seg_bytes, Frame, Seg};
use crate::op::OpKind;
use crate::plan::Chunk;

/// The initiator's end of one data stream: the messages sent and awaiting their
/// answers, each with the caller's `J` (what to finish once it is answered).
#[derive(Debug)]
pub struct Initiator<J> {
    peer: String,
    window: usize,
    /// The tag of the last message framed (tags start at 1).
    last_tag: u64,
    /// Messages framed and not yet on the wire (the sender writes one at a time).
    writing: usize,
    awaiting: VecDeque<Awaited<J>>,
    /// Why the stream failed, once it has: later messages fail at once.
    dead: Option<String>,
}

#[derive(Debug)]
struct Awaited<J> {
    tag: u64,
    op: OpKind,
    /// The payload a READ's answer brings.
    len: u64,
    job: J,
}

/// A message framed by [`Initiator::send`] and being written: hand it to
/// [`Initiator::sent`] once it is on the wire.
#[derive(Debug)]
#[must_use = "a framed message takes a place in the window until it is sent"]
pub struct Outgoing {
    tag: u64,
    op: OpKind,
    len: u64,
}

/// What an answer's header means for the message it answers.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer<J> {
    /// The header settles the message: the target's acceptance, or its refusal.
    Settled { job: J, result: Result<()> },
    /// `len` bytes of a READ's data follow the header, for the caller to read into the
    /// job's memory; the job is the caller's to finish from here.
    Data { job: J, len: u64 },
}

impl<J> Initiator<J> {
    /// A stream to `peer` (named in errors) with up to `window` messages awaiting
    /// answers (at least one).
    pub fn new(peer: impl Into<String>, window: usize) -> Self {
        Initiator {
            peer: peer.into(),
            window: window.max(1),
            last_tag: 0,
            writing: 0,
            awaiting: VecDeque::new(),
            dead: None,
        }
    }

    /// Whether a message may be sent now: the window has room (or the stream failed,
    /// and sending fails at once rather than wait).
    pub fn has_room(&self) -> bool {
        self.dead.is_some() || self.writing + self.awaiting.len() < self.window
    }

    /// How many messages await their answers.
    pub fn awaiting(&self) -> usize {
        self.awaiting.len()
    }

    /// Why the stream failed, once it has.
    pub fn dead(&self) -> Option<&str> {
        self.dead.as_deref()
    }

    fn disconnected(&self, reason: &str) -> Error {
        Error::PeerDisconnected { peer: self.peer.clone(), reason: reason.to_string() }
    }

    /// Frames one message: a WRITE of `segs` (whose bytes follow the header as its
    /// payload), carrying `notif` where it is the request's whole transfer, or a READ
    /// of them. The caller checks [`Initiator::has_room`] first, writes the frame (and
    /// a WRITE's payload), then hands the message to [`Initiator::sent`]. Fails on a
    /// failed stream or a message no target would take; then nothing was framed.
    pub fn send(&mut self, op: OpKind, segs: Vec<Seg>, notif: Option<Vec<u8>>) -> Result<(Frame, Outgoing)> {
        if let Some(reason) = &self.dead {
            return Err(self.disconnected(&reason.clone()));
        }
        if notif.is_some() && op == OpKind::Read {
            return Err(Error::InvalidArgument("a notification rides on a WRITE only".into()));
        }
        let len = seg_bytes(&segs)?;
        debug_assert!(self.writing + self.awaiting.len() < self.window, "sent beyond the window");
        self.last_tag += 1;
        self.writing += 1;
        let tag = self.last_tag;
        let frame = match op {
            OpKind::Write => Frame::Write { tag, segs, notif },
            OpKind::Read => Frame::Read { tag, segs },
        };
        Ok((frame, Outgoing { tag, op, len: if op == OpKind::Read { len } else { 0 } }))
    }

    /// The message is on the wire: its answer is awaited from here on, and `job` comes
    /// back with it. Where the stream failed while it was written, `job` comes back at
    /// once, with the error it fails with.
    pub fn sent(&mut self, message: Outgoing, job: J) -> Result<(), (J, Error)> {
        self.writing -= 1;
        if let Some(reason) = &self.dead {
            return Err((job, self.disconnected(&reason.clone())));
        }
        let Outgoing { tag, op, len } = message;
        self.awaiting.push_back(Awaited { tag, op, len, job });
        Ok(())
    }

    /// The header of the next answer arrived: which message it answers, and what
    /// follows. An error means the stream is out of step (the caller fails it: the
    /// message it did not match is given back by [`Initiator::fail`]).
    pub fn receive(&mut self, header: Frame) -> Result<Answer<J>> {
        if let Some(reason) = &self.dead {
            return Err(self.disconnected(&reason.clone()));
        }
        let Some(next) = self.awaiting.pop_front() else {
            return Err(Error::Protocol(format!("answer {header:?} to no message")));
        };
        let rejected = |reason| Error::RemoteRejected { peer: self.peer.clone(), reason };
        match (next.op, header) {
            (OpKind::Write, Frame::WriteAck { tag, error }) if tag == next.tag => {
                Ok(Answer::Settled { job: next.job, result: error.map_or(Ok(()), |r| Err(rejected(r))) })
            }
            (OpKind::Read, Frame::ReadData { tag, error: Some(r) }) if tag == next.tag => {
                Ok(Answer::Settled { job: next.job, result: Err(rejected(r)) })
            }
            (OpKind::Read, Frame::ReadData { tag, error: None }) if tag == next.tag => {
                Ok(Answer::Data { job: next.job, len: next.len })
            }
            (_, other) => {
                let tag = next.tag;
                self.awaiting.push_front(next);
                Err(Error::Protocol(format!("unexpected answer {other:?} for message {tag}")))
            }
        }
    }

    /// The stream failed (a write or read failed, the peer closed it or broke the
    /// protocol): every message awaiting an answer, oldest first, with the error it
    /// fails with. Messages sent later fail at once. The first reason is kept.
    pub fn fail(&mut self, reason: impl Into<String>) -> Vec<(J, Error)> {
        let reason = self.dead.get_or_insert_with(|| reason.into()).clone();
        let error = self.disconnected(&reason);
        self.awaiting.drain(..).map(|a| (a.job, error.clone())).collect()
    }
}

/// The remote side of a chunk's copies: the segments its message names.
pub fn remote_segs(chunk: &Chunk) -> Vec<Seg> {
    chunk.segs.iter().map(|o| Seg { region: o.remote_region, addr: o.remote_addr, len: o.len }).collect()
}

/// A message as the target reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// `len` bytes of payload follow, for `segs`; once they are in place (or were
    /// dropped, the write refused), answer with [`write_ack`] of what
    /// [`settle_write`] makes of it.
    Write { tag: u64, segs: Vec<Seg>, notif: Option<Vec<u8>>, len: u64 },
    /// Answer with [`read_data`], followed, where the read is accepted, by the `len`
    /// bytes `segs` name.
    Read { tag: u64, segs: Vec<Seg>, len: u64 },
}

impl Message {
    /// A data stream's message, from its header. Anything else on a data stream is a
    /// violation, and so is a payload larger than the protocol allows.
    pub fn parse(header: Frame) -> Result<Message> {
        match header {
            Frame::Write { tag, segs, notif } => Ok(Message::Write { len: seg_bytes(&segs)?, tag, segs, notif }),
            Frame::Read { tag, segs } => Ok(Message::Read { len: seg_bytes(&segs)?, tag, segs }),
            other => Err(Error::Protocol(format!("unexpected message on a data stream: {other:?}"))),
        }
    }
}

/// A WRITE's outcome once its payload was taken off the stream: the notification it
/// carries goes to `deliver` only where the payload went into place, and a
/// notification that cannot be delivered fails the write (so the initiator does not
/// report it delivered).
pub fn settle_write(
    placed: Result<()>,
    notif: Option<Vec<u8>>,
    deliver: impl FnOnce(Vec<u8>) -> Result<()>,
) -> Result<()> {
    match (placed, notif) {
        (Ok(()), Some(msg)) => deliver(msg),
        (placed, _) => placed,
    }
}

/// The answer to WRITE `tag`.
pub fn write_ack(tag: u64, outcome: &Result<()>) -> Frame {
    Frame::WriteAck { tag, error: outcome.as_ref().err().map(ToString::to_string) }
}

/// The answer to READ `tag` (its data follows where `outcome` is `Ok`).
pub fn read_data(tag: u64, outcome: &Result<()>) -> Frame {
    Frame::ReadData { tag, error: outcome.as_ref().err().map(ToString::to_string) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(len: u64) -> Vec<Seg> {
        vec![Seg { region: 1, addr: 4096, len }]
    }

    /// Frames a message and puts it on the wire at once; its tag.
    fn send<J: std::fmt::Debug>(
        s: &mut Initiator<J>,
        op: OpKind,
        segs: Vec<Seg>,
        notif: Option<Vec<u8>>,
        job: J,
    ) -> u64 {
        let (frame, out) = s.send(op, segs, notif).unwrap();
        s.sent(out, job).unwrap();
        match frame {
            Frame::Write { tag, .. } | Frame::Read { tag, .. } => tag,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn answers_settle_their_messages_in_order_and_reads_bring_their_data() {
        let mut s = Initiator::new("p", 3);
        let w = send(&mut s, OpKind::Write, seg(10), Some(b"n".to_vec()), "w");
        let r = send(&mut s, OpKind::Read, seg(20), None, "r");
        assert!(w < r && s.awaiting() == 2 && s.has_room());
        assert_eq!(s.receive(write_ack(w, &Ok(()))).unwrap(), Answer::Settled { job: "w", result: Ok(()) });
        assert_eq!(s.receive(read_data(r, &Ok(()))).unwrap(), Answer::Data { job: "r", len: 20 });
        assert_eq!(s.awaiting(), 0);
    }

    #[test]
    fn a_refusal_fails_its_message_only() {
        let mut s = Initiator::new("p", 4);
        let tags: Vec<u64> = ["a", "b", "c"].into_iter().map(|j| send(&mut s, OpKind::Read, seg(1), None, j)).collect();
        let refused = Err(Error::OutOfBounds { addr: 1, len: 2, region_addr: 3, region_len: 4 });
        assert_eq!(s.receive(read_data(tags[0], &Ok(()))).unwrap(), Answer::Data { job: "a", len: 1 });
        match s.receive(read_data(tags[1], &refused)).unwrap() {
            Answer::Settled { job: "b", result: Err(Error::RemoteRejected { peer, reason }) } => {
                assert_eq!(peer, "p");
                assert!(reason.contains("out of bounds"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.receive(read_data(tags[2], &Ok(()))).unwrap(), Answer::Data { job: "c", len: 1 });
        assert!(s.dead().is_none());
    }

    #[test]
    fn the_window_bounds_the_messages_awaiting_answers() {
        let mut s = Initiator::new("p", 2);
        send(&mut s, OpKind::Write, seg(1), None, 1);
        assert!(s.has_room());
        // A message being written takes its place too.
        let (_, out) = s.send(OpKind::Write, seg(1), None).unwrap();
        assert!(!s.has_room());
        s.sent(out, 2).unwrap();
        assert!(!s.has_room());
        assert!(matches!(s.receive(write_ack(1, &Ok(()))).unwrap(), Answer::Settled { job: 1, .. }));
        assert!(s.has_room());
        assert_eq!(Initiator::<()>::new("p", 0).window, 1, "a window of at least one");
    }

    #[test]
    fn an_answer_out_of_step_fails_the_stream_and_every_message_comes_back_once() {
        for wrong in [
            write_ack(2, &Ok(())), // the tag of the second message
            read_data(1, &Ok(())), // the right tag, the wrong kind
            Frame::Wake,           // not an answer at all
        ] {
            let mut s = Initiator::new("p", 4);
            for j in 0..3 {
                send(&mut s, OpKind::Write, seg(1), None, j);
            }
            let e = s.receive(wrong).unwrap_err();
            assert!(matches!(e, Error::Protocol(_)), "{e}");
            let failed = s.fail(e.to_string());
            assert_eq!(failed.iter().map(|(j, _)| *j).collect::<Vec<_>>(), vec![0, 1, 2]);
            assert!(failed.iter().all(|(_, e)| matches!(e, Error::PeerDisconnected { peer, .. } if peer == "p")));
            // Dead from here on: nothing is sent or answered, and the first reason stays.
            assert!(s.has_room());
            let e = s.send(OpKind::Read, seg(1), None).unwrap_err();
            assert!(matches!(&e, Error::PeerDisconnected { reason, .. } if reason.contains("unexpected")));
            assert!(s.fail("later").is_empty());
            assert!(s.dead().unwrap().contains("unexpected"));
            assert!(s.receive(write_ack(1, &Ok(()))).is_err());
        }
        let mut idle = Initiator::<u8>::new("p", 1);
        assert!(matches!(idle.receive(write_ack(1, &Ok(()))), Err(Error::Protocol(_))));
    }

    #[test]
    fn a_stream_that_fails_while_a_message_is_written_gives_its_job_back_once_written() {
        let mut s = Initiator::new("p", 2);
        send(&mut s, OpKind::Write, seg(1), None, "first");
        let (_, out) = s.send(OpKind::Write, seg(1), None).unwrap();
        // Failing the stream finishes what awaits answers, but not the message whose
        // bytes are still being written: its memory stays in use until then.
        let failed = s.fail("reset");
        assert_eq!(failed.iter().map(|(j, _)| *j).collect::<Vec<_>>(), vec!["first"]);
        let (job, e) = s.sent(out, "second").unwrap_err();
        assert!(job == "second" && matches!(e, Error::PeerDisconnected { reason, .. } if reason == "reset"));
        assert!(s.has_room() && s.awaiting() == 0);
    }

    #[test]
    fn messages_no_target_takes_are_refused_before_they_are_sent() {
        let mut s = Initiator::<u8>::new("p", 2);
        let too_long = vec![Seg { region: 1, addr: 0, len: crate::frame::MAX_PAYLOAD + 1 }];
        assert!(matches!(s.send(OpKind::Write, too_long, None), Err(Error::Protocol(_))));
        assert!(matches!(s.send(OpKind::Read, seg(1), Some(vec![1])), Err(Error::InvalidArgument(_))));
        assert_eq!(s.awaiting(), 0);
        assert_eq!(s.writing, 0, "nothing was framed");
        assert!(s.dead().is_none(), "the stream is untouched");
    }

    #[test]
    fn the_target_reads_messages_and_delivers_a_notification_only_with_its_payload_in_place() {
        let w = Message::parse(Frame::Write { tag: 4, segs: seg(7), notif: Some(b"n".to_vec()) }).unwrap();
        assert_eq!(w, Message::Write { tag: 4, segs: seg(7), notif: Some(b"n".to_vec()), len: 7 });
        assert_eq!(
            Message::parse(Frame::Read { tag: 5, segs: seg(9) }).unwrap(),
            Message::Read { tag: 5, segs: seg(9), len: 9 }
        );
        assert!(matches!(Message::parse(Frame::Wake), Err(Error::Protocol(_))));
        let mut delivered = Vec::new();
        let mut deliver = |m| {
            delivered.push(m);
            Ok(())
        };
        assert_eq!(settle_write(Ok(()), Some(b"a".to_vec()), &mut deliver), Ok(()));
        let refused = Err(Error::UnknownRegion(3));
        assert_eq!(settle_write(refused.clone(), Some(b"b".to_vec()), &mut deliver), refused);
        assert_eq!(delivered, vec![b"a".to_vec()], "never for a refused write");
        let full = Err(Error::NoSpace("queue".into()));
        assert_eq!(settle_write(Ok(()), Some(b"c".to_vec()), |_| full.clone()), full);
        assert_eq!(write_ack(3, &refused), Frame::WriteAck { tag: 3, error: Some("unknown region key 3".into()) });
    }
}
