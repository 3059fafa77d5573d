"""FreightConnector's settings: ``kv_connector_extra_config`` of vLLM's
``--kv-transfer-config``, with environment variables for what should stay off command
lines."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .. import _native
from ..errors import InvalidArgumentError

# The token both instances' agents require and present (kept out of `ps`).
TOKEN_ENV = "FREIGHT_VLLM_TOKEN"

KNOWN = ("listen", "token", "lease_seconds", "connect_timeout", "share_host_memory", "inline_copies")


@dataclass(frozen=True)
class Settings:
    """``listen``: where a worker's freight agent listens (default ``127.0.0.1:0``,
    one host; ``0.0.0.0:0`` or an address of a NIC across hosts). ``token``: what both
    instances' agents require on every connection (default: ``FREIGHT_VLLM_TOKEN``;
    without one, any local process can reach the KV cache, see docs/vllm.md).
    ``lease_seconds``: how long a prefill instance keeps a finished request's blocks
    for a decode instance that has not read them (default 120). ``connect_timeout``:
    seconds a decode worker waits for the prefill worker's listener (default 10).
    ``share_host_memory``: lay shared memory under a KV cache in host memory, in place,
    so that same-host instances read it through shm (default true; false: tcp).
    ``inline_copies``: a decode worker copies a load over shm on its own thread, as it
    posts it, instead of handing it to freight's copy threads (default: on hosts of
    fewer than 8 cores). Where vLLM's busy loops occupy every core, copy threads were
    measured waiting hundreds of milliseconds for one (docs/vllm.md); copying inline
    holds up that worker's step for the copy instead, which costs nothing where no core
    is free to copy meanwhile."""

    role: str
    listen: str = "127.0.0.1:0"
    token: Optional[str] = None
    lease_seconds: float = 120.0
    connect_timeout: float = 10.0
    share_host_memory: bool = True
    inline_copies: Optional[bool] = None

    @classmethod
    def from_extra(cls, role: str, extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> "Settings":
        unknown = sorted(set(extra) - set(KNOWN))
        if unknown:
            raise InvalidArgumentError(
                f"kv_connector_extra_config: unknown setting(s) {unknown} for FreightConnector (known: {list(KNOWN)})"
            )
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise InvalidArgumentError(f"kv_role {role!r}: FreightConnector is kv_producer, kv_consumer or kv_both")
        token = extra.get("token", environ.get(TOKEN_ENV) or None)
        if token is not None and (not isinstance(token, str) or not token):
            raise InvalidArgumentError("FreightConnector's token must be a non-empty string")
        try:
            lease = float(extra.get("lease_seconds", cls.lease_seconds))
            timeout = float(extra.get("connect_timeout", cls.connect_timeout))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"kv_connector_extra_config: {e}") from e
        if lease <= 0 or timeout <= 0:
            raise InvalidArgumentError("lease_seconds and connect_timeout must be positive")
        listen = extra.get("listen", cls.listen)
        if not isinstance(listen, str) or ":" not in listen:
            raise InvalidArgumentError(f"listen {listen!r}: give HOST:PORT (port 0: any)")
        share = extra.get("share_host_memory", cls.share_host_memory)
        inline = extra.get("inline_copies", cls.inline_copies)  # None: as the host's size says
        for name, value in (("share_host_memory", share), ("inline_copies", inline)):
            if not isinstance(value, bool) and not (name == "inline_copies" and value is None):
                raise InvalidArgumentError(f"{name} {value!r}: give true or false")
        return cls(role=role, listen=listen, token=token, lease_seconds=lease, connect_timeout=timeout,
                   share_host_memory=share, inline_copies=inline)

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "Settings":
        kv = vllm_config.kv_transfer_config
        return cls.from_extra(kv.kv_role, dict(kv.kv_connector_extra_config or {}))

    @property
    def copies_inline(self) -> bool:
        """``inline_copies``, or where unset whether this host is small: the engine has
        no cores to spare for its polling and copy threads here."""
        if self.inline_copies is not None:
            return self.inline_copies
        return not _native.host_has_spare_cores()

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")
