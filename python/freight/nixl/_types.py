"""NIXL's enumerations and exceptions, and the one mapping from freight's errors to them.

The names and values are NIXL's (its ``_bindings`` module exposes them the same way), so
code that compares statuses, memory types or catches ``nixlNotFoundError`` keeps working.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator

from .. import errors as fe

__all__ = [
    "nixl_status_t", "nixl_mem_t", "nixl_xfer_op_t", "nixl_thread_sync_t", "nixl_cost_t",
    "NixlError", "nixlNotPostedError", "nixlInvalidParamError", "nixlBackendError", "nixlNotFoundError",
    "nixlMismatchError", "nixlNotAllowedError", "nixlRepostActiveError", "nixlUnknownError",
    "nixlNotSupportedError", "nixlRemoteDisconnectError", "nixlCancelledError", "nixlNoTelemetryError",
    "mapped_errors", "MEM_KINDS",
]


class nixl_status_t(enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_thread_sync_t(enum.IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias of NONE, as in NIXL


class nixl_cost_t(enum.IntEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


#: NIXL memory types freight moves, as freight's memory kinds. BLK_SEG and OBJ_SEG
#: (block devices, object stores) have no freight counterpart.
MEM_KINDS = {nixl_mem_t.DRAM_SEG: "DRAM", nixl_mem_t.VRAM_SEG: "VRAM", nixl_mem_t.FILE_SEG: "FILE"}


class NixlError(Exception):
    """Base of the NIXL face's exceptions (NIXL's own derive from Exception alone)."""


class nixlNotPostedError(NixlError):
    pass


class nixlInvalidParamError(NixlError):
    pass


class nixlBackendError(NixlError):
    pass


class nixlNotFoundError(NixlError):
    pass


class nixlMismatchError(NixlError):
    pass


class nixlNotAllowedError(NixlError):
    pass


class nixlRepostActiveError(NixlError):
    pass


class nixlUnknownError(NixlError):
    pass


class nixlNotSupportedError(NixlError):
    pass


class nixlRemoteDisconnectError(NixlError):
    pass


class nixlCancelledError(NixlError):
    pass


class nixlNoTelemetryError(NixlError):
    pass


# Most specific first: several freight errors share a base.
_MAPPING = (
    ((fe.NotRegisteredError, fe.OutOfBoundsError, fe.UnknownPeerError, fe.UnknownRegionError), nixlNotFoundError),
    ((fe.InvalidArgumentError, fe.MetadataError, fe.OverlapError), nixlInvalidParamError),
    ((fe.AuthError, fe.RemoteRejectedError, fe.RegionBusyError), nixlNotAllowedError),
    ((fe.PeerDisconnectedError,), nixlRemoteDisconnectError),
    ((fe.InvalidStateError,), nixlRepostActiveError),
    ((fe.TransportUnavailableError, fe.CudaError, fe.IoError, fe.ProtocolError, fe.EtcdError, fe.NoSpaceError),
     nixlBackendError),
)


def nixl_error_for(e: fe.FreightError) -> NixlError:
    """The NIXL exception that stands for a freight error (same message; the freight
    error stays reachable as ``__cause__``)."""
    for kinds, nixl_kind in _MAPPING:
        if isinstance(e, kinds):
            return nixl_kind(str(e))
    return nixlUnknownError(str(e))


@contextlib.contextmanager
def mapped_errors() -> Iterator[None]:
    """Raises freight's errors as NIXL's inside the block."""
    try:
        yield
    except fe.FreightError as e:
        raise nixl_error_for(e) from e
