"""A KV cache server and its client: values in one memory pool, with TTLs and LRU
eviction, reached by key from any process.

The server (:class:`Server` here, or ``freight serve`` on the command line: the same
server) keeps values in a pool registered with a freight engine agent, and answers on a
gRPC control plane (sessions, ``exists``, ``delete``, stats). Values never cross the
control plane: the server moves them itself between its pool and the client's receive
buffer with the freight engine (shared memory on the same host, TCP otherwise), so a
GET lands in the client's memory without passing through a socket on one host.

Server (or run ``freight serve --listen 127.0.0.1:50051 --memory-mb 4096``)::

    with freight.kv.Server("127.0.0.1:50051", memory_size=4 << 30) as server:
        ...

Client::

    with freight.kv.Client("http://127.0.0.1:50051") as kv:
        kv.put("prefix-0", array)               # numpy array or bytes-like; a version
        raw = kv.get("prefix-0")                # bytes, or None
        n = kv.get_into("prefix-0", out)        # into a numpy array / buffer of yours
        kv.put_many({"a": b"1", "b": b"2"}, ttl=60)
        kv.get_many(["a", "b", "c"])            # [b"1", b"2", None]

Keys are ``str`` (UTF-8) or bytes, not empty. Values are bytes-like objects or
C-contiguous numpy arrays (their raw bytes: a numpy array comes back as bytes, to be
viewed again with ``np.frombuffer``), not empty, and at most the client's
``buffer_size``. ``ttl`` is in seconds; 0 means no expiry. A full pool evicts the least
recently used values, or, on a server started with ``evict=False``, refuses writes with
:class:`freight.NoSpaceError` ("out of memory"). Errors are freight's
(:mod:`freight.errors`): a dead or unreachable server raises
:class:`freight.PeerDisconnectedError`, :class:`freight.IoError` or
:class:`freight.TimeoutError` within the client's ``timeout``, never hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import sys
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._objects import is_tensor, to_bytes
from .errors import FreightError, InvalidArgumentError, InvalidStateError

__all__ = ["AsyncClient", "Client", "Server", "Key"]

#: What a key may be: str (encoded as UTF-8) or bytes-like.
Key = Union[str, bytes, bytearray, memoryview]


def _key(key: Any) -> bytes:
    raw = to_bytes(key, "a KV key")
    if not raw:
        raise InvalidArgumentError("KV keys must not be empty")
    return raw


def _keys(keys: Iterable[Any]) -> List[bytes]:
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise TypeError("expected a sequence of keys, got a single key")
    return [_key(k) for k in keys]


def _one_or_many(keys: Any) -> Tuple[List[bytes], bool]:
    """(keys, whether a single key was given)."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        return [_key(keys)], True
    return _keys(keys), False


def _tensor_bytes(tensor: Any, what: str) -> Any:
    """A contiguous torch tensor's bytes as a flat uint8 tensor on its device (a view)."""
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{what} (a tensor of shape {tuple(tensor.shape)}) is not contiguous "
                                   "(.contiguous() makes a copy that is)")
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{what} is on device {tensor.device}; tensors on cpu or cuda only")
    return tensor.detach().reshape(-1).view(sys.modules["torch"].uint8)


def _value(value: Any, what: str = "the value") -> np.ndarray:
    """A read-only 1-D uint8 view of a value's bytes (no copy; a GPU tensor is copied to
    host memory first)."""
    if is_tensor(value):
        flat = _tensor_bytes(value, what)
        value = flat.cpu().numpy() if flat.device.type == "cuda" else flat.numpy()
    if isinstance(value, str):
        raise TypeError(f"{what} must be bytes-like or a numpy array, not str (encode it first)")
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise InvalidArgumentError(
                f"{what} (shape {value.shape}, strides {value.strides}) is not C-contiguous "
                "(np.ascontiguousarray makes a copy that is)"
            )
        if value.dtype.hasobject:
            raise TypeError(f"{what} is an array of Python objects, which has no bytes to store")
        flat = value.reshape(-1).view(np.uint8)
    else:
        try:
            view = memoryview(value)
        except TypeError:
            raise TypeError(
                f"{what} must be bytes-like or a numpy array, got {type(value).__name__}"
            ) from None
        if not view.c_contiguous:
            raise InvalidArgumentError(f"{what} (a {type(value).__name__}) is not C-contiguous")
        flat = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    if flat.size == 0:
        raise InvalidArgumentError(f"{what} is empty; the KV server stores values of at least 1 byte")
    return flat


def _out(out: Any) -> np.ndarray:
    """A writable 1-D uint8 view of ``out`` (no copy): a numpy array, a CPU tensor or a
    writable buffer."""
    if is_tensor(out):
        out = _tensor_bytes(out, "out").numpy()
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous:
            raise InvalidArgumentError(f"out (shape {out.shape}, strides {out.strides}) is not C-contiguous")
        if not out.flags.writeable:
            raise InvalidArgumentError("out is read-only")
        return out.reshape(-1).view(np.uint8)
    try:
        view = memoryview(out)
    except TypeError:
        raise TypeError(f"out must be a numpy array or a writable buffer, got {type(out).__name__}") from None
    if view.readonly:
        raise InvalidArgumentError(f"out (a {type(out).__name__}) is read-only")
    if not view.c_contiguous:
        raise InvalidArgumentError(f"out (a {type(out).__name__}) is not C-contiguous")
    return np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)


#: A KV server running in this process (the engine's own class: see its docstring).
Server = _native.KvServer


class Client(_native.KvClient):
    """``Client(server="http://[::1]:50051", buffer_size=64 << 20, name="freight-kv-client",
    timeout=30.0, transport="auto", *, token=None, tls_ca=None, direct=True)``: a session with the KV
    server at ``server`` (its URL: ``"http://ip:port"``, as :attr:`Server.url` gives and
    ``freight serve`` prints, or a running :class:`Server`).

    The session itself (connecting, :attr:`server`, :attr:`buffer_size`,
    :attr:`timeout`, :attr:`live`, :attr:`direct`, :attr:`engine_addresses`, :meth:`stats`,
    :meth:`close`, ``with``) is the engine's native class; this one turns keys and
    values (str, numpy arrays, torch tensors) into the bytes it moves.

    ``buffer_size``: bytes of the client's receive buffer (shared memory), the largest
    value it can get or put, and the most one :meth:`put_many` request carries.
    ``name``: shown in the server's logs. ``timeout``: the seconds one call (connecting
    too) may take to get the server's answer, a new session after the server went away
    included, before it raises :class:`freight.TimeoutError`; only handing a request to
    the engine is bounded by the engine's own timeouts instead (its first connection to
    the server; a same-host server that leaves its notification queue full).
    ``transport``: ``"auto"`` (shared memory on the same host, else TCP), ``"shm"`` or
    ``"tcp"``: the only transport this client offers the server, which moves the
    values.

    ``token``: the secret of a server started with one (``Server(token=...)``,
    ``freight serve --token``); None (the default) takes ``FREIGHT_KV_TOKEN`` from the
    environment where it is set, as ``freight kv-bench`` does (an empty one is none). A
    missing or wrong one raises :class:`freight.AuthError`; a server without a token ignores it.
    ``tls_ca``: for an ``https://`` server, the path of a PEM file with the certificate
    of the authority that signed the server's (the server's own when it signed itself;
    the system's roots are not consulted), as ``kv-bench --tls-ca``.
    ``direct``: take the direct connection that a server reaching this client over TCP
    offers (requests and values on a socket of its own, far faster for small values
    than through the engine; docs/kv.md, "Direct connections"); False keeps the engine.
    :attr:`direct` says which one values take.

    An address that is not a URL (``"127.0.0.1:50051"``) raises
    :class:`freight.InvalidArgumentError` at once: write ``http://127.0.0.1:50051``.

    One request at a time: calls from several threads are serialized (use a client per
    thread for parallel requests). Context manager: :meth:`close` on exit.

    A call that moves values (``put``, ``get``, ``get_into``, ``put_many``,
    ``get_many``) and times out closes the client: the server may still carry that
    request out later, writing into the receive buffer or reading from it, and so
    corrupt whatever the next request put there. So does one whose connection breaks
    while the same server lives on (:class:`freight.PeerDisconnectedError`), through
    the engine; on a direct connection (:attr:`direct`) nothing of the request can
    still be under way once the connection is closed, so it is sent again on a new
    session, as it is to a new server after a restart. Connect a new
    client then (later calls on this one raise :class:`freight.InvalidStateError`
    saying so).
    """

    # -- writes

    def put(self, key: Key, value: Any, ttl: float = 0.0) -> int:
        """Stores ``value`` (bytes-like, a C-contiguous numpy array or a contiguous
        torch tensor, CPU or GPU: its raw bytes) under ``key``, replacing any value it
        had, expiring after ``ttl`` seconds (0: never). Returns the value's version
        (versions grow with every write to the server). Readers see the old value or
        the new one, never a mix. A GPU tensor is copied to host memory first.

        A value larger than :attr:`buffer_size` raises
        :class:`freight.InvalidArgumentError` naming both sizes; a full pool without
        eviction, :class:`freight.NoSpaceError`."""
        return self._put(_key(key), _value(value), ttl)

    def put_many(
        self, items: Union[Mapping[Key, Any], Iterable[Tuple[Key, Any]]], ttl: float = 0.0
    ) -> List[Union[int, BaseException]]:
        """Stores several values (a dict, or ``(key, value)`` pairs) in as few requests
        as :attr:`buffer_size` allows, all with the same ``ttl``.

        Returns one entry per item, in order: its version (an int), or, for an item the
        server refused, the exception that :meth:`put` would have raised for it (a
        :class:`freight.FreightError` instance, not raised: the other items are stored
        all the same). For example ``[7, NoSpaceError('... out of memory ...'), 8]``.
        Check with ``isinstance(r, Exception)``. Bad arguments (an empty key, a str
        value...) raise before anything is sent; a failure of the connection itself
        (dead server, timeout) raises, and items of requests sent before it may be
        stored."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        keys, values = [], []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"put_many takes a dict or (key, value) pairs; item {i} is {pair!r}")
            keys.append(_key(pair[0]))
            values.append(_value(pair[1], f"the value of item {i}"))
        return self._put_many(keys, values, ttl)

    def delete(self, keys: Union[Key, Sequence[Key]]) -> Union[bool, List[bool]]:
        """Deletes ``keys`` (one key, or a sequence of them); says whether each was
        there (a bool for a single key, else a list). A value being read meanwhile
        stays readable to that reader."""
        raw, single = _one_or_many(keys)
        deleted = self._delete(raw)
        return deleted[0] if single else deleted

    # -- reads

    def get(self, key: Key) -> Optional[bytes]:
        """The value of ``key`` as bytes, or None when there is none (never written,
        deleted, expired or evicted). A value larger than :attr:`buffer_size` raises
        :class:`freight.InvalidArgumentError` naming both sizes."""
        return self._get(_key(key))

    def get_into(self, key: Key, out: Any) -> Optional[int]:
        """Copies the value of ``key`` into ``out`` (a writable C-contiguous numpy array
        of any dtype, a contiguous torch tensor on the CPU or a GPU, or a writable
        buffer such as a bytearray), from its start; returns the value's length in
        bytes, or None when there is no such key (``out`` is then untouched). A value
        larger than ``out`` raises :class:`freight.InvalidArgumentError` (a
        ``ValueError``) naming both sizes.

        A GPU tensor is filled from the client's receive buffer (pinned at the first
        such call) with one host-to-device copy, finished when this returns; order your
        own GPU work on ``out`` before the call (``torch.cuda.synchronize()``)."""
        if is_tensor(out) and out.device.type == "cuda":
            flat = _tensor_bytes(out, "out")
            device = flat.device.index if flat.device.index is not None else sys.modules["torch"].cuda.current_device()
            return self._get_into_gpu(_key(key), flat.data_ptr(), flat.numel(), device)
        return self._get_into(_key(key), _out(out))

    def get_many(self, keys: Sequence[Key]) -> List[Optional[bytes]]:
        """The values of ``keys``, in order: bytes, or None for a missing key. Keys are
        fetched in batches that share the receive buffer; a value larger than its share
        is fetched again on its own, so any value up to :attr:`buffer_size` is
        returned."""
        return self._get_many(_keys(keys))

    def exists(self, keys: Union[Key, Sequence[Key]]) -> Union[bool, List[bool]]:
        """Whether each key has a live value (a bool for a single key, else a list).
        Reads nothing and does not count as a use for eviction."""
        raw, single = _one_or_many(keys)
        found = self._exists(raw)
        return found[0] if single else found

    def __contains__(self, key: Key) -> bool:
        return bool(self.exists(key))


class AsyncClient:
    """:class:`Client` for asyncio: the same session and methods, as coroutines.

    Each call runs the blocking client on a thread of this client's own (one request at
    a time, in the order they were awaited), so the event loop never waits on the
    server. Connect with ``async with AsyncClient(url, ...) as kv`` or
    ``kv = await AsyncClient(url, ...).connect()``; the arguments are
    :class:`Client`'s. Several clients serve parallel requests.

    A cancelled call stops waiting, but the request it sent still completes (or times
    out) on the client's thread, before the next one starts.
    """

    def __init__(self, server: Union[str, Server] = "http://[::1]:50051", **options: Any) -> None:
        self._args = (server,)
        self._options = options
        self._client: Optional[Client] = None
        self._closed = False
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="freight-kv-async")

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._closed:
            raise InvalidStateError("this AsyncClient is closed")
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    async def connect(self) -> "AsyncClient":
        """Opens the session (what ``async with`` does); returns this client."""
        if self._closed:
            raise InvalidStateError("this AsyncClient is closed")
        if self._client is None:
            self._client = await self._run(functools.partial(Client, *self._args, **self._options))
        return self

    def _connected(self) -> Client:
        if self._closed:
            raise InvalidStateError("this AsyncClient is closed")
        if self._client is None:
            raise InvalidStateError("this AsyncClient is not connected: await connect() or use 'async with'")
        return self._client

    @property
    def live(self) -> bool:
        return self._client is not None and self._client.live

    async def close(self) -> None:
        """Ends the session (see :meth:`Client.close`) and stops the client's thread.
        Harmless when called again; later calls raise :class:`freight.InvalidStateError`."""
        if self._closed:
            return
        try:
            if self._client is not None:
                await self._run(self._client.close)
        finally:
            self._closed = True
            self._thread.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            await self.close()
        except FreightError:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        inner = repr(self._client) if self._client is not None else "not connected"
        return f"<freight.kv.AsyncClient: {inner}>"


def _forward(name: str) -> Any:
    method = getattr(Client, name)

    @functools.wraps(method)
    async def call(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        return await self._run(functools.partial(method, self._connected(), *args, **kwargs))

    call.__doc__ = f"Awaitable :meth:`Client.{name}`.\n\n{method.__doc__ or ''}"
    return call


for _name in ("put", "put_many", "delete", "get", "get_into", "get_many", "exists", "stats"):
    setattr(AsyncClient, _name, _forward(_name))
del _name
