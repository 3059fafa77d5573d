"""NIXL's ``_bindings`` module on freight: the agent, its configuration, descriptor
lists, enumerations with their module-level constants, and exceptions."""

from __future__ import annotations

from ._agent import DEFAULT_COMM_PORT, NIXL_INIT_AGENT, nixlAgent, nixlAgentConfig, nixlXferTelemetry
from ._lists import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._types import (
    nixl_cost_t,
    nixl_mem_t,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)

#: freight has no UCX GPU device API (memory views).
HAVE_UCX_GPU_DEVICE_API = False

# NIXL's module exports every enumeration value at module level too.
for _enum in (nixl_mem_t, nixl_status_t, nixl_thread_sync_t, nixl_xfer_op_t, nixl_cost_t):
    for _member_name, _member in _enum.__members__.items():
        globals()[_member_name] = _member
del _enum, _member_name, _member

__all__ = [
    "DEFAULT_COMM_PORT", "NIXL_INIT_AGENT", "HAVE_UCX_GPU_DEVICE_API", "nixlAgent", "nixlAgentConfig",
    "nixlXferTelemetry", "nixlRegDList", "nixlRemoteDList", "nixlXferDList", "nixl_cost_t", "nixl_mem_t",
    "nixl_status_t", "nixl_thread_sync_t", "nixl_xfer_op_t", "nixlBackendError", "nixlCancelledError",
    "nixlInvalidParamError", "nixlMismatchError", "nixlNoTelemetryError", "nixlNotAllowedError",
    "nixlNotFoundError", "nixlNotPostedError", "nixlNotSupportedError", "nixlRemoteDisconnectError",
    "nixlRepostActiveError", "nixlUnknownError",
]
