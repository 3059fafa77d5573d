"""A keyed store between agents: puts committed in batches, gets by key.

A :class:`StoreSender` ``put`` s arrays or tensors for one :class:`StoreReceiver`
(several senders may feed one receiver). Puts are committed in batches of
``commit_size`` objects (128 by default, as the prefill side of a disaggregated server
hands KV chunks over): a commit returns once the receiver holds every object in it, so
a peer told "done" after a commit finds every key. The receiver copies each object out
of its pipe buffer into memory of its own (GPU objects stay on the GPU), and
:meth:`StoreReceiver.get`, ``in``, :meth:`StoreReceiver.remove` work on that store
while more objects stream in.

Receiver::

    with freight.StoreReceiver(agent, buffer=256 << 20, capacity=8 << 30) as store:
        store.wait_for(["layer-0", "layer-1"], timeout=30)
        kv = store.get("layer-0").view()          # numpy array (GPU: a CudaView)

Sender::

    with freight.StoreSender(agent, "10.0.0.2:7000", commit_size=64) as store:
        for key, tensor in chunks:
            stats = store.put(key, tensor)        # a CommitStats every 64 puts
        store.commit()                            # the rest; close() commits too

Each commit reports its figures (:class:`CommitStats`): the transfer proper, and the time
spent waiting for the receiver (for room in its buffer, then for it to take the last
objects). A full store (``capacity``) stops taking objects in: the receiver's waits raise
:class:`freight.NoSpaceError`, and the sender's commit raises
:class:`freight.PeerDisconnectedError` saying the receiver is out of space; what the store
held stays available. A store made with ``evict=True`` makes room instead: it drops its
least recently used objects (an object is used when it arrives and when ``get`` returns
it) that nobody holds any more, and stops only when even that leaves no room. A receiver
that nobody empties with :meth:`StoreReceiver.remove`, such as the remote source of a
:class:`freight.CacheEngine` in a long-running server, needs one::

    source = freight.StoreReceiver(agent, buffer=1 << 30, capacity=16 << 30, evict=True)
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence

from . import _native
from ._objects import Range
from .agent import Agent
from .errors import InvalidArgumentError
from .stream import (
    DEFAULT_BUFFER,
    KeyedObject,
    _core,
    _credit_batch,
    _on_collect,
    _PeerEnd,
    _StreamEnd,
    _deregister_all,
    _quietly_then_deregister,
    _describe_object,
    _num_senders,
    _register_if_needed,
    _split_buffer,
)

__all__ = ["StoreSender", "StoreReceiver", "StoredObject", "CommitStats"]

log = logging.getLogger("freight.storage")


@dataclass(frozen=True)
class CommitStats:
    """How one commit went."""

    #: Objects committed.
    objects: int
    #: Their bytes.
    bytes: int
    #: Posting the writes and seeing them land, less the waits for room.
    transfer_seconds: float
    #: Waiting for room in the receiver's buffer, then for it to take the last objects.
    wait_receiver_seconds: float

    @property
    def total_seconds(self) -> float:
        """The whole commit."""
        return self.transfer_seconds + self.wait_receiver_seconds

    @property
    def transfer_gbps(self) -> float:
        """Bytes over transfer time, in GB/s (1e9 bytes)."""
        return self.bytes / max(self.transfer_seconds, 1e-9) / 1e9


def _stats(raw: Any) -> Optional[CommitStats]:
    return None if raw is None else CommitStats(*raw)


class _Queued(NamedTuple):
    """An object put and not yet committed, and what keeps its memory usable."""

    key: str
    kind: str
    #: A registration made for it (None: the memory was registered already).
    temp_key: Optional[int]
    #: The object itself, alive until its commit returns.
    obj: Any


def _close_then_release(raw: Any, agent: Agent, queued: List[_Queued], busy: List[int]) -> None:
    """What a store sender dropped without :meth:`StoreSender.close` owes: closing
    (which commits what is queued, quietly), then deregistering the objects'
    temporary regions, and those a transfer still used when they were let go."""
    keys = busy + [q.temp_key for q in queued if q.temp_key is not None]
    _quietly_then_deregister(raw, "close", agent, keys)


def _check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise InvalidArgumentError(f"keys must be str, got {type(key).__name__} {key!r}")
    if not key:
        raise InvalidArgumentError("object keys must not be empty")
    return key


class StoreSender(_PeerEnd):
    """Puts keyed arrays or tensors into the :class:`StoreReceiver` listening at
    ``addr``, over a pipe opened here (the receiver must accept it within ``timeout``,
    which also bounds every later wait).

    ``commit_size``: puts per commit. ``batch_size``: objects per channel batch, and
    ``max_message`` the largest pipe message (default a quarter of the receiver's
    buffer). Objects may be larger than the receiver's buffer: they are cut and
    reassembled. Context manager: :meth:`close` (which commits) on exit.

    Memory that is not registered with the agent is registered when put and
    deregistered once the commit that carries it returns; the sender keeps the object
    alive until then. Registered memory must stay unchanged until that commit returns.
    """

    _quiet_close = "a store sender"
    _log = log

    def __init__(
        self,
        agent: Agent,
        addr: str,
        commit_size: int = 128,
        batch_size: int = 32,
        timeout: float = 30.0,
        max_message: Optional[int] = None,
        max_in_flight: int = 16,
    ) -> None:
        for name, value in (("commit_size", commit_size), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self._agent = agent
        self._raw = _native.StoreSender(
            _core(agent), addr, commit_size, batch_size, timeout, max_message, max_in_flight
        )
        self._queued: List[_Queued] = []
        #: Temporary regions of objects let go whose deregistration failed (a transfer
        #: still used them): the next release tries again.
        self._busy: List[int] = []
        self._lock = threading.RLock()
        # Not at interpreter exit: the registrations go with the process, and a commit could wait.
        weakref.finalize(self, _close_then_release, self._raw, agent, self._queued, self._busy).atexit = False

    # -- puts

    def put(self, key: str, tensor: Any) -> Optional[CommitStats]:
        """Queues ``tensor`` (a numpy array or a CPU or CUDA torch tensor, C-contiguous,
        not empty) under ``key``, with its dtype and shape; commits once
        :attr:`commit_size` objects are queued and returns that commit's figures (else
        None). A key already queued, an empty key, or memory of another kind than the
        queued objects' raises :class:`freight.InvalidArgumentError`, and nothing queued
        is lost. A failed commit raises, and its objects stay queued
        (:attr:`pending_keys`); so does the object of a put that raises while sending a
        full batch early: the next :meth:`commit` sends it, and putting its key again
        raises until then."""
        with self._lock:
            r, meta = self._check(key, tensor, self._queued[0].kind if self._queued else None)
            return self._put(key, tensor, r, meta)

    def put_many(self, keys: Sequence[str], tensors: Sequence[Any]) -> List[CommitStats]:
        """Puts ``tensors[i]`` under ``keys[i]``; returns the figures of the commits
        made meanwhile. Every object is checked before any is queued: bad input raises
        :class:`freight.InvalidArgumentError` and queues nothing."""
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(tensors)} objects")
        with self._lock:
            seen = set()
            kind = self._queued[0].kind if self._queued else None
            checked = []
            for key, tensor in zip(keys, tensors):
                if key in seen:
                    raise InvalidArgumentError(f"key {key!r} appears twice in one put_many")
                r, meta = self._check(key, tensor, kind)
                kind = r.kind
                seen.add(key)
                checked.append((key, tensor, r, meta))
            stats = []
            for key, tensor, r, meta in checked:
                s = self._put(key, tensor, r, meta)
                if s is not None:
                    stats.append(s)
            return stats

    def _check(self, key: Any, tensor: Any, kind: Optional[str]) -> "tuple[Range, bytes]":
        _check_key(key)
        if any(q.key == key for q in self._queued):
            raise InvalidArgumentError(f"key {key!r} is already waiting for this commit")
        r, meta = _describe_object(key, tensor)
        if kind is not None and r.kind != kind:
            raise InvalidArgumentError(
                f"object {key!r} is in {r.kind} memory but this commit's objects are in {kind}; commit first"
            )
        return r, meta

    def _put(self, key: str, tensor: Any, r: Range, meta: bytes) -> Optional[CommitStats]:
        self._queued.append(_Queued(key, r.kind, _register_if_needed(self._agent, r), tensor))
        try:
            raw = self._raw.put(key, r.kind, r.addr, r.length, r.device, meta)
        except BaseException:
            self._settle(refused_last=self._raw.pending < len(self._queued))
            raise
        self._settle()
        return _stats(raw)

    def _settle(self, refused_last: bool = False) -> None:
        """Lets go of objects that are no longer queued: a put refused, or the oldest
        ones, committed."""
        if refused_last:
            self._release([self._queued.pop()])
        done = len(self._queued) - self._raw.pending
        if done > 0:
            self._release(self._queued[:done])
            del self._queued[:done]

    def _release(self, queued: Iterable[_Queued]) -> None:
        self._busy.extend(q.temp_key for q in queued if q.temp_key is not None)
        if self._busy:
            _deregister_all(self._agent, self._busy)

    # -- commits

    def commit(self) -> Optional[CommitStats]:
        """Sends every queued object and waits until the receiver holds them all;
        returns the commit's figures, or None when nothing was queued. On failure the
        objects stay queued (:attr:`pending_keys`: what the receiver may lack)."""
        with self._lock:
            try:
                return _stats(self._raw.commit())
            finally:
                self._settle()

    @property
    def pending(self) -> int:
        """Objects queued and not yet committed."""
        return self._raw.pending

    @property
    def pending_keys(self) -> List[str]:
        """Their keys, in put order."""
        return self._raw.pending_keys

    def close(self) -> None:
        """Commits what is queued, then ends the stream. Harmless when called again.
        After a failure nothing stays queued: the objects are let go."""
        with self._lock:
            try:
                self._raw.close()
            finally:
                self._release(self._queued)
                self._queued.clear()

    @property
    def closed(self) -> bool:
        """True once closed, or handed to a :class:`freight.CacheEngine`."""
        return not self._raw.live

    @property
    def commit_size(self) -> int:
        """Puts per commit."""
        return self._raw.commit_size

    def __repr__(self) -> str:
        return f"<freight.StoreSender to {self.peer!r}: {self.pending} pending, commits of {self.commit_size}>"


class StoredObject(KeyedObject):
    """An object a :class:`StoreReceiver` holds.

    ``key``, ``meta`` (dict: ``dtype``, ``shape``), ``dtype``, ``shape``, ``sender``
    (index of the sender, in accept order), ``nbytes``, ``kind`` ("DRAM" or "VRAM")
    and ``device``. :meth:`view` sees the bytes in place with their dtype and shape,
    :meth:`copy_to` copies them out. The memory lives as long as this object or the
    store holds it (:meth:`StoreReceiver.remove` only drops the store's hold), and a
    view keeps this object alive.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<freight.StoredObject {self.key!r} {self.dtype} {self.shape} {self.nbytes} bytes of {self.kind}>"


class StoreReceiver(_StreamEnd):
    """Holds what ``num_senders`` :class:`StoreSender` s put, keyed.

    The constructor waits up to ``timeout`` seconds for each sender to connect (to any
    of ``agent.addresses``); ``timeout`` is also the default of every wait. ``buffer``
    is the pipe memory for all senders, split evenly: a size in bytes (host memory
    allocated here), or an object (numpy array, CPU or CUDA tensor; registered here if
    it is not yet, deregistered on :meth:`close`). Objects are copied out of it into the
    store as they arrive. ``capacity``: the most bytes the store holds (None: no
    limit); a put past it stops the store (see the module's note), unless ``evict``:
    then the least recently used objects that nobody holds (no :class:`StoredObject` of
    theirs is alive) are dropped until it fits, and only a put that does not fit even so
    stops the store. An object is used when it arrives (its key put again included) and
    when :meth:`get` (or ``store[key]``) returns it; ``in``, :meth:`keys` and the waits
    only look. ``evict`` needs a ``capacity``. A store that nobody empties with
    :meth:`remove` -- the ``remote_source`` of a :class:`freight.CacheEngine` in a
    long-running server -- should be given a ``capacity`` with ``evict=True``: without
    one it grows without bound, and without ``evict`` it stops once full.

    A key put again replaces the object held under it. Context manager: :meth:`close`
    on exit.
    """

    def __init__(
        self,
        agent: Agent,
        num_senders: int = 1,
        buffer: Any = DEFAULT_BUFFER,
        timeout: float = 30.0,
        capacity: Optional[int] = None,
        credit_batch: Optional[int] = None,
        *,
        evict: bool = False,
    ) -> None:
        n = _num_senders(num_senders)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise InvalidArgumentError(f"capacity must be a number of bytes >= 0 or None, got {capacity!r}")
        if not isinstance(evict, bool):
            raise InvalidArgumentError(f"evict must be True or False, got {evict!r}")
        if evict and capacity is None:
            raise InvalidArgumentError("evict=True needs a capacity: the store evicts to stay within it")
        self._agent = agent
        credit_batch = _credit_batch(credit_batch)
        pipes, temp_key = _split_buffer(agent, n, buffer)
        self._temp = [] if temp_key is None else [temp_key]
        try:
            self._raw = _native.StoreReceiver(
                _core(agent),
                n,
                timeout=timeout,
                credit_batch=credit_batch,
                store_capacity=capacity,
                evict=evict,
                **pipes,
            )
        except BaseException:
            self._release_buffer()
            raise
        # Handed to a cache engine, the store is the engine's to close (closing it here
        # does nothing), and the engine, which holds this object, is gone by then.
        _on_collect(self, self._raw, agent, self._temp)

    def get(self, key: str) -> Optional[StoredObject]:
        """The object held under ``key``, or None. Counts as a use: an evicting store
        keeps the object while it is alive, and evicts it after those used before."""
        raw = self._raw.get(key)
        return None if raw is None else StoredObject(raw)

    def __getitem__(self, key: str) -> StoredObject:
        obj = self.get(key)
        if obj is None:
            raise KeyError(key)
        return obj

    def contains(self, key: str) -> bool:
        """Whether the store holds ``key``."""
        return self._raw.contains(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._raw.contains(key)

    def remove(self, key: str) -> Optional[StoredObject]:
        """Drops the store's hold on ``key`` and returns the object (its memory goes
        with the last holder), or None when the key is unknown."""
        raw = self._raw.remove(key)
        return None if raw is None else StoredObject(raw)

    def keys(self) -> List[str]:
        """The keys held (in no particular order)."""
        return self._raw.keys()

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._raw.nbytes

    @property
    def received(self) -> int:
        """Objects taken in since the start (replacements included)."""
        return self._raw.received

    @property
    def evicted(self) -> int:
        """Objects evicted to make room since the start (0 unless :attr:`evict`)."""
        return self._raw.evicted

    def wait_for(self, keys: Any, timeout: Optional[float] = None) -> None:
        """Waits until every key of ``keys`` (a str or an iterable of them) is held.
        ``timeout``: seconds (None: the receiver's timeout; ``float("inf")``: no
        limit). Raises :class:`freight.TimeoutError` then; when the store stopped (a
        sender died: :class:`freight.PeerDisconnectedError`; the store is full:
        :class:`freight.NoSpaceError`); and :class:`freight.InvalidStateError` when
        every sender closed without putting them."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        for key in keys:
            if not isinstance(key, str):
                raise InvalidArgumentError(f"keys must be str, got {type(key).__name__} {key!r}")
        self._raw.wait_for(keys, timeout)

    def wait_received(self, count: int, timeout: Optional[float] = None) -> None:
        """Waits until ``count`` objects were taken in since the start (see
        :meth:`wait_for` for ``timeout`` and errors)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidArgumentError(f"count must be an int >= 0, got {count!r}")
        self._raw.wait_received(count, timeout)

    def wait_closed(self, timeout: Optional[float] = None) -> None:
        """Waits until every sender closed its stream: everything put is then held (see
        :meth:`wait_for` for ``timeout`` and errors)."""
        self._raw.wait_closed(timeout)

    def close(self) -> None:
        """Stops taking objects in (senders still putting are told). Objects got stay
        valid; a buffer registered by the constructor is deregistered. Harmless when
        called again; a store handed to a :class:`freight.CacheEngine` is the engine's
        to close."""
        if self._raw.handed:
            return
        self._raw.close()
        self._release_buffer()

    def _release_buffer(self) -> None:
        _deregister_all(self._agent, self._temp)

    @property
    def closed(self) -> bool:
        """True once closed, or handed to a :class:`freight.CacheEngine`."""
        return not self._raw.live

    @property
    def peers(self) -> List[str]:
        """The senders' agent names, indexed by :attr:`StoredObject.sender`."""
        return self._raw.peers

    @property
    def capacity(self) -> Optional[int]:
        """The most bytes the store holds (None: no limit)."""
        return self._raw.capacity

    @property
    def evict(self) -> bool:
        """Whether a put that does not fit evicts the least recently used objects
        instead of stopping the store."""
        return self._raw.evict

    def __repr__(self) -> str:
        if self.closed:
            return f"<freight.StoreReceiver from {self.peers} (closed)>"
        return f"<freight.StoreReceiver from {self.peers}: {len(self)} objects, {self.nbytes} bytes>"
