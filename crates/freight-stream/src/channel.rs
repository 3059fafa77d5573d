//! The channel: keyed objects over pipes.
//!
//! A sender sends objects (a key, bytes in its registered memory, and opaque metadata
//! such as a dtype and shape) in batches; each batch is laid out in pipe messages by
//! [`crate::layout`], and each message carries a header naming the objects in it. The
//! receiver reads one or more pipes (several senders may feed one receiver) and hands
//! out objects as zero-copy views of its pipe buffers; an object cut across messages
//! is reassembled into memory of the buffer's kind.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use freight_core::{interrupt, Desc, DescList, Error, MemKind, Result};
use freight_cuda::driver::CopyBatch;
use serde::{Deserialize, Serialize};

use crate::layout;
use crate::next::Next;
use crate::owned::{copy_bytes, Owned};
use crate::pipe::{deadline_after, Message, PipeReceiver, PipeSender, ALIGN};

/// Headers larger than this are refused before anything is sent (a message's header
/// travels in its notification).
pub const MAX_HEADER: usize = 1 << 20;

/// An object to send: its key, where its bytes are (registered memory of the sending
/// agent), and metadata the receiver gets back unchanged.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub key: String,
    pub kind: MemKind,
    pub local: Desc,
    pub meta: Vec<u8>,
}

/// One object's piece in a message, as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    key: String,
    meta: Vec<u8>,
    /// Where the piece lies in the message.
    offset: u64,
    len: u64,
    /// The whole object's size, and where the piece belongs in it.
    object_len: u64,
    object_at: u64,
}

pub struct ChannelSender {
    pipe: PipeSender,
    batch_size: usize,
    max_message: u64,
}

impl ChannelSender {
    /// `batch_size`: objects per batch (a batch fills one or more messages).
    /// `max_message`: the largest message [a quarter of the pipe's buffer, so that
    /// several are in flight while the receiver works on others].
    pub fn new(pipe: PipeSender, batch_size: usize, max_message: Option<u64>) -> Result<ChannelSender> {
        if batch_size == 0 {
            return Err(Error::InvalidArgument("the batch size must be at least 1".into()));
        }
        let capacity = pipe.capacity();
        let max_message = max_message.unwrap_or((capacity / 4 / ALIGN * ALIGN).max(ALIGN)).min(capacity);
        if max_message < ALIGN {
            return Err(Error::InvalidArgument(format!("a channel needs a pipe buffer of at least {ALIGN} bytes")));
        }
        Ok(ChannelSender { pipe, batch_size, max_message })
    }

    pub fn pipe(&self) -> &PipeSender {
        &self.pipe
    }

    /// Objects per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Sends `objects` in batches of the channel's batch size. Keys must be unique
    /// within a call and not empty; the memory must stay unchanged until
    /// [`ChannelSender::flush`] returns. Returns the number of pipe messages used. Bad
    /// input refuses a batch before any of it goes; a failure while sending (no room in
    /// time, a broken pipe) leaves the messages already sent delivered, whole objects
    /// included. A cut object whose first pieces went out is started over by the
    /// receiver when it is sent again.
    pub fn send(&self, objects: &[Outgoing]) -> Result<usize> {
        check_batch(objects)?;
        let mut messages = 0;
        for batch in objects.chunks(self.batch_size) {
            let sizes: Vec<u64> = batch.iter().map(|o| o.local.len).collect();
            let plans = layout::plan(&sizes, self.max_message);
            // Encode every header first: a batch is refused whole or sent whole.
            let mut encoded = Vec::with_capacity(plans.len());
            for pieces in &plans {
                encoded.push(self.encode(batch, pieces)?);
            }
            for (pieces, (local, spans, header)) in plans.iter().zip(encoded) {
                debug_assert_eq!(pieces.len(), spans.len());
                self.pipe.send_scattered(&local, &spans, header)?;
                messages += 1;
            }
        }
        Ok(messages)
    }

    /// A message's local memory list, its pieces' places, and its header.
    #[allow(clippy::type_complexity)]
    fn encode(&self, batch: &[Outgoing], pieces: &[layout::Piece]) -> Result<(DescList, Vec<(u64, u64)>, Vec<u8>)> {
        let kind = batch[pieces[0].object].kind;
        let mut local = DescList::new(kind);
        let mut spans = Vec::with_capacity(pieces.len());
        let mut entries = Vec::with_capacity(pieces.len());
        for p in pieces {
            let o = &batch[p.object];
            if p.len > 0 {
                local.push(Desc { addr: o.local.addr + p.object_at, len: p.len, dev: o.local.dev })?;
            }
            spans.push((p.offset, p.len));
            entries.push(Entry {
                key: o.key.clone(),
                meta: o.meta.clone(),
                offset: p.offset,
                len: p.len,
                object_len: o.local.len,
                object_at: p.object_at,
            });
        }
        let header = postcard::to_allocvec(&entries).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if header.len() > MAX_HEADER {
            return Err(Error::InvalidArgument(format!(
                "the keys and metadata of one message take {} bytes (at most {MAX_HEADER}); use a smaller batch",
                header.len()
            )));
        }
        // Empty objects take no bytes, but a message needs at least one.
        if local.is_empty() {
            let o = &batch[pieces[0].object];
            return Err(Error::InvalidArgument(format!("object '{}' is empty; send at least one byte", o.key)));
        }
        Ok((local, spans.into_iter().filter(|s| s.1 > 0).collect(), header))
    }

    pub fn flush(&self) -> Result<()> {
        self.pipe.flush()
    }

    /// Waits until no write of the channel is in flight, whatever happened to its pipe
    /// (see [`PipeSender::settle_writes`]): after a failed send, before the objects'
    /// memory is reused or deregistered.
    pub fn settle_writes(&self) -> Result<()> {
        self.pipe.settle_writes()
    }

    /// Waits until the receiver has released every object sent so far.
    pub fn drain(&self) -> Result<()> {
        self.pipe.drain()
    }

    pub fn close(&self) -> Result<()> {
        self.pipe.close()
    }
}

fn check_batch(objects: &[Outgoing]) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(objects.len());
    let kind = objects.first().map(|o| o.kind);
    for o in objects {
        if o.key.is_empty() {
            return Err(Error::InvalidArgument("object keys must not be empty".into()));
        }
        if !seen.insert(o.key.as_str()) {
            return Err(Error::InvalidArgument(format!("key '{}' appears twice in one send", o.key)));
        }
        if o.local.len == 0 {
            return Err(Error::InvalidArgument(format!("object '{}' is empty; send at least one byte", o.key)));
        }
        if Some(o.kind) != kind {
            return Err(Error::InvalidArgument("all objects of one send must be in the same kind of memory".into()));
        }
    }
    Ok(())
}

/// Where a received object's bytes are.
pub enum Data {
    /// In a pipe buffer: the message's space is freed when every view of it is gone.
    View { message: Arc<Message>, offset: u64 },
    /// Reassembled in memory of its own, of the pipe buffer's kind.
    Own(Owned),
    /// Moved out by [`Received::take_owned`].
    Gone,
}

/// An object that arrived whole.
pub struct Received {
    pub key: String,
    pub meta: Vec<u8>,
    /// Which of the receiver's pipes it came through.
    pub sender: usize,
    len: u64,
    data: Data,
    /// For a reassembled object, the message that brought its last piece: its space is
    /// freed only when the object is dropped, so a sender draining the pipe knows that
    /// every object was consumed, not only copied together.
    _last_piece: Option<Arc<Message>>,
}

impl Received {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// (kind, address, device) of the bytes.
    pub fn location(&self) -> (MemKind, u64, u64) {
        match &self.data {
            Data::View { message, offset } => {
                let (kind, addr, dev) = message.location();
                (kind, addr + offset, dev)
            }
            Data::Own(o) => o.location(),
            Data::Gone => (MemKind::Dram, 0, 0),
        }
    }

    /// True when the bytes are a view of a pipe buffer (not reassembled).
    pub fn is_view(&self) -> bool {
        matches!(self.data, Data::View { .. })
    }

    /// The bytes, when they are in host memory.
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.data {
            Data::View { message, offset } => {
                message.bytes().map(|b| &b[*offset as usize..(*offset + self.len) as usize])
            }
            Data::Own(o) => o.bytes(),
            Data::Gone => Some(&[]),
        }
    }

    /// Copies the bytes to `dst` (host memory, or device memory of `dst_kind`).
    pub fn copy_to(&self, dst_kind: MemKind, dst: u64) -> Result<()> {
        let (kind, src, dev) = self.location();
        copy_bytes(kind, dev, dst_kind, dst, src, self.len)
    }
}

impl Received {
    /// The bytes in memory of their own: a view is copied out of its pipe buffer, a
    /// reassembled object's memory is moved out (leaving this one empty). The pipe
    /// space stays taken until this object is dropped: drop it once the bytes are
    /// where they belong, and a sender draining the pipe knows they are.
    pub fn take_owned(&mut self) -> Result<Owned> {
        let mut batch = CopyBatch::default();
        let owned = self.take_owned_queued(&mut batch)?;
        batch.finish()?;
        Ok(owned)
    }

    /// [`Received::take_owned`], a copy out of a GPU's pipe buffer only queued on
    /// `batch`: the object (its pipe space) and the result must outlive the batch.
    pub fn take_owned_queued(&mut self, batch: &mut CopyBatch) -> Result<Owned> {
        let (kind, addr, dev) = self.location();
        let len = self.len;
        match std::mem::replace(&mut self.data, Data::Gone) {
            Data::Own(o) => {
                self.len = 0;
                Ok(o)
            }
            Data::View { message, offset } => {
                self.data = Data::View { message, offset };
                let mut copy = Owned::like(kind, dev, len)?;
                copy.fill_from_queued(batch, 0, kind, addr, len)?;
                Ok(copy)
            }
            Data::Gone => Err(Error::InvalidState("the object's bytes were taken already".into())),
        }
    }
}

/// An object whose pieces are still arriving.
struct Assembly {
    meta: Vec<u8>,
    data: Owned,
    len: u64,
    filled: u64,
}

enum Event {
    Message(usize, Message),
    End(usize),
    Failed(usize, Error),
}

/// One sender's pipe reader.
struct Reader {
    thread: Option<JoinHandle<()>>,
    /// Why this sender alone is cut off, once it is (its reader tells it and ends).
    cut: Arc<parking_lot::Mutex<Option<String>>>,
}

/// Reads one or more pipes and hands out whole objects.
pub struct ChannelReceiver {
    events: Receiver<Event>,
    readers: Vec<Reader>,
    stop: Arc<AtomicBool>,
    /// Why the receiver gave up, for the readers to tell the senders.
    abort: Arc<parking_lot::Mutex<Option<String>>>,
    live: usize,
    partial: HashMap<(usize, String), Assembly>,
    timeout: Duration,
}

/// How often a pipe reader looks whether the channel was dropped.
const READER_SLICE: Duration = Duration::from_millis(200);

impl ChannelReceiver {
    /// Receives from `pipes` (one per sender); `timeout` bounds each `recv`.
    pub fn new(pipes: Vec<PipeReceiver>, timeout: Duration) -> ChannelReceiver {
        let (tx, events) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let abort = Arc::new(parking_lot::Mutex::new(None));
        let live = pipes.len();
        let readers = pipes
            .into_iter()
            .enumerate()
            .map(|(i, pipe)| {
                let cut = Arc::new(parking_lot::Mutex::new(None));
                let (tx, stop, abort, why) = (tx.clone(), stop.clone(), abort.clone(), cut.clone());
                let thread = std::thread::Builder::new()
                    .name(format!("freight-channel-{i}"))
                    .spawn(move || read_pipe(i, pipe, tx, stop, abort, why))
                    .expect("cannot start a channel reader thread");
                Reader { thread: Some(thread), cut }
            })
            .collect();
        ChannelReceiver { events, readers, stop, abort, live, partial: HashMap::new(), timeout }
    }

    /// Stops receiving and tells every sender still streaming why: their next call
    /// fails with `reason`. Objects already handed out stay valid.
    pub fn abort(&mut self, reason: &str) {
        *self.abort.lock() = Some(reason.to_string());
        self.stop_readers();
        self.live = 0;
    }

    fn stop_readers(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Readers notice within a slice; their pipes then tell unfinished senders.
        for r in &mut self.readers {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// Stops reading sender `i` and tells it why; returns once it was told. The
    /// channel goes on with the other senders.
    fn cut(&mut self, i: usize, reason: &str) {
        *self.readers[i].cut.lock() = Some(reason.to_string());
        self.retire(i);
    }

    /// Done with sender `i` (its reader ended or was cut off): what it still has on
    /// the way is ignored, and its unfinished objects are void.
    fn retire(&mut self, i: usize) {
        if let Some(t) = self.readers[i].thread.take() {
            let _ = t.join();
            self.live -= 1;
        }
        self.partial.retain(|(s, _), _| *s != i);
    }

    fn retired(&self, i: usize) -> bool {
        self.readers[i].thread.is_none()
    }

    /// The objects of the next message that completes any (whole objects only; the
    /// pieces of a cut object are kept until its last one arrives). `Ok(None)` once
    /// every sender closed its stream.
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Option<Vec<Received>>> {
        let timeout = timeout.unwrap_or(self.timeout);
        self.next_within(timeout)?
            .or_timeout(|| Error::Timeout(format!("no object arrived within {:.1}s", timeout.as_secs_f64())))
    }

    /// [`ChannelReceiver::recv`] for a caller that waits in slices: `NotYet` when
    /// `wait` passed with no object completed, and nothing changed.
    pub fn next_within(&mut self, wait: Duration) -> Result<Next<Vec<Received>>> {
        let deadline = deadline_after(wait);
        loop {
            if self.live == 0 {
                return Ok(Next::End);
            }
            let event = interrupt::until(deadline, |slice| match self.events.recv_timeout(slice) {
                Ok(event) => Ok(Some(event)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    Err(Error::InvalidState("every pipe reader of the channel stopped".into()))
                }
            })?;
            let Some(event) = event else { return Ok(Next::NotYet) };
            match event {
                Event::Message(sender, _) | Event::End(sender) | Event::Failed(sender, _) if self.retired(sender) => {}
                Event::Message(sender, m) => {
                    let message = Arc::new(m);
                    match self.unpack(sender, &message) {
                        Ok(objects) if objects.is_empty() => {}
                        Ok(objects) => return Ok(Next::Item(objects)),
                        Err(e) => {
                            // The message's space goes back only after the sender heard
                            // why: a credit first would tell it the objects were taken.
                            self.cut(sender, &e.to_string());
                            drop(message);
                            return Err(e);
                        }
                    }
                }
                Event::End(sender) => {
                    // Only a send that failed halfway leaves an object unfinished, and
                    // its sender heard of it: the object is void, the stream whole.
                    for (_, key) in self.partial.keys().filter(|(s, _)| *s == sender) {
                        tracing::warn!(sender, key = %key, "a sender closed its stream with an object unfinished; it is dropped");
                    }
                    self.retire(sender);
                }
                Event::Failed(sender, e) => {
                    // The stream goes on without it.
                    self.retire(sender);
                    return Err(e);
                }
            }
        }
    }

    fn unpack(&mut self, sender: usize, message: &Arc<Message>) -> Result<Vec<Received>> {
        let entries: Vec<Entry> = postcard::from_bytes(message.tag())
            .map_err(|e| Error::Protocol(format!("malformed channel header from sender {sender}: {e}")))?;
        let mut out = Vec::new();
        for e in entries {
            let bad = |why: &str| Error::Protocol(format!("object '{}' from sender {sender}: {why}", e.key));
            if e.offset.checked_add(e.len).map_or(true, |end| end > message.len()) {
                return Err(bad("a piece lies outside its message"));
            }
            if e.object_at.checked_add(e.len).map_or(true, |end| end > e.object_len) {
                return Err(bad("a piece lies outside its object"));
            }
            if e.len == e.object_len {
                out.push(Received {
                    key: e.key,
                    meta: e.meta,
                    sender,
                    len: e.len,
                    data: Data::View { message: message.clone(), offset: e.offset },
                    _last_piece: None,
                });
                continue;
            }
            let slot = (sender, e.key.clone());
            // A first piece again: the sender sends the object anew (after a send that
            // failed halfway), and what arrived of it before is void.
            if e.object_at == 0 || !self.partial.contains_key(&slot) {
                let (kind, _, dev) = message.location();
                let data = Owned::like(kind, dev, e.object_len)?;
                self.partial
                    .insert(slot.clone(), Assembly { meta: e.meta.clone(), data, len: e.object_len, filled: 0 });
            }
            let a = self.partial.get_mut(&slot).expect("inserted above");
            if a.len != e.object_len || a.filled != e.object_at {
                return Err(bad("pieces disagree on the object's size or arrive out of order"));
            }
            let (kind, src, _) = message.location();
            a.data.fill_from(e.object_at, kind, src + e.offset, e.len)?;
            a.filled += e.len;
            if a.filled == a.len {
                let a = self.partial.remove(&slot).expect("present");
                let last = Some(message.clone());
                let data = Data::Own(a.data);
                out.push(Received { key: e.key, meta: a.meta, sender, len: a.len, data, _last_piece: last });
            }
        }
        Ok(out)
    }
}

fn read_pipe(
    i: usize,
    pipe: PipeReceiver,
    tx: crossbeam_channel::Sender<Event>,
    stop: Arc<AtomicBool>,
    abort: Arc<parking_lot::Mutex<Option<String>>>,
    cut: Arc<parking_lot::Mutex<Option<String>>>,
) {
    while !stop.load(Ordering::Acquire) && cut.lock().is_none() {
        let event = match pipe.next_within(READER_SLICE) {
            Ok(Next::Item(m)) => Event::Message(i, m),
            Ok(Next::End) => Event::End(i),
            // Quiet, but the other end is alive (a dead one is an error): keep waiting.
            Ok(Next::NotYet) => continue,
            Err(e) => Event::Failed(i, e),
        };
        let last = !matches!(event, Event::Message(..));
        if tx.send(event).is_err() || last {
            break;
        }
    }
    if let Some(reason) = cut.lock().as_deref().or(abort.lock().as_deref()) {
        pipe.abort(reason);
    }
}

impl Drop for ChannelReceiver {
    fn drop(&mut self) {
        self.stop_readers();
    }
}
