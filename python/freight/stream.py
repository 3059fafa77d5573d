"""Pipes and channels: streams of bytes and of keyed objects from one agent to another.

A **pipe** is a one-way, ordered stream of messages from a sender agent to a receiver
agent through a bounded buffer in the receiver's memory (host or GPU). The sender
writes each message straight into free space of that buffer (one copy end to end); the
receiver reads messages in order as zero-copy views and hands the space back by
releasing them. A buffer far smaller than the stream is fine: the sender waits for
space, never longer than the pipe's timeout.

Receiver::

    listener = freight.PipeListener(agent)
    with listener.accept(buffer=64 << 20) as pipe:   # or a registered array / CUDA tensor
        for msg in pipe:                              # ends when the sender closes
            with msg:                                 # releases the space on exit
                consume(msg.tag, msg.view())          # numpy uint8 view (GPU: CUDA view)

Sender::

    with freight.PipeSender.connect(agent, "10.0.0.2:7000") as pipe:
        for block in blocks:
            pipe.send(block, tag=b"layer")
    # closing flushes and ends the stream

A **channel** carries keyed arrays or tensors over pipes (several senders may feed one
receiver): :class:`ChannelSender` sends ``(keys, tensors)`` in batches, with each
object's dtype and shape; :class:`ChannelReceiver` hands out :class:`Received` objects,
viewed in place (``view()``) or copied into caller memory (``copy_to()``).

A view keeps the memory it sees mapped (and, for a reassembled object, out of reuse)
for as long as the view exists, so it never points at freed memory; but once the message
or object is released (explicitly, or by the context manager) its bytes may be
overwritten by later messages: use views before releasing.

Senders may send memory that is not registered with their agent: it is registered for
the call and deregistered once its bytes are written (after a failure or an abort, once
the writes already posted have finished), which costs a registration (and for GPU
memory an IPC export) per object and a flush per call, so that sends no longer overlap.
For a steady stream, register a pool of memory once (``agent.register``) and send from
it.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from . import _native
from ._objects import Range, _uint, describe, is_tensor, to_bytes
from .agent import Agent
from .descs import DescList, as_desclist
from .errors import FreightError, InvalidArgumentError, InvalidStateError, OverlapError, RegionBusyError

__all__ = [
    "PipeListener",
    "PipeReceiver",
    "PipeSender",
    "Message",
    "ChannelSender",
    "ChannelReceiver",
    "Received",
    "KeyedObject",
    "CudaView",
]

log = logging.getLogger("freight.stream")

#: Default size of a receiver's buffer (host memory is committed only as it is used).
DEFAULT_BUFFER = 4 << 30
#: Pipe messages start on multiples of this many bytes.
ALIGN = 256


def _core(agent: Any) -> Agent:
    if not isinstance(agent, Agent):
        raise TypeError(f"expected a freight.Agent, got {type(agent).__name__}")
    return agent


def _register_if_needed(agent: Agent, r: Range) -> Optional[int]:
    """Registers ``r`` with ``agent`` unless it is already registered; returns the key
    of a registration made here (None if the memory was registered before)."""
    try:
        return agent._register(r.kind, r.addr, r.length, r.device, r.keep)
    except OverlapError:
        # Registered already (typically inside a pool the caller registered); if only
        # partly, the transfer itself says so (NotRegisteredError / OutOfBoundsError).
        return None


def _deregister_all(agent: Agent, keys: List[int]) -> None:
    """Deregisters the temporary regions ``keys`` and takes them off the list. A region
    a transfer still uses stays on it, so that a later call (a flush, a close, the
    collection of its end) tries again instead of leaving it registered for good."""
    busy = []
    for key in keys:
        try:
            agent.deregister(key)
        except RegionBusyError as e:
            log.warning("a temporary region %d is still in use; deregistering it later: %s", key, e)
            busy.append(key)
        except FreightError as e:
            log.warning("could not deregister a temporary region %d: %s", key, e)
    keys[:] = busy


def _quietly_then_deregister(raw: Any, how: str, agent: Agent, keys: List[int]) -> None:
    """Deregisters the temporary regions ``keys`` of the stream end ``raw`` once
    ``raw.<how>()`` returned: ``"settle_writes"`` for a sending end whose stream broke or
    was aborted (the writes it posted may still be on their way), ``"close"`` for an end
    dropped without :meth:`close`. A call that fails is logged (the error that matters
    is the caller's own), and a region still in use stays listed."""
    if not keys:
        return
    try:
        getattr(raw, how)()
    except FreightError as e:
        log.debug("%s of a stream end before deregistering its memory failed: %s", how, e)
    _deregister_all(agent, keys)


def _on_collect(owner: Any, raw: Any, agent: Agent, keys: List[int], how: str = "close") -> None:
    """Deregisters ``keys`` (the list is shared with ``owner``, which empties it when it
    cleans up itself) once ``owner`` is garbage collected without being closed. Not at
    interpreter exit: the registrations go with the process, and a close could wait."""
    weakref.finalize(owner, _quietly_then_deregister, raw, how, agent, keys).atexit = False


def _credit_batch(credit_batch: Optional[int]) -> Optional[int]:
    return None if credit_batch is None else _uint(credit_batch, "credit_batch")


class CudaView:
    """GPU bytes seen as an array through ``__cuda_array_interface__`` (version 3), for
    ``torch.as_tensor(view, device="cuda")``, ``cupy.asarray(view)`` or numba. It keeps
    its owner (a message or received object) alive; the bytes are valid until the owner
    is released."""

    __slots__ = ("_owner", "_typestr", "_shape")

    def __init__(self, owner: Any, typestr: str = "|u1", shape: Optional[Tuple[int, ...]] = None) -> None:
        self._owner = owner
        self._typestr = typestr
        self._shape = tuple(shape) if shape is not None else (owner.nbytes,)

    @property
    def __cuda_array_interface__(self) -> dict:
        iface = dict(self._owner.__cuda_array_interface__)
        iface["typestr"] = self._typestr
        iface["shape"] = self._shape
        return iface

    @property
    def shape(self) -> Tuple[int, ...]:
        """The array's shape."""
        return self._shape

    @property
    def device(self) -> int:
        """The CUDA device ordinal."""
        return int(self._owner.device)

    def __repr__(self) -> str:
        return f"<freight.CudaView {self._typestr} {self._shape} on cuda:{self.device}>"


# ----------------------------------------------------------------------------- pipe


_R = TypeVar("_R", bound="_Releasable")


class _Bytes:
    """What a message and a keyed object share: bytes somewhere in host or GPU memory,
    described by the native object ``_raw``."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    @property
    def nbytes(self) -> int:
        """Length in bytes."""
        return self._raw.nbytes

    def __len__(self) -> int:
        return self._raw.nbytes

    @property
    def kind(self) -> str:
        """"DRAM" (host memory) or "VRAM" (GPU memory)."""
        return self._raw.kind

    @property
    def device(self) -> int:
        """The CUDA device of VRAM bytes (0 for host memory)."""
        return self._raw.device


class _Releasable:
    """Bytes whose space is lent until :meth:`release` (a message's, a received
    object's); leaving a ``with`` block releases them."""

    __slots__ = ()
    _raw: Any

    def release(self) -> None:
        raise NotImplementedError

    @property
    def released(self) -> bool:
        """True once :meth:`release` was called."""
        return not self._raw.live

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class Message(_Bytes, _Releasable):
    """A message of a pipe, in the receiver's buffer.

    ``tag`` (bytes the sender attached), ``seq`` (0, 1, 2... in send order),
    ``len(msg)`` / ``nbytes``, ``kind`` ("DRAM" or "VRAM"), ``device`` (CUDA ordinal).
    :meth:`view` gives the bytes without copying. :meth:`release` (or leaving a ``with``
    block, or dropping the message) frees its space for the sender. A view keeps the
    memory mapped; after release its bytes may be overwritten by later messages.
    Messages may be released in any order.
    """

    __slots__ = ()

    @property
    def tag(self) -> bytes:
        """What the sender attached to the message."""
        return self._raw.tag

    @property
    def seq(self) -> int:
        """The message's number: 0, 1, 2... in the order they were sent."""
        return self._raw.seq

    def view(self) -> Any:
        """The bytes in place: a uint8 numpy array (host memory) or a :class:`CudaView`
        (GPU memory; ``torch.as_tensor(msg.view(), device="cuda")``). The view keeps
        the message object, and with it the memory, alive, but not its space: after
        :meth:`release` later messages may overwrite the bytes."""
        if self.released:
            raise InvalidStateError("the message was released")
        if self.kind == "VRAM":
            return CudaView(self._raw)
        return np.asarray(self._raw)

    def release(self) -> None:
        """Frees the message's space for the sender (views stay mapped, but see later
        messages' bytes). Harmless when called again."""
        self._raw.release()

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return f"<freight.Message seq={self.seq} {self.nbytes} bytes of {self.kind} tag={self.tag!r}{state}>"


_End = TypeVar("_End", bound="_StreamEnd")


class _StreamEnd:
    """What every end of a pipe, a channel or a store shares: the native end
    (``_raw``), and use as a context manager that calls :meth:`close` on exit.

    A subclass that names itself in ``_quiet_close`` (e.g. ``"a pipe"``) closes quietly
    when an error is on its way out of the ``with`` block: a sender's close flushes, and
    the pipe may be what broke, so a second error would only hide the first. That one
    is logged at debug level, on the class's ``_log`` (its module's logger).
    """

    _raw: Any
    #: What the debug line calls this end; None: close as on a clean exit.
    _quiet_close: Optional[str] = None
    _log = log

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _End) -> _End:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None or self._quiet_close is None:
            self.close()
            return
        try:
            self.close()
        except FreightError as e:
            self._log.debug("closing %s after an error failed: %s", self._quiet_close, e)


class _PeerEnd(_StreamEnd):
    """An end with one peer and one pipe buffer behind it."""

    @property
    def peer(self) -> str:
        """The name of the agent at the other end."""
        return self._raw.peer

    @property
    def capacity(self) -> int:
        """Size in bytes of the receiver's pipe buffer for this end: the largest pipe
        message."""
        return self._raw.capacity


class PipeReceiver(_PeerEnd):
    """The receiving end of a pipe (from :meth:`PipeListener.accept`).

    :meth:`recv` returns messages in order, and None once the sender closed the stream
    and every message was handed out; iterating does the same until the end. A sender
    that dies or aborts makes :meth:`recv` raise (:class:`freight.PeerDisconnectedError`)
    instead of waiting; a quiet one raises :class:`freight.TimeoutError` after the
    timeout. Context manager: :meth:`close` on exit.
    """

    def __init__(self, agent: Agent, raw: Any, temp_key: Optional[int]) -> None:
        self._agent = agent
        self._raw = raw
        self._temp = [] if temp_key is None else [temp_key]
        _on_collect(self, raw, agent, self._temp)

    def recv(self, timeout: Optional[float] = None) -> Optional[Message]:
        """The next message, or None at the end of the stream. Waits up to ``timeout``
        seconds (None: the pipe's timeout; ``float("inf")``: no limit)."""
        raw = self._raw.recv(timeout)
        return None if raw is None else Message(raw)

    def __iter__(self) -> Iterator[Message]:
        while True:
            msg = self.recv()
            if msg is None:
                return
            yield msg

    @property
    def kind(self) -> str:
        """Where the buffer is: "DRAM" or "VRAM"."""
        return self._raw.kind

    @property
    def device(self) -> int:
        """The CUDA device of a VRAM buffer (0 for host memory)."""
        return self._raw.device

    @property
    def held(self) -> int:
        """Messages handed out and not yet released."""
        return self._raw.held

    @property
    def finished(self) -> bool:
        """True once the sender closed the stream and every message was handed out."""
        return self._raw.finished

    def close(self) -> None:
        """Ends this side. A sender still sending is told that the receiver went away.
        A buffer registered by :meth:`PipeListener.accept` is deregistered."""
        self._raw.close()
        _deregister_all(self._agent, self._temp)

    def __repr__(self) -> str:
        return f"<freight.PipeReceiver from {self.peer!r}: {self.capacity} bytes of {self.kind}>"


def _buffer_region(agent: Agent, buffer: Any) -> Tuple[Optional[int], Optional[Range], Optional[int]]:
    """(capacity, region, temporary key) for a buffer argument: a size in bytes (host
    memory the pipe allocates) or an object (registered here if it is not yet)."""
    if isinstance(buffer, (int, np.integer)) and not isinstance(buffer, bool):
        if buffer <= 0:
            raise InvalidArgumentError(f"the buffer size must be positive, got {buffer}")
        return int(buffer), None, None
    r = describe(buffer, readonly_ok=False)
    if r.kind not in ("DRAM", "VRAM"):
        raise InvalidArgumentError(f"a pipe buffer must be host or GPU memory, got {r.kind}")
    return None, r, _register_if_needed(agent, r)


class PipeListener:
    """Accepts pipes that senders open to ``agent`` (senders connect to one of
    ``agent.addresses``, or an address from ``agent.listen``)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._raw = _native.PipeListener(_core(agent))

    def accept(
        self, buffer: Any = DEFAULT_BUFFER, timeout: float = 30.0, credit_batch: Optional[int] = None
    ) -> PipeReceiver:
        """Waits up to ``timeout`` seconds for a sender to open a pipe and sets it up.

        ``buffer`` is the pipe's buffer: a size in bytes (host memory allocated for the
        pipe, reachable over shm and tcp), or an object (a numpy array, a buffer, a CPU
        or CUDA torch tensor) that becomes the buffer. An object not registered with
        the agent is registered here, and deregistered when the receiver is closed.
        ``timeout`` also bounds every later wait of the pipe. ``credit_batch``: the
        least number of freed bytes worth telling the sender about (default: a quarter
        of the buffer).
        """
        credit_batch = _credit_batch(credit_batch)
        capacity, region, key = _buffer_region(self._agent, buffer)
        try:
            if region is None:
                raw = self._raw.accept(capacity=capacity, timeout=timeout, credit_batch=credit_batch)
            else:
                raw = self._raw.accept(
                    region=(region.kind, region.addr, region.length, region.device),
                    keep=buffer,
                    timeout=timeout,
                    credit_batch=credit_batch,
                )
        except BaseException:
            if key is not None:
                _deregister_all(self._agent, [key])
            raise
        return PipeReceiver(self._agent, raw, key)


def _local_descs(agent: Agent, obj: Any, temp: List[int]) -> DescList:
    """A DescList for ``obj``, registering objects that are not registered yet (their
    keys are added to ``temp``). Raw ``(addr, length, device)`` tuples and DescLists
    are the caller's registered memory, taken as they are."""
    if isinstance(obj, DescList):
        return obj
    if isinstance(obj, tuple) and len(obj) == 3 and all(isinstance(v, (int, np.integer)) for v in obj):
        return DescList([obj])
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    descs = as_desclist(items)
    for item in items:
        if not isinstance(item, tuple):
            key = _register_if_needed(agent, describe(item))
            if key is not None:
                temp.append(key)
    return descs


class PipeSender(_PeerEnd):
    """The sending end of a pipe; make one with :meth:`connect`.

    :meth:`send` posts a message and returns at once (it waits only for space in the
    receiver's buffer); the sent memory must stay unchanged until :meth:`flush`.
    Context manager: :meth:`close` (flush, end of stream) on a clean exit.
    """

    _quiet_close = "a pipe"

    def __init__(self, agent: Agent, raw: Any) -> None:
        self._agent = agent
        self._raw = raw
        self._temp: List[int] = []
        # Writes from the temporary regions must be done before they go.
        _on_collect(self, raw, agent, self._temp, how="settle_writes")

    @classmethod
    def connect(cls, agent: Agent, addr: str, timeout: float = 30.0, max_in_flight: int = 16) -> "PipeSender":
        """Opens a pipe to the agent listening at ``addr`` (``"ip:port"``), which must
        accept it within ``timeout`` seconds. ``timeout`` also bounds every later wait
        (for buffer space, for writes to finish). ``max_in_flight``: writes posted and
        not yet finished before :meth:`send` waits for the oldest."""
        return cls(agent, _native.PipeSender.connect(_core(agent), addr, timeout, max_in_flight))

    def send(self, obj: Any, tag: Any = b"") -> int:
        """Sends bytes as one message tagged ``tag`` (bytes, or str sent UTF-8); returns
        the message's number.

        ``obj`` is a numpy array, a buffer or a tensor (contiguous; its bytes), or a
        :class:`freight.DescList` / list of objects and ``(addr, length, device)``
        tuples (their bytes gathered in order). Objects not registered with the agent
        are registered until the next :meth:`flush` (see the module's note on cost).
        The message may be as long as the receiver's buffer (:attr:`capacity`).
        """
        descs = _local_descs(self._agent, obj, self._temp)
        return self._raw.send(descs._raw, to_bytes(tag, "tag"))

    def send_scattered(self, obj: Any, pieces: Sequence[Tuple[int, int]], tag: Any = b"") -> int:
        """Like :meth:`send`, but the bytes land in pieces of the message: ``pieces``
        are ``(offset in the message, length)`` in the order of the bytes of ``obj``."""
        pieces = [(_uint(o, "a piece's offset"), _uint(n, "a piece's length")) for o, n in pieces]
        descs = _local_descs(self._agent, obj, self._temp)
        return self._raw.send(descs._raw, to_bytes(tag, "tag"), pieces)

    def flush(self) -> None:
        """Waits until every message sent so far is written into the receiver's buffer;
        the sent memory may change afterwards."""
        try:
            self._raw.flush()
        finally:
            self._release_temp()

    def drain(self) -> None:
        """Flushes, then waits until the receiver released every message sent so far."""
        try:
            self._raw.drain()
        finally:
            self._release_temp()

    def close(self) -> None:
        """Flushes and ends the stream (the receiver's ``recv`` then returns None after
        the last message). Harmless when called again. After an :meth:`abort` (or a
        failure) it waits for the writes already posted to finish, so that the memory
        they read is free to change or go."""
        try:
            self._raw.close()
        finally:
            self._release_temp()

    def abort(self, reason: str = "aborted by the sender") -> None:
        """Breaks the pipe: the receiver's next call raises with ``reason``, instead of
        seeing the stream end as if it were whole. Callable from any thread: a
        :meth:`send` or :meth:`flush` another thread is waiting in raises
        :class:`freight.InvalidStateError` within a fraction of a second, and so does
        every later call. Harmless once closed or aborted."""
        self._raw.abort(str(reason))

    def _release_temp(self) -> None:
        _quietly_then_deregister(self._raw, "settle_writes", self._agent, self._temp)

    @property
    def kind(self) -> str:
        """Where the receiver's buffer is: "DRAM" or "VRAM"."""
        return self._raw.kind

    @property
    def sent(self) -> int:
        """Messages sent so far."""
        return self._raw.sent

    def __repr__(self) -> str:
        return f"<freight.PipeSender to {self.peer!r}: {self.capacity} bytes of {self.kind}>"


# ----------------------------------------------------------------------------- channel


def _dtype_name(obj: Any) -> str:
    """A dtype name that numpy understands where it can: "float32", "bfloat16", ">i4"."""
    if is_tensor(obj):
        return str(obj.dtype).replace("torch.", "")
    dt = obj.dtype
    return dt.name if dt.isnative and dt.kind != "V" else dt.str


def _numpy_dtype(name: Optional[str]) -> Optional[np.dtype]:
    if name is None:
        return None
    try:
        return np.dtype(name)
    except TypeError:
        return None  # e.g. bfloat16: numpy has no such type


def _describe_object(key: Any, obj: Any) -> Tuple[Range, bytes]:
    """The memory range of one object to send, and its metadata (dtype, shape)."""
    try:
        if isinstance(obj, np.ndarray):
            if not obj.flags.c_contiguous:
                raise InvalidArgumentError("the array is not C-contiguous (use np.ascontiguousarray)")
        elif not is_tensor(obj):
            raise TypeError(f"expected a numpy array or a tensor, got {type(obj).__name__}")
        r = describe(obj)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"object {key!r}: {e}") from None
    meta = {"dtype": _dtype_name(obj), "shape": [int(n) for n in obj.shape]}
    return r, json.dumps(meta).encode()


class ChannelSender(_PeerEnd):
    """Sends keyed arrays or tensors to a :class:`ChannelReceiver` listening at
    ``addr``, over a pipe opened here (the receiver must accept it within ``timeout``).

    ``batch_size``: objects per batch; a batch fills one or more pipe messages of at
    most ``max_message`` bytes (default a quarter of the receiver's buffer, so that
    several are in flight). Objects larger than a message are cut and reassembled by
    the receiver. Context manager: :meth:`close` on exit.
    """

    _quiet_close = "a channel"

    def __init__(
        self,
        agent: Agent,
        addr: str,
        batch_size: int = 32,
        timeout: float = 30.0,
        max_message: Optional[int] = None,
        max_in_flight: int = 16,
    ) -> None:
        self._agent = agent
        self._raw = _native.ChannelSender(_core(agent), addr, batch_size, timeout, max_message, max_in_flight)
        #: Temporary regions of past sends that could not be deregistered yet (a write
        #: still used them): :meth:`flush`, :meth:`close` and collection try again.
        self._temp: List[int] = []
        _on_collect(self, self._raw, agent, self._temp, how="settle_writes")

    def send(self, keys: Sequence[str], tensors: Sequence[Any]) -> int:
        """Sends ``tensors[i]`` under ``keys[i]``; returns the number of pipe messages
        used.

        Keys are non-empty strings, unique within a call. Tensors are numpy arrays or
        torch tensors (CPU or CUDA), C-contiguous, not empty, all in the same kind of
        memory; their dtype and shape travel with them. The memory must stay unchanged
        until :meth:`flush`, except for objects that were not registered with the agent:
        those are registered for this call, and the call flushes and deregisters them
        before it returns (see the module's note on cost). Bad keys, empty tensors
        and mixed memory raise :class:`freight.InvalidArgumentError` before anything
        is sent; a batch whose headers do not fit a message fails as it goes, after
        the batches before it were sent whole.
        """
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(tensors)} objects")
        seen = set()
        for key in keys:
            if not isinstance(key, str):
                raise InvalidArgumentError(f"keys must be str, got {type(key).__name__} {key!r}")
            if not key:
                raise InvalidArgumentError("keys must not be empty")
            if key in seen:
                raise InvalidArgumentError(f"key {key!r} appears twice in one send")
            seen.add(key)
        described = [_describe_object(k, t) for k, t in zip(keys, tensors)]
        kinds = {r.kind for r, _ in described}
        if len(kinds) > 1:
            raise InvalidArgumentError(f"all objects of one send must be in the same kind of memory, got {sorted(kinds)}")
        temp: List[int] = []
        try:
            for r, _ in described:
                registered = _register_if_needed(self._agent, r)
                if registered is not None:
                    temp.append(registered)
            objects = [(k, r.kind, r.addr, r.length, r.device, meta) for k, (r, meta) in zip(keys, described)]
            messages = self._raw.send(objects)
            if temp:
                self._raw.flush()
            return messages
        finally:
            if temp:
                self._temp.extend(temp)
                self._release_temp()

    def _release_temp(self) -> None:
        _quietly_then_deregister(self._raw, "settle_writes", self._agent, self._temp)

    def flush(self) -> None:
        """Waits until every object sent so far is written into the receiver's buffer."""
        try:
            self._raw.flush()
        finally:
            self._release_temp()

    def drain(self) -> None:
        """Waits until the receiver released every object sent so far."""
        self._raw.drain()

    def close(self) -> None:
        """Flushes and ends the stream. Harmless when called again."""
        try:
            self._raw.close()
        finally:
            self._release_temp()

    def abort(self, reason: str = "aborted by the sender") -> None:
        """Breaks the channel, as :meth:`PipeSender.abort` does its pipe: the receiver
        raises with ``reason`` instead of taking a partial batch for a whole stream, and
        a :meth:`send` waiting on another thread raises. Harmless once closed."""
        self._raw.abort(str(reason))

    def __repr__(self) -> str:
        return f"<freight.ChannelSender to {self.peer!r}: {self.capacity} bytes>"


class KeyedObject(_Bytes):
    """What a received object (:class:`Received`) and a stored one
    (:class:`freight.StoredObject`) share: a key, the sender's metadata (dtype and
    shape), views with that dtype and shape, and checked copies into caller memory."""

    __slots__ = ("_meta",)

    def __init__(self, raw: Any) -> None:
        super().__init__(raw)
        try:
            meta = json.loads(raw.meta) if raw.meta else {}
        except ValueError:
            meta = {}
        self._meta = meta if isinstance(meta, dict) else {}

    @property
    def key(self) -> str:
        """The object's key."""
        return self._raw.key

    @property
    def meta(self) -> dict:
        """What the sender said about the object: ``{"dtype": str, "shape": list}``."""
        return dict(self._meta)

    @property
    def dtype(self) -> Optional[str]:
        """The sent dtype's name ("float32", "bfloat16", ...), if known."""
        return self._meta.get("dtype")

    @property
    def shape(self) -> Optional[Tuple[int, ...]]:
        """The sent shape, if known."""
        shape = self._meta.get("shape")
        return None if shape is None else tuple(shape)

    @property
    def sender(self) -> int:
        """Which sender it came from (index in the order the receiver accepted them)."""
        return self._raw.sender

    def _check_live(self) -> None:
        """Raises when the bytes may no longer be used."""

    def _typed(self) -> Tuple[Optional[np.dtype], Optional[Tuple[int, ...]]]:
        """The dtype and shape to view the bytes with, when they account for them."""
        dt, shape = _numpy_dtype(self.dtype), self.shape
        if dt is None or shape is None or int(np.prod(shape, dtype=np.int64)) * dt.itemsize != self.nbytes:
            return None, None
        return dt, shape

    def view(self) -> Any:
        """The object in place, with its sent dtype and shape: a numpy array (host
        memory) or a :class:`CudaView` (GPU memory; ``torch.as_tensor(obj.view(),
        device="cuda")``). A dtype numpy does not know (bfloat16) gives the raw bytes as
        a flat uint8 array. The view keeps this object alive."""
        self._check_live()
        dt, shape = self._typed()
        if self.kind == "VRAM":
            if dt is None:
                return CudaView(self._raw)
            return CudaView(self._raw, dt.str, shape)
        raw = np.asarray(self._raw)
        return raw if dt is None else raw.view(dt).reshape(shape)

    def copy_to(self, dst: Any) -> Any:
        """Copies the object into ``dst`` (a numpy array or a CPU or CUDA tensor,
        contiguous and writable, of the same size in bytes and, when the object's dtype
        is known, of the same dtype; or a writable buffer such as a bytearray, which
        takes the raw bytes); returns ``dst``. Raises
        :class:`freight.InvalidArgumentError` on a mismatch."""
        if isinstance(dst, np.ndarray) and not dst.flags.c_contiguous:
            raise InvalidArgumentError("the destination array is not C-contiguous")
        r = describe(dst, readonly_ok=False)
        if r.length != self.nbytes:
            raise InvalidArgumentError(f"object {self.key!r} has {self.nbytes} bytes, the destination {r.length}")
        typed = isinstance(dst, np.ndarray) or is_tensor(dst)
        if typed and self.dtype is not None and _dtype_name(dst) != self.dtype:
            raise InvalidArgumentError(f"object {self.key!r} is {self.dtype}, the destination {_dtype_name(dst)}")
        self._raw.copy_to(r.kind, r.addr, r.length)
        return dst


class Received(KeyedObject, _Releasable):
    """An object that arrived whole through a channel.

    ``key``, ``meta`` (dict: ``dtype``, ``shape``), ``sender`` (index of the sender,
    in accept order), ``nbytes``, ``kind``/``device``, ``is_view`` (True: the bytes lie
    in the pipe buffer; False: the object was cut across messages and reassembled).
    :meth:`view` sees the bytes in place, :meth:`copy_to` copies them out;
    :meth:`release` (or leaving a ``with`` block) frees the space. A view keeps the
    memory mapped (a reassembled object's memory is not reused while this object
    lives); after release, a view of a pipe buffer may see later messages' bytes.
    """

    __slots__ = ()

    @property
    def kind(self) -> str:
        """"DRAM" or "VRAM" (the receiver's buffer)."""
        return self._raw.kind

    @property
    def is_view(self) -> bool:
        """True when the bytes are in the pipe buffer (zero-copy), False when the object
        was reassembled in memory of its own."""
        return self._raw.is_view

    def _check_live(self) -> None:
        if self.released:
            raise InvalidStateError(f"object {self.key!r} was released")

    def release(self) -> None:
        """Frees the object's space (a message's space is freed once every object in it
        is released). Views stay mapped, but a view of a pipe buffer may see later
        messages' bytes. Harmless when called again."""
        self._raw.release()

    def __repr__(self) -> str:
        how = "view" if self.is_view else "reassembled"
        return f"<freight.Received {self.key!r} {self.dtype} {self.shape} {self.nbytes} bytes of {self.kind} ({how})>"


Observer = Callable[[List[str], List[Received]], Any]


def _num_senders(num_senders: Any) -> int:
    if isinstance(num_senders, bool) or not isinstance(num_senders, (int, np.integer)) or num_senders < 1:
        raise InvalidArgumentError(f"num_senders must be a positive int, got {num_senders!r}")
    return int(num_senders)


def _split_buffer(agent: Agent, n: int, buffer: Any) -> Tuple[dict, Optional[int]]:
    """The native receiver's pipe arguments for ``n`` senders sharing ``buffer`` evenly
    (a size in bytes, or an object registered here if it is not yet), and the key of a
    registration made here (the caller deregisters it when done)."""
    capacity, region, key = _buffer_region(agent, buffer)
    total = region.length if region is not None else capacity
    assert total is not None, "a buffer is a size or a region"
    part = total // n // ALIGN * ALIGN
    if part == 0:
        if key is not None:
            _deregister_all(agent, [key])
        raise InvalidArgumentError(f"a buffer of {total} bytes is too small for {n} senders")
    if region is None:
        return {"capacity": part}, None
    regions = [(region.kind, region.addr + i * part, part, region.device) for i in range(n)]
    return {"regions": regions, "keep": buffer}, key


class ChannelReceiver(_StreamEnd):
    """Receives keyed objects from ``num_senders`` :class:`ChannelSender` s.

    The constructor waits up to ``timeout`` seconds for each sender to connect (to any
    of ``agent.addresses``). ``buffer`` is the receiver's memory for all senders, split
    evenly: a size in bytes (host memory allocated here), or an object (numpy array,
    CPU or CUDA tensor; registered here if it is not yet, deregistered on
    :meth:`close`).

    Observers (:meth:`add_observer`) are called with each batch inside :meth:`recv`;
    their time is kept apart from the transfers' (:attr:`observer_seconds`).
    """

    def __init__(
        self,
        agent: Agent,
        num_senders: int = 1,
        buffer: Any = DEFAULT_BUFFER,
        timeout: float = 30.0,
        credit_batch: Optional[int] = None,
    ) -> None:
        n = _num_senders(num_senders)
        self._agent = agent
        self._observers: List[Observer] = []
        #: Seconds spent in observers, in total and for the last batch.
        self.observer_seconds = 0.0
        self.last_observer_seconds = 0.0
        #: Seconds spent in :meth:`recv` waiting for and unpacking objects (observers excluded).
        self.recv_seconds = 0.0
        #: Batches received so far.
        self.batches = 0
        credit_batch = _credit_batch(credit_batch)
        pipes, temp_key = _split_buffer(agent, n, buffer)
        self._temp = [] if temp_key is None else [temp_key]
        try:
            self._raw = _native.ChannelReceiver(_core(agent), n, timeout=timeout, credit_batch=credit_batch, **pipes)
        except BaseException:
            _deregister_all(agent, self._temp)
            raise
        _on_collect(self, self._raw, agent, self._temp)

    def add_observer(self, fn: Observer) -> None:
        """Calls ``fn(keys, objects)`` (a list of str, a list of :class:`Received`) with
        every batch :meth:`recv` returns, before it returns it. An exception from an
        observer propagates from :meth:`recv`."""
        if not callable(fn):
            raise TypeError(f"an observer must be callable, got {type(fn).__name__}")
        self._observers.append(fn)

    def remove_observer(self, fn: Observer) -> None:
        """Stops calling ``fn``."""
        self._observers.remove(fn)

    def recv(self, timeout: Optional[float] = None) -> Optional[List[Received]]:
        """The objects of the next message that completes any (whole objects only), or
        None once every sender closed its stream. Waits up to ``timeout`` seconds (None:
        the channel's timeout); raises :class:`freight.TimeoutError` then, and
        :class:`freight.PeerDisconnectedError` (or another freight error) when a sender
        dies."""
        start = time.perf_counter()
        raw = self._raw.recv(timeout)
        objects = None if raw is None else [Received(r) for r in raw]
        self.recv_seconds += time.perf_counter() - start
        if objects is None:
            return None
        self.batches += 1
        self.last_observer_seconds = 0.0
        if self._observers:
            keys = [o.key for o in objects]
            start = time.perf_counter()
            try:
                for fn in list(self._observers):
                    fn(keys, objects)
            finally:
                self.last_observer_seconds = time.perf_counter() - start
                self.observer_seconds += self.last_observer_seconds
        return objects

    def __iter__(self) -> Iterator[List[Received]]:
        while True:
            batch = self.recv()
            if batch is None:
                return
            yield batch

    @property
    def peers(self) -> List[str]:
        """The senders' agent names, indexed by :attr:`Received.sender`."""
        return self._raw.peers

    def close(self) -> None:
        """Stops receiving (senders still sending are told). Objects handed out stay
        valid until released; a buffer registered by the constructor is deregistered."""
        self._raw.close()
        _deregister_all(self._agent, self._temp)

    def __repr__(self) -> str:
        return f"<freight.ChannelReceiver from {self.peers}>"
