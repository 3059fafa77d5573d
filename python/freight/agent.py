"""The agent: registers memory, knows peers, moves bytes, sends notifications.

:class:`Agent` is the engine's own class (``freight._native.Agent``) with what takes
Python objects added: arrays, buffers, tensors and descriptor lists are turned into the
address ranges the engine takes. Everything else (peers, notifications, closing) is the
native class's, documented there and in ``freight/_native.pyi``.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import _native
from ._objects import describe, indices, is_readonly, normalize_kind, to_bytes
from .descs import _triple_array, as_desclist
from .errors import InvalidArgumentError

__all__ = ["Agent", "Path"]

from ._native import EtcdDirectory, PreparedLocal, PreparedRemote, Request, SharedSegment

BytesLike = Union[bytes, bytearray, memoryview, str]


class Path(NamedTuple):
    """The transport that serves a path, and why (see :meth:`Agent.path_to`)."""

    #: "cuda", "shm", "fabric" or "tcp".
    transport: str
    #: Human-readable reason, including why better transports were not chosen.
    reason: str


_U64 = 1 << 64


class Agent(_native.Agent):
    """A freight agent: one per process (or per engine instance).

    ``Agent(name, config=None)`` creates the agent and starts its listener.
    ``config`` is an :class:`AgentConfig` (or a dict of its fields); ``name`` must be
    unique among the agents that talk to each other.

    Typical use, target side::

        with freight.Agent("target") as agent:
            buf = agent.alloc(1 << 20)       # shm-capable numpy uint8 array
            agent.register(buf)
            publish(agent.metadata())        # give the bytes to peers somehow

    initiator side::

        with freight.Agent("initiator") as agent:
            src = agent.alloc(1 << 20); agent.register(src)
            peer = agent.add_peer(metadata_bytes)
            req = agent.transfer("WRITE", [src], peer, [(remote_addr, 1 << 20, 0)], notif=b"done")
            req.wait()

    Every method may be called from any thread; blocking calls release the GIL.
    Agents are context managers (``close()`` on exit).
    """

    # ------------------------------------------------------------------ memory

    def share_in_place(self, obj: Any) -> SharedSegment:
        """Makes host memory this process already has (a CPU tensor, a numpy array, any
        writable buffer, or an ``(addr, length, 0)`` tuple) reachable by same-host peers
        through shm, without moving it: its pages become pages of a shared segment at
        the same addresses, bytes kept, so every pointer and view into it stays valid.
        Register it afterwards (:meth:`register`); the segment lasts while the returned
        :class:`freight.SharedSegment` or a region registered in it lives.

        Whole pages are shared, so the bytes around the range in its first and last page
        go with it: use it for memory that owns its pages (an allocation of 32 MiB or
        more, which glibc maps by itself; an ``mmap``; a vLLM KV cache), never for a
        small allocation beside others. Call it while nothing writes the memory. Memory
        already inside a shared segment gets that segment. Raises
        :class:`freight.InvalidArgumentError` for memory that is not private writable
        host memory of this process (file-backed, read-only, GPU memory, unmapped), that
        lies in the process heap (``[heap]``: small allocations side by side), or that
        lies partly in a shared segment.
        """
        r = describe(obj, "DRAM", readonly_ok=False)
        return self._share_in_place(r.addr, r.length)

    def register(self, obj: Any, kind: Optional[str] = None, *, readonly_ok: bool = False) -> int:
        """Registers memory so that transfers (local and remote) may touch it; returns
        the region key.

        ``obj`` is a numpy array or any object with the buffer protocol (contiguous,
        writable unless ``readonly_ok=True``), a tensor (duck-typed; CUDA tensors are
        VRAM on their device), or an ``(addr, length, device)`` tuple whose kind is
        ``kind`` (default "DRAM"). For objects, ``kind`` (if given) must match their
        memory. The object is kept alive until :meth:`deregister`.

        A read-only object (``readonly_ok=True``: ``bytes``, a non-writable array, a
        read-only mapping) is registered read-only: peers may read it, and no transfer
        writes it. A peer's WRITE into it fails with
        :class:`freight.RemoteRejectedError` at the peer (and is refused here again
        where this agent serves the access, over tcp and fabric), and a READ into it
        here with :class:`freight.InvalidArgumentError`.

        Memory from :meth:`alloc` is reachable through shm by same-host peers; other
        host memory only through tcp.

        Peers see new regions only in metadata taken afterwards (:meth:`metadata`,
        :meth:`publish_etcd`, :meth:`refresh_peer` on their side).
        """
        k = normalize_kind(kind) if kind is not None else None
        if type(obj) is tuple and len(obj) == 3:
            # A raw (addr, length, device) of plain ints in range goes straight in: the
            # common case of an engine registering many slices, a call each. Anything
            # else takes the general path and its errors.
            addr, length, dev = obj
            if (type(addr) is int and type(length) is int and type(dev) is int
                    and 0 <= addr < _U64 and 0 < length < _U64 and 0 <= dev < _U64):
                return self._register(k or "DRAM", addr, length, dev, None, False)
        r = describe(obj, k, readonly_ok=readonly_ok)
        read_only = not isinstance(obj, tuple) and is_readonly(obj)
        return self._register(r.kind, r.addr, r.length, r.device, r.keep, read_only)

    def register_many(self, objs: Any, kind: Optional[str] = None, *, readonly_ok: bool = False) -> List[int]:
        """Registers many objects (anything :meth:`register` accepts) in one call into
        the engine; returns their keys in order. All or nothing: on error nothing stays
        registered, and the exception's ``index`` attribute names the failing object.

        ``objs`` may also be an ``N x 3`` integer numpy array of
        ``(addr, length, device)`` rows (kind ``kind``, default "DRAM")."""
        k = normalize_kind(kind) if kind is not None else None
        if isinstance(objs, np.ndarray):
            return self._register_many(k or "DRAM", _triple_array(objs), None)
        groups: dict = {}
        order: List[Tuple[Tuple[str, bool], int]] = []
        for i, obj in enumerate(objs):
            try:
                r = describe(obj, k, readonly_ok=readonly_ok)
            except (InvalidArgumentError, TypeError) as e:
                setattr(e, "index", i)  # which object, for the caller
                raise
            group = (r.kind, is_readonly(obj))
            triples, keeps, positions = groups.setdefault(group, ([], [], []))
            positions.append(i)
            order.append((group, len(triples)))
            triples.append((r.addr, r.length, r.device))
            keeps.append(r.keep)
        keys_by_kind: dict = {}
        done: List[int] = []
        try:
            for gk, (triples, keeps, positions) in groups.items():
                try:
                    keys = self._register_many(gk[0], triples, keeps, gk[1])
                except Exception as e:
                    if isinstance(getattr(e, "index", None), int):
                        e.index = positions[e.index]  # type: ignore[attr-defined]
                    raise
                keys_by_kind[gk] = keys
                done.extend(keys)
        except BaseException:
            for key in done:
                self.deregister(key)
            raise
        return [keys_by_kind[gk][j] for gk, j in order]

    # ------------------------------------------------------------------ peers

    def path_to(self, peer: str) -> Path:
        """Which transport serves host-memory transfers to ``peer``, and why."""
        return Path(*self._path_to(peer))

    # ------------------------------------------------------------------ etcd

    def publish_etcd(self, directory: EtcdDirectory) -> None:
        """Publishes :meth:`metadata` under :attr:`name` in an
        :class:`freight.EtcdDirectory`. Publish again after registering memory that peers
        should see."""
        directory.publish(self.name, self.metadata())

    def withdraw_etcd(self, directory: EtcdDirectory) -> None:
        """Removes this agent's entry from an :class:`freight.EtcdDirectory`."""
        directory.withdraw(self.name)

    def add_peer_from_etcd(self, directory: EtcdDirectory, name: str, timeout: float = 10.0,
                           token: Optional[BytesLike] = None) -> str:
        """Waits up to ``timeout`` seconds for ``name`` to appear in ``directory``, adds it
        as a peer and returns its name (:class:`freight.TimeoutError` if it does not
        appear). Whoever can read the directory reads the peer's secret: give the peer a
        token (its :attr:`AgentConfig.token`, passed here) where that is more than the
        peer's own processes."""
        return self.add_peer(directory.wait_for(name, timeout), token=token)

    # ------------------------------------------------------------------ transfers

    def prepare_local(self, descs: Any) -> PreparedLocal:
        """Checks descriptors (a :class:`DescList` or anything it accepts) against this
        agent's registered memory; the result is reusable for any number of requests.
        :class:`freight.NotRegisteredError` / :class:`freight.OutOfBoundsError`."""
        return self._prepare_local(as_desclist(descs)._raw)

    def prepare_remote(self, peer: str, descs: Any) -> PreparedRemote:
        """Checks descriptors against ``peer``'s advertised memory (as of the metadata
        last added or refreshed); reusable."""
        return self._prepare_remote(peer, as_desclist(descs)._raw)

    def make_request(
        self,
        op: str,
        local_prepared: PreparedLocal,
        local_indices: Any,
        remote_prepared: PreparedRemote,
        remote_indices: Any,
        notif: Optional[BytesLike] = None,
    ) -> Request:
        """Builds a reusable, idle :class:`freight.Request` (call ``post()``).

        ``op`` is "READ" (remote to local) or "WRITE" (local to remote). Indices select
        descriptors of the prepared lists, in order (repeats allowed): None for all, a
        list of ints, or a 1-D numpy integer array (converted without per-element Python
        work). The selected local and remote descriptors must have the same total length.
        ``notif`` (bytes) is delivered to the peer after the data of each post is
        visible there."""
        if not isinstance(local_prepared, PreparedLocal):
            raise TypeError(f"local_prepared must come from Agent.prepare_local, got {type(local_prepared).__name__}")
        if not isinstance(remote_prepared, PreparedRemote):
            raise TypeError(f"remote_prepared must come from Agent.prepare_remote, got {type(remote_prepared).__name__}")
        return self._make_request(
            _op(op),
            local_prepared,
            indices(local_indices),
            remote_prepared,
            indices(remote_indices),
            None if notif is None else to_bytes(notif, "notif"),
        )

    def transfer(
        self, op: str, local_descs: Any, peer: str, remote_descs: Any, notif: Optional[BytesLike] = None
    ) -> Request:
        """One-shot transfer: prepares both descriptor lists (:class:`DescList` or anything
        it accepts), builds the request and posts it. Returns the posted
        :class:`freight.Request`; call ``wait()`` on it. A READ into a read-only object
        (a numpy array that is not writeable, a bytes object) raises
        :class:`freight.InvalidArgumentError`."""
        if isinstance(op, str) and op.upper() == "READ":
            _check_writable(local_descs)
        local = as_desclist(local_descs)
        remote = as_desclist(remote_descs)
        return self._transfer(_op(op), local._raw, peer, remote._raw, None if notif is None else to_bytes(notif, "notif"))


def _check_writable(descs: Any) -> None:
    """Refuses read-only objects among the local descriptors of a READ: the engine would
    write into memory that Python promises will not change."""
    if not isinstance(descs, (list, tuple)):
        return  # a DescList or a descriptor array: addresses, which carry no such mark
    for i, item in enumerate(descs):
        if not isinstance(item, tuple) and is_readonly(item):
            raise InvalidArgumentError(
                f"local descriptor {i} is read-only ({type(item).__name__}): a READ writes into it"
            )


def _op(op: Any) -> str:
    if not isinstance(op, str):
        raise InvalidArgumentError(f"op must be 'READ' or 'WRITE', got {op!r}")
    return op
