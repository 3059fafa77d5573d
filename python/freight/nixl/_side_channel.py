"""The socket side of ``freight.nixl``'s side channel: the listener an agent runs on its
``listenPort``, and the client calls that push, fetch and invalidate metadata.

The frames, the limits and the authentication rule are in :mod:`freight.nixl._wire`.
The listener has one accept thread and one thread for each connection it is serving.
``max_connections`` (64 by default) caps the connections served at once; a connection
over the cap gets ``ERROR "busy"`` and is closed at once. Each connection gets
``timeout`` seconds in all (10 by default) to deliver its HELLO and request. This is a
deadline for the whole request, not an idle timer per read, so a client that sends
nothing, or one byte now and then, cannot keep a thread past it. A malformed frame, a
failed authentication, a timeout or a reset costs only that connection: it is logged
at WARNING with the peer's address and the listener goes on serving. A callback that
raises gets the client an ERROR carrying the exception's message.

Memory: a connection buffers at most one frame (64 MiB for metadata) before the
callback runs. A listener with a token buffers nothing large for a client whose HELLO
does not prove the token. A listener without one (NIXL's trust model) can be made to
hold ``max_connections`` x 64 MiB by anyone who can reach its port.

Client calls (:func:`push`, :func:`fetch`, :func:`invalidate`) connect, read the
listener's HELLO, send theirs and the request, wait for the reply and close, all within
``timeout`` seconds. They raise:

- :class:`SideChannelRefused`: the listener answered no (a failed callback, failed
  authentication, busy), or the two sides disagree about the token.
  :class:`SideChannelNotFound` is the subclass for a fetch that found no metadata.
- :class:`SideChannelProtocolError` (a :class:`ConnectionError`): the peer sent
  something that is not a valid reply, or a reply that failed authentication.
- :class:`TimeoutError` / :class:`ConnectionError`: no answer in time, nothing
  listening, a reset connection. The message names ``ip:port``.

Only the standard library is used.
"""

from __future__ import annotations

import errno
import logging
import secrets
import selectors
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

from ._wire import (
    CLIENT, NONCE_SIZE, SERVER, REQUEST_KINDS, AuthenticationError, Decoder, Frame, Handshake, Kind,
    Value, WireError, clip_utf8, encode, encode_body, encode_frame, normalize_token,
)

__all__ = [
    "Listener", "push", "fetch", "invalidate",
    "SideChannelRefused", "SideChannelNotFound", "SideChannelProtocolError",
    "DEFAULT_TIMEOUT", "MAX_CONNECTIONS",
]

log = logging.getLogger("freight.nixl")

#: Seconds a connection has to complete its exchange (listener and client alike).
DEFAULT_TIMEOUT = 10.0
#: Connections a listener serves at once.
MAX_CONNECTIONS = 64

_RECV_SIZE = 256 << 10
# After refusing a request before reading all of it, the listener reads and discards
# what the client is still sending, for this long at most. The client then gets the
# ERROR instead of a reset that could discard it.
_DRAIN_S = 1.0
# How long close() waits for the listener's threads in all.
_JOIN_S = 2.0

Token = Union[bytes, bytearray, memoryview, str, None]


class SideChannelRefused(RuntimeError):
    """The listener at ``peer`` refused the request, for ``reason``. Also raised when the
    two sides disagree about the token, before anything is sent."""

    def __init__(self, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"NIXL side channel {peer} refused the request: {reason}")


class SideChannelNotFound(SideChannelRefused):
    """A fetch reached the listener at ``peer``, but it has no metadata to give (for that
    label)."""


class SideChannelProtocolError(ConnectionError):
    """The peer at ``peer`` sent something that is not a valid side-channel reply, or a
    reply that failed authentication."""

    def __init__(self, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"NIXL side channel {peer}: {reason}")


def _peer_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Reader:
    """Reads whole frames from a blocking socket, within a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._decoder = Decoder()
        self._frames: List[Frame] = []

    def next(self, deadline: float) -> Optional[Frame]:
        """The next frame, or None if the stream ended cleanly between frames. Raises
        socket.timeout past ``deadline``, WireError on bad bytes, OSError from the socket."""
        while not self._frames:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("timed out")
            self._sock.settimeout(remaining)
            data = self._sock.recv(_RECV_SIZE)
            if not data:
                self._decoder.eof()
                return None
            self._frames.extend(self._decoder.feed(data))
        return self._frames.pop(0)


# --------------------------------------------------------------------------- listener


class Listener:
    """A NIXL agent's metadata listener on TCP ``host:port``.

    It binds when it is constructed. ``port=0`` takes an ephemeral port, which
    :attr:`port` then gives. A port that cannot be had raises :class:`OSError` (errno
    kept) with a message naming it. Serving runs in daemon threads until
    :meth:`close`, which is idempotent; the listener is also a context manager.

    The callbacks run in the connection's thread, one request per connection. Several
    connections are served at once, so **callbacks may run concurrently** and must be
    thread-safe:

    - ``on_push(blob)``: a peer pushed its metadata. Load it.
    - ``on_fetch(label) -> bytes | None``: a peer asks for this agent's metadata. The
      label is None when the peer gave none. None means "no metadata", which the
      peer's fetch raises as :class:`SideChannelNotFound`.
    - ``on_invalidate(name)``: the peer named ``name`` asks to be forgotten.

    An exception from a callback is sent to the peer as an ERROR with its message, and
    the listener goes on serving. ``token`` is the shared token (see the rule in
    :mod:`freight.nixl._wire`). None accepts unauthenticated requests from anyone,
    which is NIXL's own trust model.
    """

    def __init__(
        self,
        port: int,
        *,
        host: str = "0.0.0.0",
        token: Token = None,
        on_push: Callable[[bytes], None],
        on_fetch: Callable[[Optional[str]], Optional[bytes]],
        on_invalidate: Callable[[str], None],
        logger: Optional[logging.Logger] = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"listen port must be an integer in 0..65535, not {port!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, not {timeout!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {max_connections!r}")
        self._token = normalize_token(token)
        self._on_push = on_push
        self._on_fetch = on_fetch
        self._on_invalidate = on_invalidate
        self._log = logger or log
        self._timeout = float(timeout)
        self._max_connections = max_connections
        self._host = host

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                why = f"port {port} is already in use"
            else:
                why = e.strerror or str(e)
            raise OSError(e.errno, f"NIXL side channel cannot listen on {_peer_name(host, port)}: {why}") from None
        self._sock = sock
        self._port = sock.getsockname()[1]

        self._lock = threading.Lock()
        self._closed = False
        self._conns: Dict[threading.Thread, socket.socket] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"freight-nixl-listen-{self._port}", daemon=True)
        self._accept_thread.start()
        self._log.debug("NIXL side channel listening on %s", _peer_name(host, self._port))

    @property
    def port(self) -> int:
        """The TCP port listened on (the ephemeral one chosen for ``port=0``)."""
        return self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "listening"
        return f"<freight.nixl Listener {_peer_name(self._host, self._port)} {state}>"

    def close(self) -> None:
        """Stops listening and ends every connection, waiting for the threads for
        about 2 s at most. A callback that is still running is not interrupted, but its
        reply is not sent. Calling close() again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.items())
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        for _thread, conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + _JOIN_S
        if self._accept_thread is not threading.current_thread():
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        for thread, _conn in conns:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        self._log.debug("NIXL side channel on port %d closed", self._port)

    # -- accepting

    def _accept_loop(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.fileobj is self._wake_r or self._closed:
                        return
                    self._accept_one()
        except Exception:  # pragma: no cover - a bug, not a peer's doing
            self._log.exception("NIXL side channel on port %d: accept loop failed", self._port)
        finally:
            self._selector.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept_one(self) -> None:
        try:
            conn, addr = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # e.g. EMFILE: out of descriptors; back off a little
            self._log.warning("NIXL side channel on port %d: accept failed: %s", self._port, e)
            time.sleep(0.05)
            return
        peer = _peer_name(str(addr[0]), int(addr[1]))
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        with self._lock:
            busy = self._closed or len(self._conns) >= self._max_connections
            if not busy:
                thread = threading.Thread(
                    target=self._serve, args=(conn, peer), name=f"freight-nixl-conn-{self._port}", daemon=True)
                self._conns[thread] = conn
                thread.start()  # under the lock, so that close() never joins a thread not started
        if busy:
            self._log.warning(
                "NIXL side channel on port %d: refusing %s, already serving %d connections",
                self._port, peer, self._max_connections)
            try:
                conn.setblocking(False)
                conn.send(encode(Kind.ERROR, "busy: too many connections, try again"))
            except OSError:
                pass
            conn.close()

    # -- serving one connection

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            self._converse(conn, peer)
        except (ConnectionResetError, BrokenPipeError) as e:  # a port scan or a client gone: not worth a warning
            if not self._closed:
                self._log.info("NIXL side channel on port %d: %s dropped the connection: %s", self._port, peer, e)
        except OSError as e:
            if not self._closed:
                self._log.warning("NIXL side channel on port %d: connection from %s failed: %s", self._port, peer, e)
        except Exception:  # pragma: no cover - a bug, not a peer's doing
            self._log.exception("NIXL side channel on port %d: serving %s failed", self._port, peer)
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(threading.current_thread(), None)

    def _converse(self, conn: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + self._timeout
        server_nonce = secrets.token_bytes(NONCE_SIZE)
        conn.settimeout(self._timeout)
        conn.sendall(encode(Kind.HELLO, server_nonce, token_flag=self._token is not None))
        reader = _Reader(conn)
        handshake: Optional[Handshake] = None
        try:
            hello = reader.next(deadline)
            if hello is None:
                self._log.debug("NIXL side channel: %s closed the connection without a request", peer)
                return
            if hello.kind is not Kind.HELLO:
                raise WireError(f"expected HELLO, got {hello.kind.name}")
            handshake = Handshake(self._token, server_nonce, hello.value)  # type: ignore[arg-type]
            handshake.verify(CLIENT, hello)
            request = reader.next(deadline)
            if request is None:
                raise WireError("the connection ended after the HELLO, without a request")
            if request.kind not in REQUEST_KINDS:
                raise WireError(f"expected PUSH, FETCH or INVALIDATE, got {request.kind.name}")
            handshake.verify(CLIENT, request)
        except AuthenticationError as e:
            self._log.warning("NIXL side channel on port %d: refusing %s: %s", self._port, peer, e)
            self._refuse(conn, handshake, str(e))
            return
        except WireError as e:
            if self._closed:
                return
            self._log.warning(
                "NIXL side channel on port %d: malformed input from %s, closing the connection: %s",
                self._port, peer, e)
            self._refuse(conn, handshake, f"protocol error: {e}")
            return
        except socket.timeout:
            self._log.warning(
                "NIXL side channel on port %d: %s sent no complete request within %g s, closing the connection",
                self._port, peer, self._timeout)
            return

        if self._closed:
            return
        reply_kind, reply_value = self._dispatch(request, peer)
        try:
            reply = handshake.seal(SERVER, reply_kind, reply_value)
        except WireError as e:  # on_fetch returned something that cannot be sent
            self._log.warning("NIXL side channel on port %d: cannot reply to %s: %s", self._port, peer, e)
            reply = handshake.seal(SERVER, Kind.ERROR, clip_utf8(f"cannot send the reply: {e}"))
        if self._closed:
            return
        conn.settimeout(self._timeout)
        conn.sendall(reply)
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _dispatch(self, request: Frame, peer: str) -> Tuple[Kind, Value]:
        try:
            if request.kind is Kind.PUSH:
                self._on_push(request.value)  # type: ignore[arg-type]
                return Kind.ACK, ""
            if request.kind is Kind.FETCH:
                blob = self._on_fetch(request.value)  # type: ignore[arg-type]
                if blob is not None and not isinstance(blob, (bytes, bytearray, memoryview)):
                    raise TypeError(f"on_fetch returned {type(blob).__name__}, not bytes or None")
                return Kind.FETCH_REPLY, (None if blob is None else bytes(blob))
            self._on_invalidate(request.value)  # type: ignore[arg-type]
            return Kind.ACK, ""
        except Exception as e:
            reason = clip_utf8(str(e) or type(e).__name__)
            self._log.warning(
                "NIXL side channel on port %d: %s from %s failed: %s", self._port, request.kind.name, peer, reason)
            return Kind.ERROR, reason

    def _refuse(self, conn: socket.socket, handshake: Optional[Handshake], reason: str) -> None:
        """Sends ERROR(reason) and ends the connection. It then reads and discards
        whatever the peer is still sending, for _DRAIN_S at most, so that closing does not
        reset the connection before the peer has read the ERROR."""
        reason = clip_utf8(reason)
        try:
            if handshake is not None and self._token is not None:
                frame = handshake.seal(SERVER, Kind.ERROR, reason)
            else:
                frame = encode(Kind.ERROR, reason)
            conn.settimeout(_DRAIN_S)
            conn.sendall(frame)
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _DRAIN_S
            while not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                conn.settimeout(remaining)
                if not conn.recv(_RECV_SIZE):
                    break
        except OSError:
            pass


# --------------------------------------------------------------------------- client


def _connect(ip: str, port: int, timeout: float, peer: str) -> socket.socket:
    try:
        sock = socket.create_connection((ip, port), timeout=timeout)
    except socket.timeout:
        raise TimeoutError(f"NIXL side channel {peer}: no connection within {timeout:g} s") from None
    except ConnectionRefusedError as e:
        raise ConnectionRefusedError(
            e.errno, f"NIXL side channel {peer}: connection refused (is an agent listening there?)") from None
    except socket.gaierror as e:
        raise ConnectionError(f"NIXL side channel {peer}: cannot resolve {ip!r}: {e.strerror or e}") from None
    except OSError as e:
        raise ConnectionError(f"NIXL side channel {peer}: cannot connect: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    return sock


def _read_reply(reader: _Reader, deadline: float, timeout: float, peer: str, what: str) -> Frame:
    try:
        frame = reader.next(deadline)
    except socket.timeout:
        raise TimeoutError(f"NIXL side channel {peer}: no {what} within {timeout:g} s") from None
    except WireError as e:
        raise SideChannelProtocolError(
            peer, f"sent malformed data where {what} was expected ({e}); is a freight NIXL agent listening there?"
        ) from None
    except OSError as e:
        raise ConnectionError(f"NIXL side channel {peer}: connection failed before {what}: {e.strerror or e}") from None
    if frame is None:
        raise ConnectionError(f"NIXL side channel {peer}: the connection closed before {what}")
    return frame


def _request(ip: str, port: int, kind: Kind, value: Value, token: Token, timeout: float,
             expect: Kind) -> Frame:
    """One exchange: returns the reply frame, of kind ``expect``, authenticated."""
    token = normalize_token(token)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        raise ValueError(f"port must be an integer in 1..65535, not {port!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, not {timeout!r}")
    body = encode_body(kind, value)  # the caller's mistakes surface before any I/O
    peer = _peer_name(str(ip), port)
    deadline = time.monotonic() + timeout
    sock = _connect(ip, port, timeout, peer)
    try:
        reader = _Reader(sock)
        hello = _read_reply(reader, deadline, timeout, peer, "its HELLO")
        if hello.kind is Kind.ERROR:
            raise SideChannelRefused(peer, str(hello.value))
        if hello.kind is not Kind.HELLO:
            raise SideChannelProtocolError(peer, f"sent {hello.kind.name} where its HELLO was expected")
        if hello.token_flag and token is None:
            raise SideChannelRefused(
                peer, "authentication failed: the listener requires a token and this side has none (set FREIGHT_TOKEN)")
        if token is not None and not hello.token_flag:
            raise SideChannelRefused(
                peer, "the listener has no token but this side has one; not sending to a listener that cannot "
                      "authenticate (set the same FREIGHT_TOKEN on both agents, or on neither)")
        client_nonce = secrets.token_bytes(NONCE_SIZE)
        handshake = Handshake(token, hello.value, client_nonce)  # type: ignore[arg-type]
        authed = token is not None
        out = b"".join((
            encode_frame(Kind.HELLO, client_nonce, token_flag=authed,
                         tag=handshake.tag(CLIENT, Kind.HELLO, client_nonce) if authed else None),
            encode_frame(kind, body, tag=handshake.tag(CLIENT, kind, body) if authed else None),
        ))
        send_error: Optional[OSError] = None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall(out)
        except socket.timeout:
            raise TimeoutError(f"NIXL side channel {peer}: could not send the request within {timeout:g} s") from None
        except OSError as e:  # the listener may have refused early: its ERROR may still be readable
            send_error = e
        try:
            reply = _read_reply(reader, deadline, timeout, peer, "a reply")
        except ConnectionError as e:
            if send_error is not None and not isinstance(e, SideChannelProtocolError):
                raise ConnectionError(
                    f"NIXL side channel {peer}: sending the request failed: {send_error.strerror or send_error}"
                ) from None
            raise
        if reply.kind is Kind.ERROR:
            raise SideChannelRefused(peer, str(reply.value))
        if reply.kind is not expect:
            raise SideChannelProtocolError(peer, f"replied {reply.kind.name} to {kind.name}")
        if authed:
            try:
                handshake.verify(SERVER, reply)
            except AuthenticationError as e:
                raise SideChannelProtocolError(peer, f"its reply failed authentication: {e}") from None
        return reply
    finally:
        sock.close()


def push(ip: str, port: int, blob: bytes, *, token: Token = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Sends the metadata ``blob`` to the listener at ``ip:port``. It returns once that
    agent has loaded it (its ``on_push`` returned). Raises SideChannelRefused with the
    listener's reason if it failed there."""
    _request(ip, port, Kind.PUSH, blob, token, timeout, Kind.ACK)


def fetch(ip: str, port: int, label: Optional[str] = None, *, token: Token = None,
          timeout: float = DEFAULT_TIMEOUT) -> bytes:
    """The metadata blob of the agent listening at ``ip:port``, for ``label`` (None: no
    label). Raises SideChannelNotFound if it has none."""
    reply = _request(ip, port, Kind.FETCH, label, token, timeout, Kind.FETCH_REPLY)
    if reply.value is None:
        what = "no metadata" if label is None else f"no metadata for label {label!r}"
        raise SideChannelNotFound(_peer_name(str(ip), port), what)
    return reply.value  # type: ignore[return-value]


def invalidate(ip: str, port: int, name: str, *, token: Token = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Asks the agent listening at ``ip:port`` to forget the agent ``name``. It returns
    once it has (its ``on_invalidate`` returned)."""
    _request(ip, port, Kind.INVALIDATE, name, token, timeout, Kind.ACK)
