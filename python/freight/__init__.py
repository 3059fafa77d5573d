"""freight: point-to-point transfers between registered memory of agents.

An :class:`Agent` registers memory (numpy arrays, buffers, tensors, raw ranges), learns
about peers from their metadata (bytes passed around by any means, a listener, or an
:class:`EtcdDirectory`), and moves bytes between its memory and theirs with
:class:`Request` objects (READ or WRITE, optionally followed by a notification that
arrives only after the data is visible). Same-host peers use shared memory ("shm",
memory from :meth:`Agent.alloc`), others TCP.

Main names:

* :class:`Agent`, :class:`AgentConfig` -- the engine and its configuration;
* :class:`DescList` -- which bytes a transfer touches;
* :class:`Request` -- a posted/reusable transfer (``post``, ``status``, ``wait``);
* :class:`PipeListener`, :class:`PipeSender` -- ordered streams of messages through a
  bounded buffer in the receiver's memory; :class:`ChannelSender`,
  :class:`ChannelReceiver` -- keyed arrays and tensors over them (see :mod:`freight.stream`);
* :class:`StoreSender`, :class:`StoreReceiver` -- a keyed store between agents, puts
  committed in batches (:class:`CommitStats`), gets by key (:class:`StoredObject`; see
  :mod:`freight.storage`);
* :class:`CacheEngine` -- a chunked KV cache (prefix-keyed chunks, contiguous or paged
  KV memory, GPU / host / remote tiers; see :mod:`freight.cache`);
* :mod:`freight.kv` -- a KV cache server (``freight.kv.Server``, also ``freight serve``)
  and its client (``freight.kv.Client``): values by key, with TTLs and LRU eviction;
* :mod:`freight.ep` -- MoE expert parallelism: dispatch and combine of tokens across
  GPU ranks (needs PyTorch; imported on demand);
* :class:`EtcdDirectory` -- metadata exchange through etcd;
* :func:`inspect_metadata` -- what metadata bytes advertise (regions, addresses);
* engine logs go to :mod:`logging` (loggers ``freight_core.*``, ``freight_kv.*``, ...;
  :func:`reload_log_levels` after changing their levels), or to stderr with
  :func:`set_log_level` (or ``FREIGHT_LOG``);
* :func:`release_pooled_memory` -- frees the memory received objects leave for reuse;
* exceptions, all deriving from :class:`FreightError` (see :mod:`freight.errors`).
"""

import atexit as _atexit
import os as _os


def _nvidia_library_dirs() -> str:
    """Folders of NVIDIA's PyPI wheels (``nvidia-cuda-nvrtc``, and those PyTorch pulls
    in) that may hold NVRTC, for the engine to look in: pip puts them outside the
    loader's search path."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    dirs = []
    for root in roots:
        for sub in ("cuda_nvrtc/lib", "cu13/lib", "cu12/lib"):
            path = _os.path.join(root, sub)
            if _os.path.isdir(path):
                dirs.append(path)
    return _os.pathsep.join(dirs)


if "FREIGHT_CUDA_LIB_DIRS" not in _os.environ:
    _found = _nvidia_library_dirs()
    if _found:
        _os.environ["FREIGHT_CUDA_LIB_DIRS"] = _found

from . import _native, errors  # noqa: E402
from ._native import (  # noqa: E402
    TRANSPORTS,
    AgentConfig,
    EtcdDirectory,
    PreparedLocal,
    PreparedRemote,
    Request,
    SharedSegment,
    __version__,
    compile_copy_kernel,
    copy_kernel_occupancy,
    cuda_status,
    inspect_metadata,
    release_pooled_memory,
    reload_log_levels,
)
from .agent import Agent, Path

# The engine's last records (an agent closing) reach logging before the interpreter goes.
# Later ones are dropped: the interpreter may be gone when they arrive.
_atexit.register(_native._flush_logs, 1.0, True)
from .descs import DescList
from .stream import (  # noqa: E402
    ChannelReceiver,
    ChannelSender,
    CudaView,
    Message,
    PipeListener,
    PipeReceiver,
    PipeSender,
    Received,
)
from .storage import CommitStats, StoredObject, StoreReceiver, StoreSender  # noqa: E402
from .cache import CacheEngine  # noqa: E402
from . import kv  # noqa: E402
from .errors import (
    AuthError,
    EtcdError,
    CudaError,
    FreightError,
    InvalidArgumentError,
    InvalidStateError,
    IoError,
    NoSpaceError,
    MetadataError,
    NotRegisteredError,
    OutOfBoundsError,
    OverlapError,
    PeerDisconnectedError,
    ProtocolError,
    RegionBusyError,
    RemoteRejectedError,
    TimeoutError,
    TransportUnavailableError,
    UnknownPeerError,
    UnknownRegionError,
)


def set_log_level(level=None) -> None:
    """Sends the engine's logs to stderr at ``level``, instead of :mod:`logging`.

    Without it (and without ``FREIGHT_LOG`` or ``RUST_LOG``), engine records go to
    Python's :mod:`logging`: a record of target ``freight_core::server`` to the logger
    ``freight_core.server``, at the level the application sets there (call
    :func:`reload_log_levels` after changing levels once the engine has logged).

    ``level`` is "error", "warn"/"warning", "info", "debug", "trace" or "off" (any case),
    a :mod:`logging` level number, or a tracing filter such as
    ``"freight_core=debug,info"``. With no level, uses the ``FREIGHT_LOG`` environment
    variable, else ``RUST_LOG``, else "info". (When either variable is set, logging is
    also switched on automatically when the first agent is created; a misspelt level
    there is an :class:`InvalidArgumentError` naming the variable.) The first call
    installs a tracing subscriber for the process, writing text, or one JSON object per
    line where ``FREIGHT_LOG_FORMAT=json``; later calls change its level.
    """
    if level is not None and not isinstance(level, str):
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(f"level must be a str or a logging level int, got {type(level).__name__}")
        level = "error" if level >= 40 else "warn" if level >= 30 else "info" if level >= 20 else "debug" if level >= 10 else "trace"
    elif isinstance(level, str):
        level = {"warning": "warn", "critical": "error", "fatal": "error"}.get(level.strip().lower(), level.strip())
        if level.lower() in _LEVELS:
            level = level.lower()
        elif not level or level.isalpha() or any(c.isspace() for c in level):
            raise InvalidArgumentError(
                f"unknown log level {level!r} (expected one of {', '.join(_LEVELS)}, or a filter like 'freight_core=debug')"
            )
    _native.set_log_level(level)


_LEVELS = ("error", "warn", "info", "debug", "trace", "off")


__all__ = [
    "Agent",
    "AgentConfig",
    "CacheEngine",
    "ChannelReceiver",
    "ChannelSender",
    "CommitStats",
    "CudaView",
    "DescList",
    "EtcdDirectory",
    "Message",
    "Path",
    "PipeListener",
    "PipeReceiver",
    "PipeSender",
    "PreparedLocal",
    "PreparedRemote",
    "Received",
    "Request",
    "SharedSegment",
    "StoreReceiver",
    "StoreSender",
    "StoredObject",
    "TRANSPORTS",
    "compile_copy_kernel",
    "copy_kernel_occupancy",
    "cuda_status",
    "set_log_level",
    "reload_log_levels",
    "inspect_metadata",
    "release_pooled_memory",
    "kv",
    "__version__",
    *errors.__all__,
]
