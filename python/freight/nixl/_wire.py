"""The frames of ``freight.nixl``'s side channel, without any I/O.

This module does no I/O: no sockets, threads or clock. It turns values into bytes and
bytes back into frames, and computes and checks the authentication tags.
:mod:`freight.nixl._side_channel` does the networking on top of it.

Conversation
------------
A TCP connection carries one request. Each side first sends a HELLO with a fresh
random nonce. The listener sends its HELLO as soon as it accepts the connection. The
client waits for it, then sends its own HELLO and the request (PUSH, FETCH or
INVALIDATE) in one write. The listener sends one reply (ACK, FETCH_REPLY or ERROR)
and closes the connection::

    listener -> client   HELLO(server nonce)       TOKEN flag if the listener has a token
    client -> listener   HELLO(client nonce)       tagged, with the TOKEN flag, if the client has a token
    client -> listener   PUSH(blob) | FETCH(label) | INVALIDATE(name)      tagged if token
    listener -> client   ACK | FETCH_REPLY(blob or none) | ERROR(reason)   tagged if token

The listener can also send an ERROR in place of its HELLO, for example when it is
too busy to serve the connection. When it refuses a request before reading all of it,
it sends its ERROR and then reads and discards the rest (for a bounded time, without
keeping it), so the client does get the ERROR instead of a reset connection.

Frame layout (integers are big-endian)
--------------------------------------

========  =====  ==========================================================
offset    size   field
========  =====  ==========================================================
0         4      magic ``b"FNXS"`` (Freight NiXl Side channel)
4         1      version, 1
5         1      kind (see below)
6         1      flags: 0x01 TAGGED (a 32-byte tag follows the header);
                 0x02 TOKEN (HELLO only: its sender holds a token).
                 Any other bit is an error.
7         1      reserved, 0
8         4      body length ``n`` (u32)
12        32     tag, only when TAGGED is set
12 / 44   n      body
========  =====  ==========================================================

=====  ===========  ============================================  =================
kind   name         body                                          most body bytes
=====  ===========  ============================================  =================
1      HELLO        the sender's nonce: exactly 32 random bytes   32
2      PUSH         a metadata blob, not empty                    MAX_METADATA
3      FETCH        a label in UTF-8; empty means no label        MAX_LABEL
4      FETCH_REPLY  0x01 followed by the blob, or 0x00 alone      MAX_METADATA + 1
                    ("no metadata")
5      INVALIDATE   the name of an agent in UTF-8, not empty      MAX_NAME
6      ACK          a note in UTF-8 (usually empty)               MAX_REASON
7      ERROR        the reason in UTF-8                           MAX_REASON
=====  ===========  ============================================  =================

The decoder checks the declared length against the limit for its kind as soon as the
12-byte header has arrived. A longer declared body, even 4 GiB, is refused before any
of it is buffered. The decoder holds at most one incomplete frame (at most its kind's
limit) plus the bytes of the latest ``feed``.

Authentication
--------------
Agents can share a token (bytes; ``FREIGHT_TOKEN``). A metadata blob contains the
secret that gives access to an agent's memory. A process without the token must not
be able to fetch a blob, push fake metadata (which would send a victim's writes to
the attacker) or invalidate an agent. So, when there is a token, every frame after
the listener's HELLO carries the tag below. The one exception is an ERROR that the
listener sends before it has the client's nonce::

    HMAC-SHA256(token, b"freight-nixl-side-channel/1\\0" || sender || server_nonce
                       || client_nonce || kind || body)

This includes the client's HELLO, whose body is its nonce. ``sender`` is one byte:
``b"C"`` for frames the client sends, ``b"S"`` for frames the listener sends.
``kind`` is one byte. Tags are compared with :func:`hmac.compare_digest`.

- The listener's nonce is fresh for every connection, so a recorded request cannot be
  replayed.
- The client's tagged HELLO proves that the client knows the token before the
  listener buffers the request. A client without the token cannot make the listener
  hold up to 64 MiB for it; its HELLO is refused at once.
- The client's nonce is fresh too, and it is part of the reply's tag. A client with a
  token therefore rejects a replayed or forged FETCH_REPLY or ACK, for example from
  another process that took the port of a dead agent.
- Because the sender byte is in the tag, a tag cannot be sent back in the other
  direction.

The rule:

- Listener with a token: it serves only a client whose HELLO and request both have a
  valid tag. Otherwise the client gets ``ERROR "authentication failed: ..."`` and
  the connection is closed. No callback runs.
- Listener without a token: it serves untagged requests from anyone. This is NIXL's
  own trust model: anyone who can reach the port can fetch, push and invalidate. It
  refuses a tagged HELLO, because a token configured on one side only is a
  configuration error, and it says so.
- Client with a token: it accepts only ACK and FETCH_REPLY frames with a valid tag.
  It refuses to send anything to a listener whose HELLO lacks the TOKEN flag, so its
  blob never reaches a listener that cannot check tokens. An ERROR frame is accepted
  untagged, since it can only make a request fail.
- Client without a token: it sends nothing to a listener whose HELLO has the TOKEN
  flag, since that listener would refuse it anyway. It raises the refusal at once.

Without TLS the bytes on the wire are readable by anyone who can see the traffic. The
token guards who may act, not the secrecy of the channel.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import List, Optional, Union

__all__ = [
    "MAGIC", "VERSION", "HEADER_SIZE", "NONCE_SIZE", "TAG_SIZE",
    "MAX_METADATA", "MAX_LABEL", "MAX_NAME", "MAX_REASON",
    "FLAG_TAGGED", "FLAG_TOKEN", "CLIENT", "SERVER",
    "Kind", "REQUEST_KINDS", "REPLY_KINDS", "Frame", "WireError", "AuthenticationError",
    "Decoder", "Handshake", "body_limit", "encode_body", "decode_body", "encode_frame",
    "encode", "clip_utf8", "normalize_token",
]

MAGIC = b"FNXS"
VERSION = 1
_HEADER = struct.Struct(">4sBBBBI")
HEADER_SIZE = _HEADER.size  # 12
NONCE_SIZE = 32
TAG_SIZE = 32

#: Largest metadata blob that can be pushed or fetched.
MAX_METADATA = 64 << 20
#: Largest FETCH label, in UTF-8 bytes.
MAX_LABEL = 4096
#: Largest agent name in an INVALIDATE, in UTF-8 bytes.
MAX_NAME = 4096
#: Largest ACK / ERROR text, in UTF-8 bytes (longer reasons are clipped by clip_utf8).
MAX_REASON = 4096

FLAG_TAGGED = 0x01
FLAG_TOKEN = 0x02
_KNOWN_FLAGS = FLAG_TAGGED | FLAG_TOKEN

#: The sender bytes in the tag.
CLIENT = b"C"
SERVER = b"S"

_TAG_DOMAIN = b"freight-nixl-side-channel/1\0"


class WireError(ValueError):
    """Bytes that are not a valid side-channel frame, or a value that cannot be framed."""


class AuthenticationError(WireError):
    """A frame whose tag is missing, wrong, or present where no token exists to check it."""


class Kind(enum.IntEnum):
    HELLO = 1
    PUSH = 2
    FETCH = 3
    FETCH_REPLY = 4
    INVALIDATE = 5
    ACK = 6
    ERROR = 7


REQUEST_KINDS = frozenset({Kind.PUSH, Kind.FETCH, Kind.INVALIDATE})
REPLY_KINDS = frozenset({Kind.ACK, Kind.FETCH_REPLY, Kind.ERROR})

_LIMITS = {
    Kind.HELLO: NONCE_SIZE,
    Kind.PUSH: MAX_METADATA,
    Kind.FETCH: MAX_LABEL,
    Kind.FETCH_REPLY: MAX_METADATA + 1,
    Kind.INVALIDATE: MAX_NAME,
    Kind.ACK: MAX_REASON,
    Kind.ERROR: MAX_REASON,
}

_FOUND = 0x01
_NONE = 0x00

#: What a frame's value is: the nonce or blob (bytes), a label (str or None), a name or
#: reason (str), or a fetch reply (bytes or None).
Value = Union[bytes, str, None]


def body_limit(kind: Kind) -> int:
    """The most body bytes a frame of ``kind`` may declare."""
    return _LIMITS[kind]


def normalize_token(token: Union[bytes, bytearray, memoryview, str, None]) -> Optional[bytes]:
    """``token`` as bytes (a str is encoded as UTF-8), or None. An empty token is refused:
    an HMAC keyed with nothing would authenticate anyone."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode("utf-8")
    elif isinstance(token, (bytes, bytearray, memoryview)):
        token = bytes(token)
    else:
        raise TypeError(f"token must be bytes, str or None, not {type(token).__name__}")
    if not token:
        raise ValueError("token must not be empty (pass None for no token)")
    return token


def clip_utf8(text: str, limit: int = MAX_REASON) -> str:
    """``text`` shortened so that its UTF-8 encoding fits in ``limit`` bytes. It is cut
    on a character boundary, and ``"..."`` marks the cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: max(0, limit - 3)].decode("utf-8", "ignore") + "..."


def _utf8(body: bytes, what: str) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _text_bytes(value: object, kind: Kind, what: str) -> bytes:
    if not isinstance(value, str):
        raise WireError(f"{kind.name} needs a str {what}, not {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise WireError(f"{kind.name} {what} cannot be encoded as UTF-8: {e.reason}") from None


def _blob_bytes(value: object, kind: Kind) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise WireError(f"{kind.name} needs a bytes metadata blob, not {type(value).__name__}")
    blob = bytes(value)
    if not blob:
        raise WireError(f"{kind.name} needs a metadata blob that is not empty")
    return blob


def encode_body(kind: Kind, value: Value = None) -> bytes:
    """The body of a ``kind`` frame carrying ``value``. Raises WireError for a value of the
    wrong type, an empty blob or name, or a body over the kind's limit."""
    kind = Kind(kind)
    if kind is Kind.HELLO:
        if not isinstance(value, (bytes, bytearray)) or len(value) != NONCE_SIZE:
            raise WireError(f"HELLO needs a nonce of exactly {NONCE_SIZE} bytes")
        body = bytes(value)
    elif kind is Kind.PUSH:
        body = _blob_bytes(value, kind)
    elif kind is Kind.FETCH:
        body = b"" if value is None else _text_bytes(value, kind, "label")
    elif kind is Kind.FETCH_REPLY:
        body = bytes([_NONE]) if value is None else bytes([_FOUND]) + _blob_bytes(value, kind)
    elif kind is Kind.INVALIDATE:
        body = _text_bytes(value, kind, "agent name")
        if not body:
            raise WireError("INVALIDATE needs an agent name that is not empty")
    else:  # ACK, ERROR
        body = _text_bytes("" if value is None else value, kind, "text")
    if len(body) > _LIMITS[kind]:
        raise WireError(f"{kind.name} body of {len(body)} bytes exceeds its limit of {_LIMITS[kind]} bytes")
    return body


def decode_body(kind: Kind, body: bytes) -> Value:
    """The value a ``kind`` frame's ``body`` carries (the inverse of :func:`encode_body`).
    Raises WireError for a body that is not valid for its kind."""
    kind = Kind(kind)
    if len(body) > _LIMITS[kind]:
        raise WireError(f"{kind.name} body of {len(body)} bytes exceeds its limit of {_LIMITS[kind]} bytes")
    if kind is Kind.HELLO:
        if len(body) != NONCE_SIZE:
            raise WireError(f"HELLO carries a nonce of {len(body)} bytes, not {NONCE_SIZE}")
        return bytes(body)
    if kind is Kind.PUSH:
        if not body:
            raise WireError("PUSH carries no metadata")
        return bytes(body)
    if kind is Kind.FETCH:
        return _utf8(body, "FETCH label") if body else None
    if kind is Kind.FETCH_REPLY:
        if not body:
            raise WireError("FETCH_REPLY has an empty body")
        if body[0] == _NONE:
            if len(body) != 1:
                raise WireError("FETCH_REPLY 'no metadata' carries trailing bytes")
            return None
        if body[0] != _FOUND:
            raise WireError(f"FETCH_REPLY has an unknown status byte 0x{body[0]:02x}")
        if len(body) == 1:
            raise WireError("FETCH_REPLY carries an empty metadata blob")
        return bytes(body[1:])
    if kind is Kind.INVALIDATE:
        if not body:
            raise WireError("INVALIDATE carries no agent name")
        return _utf8(body, "INVALIDATE agent name")
    return _utf8(body, f"{kind.name} text")


def encode_frame(kind: Kind, body: bytes, *, tag: Optional[bytes] = None, token_flag: bool = False) -> bytes:
    """A complete frame: the header, the tag if given, and ``body`` (already encoded).
    ``token_flag`` sets TOKEN, which only a HELLO may carry."""
    kind = Kind(kind)
    if len(body) > _LIMITS[kind]:
        raise WireError(f"{kind.name} body of {len(body)} bytes exceeds its limit of {_LIMITS[kind]} bytes")
    flags = 0
    if tag is not None:
        if len(tag) != TAG_SIZE:
            raise WireError(f"a tag is {TAG_SIZE} bytes, not {len(tag)}")
        flags |= FLAG_TAGGED
    if token_flag:
        if kind is not Kind.HELLO:
            raise WireError("only a HELLO carries the TOKEN flag")
        flags |= FLAG_TOKEN
    header = _HEADER.pack(MAGIC, VERSION, int(kind), flags, 0, len(body))
    return b"".join((header, tag or b"", body))


def encode(kind: Kind, value: Value = None, *, tag: Optional[bytes] = None, token_flag: bool = False) -> bytes:
    """``encode_frame(kind, encode_body(kind, value), ...)``: a frame that carries ``value``."""
    return encode_frame(kind, encode_body(kind, value), tag=tag, token_flag=token_flag)


@dataclass(frozen=True)
class Frame:
    """One decoded frame.

    ``value`` is what the body carries (see :func:`decode_body`). ``body`` is the raw
    body, which the tag covers. ``tag`` is the 32-byte tag, or None when the frame is
    untagged. ``token_flag`` is the TOKEN flag of a HELLO.
    """

    kind: Kind
    body: bytes
    value: Value = None
    tag: Optional[bytes] = None
    token_flag: bool = False


class Decoder:
    """Turns a byte stream into frames, fed as many bytes at a time as arrive.

    ``feed(data)`` returns the frames that ``data`` completes, which may be none. Bytes
    that are not a frame raise :class:`WireError`. The checks run as early as possible:
    the magic on its first byte, and the header (version, kind, flags, declared length
    against the kind's limit) as soon as its 12 bytes are in. After an error the decoder
    is broken and every later ``feed`` raises again. ``eof()`` says that the stream has
    ended; it raises WireError if a frame was cut short.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need: Optional[int] = None  # total size of the frame whose header is parsed
        self._header: Optional[tuple] = None
        self._broken: Optional[str] = None

    @property
    def buffered(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buf)

    def _fail(self, message: str) -> "WireError":
        self._broken = message
        self._buf.clear()
        return WireError(message)

    def feed(self, data: bytes) -> List[Frame]:
        if self._broken is not None:
            raise WireError(f"decoder already failed: {self._broken}")
        self._buf += data
        frames: List[Frame] = []
        while True:
            if self._need is None:
                head = bytes(self._buf[: len(MAGIC)])
                if not MAGIC.startswith(head):
                    raise self._fail(f"bad magic {head!r} (not a freight NIXL side-channel frame)")
                if len(self._buf) < HEADER_SIZE:
                    return frames
                self._parse_header()
            assert self._need is not None and self._header is not None
            if len(self._buf) < self._need:
                return frames
            kind, flags, length = self._header
            tagged = bool(flags & FLAG_TAGGED)
            start = HEADER_SIZE + (TAG_SIZE if tagged else 0)
            tag = bytes(self._buf[HEADER_SIZE:start]) if tagged else None
            body = bytes(self._buf[start:self._need])
            del self._buf[: self._need]
            self._need = self._header = None
            try:
                value = decode_body(kind, body)
            except WireError as e:
                raise self._fail(str(e)) from None
            frames.append(Frame(kind, body, value, tag, bool(flags & FLAG_TOKEN)))

    def _parse_header(self) -> None:
        _magic, version, kind_byte, flags, reserved, length = _HEADER.unpack_from(self._buf)
        if version != VERSION:
            raise self._fail(f"unsupported protocol version {version} (this side speaks {VERSION})")
        try:
            kind = Kind(kind_byte)
        except ValueError:
            raise self._fail(f"unknown frame kind {kind_byte}") from None
        if flags & ~_KNOWN_FLAGS:
            raise self._fail(f"unknown flags 0x{flags:02x} on {kind.name}")
        if flags & FLAG_TOKEN and kind is not Kind.HELLO:
            raise self._fail(f"the TOKEN flag on {kind.name} (only a HELLO carries it)")
        if reserved != 0:
            raise self._fail(f"reserved header byte is {reserved}, not 0")
        if length > _LIMITS[kind]:
            raise self._fail(
                f"{kind.name} declares a body of {length} bytes, over its limit of {_LIMITS[kind]} bytes")
        self._header = (kind, flags, length)
        self._need = HEADER_SIZE + (TAG_SIZE if flags & FLAG_TAGGED else 0) + length

    def eof(self) -> None:
        """The stream ended. Raises WireError if part of a frame is buffered."""
        if self._broken is None and self._buf:
            what = f"{self._need} bytes of a frame" if self._need is not None else "a 12-byte header"
            raise self._fail(f"truncated frame: the stream ended after {len(self._buf)} bytes of {what}")


@dataclass(frozen=True)
class Handshake:
    """The shared state of one connection after the HELLOs: the token (or None) and both
    nonces. It tags outgoing frames and checks the tags of incoming ones."""

    token: Optional[bytes]
    server_nonce: bytes
    client_nonce: bytes

    def __post_init__(self) -> None:
        if len(self.server_nonce) != NONCE_SIZE or len(self.client_nonce) != NONCE_SIZE:
            raise WireError(f"nonces are {NONCE_SIZE} bytes")

    def tag(self, sender: bytes, kind: Kind, body: bytes) -> bytes:
        """The tag of a frame that ``sender`` (CLIENT or SERVER) sends. Needs a token."""
        if self.token is None:
            raise WireError("no token to tag with")
        if sender not in (CLIENT, SERVER):
            raise ValueError("sender must be CLIENT or SERVER")
        mac = hmac.new(self.token, digestmod=hashlib.sha256)
        for part in (_TAG_DOMAIN, sender, self.server_nonce, self.client_nonce, bytes([int(kind)]), body):
            mac.update(part)
        return mac.digest()

    def seal(self, sender: bytes, kind: Kind, value: Value = None) -> bytes:
        """The encoded frame that carries ``value``, tagged when there is a token."""
        body = encode_body(kind, value)
        tag = self.tag(sender, kind, body) if self.token is not None else None
        return encode_frame(kind, body, tag=tag)

    def verify(self, sender: bytes, frame: Frame) -> None:
        """Checks ``frame``, which ``sender`` sent, against the authentication rule.

        With a token, the frame must carry the right tag. Without one, it must carry
        no tag, since a tag shows that the two sides disagree about the token. Raises
        :class:`AuthenticationError` with a reason that starts with
        ``"authentication failed"``.
        """
        if self.token is None:
            if frame.tag is not None:
                raise AuthenticationError(
                    "authentication failed: the frame is signed with a token but this side has none "
                    "(set the same FREIGHT_TOKEN on both agents, or on neither)")
            return
        if frame.tag is None:
            raise AuthenticationError(
                "authentication failed: the frame is not signed (the other side has no token)")
        if not hmac.compare_digest(frame.tag, self.tag(sender, frame.kind, frame.body)):
            raise AuthenticationError("authentication failed: bad signature (a different token?)")
