//! The receiving end: accepts pipes, hands out messages in order, returns space.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use freight_core::{interrupt, Agent, Desc, DescList, Error, MemKind, Result, SharedSegment};
use parking_lot::Mutex;

use super::{check_buffer, deadline_after, wait_message, window_error, Buffer, BufferInfo, PipeConfig, ALIGN};
use crate::next::Next;
use crate::proto::Msg;
use crate::router::Router;
use crate::window::{RecvWindow, Slot};

/// Accepts pipes that senders open to this agent.
pub struct PipeListener {
    router: Arc<Router>,
}

impl PipeListener {
    pub fn new(agent: &Arc<Agent>) -> PipeListener {
        PipeListener { router: Router::of(agent) }
    }

    /// Waits up to `config.timeout` for a sender to open a pipe, and sets it up with
    /// `buffer`. A sender that cannot be served is told why (`Refuse`).
    pub fn accept(&self, buffer: Buffer, config: &PipeConfig) -> Result<PipeReceiver> {
        config.validate()?;
        let deadline = deadline_after(config.timeout);
        let (peer, pipe, addresses) = loop {
            let opened = interrupt::until(deadline, |slice| match self.router.opens().recv_timeout(slice) {
                Ok(open) => Ok(Some(open)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    Err(Error::InvalidState("the agent's pipe router closed".into()))
                }
            })?;
            let (peer, msg) = opened.ok_or_else(|| {
                Error::Timeout(format!("no sender opened a pipe within {:.1}s", config.timeout.as_secs_f64()))
            })?;
            let Msg::Open { pipe, addresses } = msg else {
                return Err(Error::Protocol(format!("'{peer}' sent {msg:?} where a pipe request was due")));
            };
            // A sender that stopped waiting for this one is not served.
            if !self.router.withdrawn(&peer, pipe) {
                break (peer, pipe, addresses);
            }
            tracing::debug!(peer = %peer, pipe, "skipped a pipe request its sender gave up");
        };
        RecvEnd::set_up(&self.router, &peer, pipe, &addresses, buffer, config)
            .map(|end| PipeReceiver { end: Arc::new(end) })
            .inspect_err(|e| {
                let _ = self.router.send(&peer, &Msg::Refuse { pipe, reason: e.to_string() });
                // What the sender sent before it heard is for no one.
                self.router.unsubscribe(&peer, pipe);
            })
    }
}

/// The receiving end of one pipe. Dropping it before the stream ended tells the sender.
pub struct PipeReceiver {
    end: Arc<RecvEnd>,
}

/// A message in the receiver's buffer. Its bytes stay put until it is released
/// (explicitly or by dropping it); then the sender may write over them.
pub struct Message {
    end: Arc<RecvEnd>,
    seq: u64,
    start: u64,
    offset: u64,
    len: u64,
    tag: Vec<u8>,
    released: bool,
}

struct RecvEnd {
    router: Arc<Router>,
    peer: String,
    pipe: u64,
    inbox: Receiver<Msg>,
    buffer: BufferInfo,
    /// The buffer when this end allocated it: the segment and its registration.
    owned: Option<(Arc<SharedSegment>, u64)>,
    timeout: Duration,
    state: Mutex<RecvState>,
    /// One reader at a time hands out messages.
    reading: Mutex<()>,
}

struct RecvState {
    window: RecvWindow,
    /// Announced messages not handed out yet (writes may finish out of order): seq ->
    /// (slot, payload length, tag).
    pending: BTreeMap<u64, (Slot, u64, Vec<u8>)>,
    /// Messages in the stream, once the sender closed it.
    end: Option<u64>,
    broken: Option<Error>,
}

impl RecvState {
    fn new(window: RecvWindow) -> RecvState {
        RecvState { window, pending: BTreeMap::new(), end: None, broken: None }
    }

    /// Files the announcement of a message that landed in a buffer of `capacity`
    /// bytes, refusing (as a protocol error) one that an honest sender cannot have
    /// sent: a message announced twice, longer than its slot, further ahead than the
    /// buffer holds, or past the end of a closed stream (it would never be handed out).
    fn file_data(&mut self, peer: &str, capacity: u64, slot: Slot, len: u64, tag: Vec<u8>) -> Result<()> {
        let next = self.window.next_seq();
        // Every message takes at least ALIGN bytes of the buffer: a sender that
        // follows credits has no more than this many on the way.
        let most_ahead = capacity.div_ceil(ALIGN);
        if slot.seq < next || self.pending.contains_key(&slot.seq) || len > slot.len {
            return Err(Error::Protocol(format!(
                "pipe from '{peer}': message {} announced twice or with {len} bytes in a {}-byte slot",
                slot.seq, slot.len
            )));
        }
        if slot.seq - next >= most_ahead {
            return Err(Error::Protocol(format!(
                "pipe from '{peer}': message {} announced while {} is due; no more than {most_ahead} fit the buffer",
                slot.seq, next
            )));
        }
        if let Some(end) = self.end.filter(|&end| slot.seq >= end) {
            return Err(Error::Protocol(format!(
                "pipe from '{peer}': message {} announced after the stream was closed at {end} messages",
                slot.seq
            )));
        }
        self.pending.insert(slot.seq, (slot, len, tag));
        Ok(())
    }

    /// Files the sender's word that the stream has `messages` messages, refusing (as a
    /// protocol error) a count below a message that arrived already, handed out or
    /// still pending: the messages past it would be dropped unseen.
    fn file_close(&mut self, peer: &str, messages: u64) -> Result<()> {
        // Pending messages all lie at or past the next one due (see `file_data`).
        let arrived = self.pending.last_key_value().map_or(self.window.next_seq(), |(&seq, _)| seq + 1);
        if messages < arrived {
            return Err(Error::Protocol(format!(
                "pipe from '{peer}': closed after {messages} messages, but message {} arrived",
                arrived - 1
            )));
        }
        self.end = Some(messages);
        Ok(())
    }
}

impl RecvEnd {
    fn set_up(
        router: &Arc<Router>,
        peer: &str,
        pipe: u64,
        addresses: &[String],
        buffer: Buffer,
        config: &PipeConfig,
    ) -> Result<RecvEnd> {
        let agent = router.agent();
        know_peer(agent, peer, addresses)?;
        let (buffer, owned) = match buffer {
            Buffer::Host { capacity } => {
                let len = usize::try_from(capacity).map_err(|_| Error::InvalidArgument("buffer too large".into()))?;
                let info = BufferInfo { kind: MemKind::Dram, addr: 0, len: capacity, dev: 0 };
                check_buffer(&info)?;
                let segment = agent.alloc(len)?;
                let key = agent.register(MemKind::Dram, segment.addr(), capacity, 0)?;
                (BufferInfo { addr: segment.addr(), ..info }, Some((segment, key)))
            }
            Buffer::Registered(info) => {
                check_buffer(&info)?;
                let whole = DescList::from_descs(info.kind, [Desc { addr: info.addr, len: info.len, dev: info.dev }])?;
                agent.prepare_local(&whole)?;
                (info, None)
            }
        };
        let batch = config.credit_batch.unwrap_or(buffer.len / 4);
        let window = RecvWindow::new(buffer.len, batch).map_err(|e| window_error(peer, e))?;
        let inbox = router.subscribe(peer, pipe);
        let end = RecvEnd {
            router: router.clone(),
            peer: peer.to_string(),
            pipe,
            inbox,
            buffer: buffer.clone(),
            owned,
            timeout: config.timeout,
            state: Mutex::new(RecvState::new(window)),
            reading: Mutex::new(()),
        };
        router.send(peer, &Msg::Accept { pipe, buffer, credit_batch: batch })?;
        tracing::info!(peer, pipe, capacity = end.buffer.len, kind = %end.buffer.kind.as_str(), "pipe accepted");
        Ok(end)
    }

    fn agent(&self) -> &Agent {
        self.router.agent()
    }

    /// Files a message from the sender.
    fn take(&self, msg: Msg) {
        let mut st = self.state.lock();
        match msg {
            Msg::Data { slot, len, tag, .. } => {
                if let Err(e) = st.file_data(&self.peer, self.buffer.len, Slot::from(slot), len, tag) {
                    self.fail(&mut st, e);
                }
            }
            Msg::Close { messages, .. } => {
                if let Err(e) = st.file_close(&self.peer, messages) {
                    self.fail(&mut st, e);
                }
            }
            Msg::Sync { upto, .. } => {
                if let Some(credit) = st.window.want(upto) {
                    drop(st);
                    self.offer_credit(credit);
                }
            }
            Msg::Abort { reason, .. } => {
                st.broken = Some(Error::PeerDisconnected {
                    peer: self.peer.clone(),
                    reason: format!("the sender aborted the pipe: {reason}"),
                })
            }
            other => {
                tracing::warn!(peer = %self.peer, pipe = self.pipe, msg = ?other, "unexpected message on a receiving pipe")
            }
        }
    }

    /// Marks the pipe broken and tells the sender why.
    fn fail(&self, st: &mut RecvState, e: Error) -> Error {
        st.broken = Some(e.clone());
        let _ = self.router.send(&self.peer, &Msg::Abort { pipe: self.pipe, reason: e.to_string() });
        e
    }

    fn next(self: &Arc<Self>, wait: Duration) -> Result<Next<Message>> {
        let _reader = self.reading.lock();
        let deadline = deadline_after(wait);
        loop {
            // File what already arrived first: a Close among it tells `send_credit` that
            // a sender which has since gone needs no credit.
            while let Ok(msg) = self.inbox.try_recv() {
                self.take(msg);
            }
            let credit = {
                let mut st = self.state.lock();
                if let Some(e) = &st.broken {
                    return Err(e.clone());
                }
                let next = st.window.next_seq();
                if let Some((slot, len, tag)) = st.pending.remove(&next) {
                    if let Err(e) = st.window.accept(slot) {
                        let e = window_error(&self.peer, e);
                        return Err(self.fail(&mut st, e));
                    }
                    let offset = slot.offset(self.buffer.len);
                    return Ok(Next::Item(Message {
                        end: self.clone(),
                        seq: slot.seq,
                        start: slot.start,
                        offset,
                        len,
                        tag,
                        released: false,
                    }));
                }
                if st.end == Some(next) {
                    return Ok(Next::End);
                }
                // About to wait: space freed but not yet credited must not stay hidden
                // from a sender that may be waiting for it.
                st.window.flush()
            };
            // A sender that takes no credit is stuck: say so rather than wait it out
            // (the credit stays owed, for a later call).
            if let Some(upto) = credit {
                self.send_credit(upto)?;
            }
            // In slices, so that an abort from another thread ends the wait.
            let slice_end = deadline.min(Instant::now() + interrupt::SLICE);
            let waited = wait_message(self.agent(), &self.peer, &self.inbox, slice_end);
            match waited {
                Ok(Some(msg)) => self.take(msg),
                Ok(None) if Instant::now() < deadline => interrupt::check()?,
                Ok(None) => return Ok(Next::NotYet),
                // An interrupted wait took nothing: the next call goes on.
                Err(e @ Error::Interrupted(_)) => return Err(e),
                Err(e) => {
                    let mut st = self.state.lock();
                    st.broken = Some(e.clone());
                    return Err(e);
                }
            }
        }
    }

    /// Frees a message's space. A credit that cannot be sent now is owed, and goes
    /// with the next one: whether the sender is still there is for the waits to find
    /// out (a sender that closed the stream may have exited, and needs no credit).
    fn release(&self, start: u64) -> Result<()> {
        let credit = self.state.lock().window.release(start).map_err(|e| window_error(&self.peer, e))?;
        if let Some(upto) = credit {
            self.offer_credit(upto);
        }
        Ok(())
    }

    /// Sends a credit; one not delivered is owed, and goes with the next.
    fn offer_credit(&self, upto: u64) {
        if let Err(e) = self.send_credit(upto) {
            tracing::debug!(peer = %self.peer, pipe = self.pipe, error = %e, "a credit was not delivered; it is owed");
        }
    }

    /// Tells the sender that space up to `upto` is free. A credit not delivered is
    /// owed again (see [`RecvWindow::credit_lost`]). Once the sender closed the stream
    /// it needs no more space and may be gone (a sender process exits after `close`):
    /// a credit that cannot be delivered then is no error.
    fn send_credit(&self, upto: u64) -> Result<()> {
        let sent = self.router.send(&self.peer, &Msg::Credit { pipe: self.pipe, upto });
        let mut st = self.state.lock();
        match sent {
            Ok(()) => {
                st.window.credit_sent(upto);
                Ok(())
            }
            Err(e) if st.end.is_some() => {
                tracing::debug!(peer = %self.peer, pipe = self.pipe, error = %e, "credit after the end of the stream not delivered");
                Ok(())
            }
            Err(e) => {
                st.window.credit_lost();
                Err(e)
            }
        }
    }
}

impl Drop for RecvEnd {
    fn drop(&mut self) {
        self.router.unsubscribe(&self.peer, self.pipe);
        if let Some((_, key)) = &self.owned {
            if let Err(e) = self.agent().deregister(*key) {
                tracing::warn!(error = %e, "could not deregister a pipe buffer");
            }
        }
    }
}

/// Makes sure this agent can talk back to the sender (for credits), presenting its own
/// token (the two ends of a pipe share one, where they have one).
fn know_peer(agent: &Agent, peer: &str, addresses: &[String]) -> Result<()> {
    if agent.peers().iter().any(|p| p == peer) {
        return Ok(());
    }
    let mut last = Error::TransportUnavailable(format!("the sender '{peer}' gave no address to answer at"));
    for a in addresses {
        match agent.connect(a, agent.config().token.as_deref()) {
            Ok(name) if name == peer => return Ok(()),
            Ok(name) => last = Error::Protocol(format!("{a} is agent '{name}', not the sender '{peer}'")),
            Err(e) => last = e,
        }
    }
    Err(last)
}

impl PipeReceiver {
    /// The next message in order; `Ok(None)` once the sender closed the stream and
    /// every message was handed out. Waits up to `timeout` (the pipe's, by default).
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Option<Message>> {
        let timeout = timeout.unwrap_or(self.end.timeout);
        self.end.next(timeout)?.or_timeout(|| {
            Error::Timeout(format!(
                "no message {} from '{}' within {:.1}s",
                self.end.state.lock().window.next_seq(),
                self.end.peer,
                timeout.as_secs_f64()
            ))
        })
    }

    /// [`PipeReceiver::recv`] for a caller that waits in slices: `NotYet` when `wait`
    /// passed with no message, and nothing changed.
    pub fn next_within(&self, wait: Duration) -> Result<Next<Message>> {
        self.end.next(wait)
    }

    pub fn peer(&self) -> &str {
        &self.end.peer
    }

    pub fn buffer(&self) -> &BufferInfo {
        &self.end.buffer
    }

    /// Messages handed out and not yet released.
    pub fn held(&self) -> usize {
        self.end.state.lock().window.held()
    }

    /// Ends the stream from this side: the sender's next call fails with `reason`,
    /// and so does a `recv` waiting on another thread. Messages already handed out
    /// stay valid. Aborting twice is harmless.
    pub fn abort(&self, reason: &str) {
        self.end.stop(Error::InvalidState(format!("the pipe was aborted here: {reason}")), reason, true);
    }

    /// Ends this side before the end is dropped (another thread may still hold it): a
    /// `recv` waiting there fails, and a sender still sending is told, as on drop.
    pub fn close(&self) {
        let reason = "the receiver closed the pipe before the end of the stream";
        self.end.stop(Error::InvalidState("the pipe receiver is closed".into()), reason, false);
    }

    /// True once the sender closed the stream and every message was handed out.
    pub fn finished(&self) -> bool {
        let st = self.end.state.lock();
        st.end == Some(st.window.next_seq()) && st.pending.is_empty()
    }
}

impl Drop for PipeReceiver {
    fn drop(&mut self) {
        self.close();
    }
}

impl RecvEnd {
    /// Breaks the pipe with `e` (what later calls here fail with) unless it is broken
    /// already, and tells the sender `reason`: always when `always`, else only when
    /// the stream had not ended.
    fn stop(&self, e: Error, reason: &str, always: bool) {
        let mut st = self.state.lock();
        if st.broken.is_some() {
            return;
        }
        let unfinished = st.end != Some(st.window.next_seq());
        st.broken = Some(e);
        if always || unfinished {
            let _ = self.router.send(&self.peer, &Msg::Abort { pipe: self.pipe, reason: reason.to_string() });
        }
    }
}

impl Message {
    /// Messages are numbered from 0 in the order they were sent.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// What the sender attached to the message.
    pub fn tag(&self) -> &[u8] {
        &self.tag
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the message lies: (kind, address, device).
    pub fn location(&self) -> (MemKind, u64, u64) {
        let b = &self.end.buffer;
        (b.kind, b.addr + self.offset, b.dev)
    }

    /// Offset of the message in the pipe's buffer.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The bytes, when the buffer is host memory.
    pub fn bytes(&self) -> Option<&[u8]> {
        let (kind, addr, _) = self.location();
        // SAFETY: the buffer is registered host memory that outlives `self` (the
        // message holds its end, which owns or borrows the registration), and the
        // sender writes nowhere in this slot until the message is released.
        (kind == MemKind::Dram).then(|| unsafe { std::slice::from_raw_parts(addr as *const u8, self.len as usize) })
    }

    /// Frees the message's space for the sender.
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.end.release(self.start)
    }
}

impl Drop for Message {
    fn drop(&mut self) {
        if !self.released {
            if let Err(e) = self.end.release(self.start) {
                tracing::warn!(error = %e, seq = self.seq, "could not release a pipe message");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPACITY: u64 = 4096;

    fn slot(seq: u64) -> Slot {
        Slot { seq, start: seq * ALIGN, len: ALIGN }
    }

    /// Messages 0, 1 and 2 announced, none handed out yet.
    fn three_pending() -> RecvState {
        let mut st = RecvState::new(RecvWindow::new(CAPACITY, CAPACITY).unwrap());
        for seq in 0..3 {
            st.file_data("tx", CAPACITY, slot(seq), 10, vec![]).unwrap();
        }
        st
    }

    fn is_protocol(r: Result<()>) -> bool {
        matches!(r, Err(Error::Protocol(_)))
    }

    #[test]
    fn a_close_below_a_pending_message_is_refused() {
        let mut st = three_pending();
        assert!(is_protocol(st.file_close("tx", 2)), "message 2 would be dropped unseen");
        assert_eq!(st.end, None);
        let mut st = three_pending();
        st.file_close("tx", 3).unwrap();
        assert_eq!(st.end, Some(3));
    }

    #[test]
    fn a_close_below_a_message_handed_out_is_refused() {
        let mut st = three_pending();
        for seq in 0..3 {
            let (slot, ..) = st.pending.remove(&seq).unwrap();
            st.window.accept(slot).unwrap();
        }
        assert!(is_protocol(st.file_close("tx", 2)));
        st.file_close("tx", 3).unwrap();
    }

    #[test]
    fn a_message_past_the_end_of_a_closed_stream_is_refused() {
        let mut st = three_pending();
        st.file_close("tx", 4).unwrap();
        st.file_data("tx", CAPACITY, slot(3), 10, vec![]).unwrap();
        assert!(is_protocol(st.file_data("tx", CAPACITY, slot(4), 10, vec![])), "the stream has 4 messages");
        assert!(!st.pending.contains_key(&4));
    }

    #[test]
    fn messages_announced_twice_or_too_far_ahead_are_still_refused() {
        let mut st = three_pending();
        assert!(is_protocol(st.file_data("tx", CAPACITY, slot(1), 10, vec![])));
        assert!(is_protocol(st.file_data("tx", CAPACITY, slot(3), ALIGN + 1, vec![])));
        assert!(is_protocol(st.file_data("tx", CAPACITY, slot(CAPACITY / ALIGN), 10, vec![])));
    }
}
