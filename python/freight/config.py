"""Agent configuration."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from .errors import InvalidArgumentError

__all__ = ["AgentConfig", "TRANSPORTS"]

#: Transports this build knows, in order of preference.
TRANSPORTS: Tuple[str, ...] = ("cuda", "shm", "fabric", "tcp")

# What the copy kernel accepts (crates/freight-core/src/cuda/kernel.rs checks the same).
_KERNEL_THREADS = (128, 256, 512, 1024)
_KERNEL_MAX_BLOCKS_PER_SM = 32
_KERNEL_MIN_ITEM_BYTES = 1024
_KERNEL_MODES = ("warp", "block")
_COMPLETIONS = ("event", "poll")


def _token(field: str, value: Any) -> Optional[bytes]:
    """A token as bytes (str is taken as UTF-8)."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise _type_error(field, "None, bytes or str", value)


def _type_error(field: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"AgentConfig.{field} must be {expected}, got {type(value).__name__} {value!r}")


def _strings(field: str, value: Any) -> Tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise _type_error(field, "a sequence of strings", value)
    out = tuple(value)
    for item in out:
        if not isinstance(item, str):
            raise _type_error(field, "a sequence of strings", value)
    return out


def _int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(field, "an int", value)
    if value < minimum:
        raise InvalidArgumentError(f"AgentConfig.{field} must be >= {minimum}, got {value}")
    return value


def _choice(field: str, value: Any, choices: Tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise _type_error(field, f"one of {choices}", value)
    if value.lower() not in choices:
        raise InvalidArgumentError(f"AgentConfig.{field} must be one of {choices}, got {value!r}")
    return value.lower()


def _seconds(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(field, "a number of seconds", value)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"AgentConfig.{field} must be a positive, finite number of seconds, got {value}")
    return value


@dataclass(frozen=True)
class AgentConfig:
    """Everything an :class:`freight.Agent` can be told at creation.

    Fields are type-checked on construction (``TypeError`` for a wrong type,
    :class:`freight.InvalidArgumentError` for a bad value). The object is immutable;
    derive variants with ``dataclasses.replace(cfg, require="tcp")``.

    listen:
        ``"ip:port"`` of the agent's listener (peers connect there); port 0 picks a
        free port. ``"0.0.0.0:0"`` listens on every interface.
    advertise:
        Addresses to advertise to peers instead of the bound ones (NAT, several NICs).
    transports:
        Transports this agent may use and serve, among ``"cuda"`` (same host, GPU
        memory on either side), ``"shm"`` (same host, memory from :meth:`Agent.alloc`),
        ``"fabric"`` (anywhere, one-sided RDMA through libfabric; see ``fabric_provider``)
        and ``"tcp"`` (anywhere). A lone string is one transport.
    require:
        When set (``"cuda"``, ``"shm"``, ``"fabric"`` or ``"tcp"``), every transfer must use
        that transport or fail with :class:`freight.TransportUnavailableError`; never
        silently replaced. The environment variable ``FREIGHT_TRANSPORT`` overrides it.
    tcp_streams, tcp_chunk_size, tcp_window:
        TCP data streams per peer, largest message payload in bytes (large copies are
        split into chunks of this size) and chunks in flight per stream.
    tcp_local_addrs:
        Local IP addresses to bind data streams to, round-robin (several NICs). Empty: one
        per local NIC whose subnet holds one of the peer's addresses, else the kernel routes.
    tcp_pin:
        Where each tcp stream's sender and receiver threads run: ``"numa"`` (the cores of
        the NUMA node of the stream's NIC, where it has one), ``"off"``, or cores (a list
        of ints, or a string such as ``"0-3,8"``) that stream threads take in turn.
    tcp_zerocopy:
        Send payloads of 64 KiB and more with Linux ``MSG_ZEROCOPY`` to peers on other
        hosts: the NIC reads registered memory directly. Never used on loopback, where
        the kernel copies anyway; turned off per stream if the kernel reports copying.
    fabric_provider:
        The libfabric provider (``"efa"``, ``"verbs"``, ``"tcp"``, ``"shm"``...). Naming one
        opens the fabric transport (so does requiring it); ``FREIGHT_FABRIC_PROVIDER``
        overrides it. libfabric is loaded at run time: without it, fabric is not offered.
        Software providers (tcp, shm...) are used only when fabric is required.
    fabric_domains:
        Domains to use as rails, one endpoint each (for the tcp provider, interface
        names; a name may repeat). Empty: the provider's first domain.
        ``FREIGHT_FABRIC_DOMAINS`` (comma-separated) overrides it.
    fabric_chunk_size:
        Largest single RDMA operation in bytes; larger copies are split and dealt to the
        rails in turn (default 4 MiB).
    fabric_stage_remote_host:
        Send the peer's host memory through the landing buffers the peer lends, as GPU
        memory goes that the peer's provider cannot register: for tests of that path
        without GPUs, and to compare it with the direct one.
    fabric_gpu_direct:
        Register GPU memory with the provider where it offers ``FI_HMEM`` (default);
        False stages it through pinned host buffers always, to compare the two or where
        the provider's own GPU path is slower. ``FREIGHT_FABRIC_GPU_DIRECT=0`` (or
        ``off``) overrides it.
    shm_threads:
        Copy threads for large shm transfers (None: number of cores, at most 8).
    shm_inline_bytes:
        shm transfers up to this size are copied on the posting thread (None: 512 KiB
        on hosts with 8 or more cores, 4 MiB on smaller ones, where waking a copy
        thread costs more than copying a few MiB).
    cuda_copy_engine_min_host, cuda_copy_engine_min_peer:
        GPU copies at least this long (bytes) go to the copy engines instead of the
        batched copy kernel: between GPU and host memory (None: 4 MiB) and between
        GPUs (None: 16 MiB; over NVLink the copy engines move long copies a few per
        cent faster, the kernel moves many short ones in one launch).
    cuda_kernel_mode:
        How the batched copy kernel shares out its work items: ``"block"`` (None: one
        CUDA block per item, four 16-byte loads in flight per thread) or ``"warp"`` (one
        warp per item, eight loads in flight per thread).
    cuda_kernel_threads, cuda_kernel_blocks_per_sm:
        The kernel's launch shape: threads per CUDA block, one of 128, 256, 512, 1024
        (None: 256), and blocks per SM, 1 to 32 (None: 2; fewer where an SM cannot hold
        that many, see :func:`freight.copy_kernel_occupancy`).
    cuda_kernel_item_bytes:
        Longest work item of the kernel, a multiple of 16 and at least 1024 (None:
        64 KiB). Requests with too few items for the GPU have their copies cut finer
        (down to 4 KiB) so that every SM gets work.
    cuda_completion:
        How the agent learns that a request's GPU work is done. ``"poll"`` (None):
        sleeps until the earliest time the work can be done (from its size and the best
        rate seen on the GPU), then looks every 10 us, sleeping in between; on hosts
        with fewer than 8 cores it acts as ``"event"``. ``"event"``: polls the work's
        event for up to 100 us (on hosts with 8 cores or more), then sleeps in the
        driver until it fires.
    peer_timeout:
        Seconds without an answer after which a peer is declared dead (its requests
        fail with :class:`freight.PeerDisconnectedError`).
    connect_timeout:
        Seconds allowed for connecting and for each handshake.
    token:
        When set (bytes, or str encoded as UTF-8), every connection to this agent must
        present it: metadata requests (:meth:`Agent.connect`), notifications and
        transfers alike. Peers give it to :meth:`Agent.connect` or
        :meth:`Agent.add_peer`. Unset, any process that reaches the listener may fetch
        the metadata, whose secret opens every registered region to it (see
        docs/engine.md, "Security model").
    serve_metadata:
        Whether the listener answers metadata requests (:meth:`Agent.connect`). Turn it
        off where the metadata travels another way only (:meth:`Agent.metadata` handed
        over by the application): then the listener hands out no secret at all.
    metadata_token:
        The former name of ``token`` (accepted, with a ``DeprecationWarning``).
    """

    listen: str = "127.0.0.1:0"
    advertise: Sequence[str] = ()
    transports: Sequence[str] = TRANSPORTS
    require: Optional[str] = None
    tcp_streams: int = 4
    tcp_chunk_size: int = 1 << 20
    tcp_window: int = 8
    tcp_local_addrs: Sequence[str] = ()
    tcp_zerocopy: bool = True
    tcp_pin: Union[str, Sequence[int]] = "numa"
    fabric_provider: Optional[str] = None
    fabric_domains: Sequence[str] = ()
    fabric_chunk_size: int = 4 << 20
    fabric_stage_remote_host: bool = False
    fabric_gpu_direct: bool = True
    shm_threads: Optional[int] = None
    shm_inline_bytes: Optional[int] = None
    cuda_copy_engine_min_host: Optional[int] = None
    cuda_copy_engine_min_peer: Optional[int] = None
    cuda_kernel_mode: Optional[str] = None
    cuda_kernel_threads: Optional[int] = None
    cuda_kernel_blocks_per_sm: Optional[int] = None
    cuda_kernel_item_bytes: Optional[int] = None
    cuda_completion: Optional[str] = None
    peer_timeout: float = 30.0
    connect_timeout: float = 5.0
    token: Optional[Union[bytes, str]] = None
    serve_metadata: bool = True
    metadata_token: Optional[Union[bytes, str]] = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.listen, str):
            raise _type_error("listen", "a string 'ip:port'", self.listen)
        put("advertise", _strings("advertise", self.advertise))
        transports = tuple(t.lower() for t in _strings("transports", self.transports))
        if not transports:
            raise InvalidArgumentError("AgentConfig.transports must enable at least one transport")
        for t in transports:
            if t not in TRANSPORTS:
                raise InvalidArgumentError(f"AgentConfig.transports: unknown transport {t!r} (expected one of {TRANSPORTS})")
        put("transports", transports)
        if self.require is not None:
            if not isinstance(self.require, str):
                raise _type_error("require", "None or a transport name", self.require)
            req = self.require.lower()
            if req not in TRANSPORTS:
                raise InvalidArgumentError(f"AgentConfig.require: unknown transport {self.require!r} (expected one of {TRANSPORTS})")
            if req not in transports:
                raise InvalidArgumentError(f"AgentConfig.require={req!r} is not among the enabled transports {transports}")
            put("require", req)
        put("tcp_streams", _int("tcp_streams", self.tcp_streams, 1))
        put("tcp_chunk_size", _int("tcp_chunk_size", self.tcp_chunk_size, 1))
        put("tcp_window", _int("tcp_window", self.tcp_window, 1))
        put("tcp_local_addrs", _strings("tcp_local_addrs", self.tcp_local_addrs))
        pin = self.tcp_pin
        if isinstance(pin, (list, tuple)) and pin and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                          for c in pin):
            pin = ",".join(str(c) for c in pin)
        if not isinstance(pin, str):
            raise _type_error("tcp_pin", '"numa", "off" or a list of cores', self.tcp_pin)
        put("tcp_pin", pin)
        if not isinstance(self.tcp_zerocopy, bool):
            raise _type_error("tcp_zerocopy", "a bool", self.tcp_zerocopy)
        if self.fabric_provider is not None and not isinstance(self.fabric_provider, str):
            raise _type_error("fabric_provider", "None or a provider name", self.fabric_provider)
        put("fabric_domains", _strings("fabric_domains", self.fabric_domains))
        put("fabric_chunk_size", _int("fabric_chunk_size", self.fabric_chunk_size, 1))
        if not isinstance(self.fabric_stage_remote_host, bool):
            raise _type_error("fabric_stage_remote_host", "a bool", self.fabric_stage_remote_host)
        if not isinstance(self.fabric_gpu_direct, bool):
            raise _type_error("fabric_gpu_direct", "a bool", self.fabric_gpu_direct)
        if self.shm_threads is not None:
            put("shm_threads", _int("shm_threads", self.shm_threads, 1))
        if self.shm_inline_bytes is not None:
            put("shm_inline_bytes", _int("shm_inline_bytes", self.shm_inline_bytes, 0))
        for field in ("cuda_copy_engine_min_host", "cuda_copy_engine_min_peer"):
            if getattr(self, field) is not None:
                put(field, _int(field, getattr(self, field), 1))
        if self.cuda_kernel_mode is not None:
            put("cuda_kernel_mode", _choice("cuda_kernel_mode", self.cuda_kernel_mode, _KERNEL_MODES))
        if self.cuda_kernel_threads is not None:
            threads = _int("cuda_kernel_threads", self.cuda_kernel_threads, 1)
            if threads not in _KERNEL_THREADS:
                raise InvalidArgumentError(f"AgentConfig.cuda_kernel_threads must be one of {_KERNEL_THREADS}, got {threads}")
        if self.cuda_kernel_blocks_per_sm is not None:
            blocks = _int("cuda_kernel_blocks_per_sm", self.cuda_kernel_blocks_per_sm, 1)
            if blocks > _KERNEL_MAX_BLOCKS_PER_SM:
                raise InvalidArgumentError(
                    f"AgentConfig.cuda_kernel_blocks_per_sm must be at most {_KERNEL_MAX_BLOCKS_PER_SM}, got {blocks}"
                )
        if self.cuda_kernel_item_bytes is not None:
            item = _int("cuda_kernel_item_bytes", self.cuda_kernel_item_bytes, _KERNEL_MIN_ITEM_BYTES)
            if item % 16:
                raise InvalidArgumentError(f"AgentConfig.cuda_kernel_item_bytes must be a multiple of 16, got {item}")
        if self.cuda_completion is not None:
            put("cuda_completion", _choice("cuda_completion", self.cuda_completion, _COMPLETIONS))
        put("peer_timeout", _seconds("peer_timeout", self.peer_timeout))
        put("connect_timeout", _seconds("connect_timeout", self.connect_timeout))

        token = _token("token", self.token)
        if self.metadata_token is not None:
            warnings.warn("AgentConfig.metadata_token is now AgentConfig.token (required on every connection)",
                          DeprecationWarning, stacklevel=3)
            old = _token("metadata_token", self.metadata_token)
            if token is not None and token != old:
                raise InvalidArgumentError("AgentConfig: token and metadata_token are both given, and differ")
            token = old
            put("metadata_token", None)
        if token is not None and not token:
            raise InvalidArgumentError("AgentConfig.token is empty, which every peer presents: give a non-empty one, or None")
        put("token", token)
        if not isinstance(self.serve_metadata, bool):
            raise _type_error("serve_metadata", "a bool", self.serve_metadata)

    def replace(self, **changes: Any) -> "AgentConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def _native_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``freight._native.Agent``."""
        return {
            "listen": self.listen,
            "advertise": list(self.advertise),
            "transports": list(self.transports),
            "require": self.require,
            "tcp_streams": self.tcp_streams,
            "tcp_chunk_size": self.tcp_chunk_size,
            "tcp_window": self.tcp_window,
            "tcp_local_addrs": list(self.tcp_local_addrs),
            "tcp_zerocopy": self.tcp_zerocopy,
            "tcp_pin": self.tcp_pin,
            "fabric_provider": self.fabric_provider,
            "fabric_domains": list(self.fabric_domains),
            "fabric_chunk_size": self.fabric_chunk_size,
            "fabric_stage_remote_host": self.fabric_stage_remote_host,
            "fabric_gpu_direct": self.fabric_gpu_direct,
            "shm_threads": self.shm_threads,
            "shm_inline_bytes": self.shm_inline_bytes,
            "cuda_copy_engine_min_host": self.cuda_copy_engine_min_host,
            "cuda_copy_engine_min_peer": self.cuda_copy_engine_min_peer,
            "cuda_kernel_mode": self.cuda_kernel_mode,
            "cuda_kernel_threads": self.cuda_kernel_threads,
            "cuda_kernel_blocks_per_sm": self.cuda_kernel_blocks_per_sm,
            "cuda_kernel_item_bytes": self.cuda_kernel_item_bytes,
            "cuda_completion": self.cuda_completion,
            "peer_timeout": self.peer_timeout,
            "connect_timeout": self.connect_timeout,
            "token": self.token,
            "serve_metadata": self.serve_metadata,
        }
