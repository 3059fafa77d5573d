"""freight.nixl's side channel: the frames (_wire, without I/O) and the listener and
client (_side_channel) over real loopback sockets, including hostile clients."""

from __future__ import annotations

import errno
import importlib
import importlib.util
import logging
import os
import socket
import struct
import sys
import threading
import time
import types

import pytest


def _load():
    """freight.nixl's two modules. If the package cannot be imported (its __init__ is
    missing or broken while it is being written), they are loaded from their files."""
    try:
        return (importlib.import_module("freight.nixl._wire"),
                importlib.import_module("freight.nixl._side_channel"))
    except Exception:
        here = os.path.join(os.path.dirname(__file__), "..", "python", "freight", "nixl")
        pkg = types.ModuleType("_freight_nixl_sc_test")
        pkg.__path__ = [os.path.abspath(here)]
        sys.modules[pkg.__name__] = pkg
        return (importlib.import_module(pkg.__name__ + "._wire"),
                importlib.import_module(pkg.__name__ + "._side_channel"))


wire, sc = _load()
Kind = wire.Kind
WireError = wire.WireError

TOKEN = b"s3cret-token"
NONCE_A = bytes(range(32))
NONCE_B = bytes(range(32, 64))


# --------------------------------------------------------------------------- _wire


def header(kind, length, *, magic=b"FNXS", version=1, flags=0, reserved=0):
    return struct.pack(">4sBBBBI", magic, version, kind, flags, reserved, length)


@pytest.mark.parametrize("kind,value", [
    (Kind.HELLO, NONCE_A),
    (Kind.PUSH, b"\x00metadata\xff" * 10),
    (Kind.FETCH, None),
    (Kind.FETCH, "label/é"),
    (Kind.FETCH_REPLY, b"blob"),
    (Kind.FETCH_REPLY, None),
    (Kind.INVALIDATE, "agent-7"),
    (Kind.ACK, ""),
    (Kind.ERROR, "no such agent ✗"),
])
def test_frame_round_trip(kind, value):
    raw = wire.encode(kind, value)
    assert raw[:4] == wire.MAGIC and raw[4] == wire.VERSION and raw[5] == kind
    (frame,) = wire.Decoder().feed(raw)
    assert frame.kind is kind and frame.value == value and frame.tag is None and not frame.token_flag
    assert wire.decode_body(kind, wire.encode_body(kind, value)) == value
    tag = bytes(range(100, 132))
    (frame,) = wire.Decoder().feed(wire.encode(kind, value, tag=tag, token_flag=kind is Kind.HELLO))
    assert frame.value == value and frame.tag == tag and frame.token_flag == (kind is Kind.HELLO)


def test_decoder_fed_one_byte_at_a_time():
    frames = [wire.encode(Kind.HELLO, NONCE_A, token_flag=True),
              wire.encode(Kind.PUSH, b"x" * 300, tag=b"t" * 32),
              wire.encode(Kind.FETCH, "lbl"),
              wire.encode(Kind.ERROR, "")]
    stream = b"".join(frames)
    dec = wire.Decoder()
    got = []
    for i in range(len(stream)):
        got += dec.feed(stream[i:i + 1])
    dec.eof()
    assert [f.kind for f in got] == [Kind.HELLO, Kind.PUSH, Kind.FETCH, Kind.ERROR]
    assert got[1].value == b"x" * 300 and got[1].tag == b"t" * 32 and got[2].value == "lbl"
    assert dec.buffered == 0
    # All at once, and split at odd places, give the same frames.
    assert [f.value for f in wire.Decoder().feed(stream)] == [f.value for f in got]
    dec = wire.Decoder()
    assert dec.feed(stream[:13]) == [] and len(dec.feed(stream[13:])) == 4


@pytest.mark.parametrize("raw,match", [
    (b"X", "bad magic"),
    (b"FNXQ", "bad magic"),
    (b"GET / HTTP/1.1\r\n\r\n", "bad magic"),
    (header(2, 4, version=2) + b"abcd", "unsupported protocol version 2"),
    (header(2, 4, version=0), "unsupported protocol version 0"),
    (header(0, 0), "unknown frame kind 0"),
    (header(99, 0), "unknown frame kind 99"),
    (header(2, 4, flags=0x80), "unknown flags"),
    (header(2, 4, flags=wire.FLAG_TOKEN), "TOKEN flag"),
    (header(2, 4, reserved=1), "reserved"),
    (header(1, 31) + b"n" * 31, "nonce of 31 bytes"),
    (header(2, 0), "PUSH carries no metadata"),
    (header(5, 0), "INVALIDATE carries no agent name"),
    (header(3, 2) + b"\xff\xfe", "not valid UTF-8"),
    (header(5, 3) + b"a\xc3(", "not valid UTF-8"),
    (header(7, 1) + b"\x80", "not valid UTF-8"),
    (header(4, 0), "FETCH_REPLY has an empty body"),
    (header(4, 2) + b"\x00x", "trailing"),
    (header(4, 2) + b"\x07x", "unknown status"),
    (header(4, 1) + b"\x01", "empty metadata"),
])
def test_decoder_rejects(raw, match):
    dec = wire.Decoder()
    with pytest.raises(WireError, match=match):
        dec.feed(raw)
    with pytest.raises(WireError, match="already failed"):  # a failed decoder stays failed
        dec.feed(wire.encode(Kind.ACK, ""))


def test_bad_magic_is_refused_on_its_first_byte():
    with pytest.raises(WireError, match="bad magic"):
        wire.Decoder().feed(b"\x16")  # a TLS ClientHello, say
    dec = wire.Decoder()
    assert dec.feed(b"FN") == []
    with pytest.raises(WireError, match="bad magic"):
        dec.feed(b"Z")


@pytest.mark.parametrize("kind,length", [
    (Kind.PUSH, 0xFFFFFFFF),  # 4 GiB
    (Kind.PUSH, wire.MAX_METADATA + 1),
    (Kind.FETCH_REPLY, wire.MAX_METADATA + 2),
    (Kind.FETCH, wire.MAX_LABEL + 1),
    (Kind.INVALIDATE, wire.MAX_NAME + 1),
    (Kind.ERROR, wire.MAX_REASON + 1),
    (Kind.HELLO, 33),
])
def test_oversize_length_refused_from_the_header_alone(kind, length):
    dec = wire.Decoder()
    # Refused on the header's 12 bytes: nothing of the declared size is awaited or kept.
    with pytest.raises(WireError, match="over its limit"):
        dec.feed(header(kind, length))
    assert dec.buffered == 0


def test_limits_themselves_are_accepted():
    assert wire.body_limit(Kind.PUSH) == wire.MAX_METADATA == 64 << 20
    dec = wire.Decoder()
    assert dec.feed(header(Kind.PUSH, wire.MAX_METADATA)) == []  # declared, now awaited
    (f,) = wire.Decoder().feed(wire.encode(Kind.FETCH, "l" * wire.MAX_LABEL))
    assert len(f.value) == wire.MAX_LABEL


def test_truncated_frames():
    raw = wire.encode(Kind.PUSH, b"abcdef", tag=b"T" * 32)
    for cut in (1, 5, 11, 12, 30, 44, len(raw) - 1):
        dec = wire.Decoder()
        assert dec.feed(raw[:cut]) == []
        with pytest.raises(WireError, match="truncated"):
            dec.eof()
    dec = wire.Decoder()
    dec.feed(raw)
    dec.eof()  # at a frame boundary: fine
    wire.Decoder().eof()


def test_encode_refuses_bad_values():
    with pytest.raises(WireError):
        wire.encode(Kind.PUSH, b"")
    with pytest.raises(WireError):
        wire.encode(Kind.PUSH, "not bytes")
    with pytest.raises(WireError):
        wire.encode(Kind.INVALIDATE, "")
    with pytest.raises(WireError):
        wire.encode(Kind.HELLO, b"short")
    with pytest.raises(WireError, match="limit"):
        wire.encode(Kind.FETCH, "x" * (wire.MAX_LABEL + 1))
    with pytest.raises(WireError, match="limit"):
        wire.encode(Kind.FETCH_REPLY, b"x" * wire.MAX_METADATA + b"y")
    with pytest.raises(WireError):
        wire.encode(Kind.INVALIDATE, "\ud800")  # a lone surrogate is not UTF-8
    with pytest.raises(WireError):
        wire.encode(Kind.ACK, "", token_flag=True)
    with pytest.raises(WireError):
        wire.encode_frame(Kind.ACK, b"", tag=b"short")
    assert issubclass(WireError, ValueError) and issubclass(wire.AuthenticationError, WireError)


def test_handshake_tags():
    hs = wire.Handshake(TOKEN, NONCE_A, NONCE_B)
    (req,) = wire.Decoder().feed(hs.seal(wire.CLIENT, Kind.PUSH, b"blob"))
    hs.verify(wire.CLIENT, req)
    assert len(req.tag) == 32

    def refused(handshake, sender, frame, match="authentication failed"):
        with pytest.raises(wire.AuthenticationError, match=match):
            handshake.verify(sender, frame)

    refused(wire.Handshake(b"other", NONCE_A, NONCE_B), wire.CLIENT, req, "bad signature")  # wrong token
    refused(wire.Handshake(TOKEN, NONCE_B, NONCE_A), wire.CLIENT, req)  # other nonces: a replay
    refused(hs, wire.SERVER, req)  # reflected in the other direction
    tampered = wire.Frame(req.kind, b"evil", b"evil", req.tag)
    refused(hs, wire.CLIENT, tampered)
    other_kind = wire.Frame(Kind.INVALIDATE, req.body, "blob", req.tag)
    refused(hs, wire.CLIENT, other_kind)
    (plain,) = wire.Decoder().feed(wire.encode(Kind.PUSH, b"blob"))
    refused(hs, wire.CLIENT, plain, "not signed")
    # No token: untagged frames pass, tagged ones show a token mismatch.
    none = wire.Handshake(None, NONCE_A, NONCE_B)
    none.verify(wire.CLIENT, plain)
    refused(none, wire.CLIENT, req, "this side has none")
    assert wire.decode_body(Kind.PUSH, req.body) == b"blob"
    assert wire.Decoder().feed(none.seal(wire.SERVER, Kind.ACK, ""))[0].tag is None


def test_token_and_clip_helpers():
    assert wire.normalize_token(None) is None
    assert wire.normalize_token("abc") == b"abc" == wire.normalize_token(bytearray(b"abc"))
    with pytest.raises(ValueError):
        wire.normalize_token(b"")
    with pytest.raises(TypeError):
        wire.normalize_token(12)
    assert wire.clip_utf8("short") == "short"
    clipped = wire.clip_utf8("é" * 5000)
    assert len(clipped.encode()) <= wire.MAX_REASON and clipped.endswith("...")


# --------------------------------------------------------------------------- listener fixtures


class Agent:
    """Callbacks that record what reached them."""

    def __init__(self, blob=b"META" * 100):
        self.blob = blob
        self.pushed = []
        self.fetched = []
        self.invalidated = []
        self.fail = None

    def on_push(self, blob):
        if self.fail:
            raise self.fail
        self.pushed.append(blob)

    def on_fetch(self, label):
        if self.fail:
            raise self.fail
        self.fetched.append(label)
        return self.blob

    def on_invalidate(self, name):
        if self.fail:
            raise self.fail
        self.invalidated.append(name)

    @property
    def calls(self):
        return len(self.pushed) + len(self.fetched) + len(self.invalidated)


@pytest.fixture
def make_listener():
    made = []

    def make(token=None, agent=None, timeout=0.5, **kw):
        agent = agent or Agent()
        lst = sc.Listener(0, host="127.0.0.1", token=token, on_push=agent.on_push, on_fetch=agent.on_fetch,
                          on_invalidate=agent.on_invalidate, timeout=timeout, **kw)
        made.append(lst)
        return lst, agent

    yield make
    for lst in made:
        lst.close()


def raw_client(port, timeout=3.0):
    """A bare socket to the listener, past its HELLO (returned)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    dec = wire.Decoder()
    frames = []
    while not frames:
        data = s.recv(4096)
        assert data, "listener closed before its HELLO"
        frames = dec.feed(data)
    assert frames[0].kind is Kind.HELLO
    return s, frames[0]


def read_until_closed(s, timeout=3.0):
    """Frames the listener sends until it closes, and the seconds that took."""
    s.settimeout(timeout)
    dec = wire.Decoder()
    frames = []
    t0 = time.monotonic()
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        frames += dec.feed(data)
    return frames, time.monotonic() - t0


def assert_serving(lst, agent, token=None):
    assert sc.fetch("127.0.0.1", lst.port, token=token, timeout=2.0) == agent.blob


# --------------------------------------------------------------------------- listener end to end


def test_push_fetch_invalidate_reach_the_callbacks(make_listener):
    lst, agent = make_listener()
    assert lst.port > 0 and not lst.closed
    sc.push("127.0.0.1", lst.port, b"their metadata")
    assert agent.pushed == [b"their metadata"]
    assert sc.fetch("127.0.0.1", lst.port) == agent.blob
    assert sc.fetch("127.0.0.1", lst.port, "prefill-0") == agent.blob
    assert agent.fetched == [None, "prefill-0"]
    sc.invalidate("127.0.0.1", lst.port, "agent-b")
    assert agent.invalidated == ["agent-b"]
    big = os.urandom(8 << 20)
    sc.push("127.0.0.1", lst.port, big)
    assert agent.pushed[-1] == big


def test_fetch_without_metadata_is_not_found(make_listener):
    lst, agent = make_listener()
    agent.blob = None
    with pytest.raises(sc.SideChannelNotFound, match="no metadata for label 'x'") as e:
        sc.fetch("127.0.0.1", lst.port, "x")
    assert isinstance(e.value, sc.SideChannelRefused) and e.value.peer == f"127.0.0.1:{lst.port}"


def test_right_token_works(make_listener):
    lst, agent = make_listener(token=TOKEN)
    sc.push("127.0.0.1", lst.port, b"m", token=TOKEN)
    assert sc.fetch("127.0.0.1", lst.port, "l", token=TOKEN.decode()) == agent.blob  # str tokens too
    sc.invalidate("127.0.0.1", lst.port, "a", token=TOKEN)
    assert (agent.pushed, agent.fetched, agent.invalidated) == ([b"m"], ["l"], ["a"])


@pytest.mark.parametrize("client_token", [b"wrong-token", None])
def test_wrong_or_missing_token_is_refused(make_listener, client_token):
    lst, agent = make_listener(token=TOKEN)
    for call in (lambda: sc.push("127.0.0.1", lst.port, b"fake", token=client_token),
                 lambda: sc.fetch("127.0.0.1", lst.port, token=client_token),
                 lambda: sc.invalidate("127.0.0.1", lst.port, "victim", token=client_token)):
        with pytest.raises(sc.SideChannelRefused, match="authentication failed"):
            call()
    assert agent.calls == 0
    assert_serving(lst, agent, TOKEN)


def test_token_on_the_client_only_is_refused(make_listener):
    lst, agent = make_listener(token=None)
    with pytest.raises(sc.SideChannelRefused, match="listener has no token"):
        sc.push("127.0.0.1", lst.port, b"secret", token=TOKEN)
    assert agent.calls == 0


def client_hello(token, server_nonce, nonce=NONCE_B):
    hs = wire.Handshake(token, server_nonce, nonce)
    tag = hs.tag(wire.CLIENT, Kind.HELLO, nonce) if token else None
    return hs, wire.encode(Kind.HELLO, nonce, tag=tag, token_flag=token is not None)


def test_listener_enforces_the_token_against_raw_clients(make_listener):
    lst, agent = make_listener(token=TOKEN)
    # An untagged request, as a client that ignores the TOKEN flag would send.
    s, hello = raw_client(lst.port)
    assert hello.token_flag
    _, h = client_hello(None, hello.value)
    s.sendall(h + wire.encode(Kind.PUSH, b"fake metadata"))
    frames, _ = read_until_closed(s)
    assert [f.kind for f in frames] == [Kind.ERROR] and "authentication failed" in frames[0].value
    s.close()
    # A HELLO tagged with another token.
    s, hello = raw_client(lst.port)
    hs, h = client_hello(b"guess", hello.value)
    s.sendall(h + hs.seal(wire.CLIENT, Kind.INVALIDATE, "victim"))
    frames, _ = read_until_closed(s)
    assert frames[0].kind is Kind.ERROR and "authentication failed" in frames[0].value
    s.close()
    # A HELLO replayed from another connection: its tag covers the old server nonce.
    s, hello = raw_client(lst.port)
    _, h = client_hello(TOKEN, NONCE_A)
    s.sendall(h)
    frames, _ = read_until_closed(s)
    assert frames[0].kind is Kind.ERROR and "authentication failed" in frames[0].value
    s.close()
    # A good HELLO, then a request whose tag does not match its body.
    s, hello = raw_client(lst.port)
    hs, h = client_hello(TOKEN, hello.value)
    good = hs.seal(wire.CLIENT, Kind.PUSH, b"real")
    forged = good[:-4] + b"fake"
    s.sendall(h + forged)
    frames, _ = read_until_closed(s)
    assert frames[0].kind is Kind.ERROR and "bad signature" in frames[0].value
    s.close()
    assert agent.calls == 0
    # A tagged HELLO at a listener without a token.
    lst2, agent2 = make_listener(token=None)
    s, hello = raw_client(lst2.port)
    assert not hello.token_flag
    hs, h = client_hello(TOKEN, hello.value)
    s.sendall(h + hs.seal(wire.CLIENT, Kind.FETCH, None))
    frames, _ = read_until_closed(s)
    assert frames[0].kind is Kind.ERROR and "this side has none" in frames[0].value
    s.close()
    assert agent2.calls == 0
    assert_serving(lst, agent, TOKEN)


def fake_listener(behave):
    """A one-shot TCP server whose connection handler is behave(conn)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def run():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            try:
                behave(conn)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()
    return srv


def test_client_rejects_forged_and_malformed_replies():
    def forged_ack(conn):
        conn.sendall(wire.encode(Kind.HELLO, NONCE_A, token_flag=True))
        conn.recv(65536)
        conn.sendall(wire.encode(Kind.ACK, "", tag=b"\x00" * 32))  # no token: cannot tag it right

    srv = fake_listener(forged_ack)
    with pytest.raises(sc.SideChannelProtocolError, match="failed authentication"):
        sc.push("127.0.0.1", srv.getsockname()[1], b"m", token=TOKEN, timeout=2.0)
    srv.close()

    def untagged_reply(conn):
        conn.sendall(wire.encode(Kind.HELLO, NONCE_A, token_flag=True))
        conn.recv(65536)
        conn.sendall(wire.encode(Kind.FETCH_REPLY, b"attacker metadata"))

    srv = fake_listener(untagged_reply)
    with pytest.raises(sc.SideChannelProtocolError, match="failed authentication"):
        sc.fetch("127.0.0.1", srv.getsockname()[1], token=TOKEN, timeout=2.0)
    srv.close()

    srv = fake_listener(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"))
    port = srv.getsockname()[1]
    with pytest.raises(sc.SideChannelProtocolError, match=f"127.0.0.1:{port}.*bad magic"):
        sc.fetch("127.0.0.1", port, timeout=2.0)
    srv.close()

    srv = fake_listener(lambda conn: None)  # accepts, then closes at once
    with pytest.raises(ConnectionError, match="closed before its HELLO"):
        sc.fetch("127.0.0.1", srv.getsockname()[1], timeout=2.0)
    srv.close()


def test_silent_client_does_not_block_others_and_is_timed_out(make_listener):
    lst, agent = make_listener(timeout=0.5)
    silent, _ = raw_client(lst.port)
    t0 = time.monotonic()
    assert_serving(lst, agent)  # at once, while the silent one is connected
    assert time.monotonic() - t0 < 0.4
    frames, waited = read_until_closed(silent)
    assert frames == [] and waited < 2.0  # closed by the listener after its 0.5 s
    silent.close()
    # One that trickles a byte now and then is held to the same deadline.
    slow, hello = raw_client(lst.port)
    _, h = client_hello(None, hello.value)
    t0 = time.monotonic()
    closed = False
    for b in h:
        try:
            slow.sendall(bytes([b]))
        except OSError:
            closed = True
            break
        time.sleep(0.05)
        if time.monotonic() - t0 > 1.5:
            break
    if not closed:
        frames, _ = read_until_closed(slow)
    assert time.monotonic() - t0 < 2.0
    slow.close()
    assert_serving(lst, agent)


def test_garbage_is_logged_and_the_connection_closed(make_listener, caplog):
    lst, agent = make_listener()
    caplog.set_level(logging.WARNING, logger="freight.nixl")
    s, _ = raw_client(lst.port)
    local = "%s:%d" % s.getsockname()
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    frames, waited = read_until_closed(s)
    s.close()
    assert [f.kind for f in frames] == [Kind.ERROR] and "protocol error" in frames[0].value
    assert waited < 1.0
    assert any(local in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    # Garbage before even reading the HELLO, and random bytes.
    for junk in (os.urandom(5000), b"\x00" * 100):
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=3)
        s.sendall(junk)
        read_until_closed(s)
        s.close()
    assert_serving(lst, agent)


def test_declared_4gib_body_is_refused_at_once(make_listener):
    lst, agent = make_listener(timeout=5.0)
    s, hello = raw_client(lst.port)
    _, h = client_hello(None, hello.value)
    s.sendall(h + header(Kind.PUSH, 0xFFFFFFFF) + b"x" * 1000)
    frames, waited = read_until_closed(s)
    s.close()
    assert frames[0].kind is Kind.ERROR and "over its limit" in frames[0].value
    assert waited < 2.0  # refused on the header, not after the 5 s timeout
    assert agent.calls == 0
    assert_serving(lst, agent)


def test_client_disconnecting_mid_frame(make_listener, caplog):
    lst, agent = make_listener()
    caplog.set_level(logging.WARNING, logger="freight.nixl")
    for cut in (3, 20, 60):
        s, hello = raw_client(lst.port)
        _, h = client_hello(None, hello.value)
        s.sendall((h + wire.encode(Kind.PUSH, b"m" * 100))[:len(h) + cut])
        s.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and sum("truncated" in r.getMessage() for r in caplog.records) < 3:
        time.sleep(0.02)
    assert sum("truncated" in r.getMessage() for r in caplog.records) == 3
    assert agent.calls == 0
    assert_serving(lst, agent)


def test_hundred_connections_at_once(make_listener):
    lst, agent = make_listener(timeout=5.0)
    socks = []
    for i in range(100):
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=3)
        if i % 3 == 0:
            s.sendall(b"junk" * 10)
        elif i % 3 == 1:
            s.sendall(wire.encode(Kind.HELLO, NONCE_B))  # a HELLO, then nothing
        socks.append(s)
    for s in socks:
        s.close()
    # The listener is serving again once those connections have ended.
    deadline = time.monotonic() + 3
    while True:
        try:
            assert_serving(lst, agent)
            break
        except sc.SideChannelRefused as e:
            assert "busy" in str(e) and time.monotonic() < deadline
            time.sleep(0.05)


def test_over_max_connections_is_busy(make_listener):
    lst, agent = make_listener(timeout=5.0, max_connections=2)
    held = [raw_client(lst.port)[0] for _ in range(2)]
    with pytest.raises(sc.SideChannelRefused, match="busy"):
        sc.fetch("127.0.0.1", lst.port, timeout=2.0)
    for s in held:
        s.close()
    deadline = time.monotonic() + 3
    while True:
        try:
            return assert_serving(lst, agent)
        except sc.SideChannelRefused:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_callback_raising_refuses_with_its_message(make_listener):
    lst, agent = make_listener(token=TOKEN)
    agent.fail = ValueError("metadata of agent-x does not parse")
    with pytest.raises(sc.SideChannelRefused, match="metadata of agent-x does not parse") as e:
        sc.push("127.0.0.1", lst.port, b"m", token=TOKEN)
    assert e.value.reason == "metadata of agent-x does not parse"
    agent.fail = KeyError("agent-y")
    with pytest.raises(sc.SideChannelRefused, match="agent-y"):
        sc.invalidate("127.0.0.1", lst.port, "agent-y", token=TOKEN)
    agent.fail = RuntimeError()
    with pytest.raises(sc.SideChannelRefused, match="RuntimeError"):
        sc.fetch("127.0.0.1", lst.port, token=TOKEN)
    agent.fail = None
    agent.blob = "a str, not bytes"
    with pytest.raises(sc.SideChannelRefused, match="not bytes"):
        sc.fetch("127.0.0.1", lst.port, token=TOKEN)
    agent.blob = b"ok"
    assert_serving(lst, agent, TOKEN)


def test_close_while_a_client_is_connected_is_prompt(make_listener):
    lst, agent = make_listener(timeout=30.0)
    s, hello = raw_client(lst.port)
    s.sendall(client_hello(None, hello.value)[1] + header(Kind.PUSH, 1000) + b"x" * 10)  # mid-request
    idle, _ = raw_client(lst.port)
    t0 = time.monotonic()
    lst.close()
    assert time.monotonic() - t0 < 1.0
    assert lst.closed
    lst.close()  # idempotent
    for c in (s, idle):
        frames, waited = read_until_closed(c)
        assert waited < 1.0
        c.close()
    with pytest.raises(ConnectionError):
        sc.fetch("127.0.0.1", lst.port, timeout=1.0)
    with sc.Listener(0, host="127.0.0.1", on_push=agent.on_push, on_fetch=agent.on_fetch,
                     on_invalidate=agent.on_invalidate) as again:
        assert_serving(again, agent)
    assert again.closed


def test_port_already_in_use(make_listener):
    lst, agent = make_listener()
    with pytest.raises(OSError, match=f"port {lst.port} is already in use") as e:
        sc.Listener(lst.port, host="127.0.0.1", on_push=agent.on_push, on_fetch=agent.on_fetch,
                    on_invalidate=agent.on_invalidate)
    assert e.value.errno == errno.EADDRINUSE
    with pytest.raises(ValueError):
        sc.Listener(70000, on_push=agent.on_push, on_fetch=agent.on_fetch, on_invalidate=agent.on_invalidate)
    assert_serving(lst, agent)


def test_nothing_listening_is_a_quick_connection_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        sc.fetch("127.0.0.1", port, timeout=5.0)
    assert time.monotonic() - t0 < 1.0


def test_listener_that_never_answers_is_a_timeout():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)  # the kernel accepts; nobody ever sends a HELLO
    port = srv.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        sc.fetch("127.0.0.1", port, timeout=0.3)
    assert time.monotonic() - t0 < 1.0
    srv.close()


def test_client_argument_errors_come_before_any_io():
    with pytest.raises(WireError):
        sc.push("127.0.0.1", 9, b"")
    with pytest.raises(WireError):
        sc.push("127.0.0.1", 9, b"x" * (wire.MAX_METADATA + 1))
    with pytest.raises(WireError):
        sc.invalidate("127.0.0.1", 9, "")
    with pytest.raises(ValueError):
        sc.fetch("127.0.0.1", 0)
    with pytest.raises(ValueError):
        sc.fetch("127.0.0.1", 9, token=b"")


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    agent = Agent()
    try:
        lst = sc.Listener(0, host="::1", on_push=agent.on_push, on_fetch=agent.on_fetch,
                          on_invalidate=agent.on_invalidate)
    except OSError:
        pytest.skip("no IPv6 loopback")
    with lst:
        assert sc.fetch("::1", lst.port) == agent.blob
