"""``nixlAgent``: NIXL's agent (the object of its ``_bindings`` module), served by a
freight :class:`~freight.Agent`.

Handles are integers, as NIXL's are (they stand for C++ pointers there): one per
backend, prepared descriptor list and transfer request, looked up in this agent's tables,
so a stale or foreign handle is an error instead of a crash. Calls raise NIXL's
exceptions (``nixlNotFoundError``...), each with freight's error as its ``__cause__``.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import os
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from .. import errors as fe
from ..agent import Agent
from .._native import AgentConfig
from ..descs import DescList
from . import _backends, _metadata
from ._exchange import Exchange, etcd_endpoints
from ._lists import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._side_channel import Listener
from ._types import (
    MEM_KINDS,
    mapped_errors,
    nixl_error_for,
    nixl_mem_t,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlBackendError,
    nixlUnknownError,
)

log = logging.getLogger("freight.nixl")

DEFAULT_COMM_PORT = 8888
#: The agent name that stands for "this agent, as the local side" in prepXferDlist.
NIXL_INIT_AGENT = ""

#: DRAM registrations this large are made shareable in place (same-host peers reach
#: them through shm instead of tcp); smaller ones usually share pages with other
#: allocations. FREIGHT_NIXL_SHARE_IN_PLACE=0 turns it off.
SHARE_IN_PLACE_MIN = 32 << 20

_handles = itertools.count(0x7F0000001000, 0x40)
_yield = getattr(os, "sched_yield", lambda: None)
# The hot paths' answers, looked up once (an enum member's lookup costs more than the rest).
_SUCCESS, _IN_PROG = nixl_status_t.NIXL_SUCCESS, nixl_status_t.NIXL_IN_PROG


class nixlAgentConfig:
    """NIXL's agent configuration; positional arguments in NIXL's order."""

    def __init__(self, useProgThread: bool = False, useListenThread: bool = False, listenPort: int = DEFAULT_COMM_PORT,
                 syncMode: nixl_thread_sync_t = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE, pthrDelay: int = 0,
                 lthrDelay: int = 100000, etcdWatchTimeout: Union[int, datetime.timedelta] = 5_000_000,
                 captureTelemetry: bool = False) -> None:
        self.useProgThread = bool(useProgThread)
        self.useListenThread = bool(useListenThread)
        self.listenPort = int(listenPort)
        self.syncMode = nixl_thread_sync_t(syncMode)
        self.pthrDelay = int(pthrDelay)
        self.lthrDelay = int(lthrDelay)
        if not isinstance(etcdWatchTimeout, datetime.timedelta):
            etcdWatchTimeout = datetime.timedelta(microseconds=int(etcdWatchTimeout))
        self.etcdWatchTimeout = etcdWatchTimeout
        self.captureTelemetry = bool(captureTelemetry)

    def __repr__(self) -> str:
        return (f"nixlAgentConfig(useProgThread={self.useProgThread}, useListenThread={self.useListenThread}, "
                f"listenPort={self.listenPort}, syncMode={self.syncMode.name}, "
                f"captureTelemetry={self.captureTelemetry})")


class nixlXferTelemetry:
    """A transfer's figures: times in microseconds (``startTime`` since the epoch)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0, totalBytes: int = 0,
                 descCount: int = 0) -> None:
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})")


class _Prepped(NamedTuple):
    peer: Optional[str]  # None: the local side
    prepared: Any  # PreparedLocal / PreparedRemote
    mem: nixl_mem_t
    #: Descriptors in the list (not `count`: a tuple has a method of that name).
    entries: int


class _Xfer:
    __slots__ = ("request", "peer", "descs", "start_us", "post_us")

    def __init__(self, request: Any, peer: str, descs: int) -> None:
        self.request = request
        self.peer = peer
        self.descs = descs
        self.start_us = 0
        self.post_us = 0


def _telemetry_wanted(config: nixlAgentConfig) -> bool:
    env = os.environ.get("NIXL_TELEMETRY_ENABLE", "").strip().lower()
    if env in ("y", "yes", "1", "on", "true"):
        return True
    if env in ("n", "no", "0", "off", "false"):
        return False
    return config.captureTelemetry


def _name(agent_name: Union[str, bytes]) -> str:
    if isinstance(agent_name, (bytes, bytearray)):
        return bytes(agent_name).decode()
    if not isinstance(agent_name, str):
        raise TypeError(f"agent name must be str or bytes, got {type(agent_name).__name__}")
    return agent_name


def _msg(notif: Union[str, bytes, None]) -> bytes:
    if notif is None:
        return b""
    if isinstance(notif, str):
        return notif.encode()
    if isinstance(notif, (bytes, bytearray, memoryview)):
        return bytes(notif)
    raise TypeError(f"notification must be bytes or str, got {type(notif).__name__}")


def _token() -> Optional[bytes]:
    t = os.environ.get("FREIGHT_TOKEN")
    return t.encode() if t else None


def _kind(mem: nixl_mem_t) -> str:
    try:
        return MEM_KINDS[nixl_mem_t(mem)]
    except (KeyError, ValueError):
        raise nixlNotSupportedError(f"memory type {nixl_mem_t(mem).name} has no freight counterpart "
                                    "(freight moves DRAM and VRAM and registers FILE)") from None


def _indices(what: str, idx: Any) -> Any:
    if isinstance(idx, np.ndarray):
        if idx.ndim != 1:
            raise ValueError(f"{what} numpy array must be 1-D, got {idx.ndim} dimensions")
        # NIXL converts any integer array (vLLM passes int64); freight reads it as is.
        if idx.dtype.kind not in "iu":
            raise ValueError(f"{what} numpy array must hold integers, got {idx.dtype}")
        return np.ascontiguousarray(idx)
    return list(idx)


class nixlAgent:
    """NIXL's agent on freight: ``nixlAgent(name, nixlAgentConfig)``."""

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("a NIXL agent needs a non-empty name")
        if not isinstance(config, nixlAgentConfig):
            raise TypeError(f"config must be a nixlAgentConfig, got {type(config).__name__}")
        self.name = name
        self._config = config
        self._token = _token()
        self._telemetry = _telemetry_wanted(config)
        self._share = os.environ.get("FREIGHT_NIXL_SHARE_IN_PLACE", "1") != "0"
        listen = os.environ.get("FREIGHT_NIXL_LISTEN", "127.0.0.1:0")
        with mapped_errors():
            self._fa = Agent(name, AgentConfig(token=self._token, listen=listen))
        self._lock = threading.RLock()
        self._backends: Dict[int, _backends.Backend] = {}
        # (kind, addr, len, dev) -> freight region key, and segments shared in place
        self._regions: Dict[Tuple[str, int, int, int], int] = {}
        self._segments: Dict[Tuple[str, int, int, int], Any] = {}
        self._generation = 0
        self._loopback_generation = -1
        # remote agent -> visible ranges (None: all it registered)
        self._remotes: Dict[str, Optional[List[_metadata.Range]]] = {}
        self._remote_blobs: Dict[str, bytes] = {}
        self._dlists: Dict[int, _Prepped] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._exchange = Exchange(name, self._token, self.loadRemoteMD, config.etcdWatchTimeout.total_seconds())
        self._listener: Optional[Listener] = None
        if config.useListenThread:
            try:
                self._listener = Listener(config.listenPort, token=self._token, on_push=self._pushed,
                                          on_fetch=lambda label: self.getLocalMD(),
                                          on_invalidate=self._invalidated, logger=log)
            except OSError as e:
                self._fa.close()
                raise nixlBackendError(f"NIXL agent {name}: cannot listen on port {config.listenPort}: {e}") from e
        log.debug("nixl agent %s on freight %s", name, self._fa.addresses)

    # ------------------------------------------------------------------ life

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Stops the listener and the exchange thread and closes the freight agent."""
        listener, self._listener = getattr(self, "_listener", None), None
        if listener is not None:
            listener.close()
        if hasattr(self, "_exchange"):
            self._exchange.close()
        if hasattr(self, "_fa"):
            self._fa.close()

    @property
    def freight_agent(self) -> Agent:
        """The freight agent underneath (for code that moves to freight's own API)."""
        return self._fa

    # ------------------------------------------------------------------ backends

    def getAvailPlugins(self) -> List[str]:
        return _backends.plugin_names()

    def getPluginParams(self, type: str) -> Tuple[Dict[str, str], List[str]]:
        b = _backends.lookup(type)
        return dict(b.params), list(b.mems)

    def createBackend(self, type: str, initParams: Dict[str, str]) -> int:
        b = _backends.lookup(type)
        if not isinstance(initParams, dict):
            raise TypeError(f"initParams must be a dict of str, got {type(initParams).__name__}")
        with self._lock:
            for h, known in self._backends.items():
                if known.name == b.name:
                    raise nixlInvalidParamError(f"backend {b.name} was already created on agent {self.name}")
            h = next(_handles)
            self._backends[h] = b
        log.info("nixl agent %s: backend %s is %s", self.name, b.name, b.means)
        return h

    def getBackendParams(self, backend: int) -> Tuple[Dict[str, str], List[str]]:
        b = self._backend(backend)
        return dict(b.params), list(b.mems)

    def _backend(self, handle: int) -> _backends.Backend:
        try:
            return self._backends[handle]
        except (KeyError, TypeError):
            raise nixlInvalidParamError(f"{handle!r} is not a backend handle of agent {self.name}") from None

    def _serving(self, backends: Sequence[int], mem: nixl_mem_t) -> List[_backends.Backend]:
        """The backends (all created ones where none are named) that handle ``mem``."""
        chosen = [self._backend(h) for h in backends] if backends else list(self._backends.values())
        if not chosen:
            raise nixlNotFoundError(f"agent {self.name} has no backend (create one, e.g. UCX)")
        name = nixl_mem_t(mem).name
        fit = [b for b in chosen if name in b.mems]
        if not fit:
            raise nixlNotFoundError(f"no backend of {[b.name for b in chosen]} handles {name} memory")
        return fit

    # ------------------------------------------------------------------ memory

    def registerMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"registerMem takes a nixlRegDList, got {type(descs).__name__}")
        mem = descs.getType()
        kind = _kind(mem)
        self._serving(backends, mem)
        rows = descs._triples()
        with self._lock:
            keyed = [(kind, int(a), int(n), int(d)) for a, n, d in rows]
            if len(set(keyed)) != len(keyed):
                raise nixlInvalidParamError("the list registers one region twice")
            for k in keyed:
                if k in self._regions:
                    raise nixlInvalidParamError(f"region {k[1]:#x}+{k[2]} of {kind} is already registered")
            segments: Dict[Tuple[str, int, int, int], Any] = {}
            if kind == "DRAM" and self._share:
                for k in keyed:
                    if k[2] >= SHARE_IN_PLACE_MIN:
                        try:
                            segments[k] = self._fa.share_in_place((k[1], k[2], 0))
                        except fe.InvalidArgumentError as e:
                            log.debug("nixl agent %s: %#x+%d stays private memory: %s", self.name, k[1], k[2], e)
            with mapped_errors():
                keys = self._fa.register_many(np.ascontiguousarray(rows, dtype=np.uint64), kind) if keyed else []
            self._regions.update(zip(keyed, keys))
            self._segments.update(segments)
            self._generation += 1
        return nixl_status_t.NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"deregisterMem takes a nixlRegDList, got {type(descs).__name__}")
        kind = _kind(descs.getType())
        with self._lock:
            keyed = [(kind, int(a), int(n), int(d)) for a, n, d in descs._triples()]
            for k in keyed:
                if k not in self._regions:
                    raise nixlNotFoundError(f"region {k[1]:#x}+{k[2]} of {kind} is not registered")
            for k in keyed:
                with mapped_errors():
                    self._fa.deregister(self._regions[k])
                del self._regions[k]
                self._segments.pop(k, None)
            self._generation += 1
        return nixl_status_t.NIXL_SUCCESS

    def queryMem(self, descs: nixlRegDList, backend: int) -> List[Optional[Dict[str, str]]]:
        b = self._backend(backend)
        if b.name != "POSIX":
            raise nixlNotSupportedError(f"backend {b.name} answers no memory queries (POSIX does, for files)")
        out: List[Optional[Dict[str, str]]] = []
        for meta in descs._metas():
            try:
                st = os.stat(meta.decode(errors="surrogateescape"))
            except OSError:
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))})
        return out

    # ------------------------------------------------------------------ metadata

    def getLocalMD(self) -> bytes:
        return _metadata.encode(self.name, None, self._fa.metadata())

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False,
                          backends: Sequence[int] = ()) -> bytes:
        return _metadata.encode(self.name, self._visible(descs), self._fa.metadata())

    def _visible(self, descs: nixlRegDList) -> List[_metadata.Range]:
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"partial metadata takes a nixlRegDList, got {type(descs).__name__}")
        mem = int(descs.getType())
        kind = _kind(descs.getType())
        out = []
        with self._lock:
            for a, n, d in descs._triples():
                k = (kind, int(a), int(n), int(d))
                if k not in self._regions:
                    raise nixlNotFoundError(f"region {k[1]:#x}+{k[2]} of {kind} is not registered")
                out.append((mem, k[1], k[2], k[3]))
        return out

    def loadRemoteMD(self, remote_metadata: bytes) -> bytes:
        try:
            blob = _metadata.decode(remote_metadata)
        except _metadata.BlobError as e:
            raise nixlMismatchError(str(e)) from e
        if blob.name == self.name:
            raise nixlInvalidParamError(f"agent {self.name} cannot load its own metadata as a remote agent's")
        with self._lock:
            if self._remote_blobs.get(blob.name) != blob.freight or blob.name not in self._remotes:
                with mapped_errors():
                    got = self._fa.add_peer(blob.freight, token=self._token)
                if got != blob.name:
                    self._fa.remove_peer(got)
                    raise nixlMismatchError(f"metadata names agent {blob.name!r} outside, {got!r} inside")
                self._remote_blobs[blob.name] = blob.freight
            known = self._remotes.get(blob.name, [])
            if blob.visible is None or known is None:
                self._remotes[blob.name] = None
            else:
                self._remotes[blob.name] = list(dict.fromkeys([*known, *blob.visible]))
        return blob.name.encode()

    def invalidateRemoteMD(self, remote_agent: Union[str, bytes]) -> nixl_status_t:
        name = _name(remote_agent)
        with self._lock:
            if name not in self._remotes:
                return nixl_status_t.NIXL_ERR_NOT_FOUND
            del self._remotes[name]
            self._remote_blobs.pop(name, None)
            try:
                self._fa.remove_peer(name)
            except fe.UnknownPeerError:
                pass
        return nixl_status_t.NIXL_SUCCESS

    def checkRemoteMD(self, remote_name: Union[str, bytes], descs: nixlXferDList) -> nixl_status_t:
        name = _name(remote_name)
        with self._lock:
            if name not in self._remotes:
                return nixl_status_t.NIXL_ERR_NOT_FOUND
            if descs.descCount() == 0:
                return nixl_status_t.NIXL_SUCCESS
            try:
                self._check_visible(name, descs.getType(), descs._triples())
                with mapped_errors():
                    self._fa.prepare_remote(name, DescList(descs._triples(), _kind(descs.getType())))
            except (nixlNotFoundError, nixlNotSupportedError, nixlInvalidParamError):
                return nixl_status_t.NIXL_ERR_NOT_FOUND
        return nixl_status_t.NIXL_SUCCESS

    def _check_visible(self, name: str, mem: nixl_mem_t, rows: np.ndarray) -> None:
        visible = self._remotes.get(name)
        if visible is None:
            return
        for a, n, d in rows:
            if not _metadata.covered(visible, int(mem), int(a), int(n), int(d)):
                raise nixlNotFoundError(f"{int(a):#x}+{int(n)} of agent {name} is not in the partial metadata loaded")

    def makeConnection(self, remote_agent: str, backends: Sequence[int] = ()) -> nixl_status_t:
        name = _name(remote_agent)
        if name not in self._remotes:
            raise nixlNotFoundError(f"agent {self.name} knows no remote agent {name!r}")
        return nixl_status_t.NIXL_SUCCESS

    # ------------------------------------------------------------------ metadata exchange

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        self._send(self.getLocalMD(), ip_addr, port, "")

    def sendLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Sequence[int] = (),
                           ip_addr: str = "", port: int = 0, label: str = "") -> None:
        self._send(self.getLocalPartialMD(descs, inc_conn_info, backends), ip_addr, port, label)

    def _send(self, blob: bytes, ip_addr: str, port: int, label: str) -> None:
        if ip_addr:
            self._exchange.push(ip_addr, port or DEFAULT_COMM_PORT, blob)
        elif etcd_endpoints():
            self._exchange.publish(blob, label)
        else:
            raise nixlInvalidParamError("no peer address given and NIXL_ETCD_ENDPOINTS is not set")

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 0, label: str = "") -> None:
        remote = _name(remote_agent)
        if remote == self.name:
            raise nixlInvalidParamError(f"agent {self.name} cannot fetch its own metadata")
        if ip_addr:
            self._exchange.fetch(remote, ip_addr, port or DEFAULT_COMM_PORT, label)
        elif etcd_endpoints():
            self._exchange.fetch_etcd(remote, label)
        else:
            raise nixlInvalidParamError("no peer address given and NIXL_ETCD_ENDPOINTS is not set")

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        if ip_addr:
            self._exchange.invalidate(ip_addr, port or DEFAULT_COMM_PORT)
        elif etcd_endpoints():
            self._exchange.withdraw()
        else:
            raise nixlInvalidParamError("no peer address given and NIXL_ETCD_ENDPOINTS is not set")

    def _pushed(self, blob: bytes) -> None:
        self.loadRemoteMD(blob)

    def _invalidated(self, name: str) -> None:
        self.invalidateRemoteMD(name)

    # ------------------------------------------------------------------ descriptor lists

    def prepXferDlist(self, *args: Any, **kwargs: Any) -> int:
        """``prepXferDlist(agent_name, descs, backends=[])``, ``prepXferDlist(descs,
        backends=[])`` (local) or ``prepXferDlist(agent_name, mem_type, Nx5 array,
        backends=[])`` (strided rows ``(addr, len, dev, stride, count)``)."""
        backends = kwargs.pop("backends", kwargs.pop("backend", ()))
        if kwargs:
            raise TypeError(f"prepXferDlist got unexpected keyword arguments {sorted(kwargs)}")
        if args and isinstance(args[0], nixlXferDList):
            agent_name: Union[str, bytes] = NIXL_INIT_AGENT
            rest = args
        elif args:
            agent_name, rest = args[0], args[1:]
        else:
            raise TypeError("prepXferDlist needs a descriptor list")
        if len(rest) >= 2 and isinstance(rest[1], np.ndarray):
            mem, rows = nixl_mem_t(rest[0]), rest[1]
            if rows.ndim != 2 or rows.shape[1] != 5:
                raise ValueError(f"strided descriptors are an N x 5 array, got shape {rows.shape}")
            backends = rest[2] if len(rest) > 2 else backends
            kind = _kind(mem)
            dl = DescList((), kind)
            for a, n, d, s, c in rows.astype(np.uint64, copy=False):
                dl.append_strided(int(a), int(n), int(d), int(s), int(c))
            count = len(dl)
            triples = None
        else:
            descs = rest[0] if rest else None
            if not isinstance(descs, nixlXferDList):
                raise TypeError(f"prepXferDlist takes a nixlXferDList, got {type(descs).__name__}")
            backends = rest[1] if len(rest) > 1 else backends
            mem = descs.getType()
            kind = _kind(mem)
            triples = descs._triples()
            dl = DescList(triples, kind)
            count = len(triples)
        self._serving(backends, mem)
        name = _name(agent_name)
        with self._lock, mapped_errors():
            if name == NIXL_INIT_AGENT:
                prepared: Any = self._fa.prepare_local(dl)
                peer: Optional[str] = None
            else:
                if name == self.name:
                    self._refresh_loopback()
                elif name not in self._remotes:
                    raise nixlNotFoundError(f"agent {self.name} knows no remote agent {name!r} (load its metadata)")
                elif triples is not None:
                    self._check_visible(name, mem, triples)
                prepared = self._fa.prepare_remote(name, dl)
                peer = name
            h = next(_handles)
            self._dlists[h] = _Prepped(peer, prepared, nixl_mem_t(mem), count)
        return h

    def _refresh_loopback(self) -> None:
        """This agent as its own peer (loopback transfers), with its current regions."""
        if self._loopback_generation != self._generation:
            self._fa.add_peer(self._fa.metadata(), token=self._token)
            self._loopback_generation = self._generation

    def releasedDlistH(self, handle: int) -> nixl_status_t:
        with self._lock:
            if self._dlists.pop(handle, None) is None:
                raise nixlInvalidParamError(f"{handle!r} is not a prepared list of agent {self.name} "
                                            "(released already?)")
        return nixl_status_t.NIXL_SUCCESS

    def _dlist(self, handle: int, side: str) -> _Prepped:
        try:
            p = self._dlists[handle]
        except (KeyError, TypeError):
            raise nixlInvalidParamError(f"{handle!r} is not a prepared list of agent {self.name}") from None
        if (side == "local") != (p.peer is None):
            want = "prepared with NIXL_INIT_AGENT" if side == "local" else "prepared for a remote agent"
            raise nixlInvalidParamError(f"the {side} side must be a list {want}")
        return p

    # ------------------------------------------------------------------ transfers

    def makeXferReq(self, operation: nixl_xfer_op_t, local_side: int, local_indices: Any, remote_side: int,
                    remote_indices: Any, notif_msg: Union[str, bytes] = b"", backends: Sequence[int] = (),
                    skip_desc_merge: bool = False) -> int:
        op = nixl_xfer_op_t(operation).name[len("NIXL_"):]
        local = self._dlist(local_side, "local")
        remote = self._dlist(remote_side, "remote")
        li, ri = _indices("local indices", local_indices), _indices("remote indices", remote_indices)
        msg = _msg(notif_msg)
        with mapped_errors():
            req = self._fa.make_request(op, local.prepared, li, remote.prepared, ri, msg or None)
        return self._new_xfer(req, remote.peer or "", len(li), backends)

    def createXferReq(self, operation: nixl_xfer_op_t, local_descs: nixlXferDList, remote_descs: nixlXferDList,
                      remote_agent: Union[str, bytes], notif_msg: Union[str, bytes] = b"",
                      backends: Sequence[int] = ()) -> int:
        lh = self.prepXferDlist(NIXL_INIT_AGENT, local_descs, backends)
        rh = self.prepXferDlist(remote_agent, remote_descs, backends)
        try:
            op = nixl_xfer_op_t(operation).name[len("NIXL_"):]
            local, remote = self._dlists[lh], self._dlists[rh]
            with mapped_errors():
                req = self._fa.make_request(op, local.prepared, None, remote.prepared, None, _msg(notif_msg) or None)
            return self._new_xfer(req, remote.peer or "", local.entries, backends)
        finally:
            self._dlists.pop(lh, None)
            self._dlists.pop(rh, None)

    def _new_xfer(self, req: Any, peer: str, descs: int, backends: Sequence[int]) -> int:
        chosen = [self._backend(b) for b in backends] if backends else list(self._backends.values())
        allowed = [b for b in chosen if b.transports != ()]
        if not allowed:
            raise nixlNotSupportedError(f"none of the backends {[b.name for b in chosen]} moves bytes "
                                        "(POSIX on freight registers and queries files only)")
        if all(b.transports is not None and req.transport not in b.transports for b in allowed):
            raise nixlBackendError(f"freight serves the path to {peer} with {req.transport}, which none of "
                                   f"{[b.name for b in allowed]} stands for")
        h = next(_handles)
        with self._lock:
            self._xfers[h] = _Xfer(req, peer, descs)
        return h

    def _xfer(self, handle: int) -> _Xfer:
        try:
            return self._xfers[handle]
        except (KeyError, TypeError):
            raise nixlInvalidParamError(f"{handle!r} is not a transfer request of agent {self.name} "
                                        "(released already?)") from None

    def postXferReq(self, reqh: int, notif_msg: Union[str, bytes] = b"") -> nixl_status_t:
        # The hot path of every transfer: no context managers, clocks only for telemetry.
        try:
            x = self._xfers[reqh]
        except (KeyError, TypeError):
            x = self._xfer(reqh)
        request = x.request
        timed = self._telemetry
        if timed:
            start = time.time()
            t0 = time.perf_counter()
        try:
            done = request.post(notif=_msg(notif_msg)) if notif_msg else request.post()
        except fe.FreightError as e:
            raise nixl_error_for(e) from e
        if timed:
            x.post_us = max(1, math.ceil((time.perf_counter() - t0) * 1e6))
            x.start_us = int(start * 1e6)
        # Not done yet, or failed at once: the first check_xfer_state says which.
        return _SUCCESS if done else _IN_PROG

    def getXferStatus(self, reqh: int) -> nixl_status_t:
        try:
            x = self._xfers[reqh]
        except (KeyError, TypeError):
            x = self._xfer(reqh)
        status = x.request.status()
        if status == "DONE":
            return _SUCCESS
        if status == "PENDING":
            # NIXL's callers poll this in a loop; NIXL makes progress in the call, freight's
            # copy threads make it elsewhere: give them the core this poller holds.
            _yield()
            return _IN_PROG
        if status == "IDLE":
            raise nixlNotPostedError(f"transfer request {reqh:#x} was never posted")
        err = x.request.error
        if isinstance(err, fe.FreightError):
            raise nixl_error_for(err) from err
        raise nixlUnknownError(f"transfer request {reqh:#x} failed: {err}")

    def getXferTelemetry(self, reqh: int) -> nixlXferTelemetry:
        x = self._xfer(reqh)
        if not self._telemetry:
            raise nixlNoTelemetryError("telemetry is off (nixl_agent_config(capture_telemetry=True) or "
                                       "NIXL_TELEMETRY_ENABLE=y turns it on)")
        duration = x.request.duration
        # The round as NIXL counts it: from the start of the post (the post included).
        xfer_us = max(x.post_us, math.ceil(duration * 1e6)) if duration is not None else 0
        return nixlXferTelemetry(x.start_us, x.post_us, xfer_us, x.request.nbytes, x.descs)

    def queryXferBackend(self, reqh: int) -> int:
        x = self._xfer(reqh)
        for h, b in self._backends.items():
            if b.transports is not None and x.request.transport in b.transports:
                return h
        for h, b in self._backends.items():
            if b.transports is None:
                return h
        raise nixlNotFoundError("no backend of this agent serves the request")

    def releaseXferReq(self, reqh: int) -> nixl_status_t:
        x = self._xfer(reqh)
        if x.request.status() == "PENDING":
            raise nixlNotAllowedError(f"transfer request {reqh:#x} is in progress; freight cannot cancel a posted "
                                      "transfer: release it once check_xfer_state says DONE or ERR")
        with self._lock:
            self._xfers.pop(reqh, None)
        return nixl_status_t.NIXL_SUCCESS

    def estimateXferCost(self, req_handle: int) -> Tuple[int, int, int]:
        raise nixlNotSupportedError("freight's NIXL face makes no transfer cost estimates")

    def prepMemView(self, dlist: Union[nixlXferDList, nixlRemoteDList], backends: Sequence[int] = ()) -> int:
        raise nixlNotSupportedError("memory views (UCX's GPU device API) are not supported by freight's NIXL face")

    def releaseMemView(self, mvh: int) -> None:
        raise nixlNotSupportedError("memory views (UCX's GPU device API) are not supported by freight's NIXL face")

    # ------------------------------------------------------------------ notifications

    def getNotifs(self, notif_map: Dict[str, List[bytes]], backends: Sequence[int] = ()) -> Dict[str, List[bytes]]:
        if not isinstance(notif_map, dict):
            raise TypeError(f"notif_map must be a dict, got {type(notif_map).__name__}")
        for peer, msg in self._fa.get_notifs():
            notif_map.setdefault(peer, []).append(msg)
        return notif_map

    def genNotif(self, remote_agent: Union[str, bytes], msg: Union[str, bytes],
                 backends: Union[int, Sequence[int]] = ()) -> nixl_status_t:
        name = _name(remote_agent)
        if name not in self._remotes and name != self.name:
            raise nixlNotFoundError(f"agent {self.name} knows no remote agent {name!r}")
        with mapped_errors():
            if name == self.name:
                self._refresh_loopback()
            self._fa.notify(name, _msg(msg))
        return nixl_status_t.NIXL_SUCCESS
