"""A chunked KV cache engine: stores a request's KV cache in chunks keyed by their token
prefix, and gives back the longest stored prefix of another request.

A prompt is cut into chunks of ``chunk_tokens`` tokens; each chunk's key hashes the
whole prefix it ends, so a prompt that shares a prefix with a stored one finds that
prefix's chunks (and nothing after the prompts part). Keys also hash the model's KV
shape and dtype, the chunk size and the engine's ``namespace``, so engines that differ
in any of them never take each other's chunks, also through one store. Chunks live in
tiers, searched in this order: the local GPU (``gpu_bytes``), local host memory
(``host_bytes``; pinned for ``gpu`` when one is given), each evicting its least
recently used chunks (the GPU tier's go down to the host tier), and a remote peer
through the keyed store (:mod:`freight.storage`). A chunk is used when ``store`` finds
or copies it and when ``lookup`` or ``retrieve`` finds it, a prompt's prefix last, so a
full tier lets go of the ends of prompts before their starts.

The caller's KV memory is a numpy array or a torch tensor (CPU or CUDA), C-contiguous,
of the model's dtype, laid out either contiguously, ``(layers, 2, tokens, heads,
head_dim)`` (keys then values), or paged like vLLM's, ``(layers, 2, num_blocks,
block_size, heads, head_dim)`` with a block table naming the request's blocks in token
order. Token ``i`` of the prompt is at position ``i``.

Prefill side (every new chunk is also put to a decode peer's store, and ``store``
returns once the peer holds them)::

    sink = freight.StoreSender(agent, decode_addr, commit_size=64)
    engine = freight.CacheEngine(agent, layers=32, heads=8, head_dim=128, dtype="bfloat16",
                                 gpu=0, gpu_bytes=8 << 30, host_bytes=32 << 30, remote_sink=sink)
    engine.store(tokens, kv, block_table=table)

Decode side (the engine never removes anything from its remote source: in a
long-running server, give the source a ``capacity`` with ``evict=True``, so that it drops
the chunks used least recently instead of growing without bound, or stopping once full)::

    source = freight.StoreReceiver(agent, buffer=1 << 30, capacity=16 << 30, evict=True)
    engine = freight.CacheEngine(agent, ..., remote_source=source)
    hit = engine.retrieve(tokens, kv, block_table=table)   # prefix tokens now in kv

A remote sink whose stream breaks (the decode peer restarted, or its store ran out of
room) fails the ``store`` that finds it broken, as the peer lacks that prompt's chunks;
the engine then lets go of the sink, and later stores cache locally only.

CUDA KV memory is read and written as memory, not on a stream: synchronize the work
that touches it (``torch.cuda.synchronize()``) before :meth:`CacheEngine.store` and
:meth:`CacheEngine.retrieve`; both have finished with it when they return.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from . import _native
from ._objects import describe, is_tensor, to_bytes, u64_indices
from .agent import Agent
from .errors import InvalidArgumentError
from .storage import StoreReceiver, StoreSender
from .stream import _core, _dtype_name

__all__ = ["CacheEngine"]

#: Element sizes of dtypes numpy does not know.
_EXTRA_DTYPES = {
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def dtype_info(dtype: Any) -> Tuple[str, int]:
    """(name, bytes per element) of a numpy or torch dtype, or of its name
    ("float16", "bfloat16", "torch.float8_e4m3fn", ...)."""
    if isinstance(dtype, str):
        name = dtype.strip()
        name = name[len("torch."):] if name.startswith("torch.") else name
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
    else:
        name = None
    if name is not None and name in _EXTRA_DTYPES:
        return name, _EXTRA_DTYPES[name]
    try:
        dt = np.dtype(name if name is not None else dtype)
    except TypeError:
        itemsize = getattr(dtype, "itemsize", None)
        if name is not None and isinstance(itemsize, int) and itemsize > 0:
            return name, itemsize
        raise InvalidArgumentError(f"unknown dtype {dtype!r}") from None
    if dt.kind == "V" or dt.hasobject or dt.itemsize == 0:
        raise InvalidArgumentError(f"the KV dtype must be a number type, got {dtype!r}")
    return (dt.name if dt.isnative else dt.str), dt.itemsize


def _count(value: Any, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise InvalidArgumentError(f"{what} must be an int >= {least}, got {value!r}")
    return int(value)


def _tokens(tokens: Any) -> np.ndarray:
    """Token ids as a contiguous uint32 array."""
    if is_tensor(tokens):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= 1 << 32:
        raise InvalidArgumentError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype=np.uint32)


class CacheEngine:
    """A chunked KV cache for a model of ``layers`` layers, ``heads`` KV heads of
    ``head_dim`` elements of ``dtype`` (a numpy or torch dtype, or its name), on
    ``agent`` (whose memory the tiers are).

    ``chunk_tokens``: tokens per chunk. ``gpu``: the CUDA device of the GPU tier and of
    CUDA KV memory (host memory is then pinned for it). With ``gpu=None``, CUDA KV memory
    still works, on any device, but there is no GPU tier and the host tier is plain,
    unpinned memory: copies between it and the GPU are staged by the driver and run
    slower; give ``gpu`` whenever the KV memory is on a GPU. ``gpu_bytes`` /
    ``host_bytes``: the tiers' sizes (0: no such tier; at least one). ``namespace`` (str
    or bytes, empty by default): what else the KV depends on beside the tokens, shape and
    dtype, such as the model, adapter or TP rank; engines in different namespaces never
    share a chunk. ``remote_sink``: a
    :class:`freight.StoreSender` every new chunk is also put to (committed before
    ``store`` returns); ``remote_source``: a :class:`freight.StoreReceiver` whose chunks
    are found too (chunks it holds in GPU memory only where ``gpu`` is given and they are
    on that GPU: ``lookup`` then counts exactly what ``retrieve`` copies). The engine never
    removes a chunk from ``remote_source``, so in a long-running server it should be made
    with a ``capacity`` and ``evict=True`` (it then drops the chunks used least recently;
    the engine uses a prompt's chunks last to first, so their ends go before their
    starts). Both are handed over to the engine (their own queued puts are
    committed first): using them afterwards raises :class:`freight.InvalidStateError`.
    Context manager: :meth:`close` on exit. Not for several threads at once: calls are
    serialized.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        chunk_tokens: int = 256,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: Any,
        gpu: Optional[int] = None,
        gpu_bytes: int = 0,
        host_bytes: int = 1 << 30,
        remote_sink: Optional[StoreSender] = None,
        remote_source: Optional[StoreReceiver] = None,
        namespace: Union[str, bytes] = b"",
    ) -> None:
        self._dtype, elem_bytes = dtype_info(dtype)
        namespace = to_bytes(namespace, "namespace")
        self._namespace = namespace
        self._layers = _count(layers, "layers")
        self._heads = _count(heads, "heads")
        self._head_dim = _count(head_dim, "head_dim")
        chunk_tokens = _count(chunk_tokens, "chunk_tokens")
        self._gpu = None if gpu is None else _count(gpu, "gpu", 0)
        gpu_bytes, host_bytes = _count(gpu_bytes, "gpu_bytes", 0), _count(host_bytes, "host_bytes", 0)
        if remote_sink is not None and not isinstance(remote_sink, StoreSender):
            raise TypeError(f"remote_sink must be a freight.StoreSender, got {type(remote_sink).__name__}")
        if remote_source is not None and not isinstance(remote_source, StoreReceiver):
            raise TypeError(f"remote_source must be a freight.StoreReceiver, got {type(remote_source).__name__}")
        if remote_sink is not None:
            remote_sink.commit()  # its own puts go before the engine's
        # The engine keeps the agent's engine running: the Python agent, which keeps the
        # objects its regions lie in, must outlive it.
        self._agent = agent
        self._raw = _native.CacheEngine(
            _core(agent),
            self._layers,
            self._heads,
            self._head_dim,
            elem_bytes,
            chunk_tokens=chunk_tokens,
            gpu=self._gpu,
            gpu_bytes=gpu_bytes,
            host_bytes=host_bytes,
            remote_sink=None if remote_sink is None else remote_sink._raw,
            remote_source=None if remote_source is None else remote_source._raw,
            # The engine keys by element size; the dtype's name parts float16 from
            # bfloat16 (no name holds a NUL).
            namespace=self._dtype.encode() + b"\0" + namespace,
        )
        self._source = remote_source

    # -- the caller's KV memory

    def _kv(self, kv: Any, block_table: Any, block_size: Any, writable: bool) -> Dict[str, Any]:
        """The native arguments for ``kv``, checked against the model."""
        if isinstance(kv, np.ndarray):
            if not kv.flags.c_contiguous:
                raise InvalidArgumentError("the KV array is not C-contiguous (use np.ascontiguousarray)")
        elif not is_tensor(kv):
            raise TypeError(f"kv must be a numpy array or a torch tensor, got {type(kv).__name__}")
        got = _dtype_name(kv)
        if got != self._dtype:
            raise InvalidArgumentError(f"the KV memory is {got}, but this cache engine stores {self._dtype}")
        try:
            r = describe(kv, readonly_ok=not writable)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"KV memory: {e}") from None
        if r.kind == "VRAM" and self._gpu is not None and r.device != self._gpu:
            raise InvalidArgumentError(f"the KV tensor is on cuda:{r.device}, but this cache engine works on GPU {self._gpu}")
        shape = tuple(int(n) for n in kv.shape)
        L, H, D = self._layers, self._heads, self._head_dim
        args: Dict[str, Any] = {"kind": r.kind, "addr": r.addr, "len": r.length, "dev": r.device}
        if block_table is None:
            if block_size is not None:
                raise InvalidArgumentError("block_size is for paged KV memory: give a block_table too")
            if len(shape) != 5 or shape[:2] != (L, 2) or shape[3:] != (H, D):
                raise InvalidArgumentError(
                    f"contiguous KV memory must have shape (layers, 2, tokens, heads, head_dim) = "
                    f"({L}, 2, T, {H}, {D}), got {shape}"
                )
            args["kv_tokens"] = shape[2]
            return args
        if len(shape) != 6 or shape[:2] != (L, 2) or shape[4:] != (H, D):
            raise InvalidArgumentError(
                f"paged KV memory must have shape (layers, 2, num_blocks, block_size, heads, head_dim) = "
                f"({L}, 2, N, B, {H}, {D}), got {shape}"
            )
        if block_size is not None and _count(block_size, "block_size") != shape[3]:
            raise InvalidArgumentError(f"block_size is {block_size}, but the KV memory's blocks hold {shape[3]} tokens")
        if is_tensor(block_table):
            block_table = block_table.detach().cpu().numpy()
        args.update(block_size=shape[3], num_blocks=shape[2], block_table=u64_indices(block_table))
        return args

    # -- the cache

    def store(self, tokens: Any, kv: Any, *, block_table: Any = None, block_size: Optional[int] = None) -> Dict[str, int]:
        """Stores the KV cache of ``tokens`` (a list or array of token ids) from ``kv``
        (token ``i`` at position ``i``; paged with ``block_table``). Chunks stored
        already are skipped; with a remote sink, returns once the peer holds every new
        chunk. Returns ``{"chunks": chunks of the prompt, "new_chunks": chunks copied,
        "bytes": bytes copied}``. Bad input raises :class:`freight.InvalidArgumentError`.
        A failure that broke the remote sink's stream raises (the peer lacks chunks), and
        the engine lets go of the sink: later calls cache locally only."""
        args = self._kv(kv, block_table, block_size, writable=False)
        chunks, new_chunks, nbytes = self._raw.store(_tokens(tokens), args)
        return {"chunks": chunks, "new_chunks": new_chunks, "bytes": nbytes}

    def retrieve(self, tokens: Any, kv: Any, *, block_table: Any = None, block_size: Optional[int] = None) -> int:
        """Copies the longest stored prefix of ``tokens`` into ``kv`` (token ``i`` at
        position ``i``; paged with ``block_table``) and returns its length in tokens
        (a multiple of ``chunk_tokens``, or all of ``tokens``); positions after it are
        left as they were. A remote chunk that cannot be copied (bytes that do not fit its
        key, or in GPU memory other than ``gpu``'s, which is all GPU memory where ``gpu``
        is None) ends the prefix there, as in :meth:`lookup`."""
        args = self._kv(kv, block_table, block_size, writable=True)
        return self._raw.retrieve(_tokens(tokens), args)

    def lookup(self, tokens: Any) -> int:
        """Tokens of the longest prefix of ``tokens`` whose chunks are stored (in any
        tier) and usable: what :meth:`retrieve` would copy, without copying anything.
        Those chunks count as used."""
        return self._raw.lookup(_tokens(tokens))

    def occupancy(self) -> Dict[str, int]:
        """Chunks held in each local tier: ``{"gpu": n, "host": m}``."""
        return dict(self._raw.occupancy())

    def close(self) -> None:
        """Commits what the remote sink still has queued, ends its stream, and frees
        the tiers and the remote source. Harmless when called again."""
        try:
            self._raw.close()
        finally:
            if self._source is not None:
                self._source._release_buffer()

    @property
    def closed(self) -> bool:
        """True once closed."""
        return not self._raw.live

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk."""
        return self._raw.chunk_tokens

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a full chunk (every layer's keys and values)."""
        return self._raw.chunk_bytes

    @property
    def layers(self) -> int:
        return self._layers

    @property
    def heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> str:
        """The KV dtype's name."""
        return self._dtype

    @property
    def namespace(self) -> bytes:
        """The namespace chunks are keyed in (as given, encoded)."""
        return self._namespace

    @property
    def gpu(self) -> Optional[int]:
        """The engine's CUDA device (None: host only)."""
        return self._gpu

    def __enter__(self) -> "CacheEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else f" {self.occupancy()}"
        return (
            f"<freight.CacheEngine {self._layers}x{self._heads}x{self._head_dim} {self._dtype}, "
            f"chunks of {self.chunk_tokens} tokens{state}>"
        )
