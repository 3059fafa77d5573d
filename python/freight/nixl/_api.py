"""``nixl_agent`` and ``nixl_agent_config``: NIXL's Python API, on freight.

The same names, argument orders, defaults, return values and state strings as NIXL 1.5's
``nixl._api``, so code written for NIXL runs unchanged; the work is done by
:class:`freight.nixl._agent.nixlAgent` over a freight agent. Where NIXL returns None
and logs an error for descriptors it cannot build, so does this module.

Two departures, both for safety: ``deserialize_descs`` reads only descriptor lists (it
is not ``pickle.loads`` on bytes a peer sent), and releasing a transfer that is still in
progress raises instead of abandoning memory the transfer still touches.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from . import _bindings
from . import _serial
from ._agent import DEFAULT_COMM_PORT
from ._backends import UNSUPPORTED
from ._types import nixl_mem_t, nixl_status_t, nixl_xfer_op_t

__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle", "nixl_prepped_dlist_handle",
           "nixl_thread_sync_t", "nixl_xfer_handle"]

log = logging.getLogger("freight.nixl")

#: The state strings of transfer / check_xfer_state, by status; any other is "ERR".
_STATES = {nixl_status_t.NIXL_SUCCESS: "DONE", nixl_status_t.NIXL_IN_PROG: "PROC"}

#: What ``nixl._api`` calls a backend handle: an integer.
nixl_backend_handle = int


class nixl_thread_sync_t(enum.Enum):
    """Thread synchronisation modes (NIXL's Python enum over its binding's values).
    freight's agent is thread-safe in every mode; the mode is recorded, not needed."""

    NIXL_THREAD_SYNC_NONE = _bindings.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = _bindings.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = _bindings.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = _bindings.nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


class _Handle:
    __slots__ = ("_handle", "_agent", "_released")
    _release = ""

    def __init__(self, agent: Any, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            getattr(self._agent, self._release)(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                getattr(self._agent, self._release)(self._handle)
            except Exception as e:
                try:
                    log.debug("%r not released at collection: %s", self, e)
                except Exception:
                    pass


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list (from ``prep_xfer_dlist``); ``release()`` frees it."""

    __slots__ = ()
    _release = "releasedDlistH"


class nixl_xfer_handle(_Handle):
    """A transfer request (from ``make_prepped_xfer`` / ``initialize_xfer``)."""

    __slots__ = ()
    _release = "releaseXferReq"


class nixl_agent_config:
    """How to build a :class:`nixl_agent`, with NIXL's arguments and defaults.

    ``enable_prog_thread`` and ``num_threads`` are accepted and ignored (freight's engine
    has its own threads); ``enable_listen_thread`` serves metadata on ``listen_port``;
    ``backends`` are created with the agent (see docs/nixl.md for what each means);
    ``sync_mode`` None picks STRICT with a listener, NONE without, as NIXL does.
    """

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False, num_threads: int = 0,
                 backends: List[str] = ["UCX"], sync_mode: Optional[nixl_thread_sync_t] = None) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


_MEMS = {"DRAM": nixl_mem_t.DRAM_SEG, "VRAM": nixl_mem_t.VRAM_SEG, "FILE": nixl_mem_t.FILE_SEG,
         "BLOCK": nixl_mem_t.BLK_SEG, "OBJ": nixl_mem_t.OBJ_SEG, "cpu": nixl_mem_t.DRAM_SEG,
         "cuda": nixl_mem_t.VRAM_SEG}
_OPS = {"WRITE": nixl_xfer_op_t.NIXL_WRITE, "READ": nixl_xfer_op_t.NIXL_READ}


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous")


def _tensor_rows(tensors: List[Any]) -> Optional[Tuple[str, np.ndarray]]:
    """(mem type name, N x 3 rows) of contiguous tensors on one device, else None."""
    device = tensors[0].device
    rows = np.empty((len(tensors), 3), dtype=np.uint64)
    for i, t in enumerate(tensors):
        if t.device != device:
            log.error("tensors of one descriptor list must be on one device (%s, then %s)", device, t.device)
            return None
        if not t.is_contiguous():
            log.error("Please use a list of contiguous Tensors")
            return None
        gpu = t.get_device()
        rows[i] = (t.data_ptr(), t.numel() * t.element_size(), max(gpu, 0))
    return ("DRAM" if tensors[0].get_device() == -1 else "VRAM"), rows


class nixl_agent:
    """A NIXL agent: ``nixl_agent(agent_name, nixl_conf=None, instantiate_all=False)``."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        if nixl_conf and instantiate_all:
            instantiate_all = False
            log.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        conf = nixl_conf or nixl_agent_config()
        default_sync = (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen
                        else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        cfg = _bindings.nixlAgentConfig()
        cfg.useProgThread = bool(conf.enable_pthread)
        cfg.useListenThread = bool(conf.enable_listen)
        cfg.listenPort = int(conf.port)
        cfg.syncMode = (conf.sync_mode or default_sync).value
        cfg.captureTelemetry = bool(conf.capture_telemetry)
        # Looked up on the module at call time, as NIXL does (tests wrap the constructor).
        self.agent = _bindings.nixlAgent(agent_name, cfg)
        self.name = agent_name
        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options: Dict[str, Dict[str, str]] = {}
        self.plugin_mem_types: Dict[str, List[str]] = {}
        self.nixl_mems = dict(_MEMS)
        self.nixl_ops = dict(_OPS)
        for backend in (self.plugin_list if instantiate_all else conf.backends):
            if backend in self.plugin_list or backend in UNSUPPORTED:
                self.create_backend(backend)  # an unsupported one raises, naming it
            else:
                log.warning("Skipping backend registration %s due to the missing plugin.", backend)
        log.info("Initialized NIXL agent: %s", agent_name)

    # ------------------------------------------------------------------ plugins and backends

    def _load_plugin_params(self, plugin: str) -> None:
        if plugin not in self.plugin_list:
            return
        self.plugin_b_options[plugin], self.plugin_mem_types[plugin] = self.agent.getPluginParams(plugin)

    def get_plugin_list(self) -> List[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            log.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            log.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> List[str]:
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        log.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        if backend in self.backend_options:
            return self.backend_options[backend]
        log.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: Dict[str, str] = {}) -> None:
        self.backends[backend] = self.agent.createBackend(backend, dict(initParams))
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(
            self.backends[backend])
        log.info("Backend %s was instantiated", backend)

    def _handles(self, backends: List[str]) -> List[int]:
        return [self.backends[b] for b in backends]

    # ------------------------------------------------------------------ memory

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, backends: List[str] = []) -> Any:
        """Registers tensors, arrays, ``(addr, len, dev, meta)`` tuples or a nixlRegDList;
        returns the nixlRegDList (give it to ``deregister_memory``)."""
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if reg_descs is None:
            raise _bindings.nixlInvalidParamError("register_memory: these are not registrable descriptors "
                                                  "(see the error logged above)")
        self.agent.registerMem(reg_descs, self._handles(backends))
        return reg_descs

    def deregister_memory(self, dereg_list: Any, backends: List[str] = []) -> None:
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> List[Optional[Dict[str, str]]]:
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        return self.agent.queryMem(reg_descs, self.backends[backend])

    def make_connection(self, remote_agent: str, backends: List[str] = []) -> None:
        self.agent.makeConnection(remote_agent, self._handles(backends))

    # ------------------------------------------------------------------ transfers

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None,
                        backends: List[str] = []) -> nixl_prepped_dlist_handle:
        """Prepares descriptors for ``make_prepped_xfer``: the local side with
        ``"NIXL_INIT_AGENT"`` (or ""), a remote agent's by its name, loopback by this
        agent's own name. An N x 5 array is strided rows (addr, len, dev, stride, count)."""
        if agent_name in ("NIXL_INIT_AGENT", "", b""):
            agent_name = _bindings.NIXL_INIT_AGENT
        handles = self._handles(backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            h = self.agent.prepXferDlist(agent_name, self.nixl_mems[mem_type], xfer_list, handles)
        elif (isinstance(xfer_list, np.ndarray) and mem_type is not None and xfer_list.ndim == 2
              and xfer_list.shape[1] == 3):
            # The list lives only for this call: over the array, not a copy of it.
            descs = _bindings.nixlXferDList._over(self.nixl_mems[mem_type], xfer_list)
            h = self.agent.prepXferDlist(agent_name, descs, handles)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            if descs is None:
                raise _bindings.nixlInvalidParamError("prep_xfer_dlist: these are not transfer descriptors "
                                                      "(see the error logged above)")
            h = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, h)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> Tuple[int, int, int]:
        return self.agent.estimateXferCost(req_handle._handle)

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Union[List[int], np.ndarray], remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Union[List[int], np.ndarray], notif_msg: bytes = b"",
                          backends: List[str] = [], skip_desc_merge: bool = False) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        h = self.agent.makeXferReq(op, local_xfer_side._handle, local_indices, remote_xfer_side._handle,
                                   remote_indices, notif_msg, self._handles(backends), skip_desc_merge)
        return nixl_xfer_handle(self.agent, h)

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any, remote_agent: str,
                        notif_msg: bytes = b"", backends: List[str] = []) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        h = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent, notif_msg,
                                     self._handles(backends))
        return nixl_xfer_handle(self.agent, h)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Posts the transfer: "DONE" if it finished in the call, "PROC" while it runs.
        ``notif_msg`` replaces the request's notification for this post."""
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR"; a failed transfer raises NIXL's exception for it."""
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> Any:
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        b = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == b)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[List[str]] = None) -> int:
        return self.agent.prepMemView(dlist, self._handles(backends or []))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # ------------------------------------------------------------------ notifications

    def get_new_notifs(self, backends: List[str] = []) -> Dict[str, List[bytes]]:
        """Notifications received since the last call: remote agent name -> [bytes]."""
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: List[str] = []) -> Dict[str, List[bytes]]:
        """Adds new notifications to ``self.notifs`` (those not yet handled) and returns it."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends: List[str] = [],
                               tag_is_prefix: bool = True) -> bool:
        """Whether a notification from ``remote_agent_name`` starts with (or, with
        ``tag_is_prefix=False``, contains) ``lookup_tag``; the one found is consumed."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        msgs = self.notifs.get(remote_agent_name, [])
        for i, msg in enumerate(msgs):
            if msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg:
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None:
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, self.backends[backend])

    # ------------------------------------------------------------------ metadata

    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False, backends: List[str] = []) -> bytes:
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a remote agent's metadata; returns its name (bytes, as NIXL's does)."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False, backends: List[str] = [],
                                    ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                              label: str = "") -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        if descs is None:
            descs = _bindings.nixlXferDList(nixl_mem_t.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == nixl_status_t.NIXL_SUCCESS

    # ------------------------------------------------------------------ descriptor lists

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        """A nixlXferDList from (addr, len, dev) tuples or an N x 3 array (with
        ``mem_type``), a tensor or list of tensors, a numpy array without ``mem_type``
        (its own memory, whole), or a nixlXferDList; None (an error logged) for anything
        else."""
        return self._build(descs, mem_type, _bindings.nixlXferDList, _bindings.nixlRegDList, 3)

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        """A nixlRegDList from (addr, len, dev, meta) tuples or an N x 3 array (with
        ``mem_type``), a tensor or list of tensors, a numpy array without ``mem_type``
        (its own memory, whole), or a nixlRegDList; None (an error logged) for anything
        else."""
        return self._build(descs, mem_type, _bindings.nixlRegDList, _bindings.nixlXferDList, 4)

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        """A nixlRemoteDList from (addr, len, dev, agent name) tuples with ``mem_type``."""
        if isinstance(descs, _bindings.nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                log.error("Please specify a mem type")
                return None
            if len(descs[0]) != 4:
                log.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
                return None
            return _bindings.nixlRemoteDList(self.nixl_mems[mem_type], descs)
        return None

    def _build(self, descs: Any, mem_type: Optional[str], cls: type, other: type, width: int) -> Any:
        what = "transfer" if width == 3 else "registration"
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            log.error("%s list given where a %s list is needed", other.__name__, cls.__name__)
            return None
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                # freight's extension: an array without a memory type is host memory to
                # describe whole (NIXL reads arrays only as N x 3 rows, with a type).
                if not descs.flags.c_contiguous:
                    log.error("Please use a contiguous array")
                    return None
                return cls(self.nixl_mems["DRAM"], np.array([[descs.ctypes.data, descs.nbytes, 0]], np.uint64))
            if descs.ndim != 2 or descs.shape[1] != 3:
                log.error("Nx3 shape required for %s descriptor list from numpy array", what)
                return None
            return cls(self.nixl_mems[mem_type], descs)
        if _is_tensor(descs):
            if not descs.is_contiguous():
                log.error("Please use a list of contiguous Tensors")
                return None
            built = _tensor_rows([descs])
        elif isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                log.error("Please specify a mem type if not using Tensors")
                return None
            if len(descs[0]) != width:
                log.error("%d-tuple list needed for %s", width, what)
                return None
            return cls(self.nixl_mems[mem_type], descs)
        elif isinstance(descs, (list, tuple)) and descs and _is_tensor(descs[0]):
            built = _tensor_rows(list(descs))
        else:
            log.error("cannot build a %s descriptor list from %s", what, type(descs).__name__)
            return None
        if built is None:
            return None
        mem, rows = built
        return cls(self.nixl_mems[mem], rows)

    def get_serialized_descs(self, descs: Any) -> bytes:
        """A descriptor list as bytes, for ``deserialize_descs`` on another agent."""
        return _serial.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """The descriptor list that ``get_serialized_descs`` made. Reads descriptor lists
        only (never arbitrary objects): bytes from a peer cannot run code here."""
        return _serial.loads(serialized_descs)
