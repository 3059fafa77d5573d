//! The sending end: opens a pipe, writes messages into free slots, follows credits.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use freight_core::{interrupt, Agent, Desc, DescList, Error, OpKind, PreparedList, Request, Result, Status};
use freight_proto::frame::MAX_NOTIF;
use parking_lot::Mutex;

use super::{align_up, deadline_after, wait_message, window_error, BufferInfo, PipeConfig, REASON_WAIT};
use crate::proto::Msg;
use crate::router::Router;
use crate::window::{SendWindow, Slot, WindowError};

/// How far a pipe's stream got (see [`PipeSender::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Every write of a message that starts before this position is done.
    pub written: u64,
    /// The receiver has released everything before this position.
    pub released: u64,
}

/// The sending end of one pipe. Dropping it closes the stream after the messages sent.
pub struct PipeSender {
    router: Arc<Router>,
    peer: String,
    pipe: u64,
    inbox: Receiver<Msg>,
    buffer: BufferInfo,
    config: PipeConfig,
    state: Mutex<SendState>,
    /// Set by [`PipeSender::abort`] without taking `state`, which a send waiting for
    /// room holds: the waits look at it between slices.
    aborted: Mutex<Option<Error>>,
}

struct SendState {
    window: SendWindow,
    /// Writes posted, oldest first, each with the stream position its message starts at.
    in_flight: VecDeque<(Request, u64)>,
    closed: bool,
    broken: Option<Error>,
    /// Time spent waiting for room in the receiver's buffer, since the pipe opened.
    credit_wait: Duration,
    /// The furthest credit asked for with `Sync` (see `reserve`).
    asked: u64,
}

impl PipeSender {
    /// Opens a pipe to the agent listening at `addr` (which must accept it with
    /// [`super::PipeListener::accept`] within `config.timeout`). The two ends of a pipe
    /// share a token, where they have one: this agent presents its own.
    pub fn connect(agent: &Arc<Agent>, addr: &str, config: &PipeConfig) -> Result<PipeSender> {
        config.validate()?;
        let router = Router::of(agent);
        let peer = agent.connect(addr, agent.config().token.as_deref())?;
        let pipe = rand::random::<u64>();
        let inbox = router.subscribe(&peer, pipe);
        let opened = Self::open(&router, &peer, pipe, &inbox, config);
        let (buffer, window) = match opened {
            Ok(x) => x,
            Err(e) => {
                // The receiver may take the request up later (or did): it must not wait
                // for a pipe nobody writes to.
                let reason = format!("the sender gave the pipe up while opening it: {e}");
                let _ = router.send(&peer, &Msg::Abort { pipe, reason });
                router.unsubscribe(&peer, pipe);
                return Err(e);
            }
        };
        tracing::info!(peer = %peer, pipe, capacity = buffer.len, kind = %buffer.kind.as_str(), "pipe opened");
        let state = SendState {
            window,
            in_flight: VecDeque::new(),
            closed: false,
            broken: None,
            credit_wait: Duration::ZERO,
            asked: 0,
        };
        Ok(PipeSender {
            router,
            peer,
            pipe,
            inbox,
            buffer,
            config: config.clone(),
            state: Mutex::new(state),
            aborted: Mutex::new(None),
        })
    }

    fn open(
        router: &Router,
        peer: &str,
        pipe: u64,
        inbox: &Receiver<Msg>,
        config: &PipeConfig,
    ) -> Result<(BufferInfo, SendWindow)> {
        let agent = router.agent();
        router.send(peer, &Msg::Open { pipe, addresses: agent.addresses() })?;
        let deadline = deadline_after(config.timeout);
        loop {
            let msg = wait_message(agent, peer, inbox, deadline)?.ok_or_else(|| {
                Error::Timeout(format!("'{peer}' did not accept the pipe within {:.1}s", config.timeout.as_secs_f64()))
            })?;
            match msg {
                Msg::Accept { buffer, .. } => {
                    // The buffer was registered after this agent read the receiver's
                    // metadata: read it again to see the new region.
                    agent.refresh_peer(peer, None)?;
                    let whole = DescList::from_descs(
                        buffer.kind,
                        [Desc { addr: buffer.addr, len: buffer.len, dev: buffer.dev }],
                    )?;
                    agent.prepare_remote(peer, &whole)?;
                    let window = SendWindow::new(buffer.len).map_err(|e| window_error(peer, e))?;
                    return Ok((buffer, window));
                }
                Msg::Refuse { reason, .. } => {
                    return Err(Error::RemoteRejected {
                        peer: peer.to_string(),
                        reason: format!("pipe refused: {reason}"),
                    })
                }
                other => tracing::warn!(peer, pipe, msg = ?other, "unexpected message while opening a pipe"),
            }
        }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The receiver's buffer.
    pub fn buffer(&self) -> &BufferInfo {
        &self.buffer
    }

    /// The largest message the pipe carries (the buffer's size).
    pub fn capacity(&self) -> u64 {
        self.buffer.len
    }

    fn agent(&self) -> &Agent {
        self.router.agent()
    }

    /// Sends the bytes of `local` (registered memory of this agent, gathered in order)
    /// as one message with `tag` attached. Returns the message's number once its write
    /// is posted; the memory must stay unchanged until [`PipeSender::flush`] returns.
    /// Waits up to the pipe's timeout for room in the receiver's buffer.
    pub fn send(&self, local: &DescList, tag: Vec<u8>) -> Result<u64> {
        let len = local.total_bytes();
        self.send_scattered(local, &[(0, len)], tag)
    }

    /// Like [`PipeSender::send`], but the bytes land in pieces of the message: `pieces`
    /// are (offset in the message, length) in the order of `local`'s bytes. The
    /// message is as long as its furthest piece.
    pub fn send_scattered(&self, local: &DescList, pieces: &[(u64, u64)], tag: Vec<u8>) -> Result<u64> {
        let piece_bytes: u64 = pieces.iter().map(|p| p.1).sum();
        if piece_bytes != local.total_bytes() {
            return Err(Error::InvalidArgument(format!(
                "the pieces hold {piece_bytes} bytes but the local memory has {}",
                local.total_bytes()
            )));
        }
        if let Some(&(at, _)) = pieces.iter().find(|(_, l)| *l == 0) {
            return Err(Error::InvalidArgument(format!("the piece at {at} is empty; pieces hold at least one byte")));
        }
        // Room for the rest of the announcement (pipe, slot, lengths) beside the tag.
        if tag.len() + 64 > MAX_NOTIF {
            return Err(Error::InvalidArgument(format!(
                "a tag of {} bytes does not fit a notification (at most {MAX_NOTIF} bytes in all)",
                tag.len()
            )));
        }
        let ends: Option<Vec<u64>> = pieces.iter().map(|(o, l)| o.checked_add(*l)).collect();
        let len = ends
            .ok_or_else(|| Error::InvalidArgument("a piece runs past the end of the address space".into()))?
            .into_iter()
            .max()
            .unwrap_or(0);
        if len == 0 {
            return Err(window_error(&self.peer, WindowError::Empty));
        }
        if len > self.buffer.len {
            return Err(window_error(&self.peer, WindowError::TooLarge { len, capacity: self.buffer.len }));
        }
        // Everything that can fail on the caller's input fails before a slot is taken.
        let prepared = self.agent().prepare_local(local)?;
        let mut st = self.state.lock();
        if st.closed {
            return Err(Error::InvalidState("the pipe is closed".into()));
        }
        let slot = self.reserve(&mut st, align_up(len).min(self.buffer.len))?;
        // From here a failure leaves a hole in the stream: the pipe is broken.
        match self.post(&prepared, slot, len, pieces, tag) {
            Ok(req) => {
                st.in_flight.push_back((req, slot.start));
                Ok(slot.seq)
            }
            Err(e) => {
                let e = self.explain(e);
                Err(self.fail(&mut st, e))
            }
        }
    }

    /// A write the engine refused (the buffer's region gone, say) is usually the trace
    /// of a receiver that closed its end: its own word on why, when it comes, is clearer.
    fn explain(&self, e: Error) -> Error {
        match self.inbox.recv_timeout(REASON_WAIT) {
            Ok(Msg::Abort { reason, .. }) => Error::PeerDisconnected {
                peer: self.peer.clone(),
                reason: format!("the receiver aborted the pipe: {reason}"),
            },
            _ => e,
        }
    }

    fn post(&self, local: &PreparedList, slot: Slot, len: u64, pieces: &[(u64, u64)], tag: Vec<u8>) -> Result<Request> {
        let base = self.buffer.addr + slot.offset(self.buffer.len);
        let b = &self.buffer;
        let remote =
            DescList::from_descs(b.kind, pieces.iter().map(|&(o, l)| Desc { addr: base + o, len: l, dev: b.dev }))?;
        let remote = self.agent().prepare_remote(&self.peer, &remote)?;
        let notif = Msg::Data { pipe: self.pipe, slot: slot.into(), len, tag }.encode();
        let req = self.agent().make_request(OpKind::Write, local, None, &remote, None, Some(notif))?;
        req.post()?;
        Ok(req)
    }

    /// Takes the next slot, waiting for credits while the buffer is full.
    fn reserve(&self, st: &mut SendState, len: u64) -> Result<Slot> {
        let deadline = deadline_after(self.config.timeout);
        loop {
            self.absorb(st)?;
            self.reap(st, self.config.max_in_flight - 1, deadline)?;
            if let Some(slot) = st.window.reserve(len).map_err(|e| window_error(&self.peer, e))? {
                return Ok(slot);
            }
            // Stuck: the receiver must credit the room it frees now, not once a batch
            // of bytes is free (it may hold the rest for long).
            let needed = st.window.needs_credit(len);
            if needed > st.asked {
                self.router.send(&self.peer, &Msg::Sync { pipe: self.pipe, upto: needed })?;
                // Only once it went: a send tried again after a failed one must ask again.
                st.asked = needed;
            }
            let waiting = Instant::now();
            let outcome = self.next_message(deadline);
            st.credit_wait += waiting.elapsed();
            if !matches!(outcome, Ok(Some(_))) {
                // A send tried again asks again, whatever it needs then.
                st.asked = 0;
            }
            match outcome {
                Ok(Some(msg)) => self.handle(st, msg)?,
                Ok(None) => {
                    return Err(Error::Timeout(format!(
                        "no room for {len} bytes in the receiver's buffer within {:.1}s ('{}' holds {} of {} bytes)",
                        self.config.timeout.as_secs_f64(),
                        self.peer,
                        st.window.in_flight(),
                        self.buffer.len
                    )))
                }
                Err(e) => return Err(self.fail(st, e)),
            }
        }
    }

    /// The receiver's next word, waiting until `deadline` (`None` then) in slices that
    /// an abort from another thread also ends.
    fn next_message(&self, deadline: Instant) -> Result<Option<Msg>> {
        interrupt::until(deadline, |slice| {
            self.check_aborted()?;
            wait_message(self.agent(), &self.peer, &self.inbox, Instant::now() + slice)
        })
    }

    fn check_aborted(&self) -> Result<()> {
        match &*self.aborted.lock() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Applies whatever the receiver said since last time.
    fn absorb(&self, st: &mut SendState) -> Result<()> {
        if let Err(e) = self.check_aborted() {
            st.broken.get_or_insert(e);
        }
        if let Some(e) = &st.broken {
            return Err(e.clone());
        }
        while let Ok(msg) = self.inbox.try_recv() {
            self.handle(st, msg)?;
        }
        Ok(())
    }

    fn handle(&self, st: &mut SendState, msg: Msg) -> Result<()> {
        match msg {
            Msg::Credit { upto, .. } => match st.window.credit(upto) {
                // Credits from releases on several threads may arrive out of order.
                Ok(()) | Err(WindowError::CreditBackwards { .. }) => Ok(()),
                Err(e) => {
                    let e = window_error(&self.peer, e);
                    Err(self.fail(st, e))
                }
            },
            Msg::Abort { reason, .. } => {
                let e = Error::PeerDisconnected {
                    peer: self.peer.clone(),
                    reason: format!("the receiver aborted the pipe: {reason}"),
                };
                st.broken = Some(e.clone());
                Err(e)
            }
            other => {
                tracing::warn!(peer = %self.peer, pipe = self.pipe, msg = ?other, "unexpected message on a sending pipe");
                Ok(())
            }
        }
    }

    /// Forgets finished writes, and waits for the oldest while more than `keep` are
    /// in flight. A failed write breaks the pipe.
    fn reap(&self, st: &mut SendState, keep: usize, deadline: Instant) -> Result<()> {
        self.reap_while(st, deadline, |in_flight, _| in_flight > keep)
    }

    /// Forgets finished writes from the oldest on, waiting for each while `must_wait`
    /// (given the writes in flight and the oldest one's start) says so.
    fn reap_while(&self, st: &mut SendState, deadline: Instant, must_wait: impl Fn(usize, u64) -> bool) -> Result<()> {
        while let Some((req, start)) = st.in_flight.front() {
            let wait = must_wait(st.in_flight.len(), *start);
            let status = if wait {
                let finished = interrupt::until(deadline, |slice| {
                    self.check_aborted()?;
                    let status = req.wait(Some(slice));
                    Ok(status.is_final().then_some(status))
                });
                finished.map_err(|e| self.fail(st, e))?.unwrap_or(Status::Pending)
            } else {
                req.status()
            };
            match status {
                Status::Done => {
                    st.in_flight.pop_front();
                }
                Status::Error(e) => return Err(self.fail(st, e)),
                _ if wait => {
                    let e = Error::Timeout(format!(
                        "a write to '{}' did not finish within {:.1}s",
                        self.peer,
                        self.config.timeout.as_secs_f64()
                    ));
                    return Err(self.fail(st, e));
                }
                _ => break,
            }
        }
        Ok(())
    }

    /// Marks the pipe broken and tells the receiver (unless an abort told it already);
    /// an interrupted wait changed nothing, and the pipe goes on.
    fn fail(&self, st: &mut SendState, e: Error) -> Error {
        if st.broken.is_none() && !matches!(e, Error::Interrupted(_)) {
            st.broken = Some(e.clone());
            if self.aborted.lock().is_none() {
                let _ = self.router.send(&self.peer, &Msg::Abort { pipe: self.pipe, reason: e.to_string() });
            }
        }
        e
    }

    /// Waits until every message sent so far is written into the receiver's buffer
    /// (the sender's memory may then change).
    pub fn flush(&self) -> Result<()> {
        self.wait_written(u64::MAX)
    }

    /// Flushes, then waits until the receiver has released every message sent so far
    /// (its buffer is empty again): the end of a stream's work, end to end.
    pub fn drain(&self) -> Result<()> {
        let end = self.position();
        self.wait_written(end)?;
        self.wait_released(end)
    }

    /// Stream position after the last message sent: once the receiver has released
    /// everything before it, it holds nothing sent so far.
    pub fn position(&self) -> u64 {
        self.state.lock().window.head()
    }

    /// How far the stream got, without waiting: every write before `written` is done,
    /// and the receiver has released everything before `released`.
    pub fn progress(&self) -> Result<Progress> {
        let mut st = self.state.lock();
        self.absorb(&mut st)?;
        self.reap_while(&mut st, Instant::now(), |_, _| false)?;
        Ok(Progress {
            written: st.in_flight.front().map_or(st.window.head(), |(_, start)| *start),
            released: st.window.credited(),
        })
    }

    /// Waits until every message that starts before stream position `upto` is written
    /// into the receiver's buffer.
    pub fn wait_written(&self, upto: u64) -> Result<()> {
        let mut st = self.state.lock();
        let deadline = deadline_after(self.config.timeout);
        self.absorb(&mut st)?;
        self.reap_while(&mut st, deadline, |_, start| start < upto)
    }

    /// Waits until no write of this pipe is in flight, whatever happened to the pipe
    /// (after a failure or an abort, before the sender's memory is reused or
    /// deregistered). A write that does not finish within the timeout breaks the pipe,
    /// so that the receiver drops what it would bring. The wait goes in slices that the
    /// caller's interrupt check can end ([`Error::Interrupted`], nothing changed); an
    /// abort does not end it, as it is what an aborting caller waits for, and neither
    /// does a dead peer, whose writes fail on their own.
    pub fn settle_writes(&self) -> Result<()> {
        let mut st = self.state.lock();
        let deadline = deadline_after(self.config.timeout);
        while let Some((req, _)) = st.in_flight.front() {
            let settled = interrupt::until(deadline, |slice| Ok(req.wait(Some(slice)).is_final().then_some(())))?;
            match settled {
                Some(()) => {
                    st.in_flight.pop_front();
                }
                None => {
                    let e = Error::Timeout(format!(
                        "a write to '{}' did not finish within {:.1}s",
                        self.peer,
                        self.config.timeout.as_secs_f64()
                    ));
                    return Err(self.fail(&mut st, e));
                }
            }
        }
        Ok(())
    }

    /// Asks the receiver to credit as soon as everything before stream position `upto`
    /// is released, rather than once a batch of bytes is free: for a sender that will
    /// wait for that point ([`PipeSender::wait_released`], [`PipeSender::progress`]).
    pub fn want_released(&self, upto: u64) -> Result<()> {
        self.router.send(&self.peer, &Msg::Sync { pipe: self.pipe, upto })
    }

    /// Waits until the receiver has released everything before stream position `upto`
    /// (a position this sender reached: see [`PipeSender::position`]).
    pub fn wait_released(&self, upto: u64) -> Result<()> {
        let mut st = self.state.lock();
        let deadline = deadline_after(self.config.timeout);
        self.absorb(&mut st)?;
        while st.window.credited() < upto.min(st.window.head()) {
            match self.next_message(deadline) {
                Ok(Some(msg)) => self.handle(&mut st, msg)?,
                Ok(None) => {
                    return Err(Error::Timeout(format!(
                        "'{}' did not release {} bytes within {:.1}s",
                        self.peer,
                        upto.min(st.window.head()) - st.window.credited(),
                        self.config.timeout.as_secs_f64()
                    )))
                }
                Err(e) => return Err(self.fail(&mut st, e)),
            }
        }
        Ok(())
    }

    /// Flushes, then ends the stream: the receiver's `recv` returns `None` after the
    /// last message. Closing twice is harmless, and so is closing after an abort (which
    /// ended the stream as its caller wanted): that only waits for the writes posted
    /// to finish (see [`PipeSender::settle_writes`]), as the caller frees the memory
    /// they read next. So does a close whose flush fails, unless the writes already
    /// had their time (a timeout) or the caller interrupted it. A `Close` that cannot
    /// be sent breaks the pipe: the stream did not end, and a later close must not
    /// say it did.
    pub fn close(&self) -> Result<()> {
        if self.aborted.lock().is_some() {
            return self.settle_writes();
        }
        if let Err(e) = self.flush() {
            if !matches!(e, Error::Timeout(_) | Error::Interrupted(_)) {
                if let Err(settling) = self.settle_writes() {
                    tracing::debug!(peer = %self.peer, error = %settling, "a failed close's writes did not settle");
                }
            }
            return Err(e);
        }
        let mut st = self.state.lock();
        if st.closed {
            return Ok(());
        }
        match self.router.send(&self.peer, &Msg::Close { pipe: self.pipe, messages: st.window.sent() }) {
            Ok(()) => {
                st.closed = true;
                Ok(())
            }
            Err(e) => Err(self.fail(&mut st, e)),
        }
    }

    /// Breaks the pipe and tells the receiver `reason`: its next call fails with it,
    /// instead of seeing the stream end as if it were whole. Later sends fail, and so
    /// does a send or wait in progress on another thread (within a slice of its wait).
    pub fn abort(&self, reason: &str) {
        let e = Error::InvalidState(format!("the pipe was aborted: {reason}"));
        let mut aborted = self.aborted.lock();
        if aborted.is_some() {
            return;
        }
        // Whoever holds the state may be waiting (for room, for writes): it sees the
        // abort between slices. A pipe that broke already told the receiver why.
        let broken_already = match self.state.try_lock() {
            Some(mut st) => {
                let was = st.broken.is_some();
                st.broken.get_or_insert_with(|| e.clone());
                was
            }
            None => false,
        };
        if !broken_already {
            let _ = self.router.send(&self.peer, &Msg::Abort { pipe: self.pipe, reason: e.to_string() });
        }
        *aborted = Some(e);
    }

    /// Messages sent so far.
    pub fn sent(&self) -> u64 {
        self.state.lock().window.sent()
    }

    /// Time `send` spent waiting for the receiver to free room, since the pipe opened.
    pub fn credit_wait(&self) -> Duration {
        self.state.lock().credit_wait
    }

    /// The pipe's timeout.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }
}

impl Drop for PipeSender {
    fn drop(&mut self) {
        let healthy = self.state.lock().broken.is_none() && self.aborted.lock().is_none();
        if healthy {
            if let Err(e) = self.close() {
                tracing::warn!(peer = %self.peer, error = %e, "closing a pipe on drop failed");
            }
        }
        self.router.unsubscribe(&self.peer, self.pipe);
    }
}
