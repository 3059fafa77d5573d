"""The KV cache server from Python: ``freight.kv.Server`` embedded in the test process,
``freight serve`` and ``freight kv-bench`` as real processes over real sockets, and
``freight.kv.Client`` against both.

Every wait is bounded: clients get short timeouts, subprocesses are read through a
thread with a deadline and killed at the end of each test, and every test has a
pytest timeout.
"""

from __future__ import annotations

import array
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import List, Optional

import numpy as np
import pytest

import freight
from conftest import free_port
from freight.kv import Client, Server

KIB, MIB = 1 << 10, 1 << 20
#: How long a test waits for a server to answer (clients' timeout).
CLIENT_TIMEOUT = 5.0


def pattern(n: int, seed: int = 0) -> bytes:
    """n deterministic bytes, different for every seed and offset."""
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97 + 13).astype(np.uint8).tobytes()


@pytest.fixture
def server():
    with Server("127.0.0.1:0", memory_size=64 * MIB) as s:
        yield s


@pytest.fixture
def client(server):
    with Client(server.url, buffer_size=4 * MIB, timeout=CLIENT_TIMEOUT) as c:
        yield c


# ------------------------------------------------------------------- embedded server


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 4 * KIB, MIB], ids=["1B", "4KiB", "1MiB"])
def test_put_get_exists_delete_and_stats_round_trip(server, client, size):
    value = pattern(size, seed=size)
    assert client.get("k") is None and client.exists("k") is False
    v1 = client.put("k", value)
    assert isinstance(v1, int) and v1 > 0
    assert client.get("k") == value
    assert client.get(b"k") == value, "str keys are their UTF-8 bytes"
    assert client.exists("k") is True and "k" in client
    # An overwrite gets a newer version and replaces the whole value.
    other = pattern(size, seed=size + 1)
    v2 = client.put(b"k", bytearray(other))
    assert v2 > v1
    assert client.get("k") == other

    stats = client.stats()
    assert stats["keys"] == 1 and stats["bytes"] == size and stats["clients"] == 1
    assert stats["capacity"] == 64 * MIB and stats["pool_used"] >= size
    assert stats["hits"] >= 3 and stats["misses"] >= 1
    local = server.stats()
    assert {k: local[k] for k in ("keys", "bytes", "capacity")} == {"keys": 1, "bytes": size, "capacity": 64 * MIB}

    assert client.delete("k") is True
    assert client.delete("k") is False
    assert client.get("k") is None and client.exists("k") is False
    assert server.stats()["keys"] == 0 and server.stats()["bytes"] == 0


@pytest.mark.timeout(60)
def test_numpy_arrays_and_buffers_go_in_as_their_bytes_and_come_out_with_get_into(client):
    arrays = {
        "f32": np.linspace(0, 1, 10_000, dtype=np.float32).reshape(100, 100),
        "i64": np.arange(-500, 500, dtype=np.int64),
        "u8": np.frombuffer(pattern(3 * MIB + 5), dtype=np.uint8),
        "scalar": np.array(3.5),
    }
    for key, a in arrays.items():
        client.put(key, a)
    for key, a in arrays.items():
        got = client.get(key)
        assert got == a.tobytes(), key
        out = np.zeros_like(a)
        assert client.get_into(key, out) == a.nbytes
        np.testing.assert_array_equal(out, a)
    # Other buffer exporters, and a larger destination (filled from its start).
    client.put("arr", array.array("d", [1.5, -2.0, 7.25]))
    dest = np.full(10, -1.0)
    assert client.get_into("arr", dest) == 24
    np.testing.assert_array_equal(dest, [1.5, -2.0, 7.25] + [-1.0] * 7)
    buf = bytearray(8000)
    assert client.get_into("i64", buf) == 8000 and bytes(buf) == arrays["i64"].tobytes()
    mv = memoryview(bytearray(8000))
    assert client.get_into("i64", mv) == 8000 and bytes(mv) == arrays["i64"].tobytes()
    # A missing key leaves the destination alone.
    untouched = np.full(4, 9, dtype=np.uint8)
    assert client.get_into("missing", untouched) is None
    assert (untouched == 9).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "server_transport,client_transport,direct",
    [("auto", "shm", True), ("auto", "tcp", True), ("auto", "tcp", False), ("tcp", "auto", True)],
)
def test_transports(server_transport, client_transport, direct):
    with Server(memory_size=16 * MIB, transport=server_transport) as s, Client(
        s.url, buffer_size=4 * MIB, timeout=CLIENT_TIMEOUT, transport=client_transport, direct=direct
    ) as c:
        # A server that reaches its client over tcp offers it a direct connection.
        over_tcp = "tcp" in (server_transport, client_transport)
        assert c.direct == (over_tcp and direct)
        value = pattern(3 * MIB + 1, seed=7)
        c.put("k", value)
        assert c.get("k") == value
        assert c.get_many(["k", "k"]) == [value, value]
        small = pattern(4096, seed=8)
        c.put("small", small)
        out = np.zeros(8192, dtype=np.uint8)
        assert c.get_into("small", out) == 4096 and out[:4096].tobytes() == small


@pytest.mark.timeout(60)
def test_get_into_a_too_small_buffer_names_both_sizes(client):
    client.put("big", pattern(5000))
    small = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(freight.InvalidArgumentError) as e:
        client.get_into("big", small)
    assert isinstance(e.value, ValueError)
    assert "5000" in str(e.value) and "4096" in str(e.value), str(e.value)
    assert not small.any(), "nothing is written into a destination too small for the value"
    # Bad destinations are refused before anything is asked of the server.
    with pytest.raises(freight.InvalidArgumentError, match="read-only"):
        client.get_into("big", b"\0" * 8192)
    ro = np.zeros(8192, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(freight.InvalidArgumentError, match="read-only"):
        client.get_into("big", ro)
    with pytest.raises(freight.InvalidArgumentError, match="contiguous"):
        client.get_into("big", np.zeros((100, 200), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError):
        client.get_into("big", 12)


@pytest.mark.timeout(60)
def test_a_value_larger_than_the_client_buffer_is_an_error_naming_both_sizes(server):
    with Client(server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as small, Client(
        server.url, buffer_size=4 * MIB, timeout=CLIENT_TIMEOUT
    ) as large:
        assert small.buffer_size == MIB
        too_big = pattern(2 * MIB)
        with pytest.raises(freight.InvalidArgumentError) as e:
            small.put("big", too_big)
        assert str(2 * MIB) in str(e.value) and str(MIB) in str(e.value), str(e.value)
        assert not small.exists("big")
        # Written by a client with room for it, read by one without.
        large.put("big", too_big)
        with pytest.raises(freight.InvalidArgumentError) as e:
            small.get("big")
        assert str(2 * MIB) in str(e.value) and str(MIB) in str(e.value), str(e.value)
        with pytest.raises(freight.InvalidArgumentError):
            small.get_into("big", np.zeros(4 * MIB, dtype=np.uint8))
        # The refusal broke nothing: both clients go on.
        assert large.get("big") == too_big
        small.put("fits", pattern(MIB))
        assert small.get("fits") == pattern(MIB)


@pytest.mark.timeout(60)
def test_a_full_pool_without_eviction_refuses_writes_with_out_of_memory():
    with Server(memory_size=MIB, evict=False) as s, Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        assert s.evict is False
        value = pattern(200 * KIB)
        stored = []
        with pytest.raises(freight.NoSpaceError) as e:
            for i in range(10):
                c.put(f"k{i}", value)
                stored.append(f"k{i}")
        assert "out of memory" in str(e.value), str(e.value)
        assert isinstance(e.value, MemoryError)
        assert 3 <= len(stored) < 10
        # Nothing was evicted: every value written before is still whole.
        for k in stored:
            assert c.get(k) == value, k
        assert s.stats()["evictions"] == 0 and s.stats()["keys"] == len(stored)
        # Deleting makes room again.
        assert c.delete(stored[0]) is True
        c.put("again", value)
        assert c.get("again") == value


@pytest.mark.timeout(60)
def test_a_full_pool_with_eviction_drops_the_least_recently_used_values():
    with Server(memory_size=MIB) as s, Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        for i in range(20):
            c.put(f"k{i}", pattern(100 * KIB, seed=i))
            if i >= 1:
                assert c.get("k0") == pattern(100 * KIB, seed=0), "k0 is used, so never the least recent"
        stats = s.stats()
        assert stats["evictions"] >= 10 and stats["pool_used"] <= MIB
        assert c.get("k0") == pattern(100 * KIB, seed=0)
        assert c.get("k19") == pattern(100 * KIB, seed=19)
        assert c.get("k1") is None, "the least recently used value went first"


@pytest.mark.timeout(60)
def test_values_expire_after_their_ttl(client, server):
    client.put("short", b"gone soon", ttl=0.3)
    client.put("long", b"stays", ttl=60)
    client.put("forever", b"stays too")
    assert client.exists(["short", "long", "forever"]) == [True, True, True]
    assert client.get("short") == b"gone soon"
    deadline = time.monotonic() + 10
    while client.exists("short") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.get("short") is None
    assert client.exists(["short", "long", "forever"]) == [False, True, True]
    assert client.get("long") == b"stays" and client.get("forever") == b"stays too"
    assert server.stats()["expirations"] >= 1
    # A TTL below the server's millisecond resolution still expires (it is not "never").
    client.put("tiny", b"x", ttl=1e-4)
    time.sleep(0.1)
    assert client.get("tiny") is None


@pytest.mark.timeout(60)
def test_batch_forms(server):
    with Client(server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        values = {f"key-{i}": pattern(1 + 997 * i, seed=i) for i in range(50)}
        versions = c.put_many(values, ttl=60)
        assert len(versions) == 50 and all(isinstance(v, int) for v in versions)
        assert len(set(versions)) == 50
        # More bytes than one buffer, as (key, value) pairs: sent in several requests.
        pairs = [(f"p{i}".encode(), np.full(300 * KIB, i, dtype=np.uint8)) for i in range(8)]
        assert all(isinstance(v, int) for v in c.put_many(pairs))
        # One item too large for the buffer fails alone; its neighbours are stored.
        mixed = c.put_many([("a", b"1"), ("huge", pattern(2 * MIB)), ("b", b"2")])
        assert isinstance(mixed[0], int) and isinstance(mixed[2], int)
        assert isinstance(mixed[1], freight.InvalidArgumentError), mixed
        assert str(2 * MIB) in str(mixed[1]) and str(MIB) in str(mixed[1])

        keys = list(values) + ["missing"]
        got = c.get_many(keys)
        assert got[:-1] == list(values.values()) and got[-1] is None
        # Values larger than their share of the buffer are fetched whole all the same.
        big = c.get_many([p[0] for p in pairs] + [b"a", b"huge"])
        assert [len(v) for v in big[:8]] == [300 * KIB] * 8
        assert all(v == bytes([i]) * (300 * KIB) for i, v in enumerate(big[:8]))
        assert big[8:] == [b"1", None]

        assert c.exists(["key-0", "missing", b"p3"]) == [True, False, True]
        assert c.exists([]) == [] and c.get_many([]) == [] and c.put_many({}) == []
        assert c.delete(["key-0", "missing", "key-1"]) == [True, False, True]
        assert c.get_many(["key-0", "key-2"]) == [None, values["key-2"]]


@pytest.mark.timeout(60)
def test_put_many_reports_a_full_pool_per_item():
    with Server(memory_size=MIB, evict=False) as s, Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        out = c.put_many([(f"k{i}", pattern(300 * KIB)) for i in range(3)] + [("k3", pattern(300 * KIB))])
        assert [isinstance(v, int) for v in out[:3]] == [True] * 3
        assert isinstance(out[3], freight.NoSpaceError) and "out of memory" in str(out[3]), out
        assert c.exists(["k0", "k1", "k2", "k3"]) == [True, True, True, False]


@pytest.mark.timeout(60)
def test_bad_arguments_raise_clear_errors(server, client):
    with pytest.raises(freight.InvalidArgumentError, match="empty"):
        client.put("", b"x")
    with pytest.raises(TypeError, match="str or bytes"):
        client.put(42, b"x")
    with pytest.raises(TypeError, match="str or bytes"):
        client.get(None)
    with pytest.raises(TypeError, match="not str"):
        client.put("k", "a string")
    with pytest.raises(freight.InvalidArgumentError, match="empty"):
        client.put("k", b"")
    with pytest.raises(freight.InvalidArgumentError, match="C-contiguous"):
        client.put("k", np.zeros((10, 10))[:, 0])
    with pytest.raises(freight.InvalidArgumentError, match="ttl"):
        client.put("k", b"x", ttl=-1)
    with pytest.raises(freight.InvalidArgumentError, match="ttl"):
        client.put("k", b"x", ttl=float("nan"))
    with pytest.raises(TypeError, match="ttl"):
        client.put("k", b"x", ttl="10")
    with pytest.raises(TypeError):
        client.put_many([("k", b"x", 1)])
    with pytest.raises(freight.InvalidArgumentError, match="empty"):
        client.put_many({"ok": b"1", "": b"2"})
    with pytest.raises(TypeError, match="sequence of keys"):
        client.get_many("abc")
    assert not client.exists("ok"), "a put_many with a bad item sends nothing"
    with pytest.raises(freight.InvalidArgumentError, match="buffer_size"):
        Client(server.url, buffer_size=0)
    with pytest.raises(freight.InvalidArgumentError, match="timeout"):
        Client(server.url, timeout=0)
    with pytest.raises(freight.InvalidArgumentError, match="transport"):
        Client(server.url, transport="carrier-pigeon")
    with pytest.raises(freight.InvalidArgumentError, match="memory_size"):
        Server(memory_size=0)
    with pytest.raises(freight.InvalidArgumentError, match="listen"):
        Server("not-an-address")


@pytest.mark.timeout(60)
def test_a_server_with_a_token_serves_only_clients_that_present_it(monkeypatch):
    monkeypatch.delenv("FREIGHT_KV_TOKEN", raising=False)
    with Server(memory_size=4 * MIB, token="s3cret") as s:
        for token in (None, "wrong"):
            with pytest.raises(freight.AuthError, match="token"):
                Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token=token)
        with Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token="s3cret") as c:
            c.put("k", b"for token holders")
        # Without token=, the client presents FREIGHT_KV_TOKEN, as kv-bench does.
        monkeypatch.setenv("FREIGHT_KV_TOKEN", "s3cret")
        with Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
            assert c.get("k") == b"for token holders"
        with pytest.raises(freight.AuthError):
            Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token="wrong")
    with Server(memory_size=4 * MIB) as open_server:
        with Client(open_server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
            c.put("k", b"a server without a token ignores the client's")
    with pytest.raises(freight.InvalidArgumentError, match="empty"):
        Server(memory_size=MIB, token="")
    with pytest.raises(freight.InvalidArgumentError, match="printable"):
        Server(memory_size=MIB, token="two\nlines")
    with pytest.raises(TypeError, match="token"):
        Client("http://127.0.0.1:1", token=b"s3cret")
    monkeypatch.setenv("FREIGHT_KV_TOKEN", "bad\tvalue")
    with pytest.raises(freight.InvalidArgumentError, match="FREIGHT_KV_TOKEN"):
        Client("http://127.0.0.1:1")


@pytest.mark.timeout(120)
def test_a_client_reaches_freight_serve_started_with_the_token_in_its_environment(monkeypatch):
    monkeypatch.setenv("FREIGHT_KV_TOKEN", "s3cret")
    proc, out, url = serve(free_port())
    with Client(url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        c.put("k", b"v")
    with Client(url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token="s3cret") as c:
        assert c.get("k") == b"v"
    with pytest.raises(freight.AuthError):
        Client(url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token="wrong")
    stop(proc, out)


def self_signed(tmp_path) -> "tuple[str, str]":
    """(certificate, key) PEM files for 127.0.0.1, signed by themselves (not a CA
    certificate: rustls refuses those as a server's own)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "2", "-subj", "/CN=kv", "-addext", "subjectAltName=IP:127.0.0.1",
         "-addext", "basicConstraints=critical,CA:FALSE"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
    )
    return str(cert), str(key)


@pytest.mark.timeout(60)
def test_tls_on_the_control_plane(tmp_path):
    cert, key = self_signed(tmp_path)
    with Server(memory_size=4 * MIB, tls_cert=cert, tls_key=key, token="s3cret") as s:
        assert s.url.startswith("https://127.0.0.1:"), s.url
        ca = tmp_path / "cert.pem"  # a path, as a str or os.PathLike
        with Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token="s3cret", tls_ca=ca) as c:
            c.put("k", b"over tls")
            assert c.get("k") == b"over tls"
        with pytest.raises(freight.InvalidArgumentError, match="certificate authority"):
            Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT, token="s3cret")
    with pytest.raises(freight.InvalidArgumentError, match="tls_cert and tls_key"):
        Server(memory_size=MIB, tls_cert=cert)


@pytest.mark.timeout(60)
def test_bad_tls_files_are_refused_at_once_and_by_name(tmp_path):
    missing = tmp_path / "missing.pem"
    with pytest.raises(freight.IoError, match="tls_ca .*missing.pem"):
        Client("https://127.0.0.1:1", tls_ca=missing)
    not_pem = tmp_path / "not.pem"
    not_pem.write_bytes(b"not a certificate")
    start = time.monotonic()
    with pytest.raises(freight.InvalidArgumentError, match="no PEM certificate"):
        Client(f"https://127.0.0.1:{free_port()}", timeout=30, tls_ca=not_pem)
    assert time.monotonic() - start < 4, "refused before dialling (dialling retries for 5 s)"
    with pytest.raises(freight.InvalidArgumentError, match="https://"):
        Client("http://127.0.0.1:1", tls_ca=not_pem)
    with pytest.raises(TypeError, match="PEM file"):
        Client("https://127.0.0.1:1", tls_ca=b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(freight.IoError, match="tls_cert .*missing.pem"):
        Server(memory_size=MIB, tls_cert=missing, tls_key=missing)


@pytest.mark.timeout(60)
def test_an_address_without_a_scheme_is_refused_at_once(server):
    address = server.url.split("://", 1)[1]
    start = time.monotonic()
    with pytest.raises(freight.InvalidArgumentError, match=r"write http://host:port"):
        Client(address, buffer_size=MIB, timeout=30)
    assert time.monotonic() - start < 4, "refused before dialling (dialling retries for 5 s)"


@pytest.mark.timeout(60)
def test_metrics_of_a_python_server():
    with Server(memory_size=4 * MIB, metrics_listen="127.0.0.1:0") as s:
        assert s.metrics_url is not None and s.metrics_url.startswith("http://127.0.0.1:"), s.metrics_url
        with Client(s.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
            c.put("k", b"v")
        with urllib.request.urlopen(s.metrics_url, timeout=CLIENT_TIMEOUT) as r:
            text = r.read().decode()
        assert "freight_kv_keys 1" in text, text
    with Server(memory_size=MIB) as s:
        assert s.metrics_url is None


@pytest.mark.timeout(60)
def test_closed_client_and_shut_down_server(server):
    c = Client(server, buffer_size=MIB, timeout=2)  # a Server stands for its URL
    c.put("k", b"v")
    assert server.stats()["keys"] == 1
    c.close()
    c.close()
    assert not c.live
    with pytest.raises(freight.InvalidStateError):
        c.get("k")
    other = Client(server.url, buffer_size=MIB, timeout=2)
    assert other.get("k") == b"v", "values outlive the client that wrote them"
    server.shutdown()
    server.shutdown()
    assert not server.live
    with pytest.raises(freight.InvalidStateError):
        server.stats()
    start = time.monotonic()
    with pytest.raises(freight.FreightError):
        other.get("k")
    with pytest.raises(freight.FreightError):
        other.exists("k")
    assert time.monotonic() - start < 15
    other.__exit__(RuntimeError, None, None)  # closing after a failure does not raise
    with pytest.raises(freight.FreightError):
        Client(server.url, timeout=2)


@pytest.mark.timeout(60)
def test_clients_in_threads_and_one_client_shared_by_threads(server):
    errors: List[BaseException] = []
    shared = Client(server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT)

    def work(t: int, own: bool) -> None:
        try:
            c = Client(server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) if own else shared
            for i in range(40):
                key, value = f"t{t}-{i}", pattern(1000 + i, seed=t * 100 + i)
                c.put(key, value)
                assert c.get(key) == value
            if own:
                c.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t, t % 2 == 0)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    assert not any(t.is_alive() for t in threads), "a client call hung"
    assert not errors, errors
    assert server.stats()["keys"] == 240
    shared.close()


@pytest.mark.timeout(60)
def test_async_client_does_what_the_client_does_without_blocking_the_loop(server):
    import asyncio

    from freight.kv import AsyncClient

    async def session(t: int) -> None:
        async with AsyncClient(server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as kv:
            value = pattern(5000 + t, seed=t)
            assert await kv.put(f"a{t}", value, ttl=60) > 0
            assert await kv.get(f"a{t}") == value
            out = np.zeros(6000, np.uint8)
            assert await kv.get_into(f"a{t}", out) == len(value)
            assert out[: len(value)].tobytes() == value
            assert await kv.get_many([f"a{t}", "missing"]) == [value, None]
            assert await kv.exists([f"a{t}", "missing"]) == [True, False]
            versions = await kv.put_many({f"b{t}": b"1", f"c{t}": b"22"})
            assert len(versions) == 2 and all(isinstance(v, int) for v in versions), versions
            assert await kv.delete(f"b{t}") is True
            assert (await kv.stats())["clients"] >= 1

    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(session(t) for t in range(4)))
        tick.cancel()
        assert ticks > 10, "the event loop was blocked while the clients waited"

        idle = AsyncClient(server.url)
        with pytest.raises(freight.InvalidStateError, match="not connected"):
            await idle.get("x")
        await idle.close()

        dead = AsyncClient(f"http://127.0.0.1:{free_port()}", timeout=1.0)
        with pytest.raises(freight.FreightError):
            await dead.connect()
        await dead.close()

        done = await AsyncClient(server.url, buffer_size=MIB, timeout=CLIENT_TIMEOUT).connect()
        await done.close()
        await done.close()  # harmless
        for call in (done.get("x"), done.connect()):
            with pytest.raises(freight.InvalidStateError, match="closed"):
                await call
        await idle.close()

    asyncio.run(main())
    assert server.stats()["keys"] == 8


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * KIB


GIB_PLUS = (1 << 30) + 12345  # larger than a gigabyte, and not a round number


@pytest.mark.timeout(300)
@pytest.mark.skipif(_available_memory() < 6 * GIB_PLUS, reason="a value over 1 GiB needs about 6 GiB of free memory "
                    "(pool, client buffer, value and destination)")
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_value_larger_than_a_gigabyte_round_trips(transport):
    value = np.random.default_rng(3).integers(0, 256, GIB_PLUS, dtype=np.uint8)
    with Server("127.0.0.1:0", memory_size=GIB_PLUS + MIB) as server, \
            Client(server.url, buffer_size=GIB_PLUS, timeout=120, transport=transport) as c:
        c.put("huge", value)
        out = np.zeros(GIB_PLUS, np.uint8)
        assert c.get_into("huge", out) == GIB_PLUS
        assert np.array_equal(out, value)
        assert server.stats()["bytes"] == GIB_PLUS


@pytest.mark.timeout(120)
def test_torch_tensors_go_in_and_come_out_on_the_cpu_and_a_gpu(server, client):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    cpu = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    client.put("cpu", cpu)
    back = torch.zeros(10, 100)
    assert client.get_into("cpu", back) == 4000 and torch.equal(back, cpu)
    assert client.get("cpu") == cpu.numpy().tobytes()
    with pytest.raises(freight.InvalidArgumentError, match="not contiguous"):
        client.put("t", cpu.t())
    with pytest.raises(freight.InvalidArgumentError, match="4000.*"):
        client.get_into("cpu", torch.zeros(10, dtype=torch.float32))
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU tensors not tried")
    gpu = (torch.arange(3 * MIB, device="cuda") % 251).to(torch.uint8).view(torch.bfloat16)
    client.put("gpu", gpu)
    into = torch.zeros_like(gpu)
    assert client.get_into("gpu", into) == 3 * MIB
    assert torch.equal(into.view(torch.uint8), gpu.view(torch.uint8))
    cuda_back = torch.zeros(10, 100, device="cuda")
    assert client.get_into("cpu", cuda_back) == 4000 and torch.equal(cuda_back.cpu(), cpu)


# ------------------------------------------------------------------- real processes


class Lines:
    """The stdout lines of a process, read by a thread, with deadlines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.q: "queue.Queue[Optional[str]]" = queue.Queue()
        self.seen: List[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.q.get(timeout=max(left, 0.01))
            except queue.Empty:
                line = None
                left = 0
            if line is not None:
                self.seen.append(line)
                if text in line:
                    return line
                continue
            if left <= 0 or self.proc.poll() is not None:
                self.proc.kill()
                _, err = self.proc.communicate(timeout=10)
                pytest.fail(f"no {text!r} line within {timeout}s (exit {self.proc.returncode}); stdout:\n"
                            f"{''.join(self.seen)}\nstderr:\n{err}")


_processes: List[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_servers():
    yield
    while _processes:
        p = _processes.pop()
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freight", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=timeout,
    )


def serve(port: int, *extra: str) -> "tuple[subprocess.Popen, Lines, str]":
    """``freight serve`` on 127.0.0.1:port, once it says it listens: (process, its
    stdout, its URL)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "freight", "serve", "--listen", f"127.0.0.1:{port}", "--memory-mb", "64", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    _processes.append(proc)
    out = Lines(proc)
    line = out.wait_for("listening on", timeout=30)
    url = f"http://127.0.0.1:{port}"
    assert url in line, line
    return proc, out, url


def stop(proc: subprocess.Popen, out: Lines) -> None:
    """SIGTERM; the server must exit 0 within a few seconds, saying it stopped."""
    proc.send_signal(signal.SIGTERM)
    out.wait_for("stopped", timeout=10)
    try:
        rc = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the server said it stopped but did not exit")
    assert rc == 0, (rc, proc.stderr.read())


@pytest.mark.timeout(180)
def test_serve_in_another_process_with_a_client_and_kv_bench_then_sigterm():
    port = free_port()
    proc, out, url = serve(port)
    with Client(url, buffer_size=4 * MIB, timeout=CLIENT_TIMEOUT) as c:
        value = np.frombuffer(pattern(MIB + 3), dtype=np.uint8)
        version = c.put("from-test", value, ttl=300)
        assert version > 0
        assert c.get("from-test") == value.tobytes()
        dest = np.zeros(2 * MIB, dtype=np.uint8)
        assert c.get_into("from-test", dest) == MIB + 3 and (dest[: MIB + 3] == value).all()
        assert c.stats()["capacity"] == 64 * MIB and c.stats()["clients"] == 1

        bench = cli(
            "kv-bench", "--server-addr", url, "--num-keys", "200", "--value-size", "4KiB",
            "--num-threads", "2", "--warmup", "10", "--json",
        )
        assert bench.returncode == 0, bench.stderr
        report = json.loads(bench.stdout)
        assert report["benchmark"] == "freight kv-bench"
        assert report["num_keys"] == 200 and report["value_size"] == 4096 and report["num_threads"] == 2
        assert report["embedded"] is False and report["server"] == url
        assert report["read"]["ops"] > 0 and report["read"]["ops_per_sec"] > 0
        assert report["write"]["ops"] == 200
        lat = report["latency_us"]
        for field in ("min", "median", "avg", "p95", "p99", "max", "samples"):
            assert field in lat, field
        assert 0 < lat["min"] <= lat["median"] <= lat["p99"] <= lat["max"]
        assert report["server_stats"]["keys"] >= 201 and report["server_stats"]["hits"] >= 200
        # The bench's keys are in the server this client talks to; its own key is intact.
        assert c.exists(["key-0", "key-199", "key-200"]) == [True, True, False]
        assert len(c.get("key-7")) == 4096
        assert c.get("from-test") == value.tobytes()

        stop(proc, out)

        start = time.monotonic()
        with pytest.raises(freight.FreightError):
            c.get("from-test")
        with pytest.raises(freight.FreightError):
            c.exists("from-test")
        assert time.monotonic() - start < 3 * CLIENT_TIMEOUT + 5, "a dead server must not hang a client"
        # Leaving the with block closes the client without raising over the dead server.


@pytest.mark.timeout(120)
def test_a_server_restarted_on_the_same_port_starts_empty():
    port = free_port()
    proc, out, url = serve(port)
    with Client(url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        c.put("before-restart", b"old value")
        assert c.get("before-restart") == b"old value"
    stop(proc, out)
    proc, out, url2 = serve(port)
    assert url2 == url
    with Client(url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as c:
        assert c.get("before-restart") is None
        assert c.exists("before-restart") is False
        assert c.stats()["keys"] == 0
        c.put("after-restart", b"new")
        assert c.get("after-restart") == b"new"
    stop(proc, out)


@pytest.mark.timeout(120)
def test_a_client_of_a_dead_server_fails_fast():
    with pytest.raises(freight.FreightError):
        Client(f"http://127.0.0.1:{free_port()}", timeout=2)
    port = free_port()
    proc, out, url = serve(port)
    c = Client(url, buffer_size=MIB, timeout=2)
    c.put("k", b"v")
    os.killpg(proc.pid, signal.SIGKILL)  # no goodbye: the process is gone at once
    proc.wait(timeout=10)
    start = time.monotonic()
    for call in (lambda: c.get("k"), lambda: c.put("k", b"w"), lambda: c.exists("k"), c.stats):
        with pytest.raises(freight.FreightError):
            call()
    assert time.monotonic() - start < 20


def wait_stopped(pid: int, timeout: float = 10) -> None:
    """Waits until the process is stopped (a signal is delivered a little later than
    kill returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    pytest.fail(f"process {pid} did not stop")


@pytest.mark.timeout(120)
def test_a_hung_server_times_out_and_the_client_is_not_used_again():
    """A GET that times out may still be carried out once the server wakes up: writing
    its value into the client's buffer, where the next PUT's value already is. The
    client is closed instead of storing the wrong bytes under the next key."""
    port = free_port()
    proc, out, url = serve(port)
    first, second = pattern(100_000, seed=1), pattern(100_000, seed=2)
    c = Client(url, buffer_size=MIB, timeout=1.5)
    c.put("a", first)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_stopped(proc.pid)
        start = time.monotonic()
        with pytest.raises(freight.TimeoutError, match="connect a new one"):
            c.get("a")
        took = time.monotonic() - start
        assert 1.0 < took < 10, took
        start = time.monotonic()
        with pytest.raises(freight.FreightError):
            c.exists("a")
        assert time.monotonic() - start < 10
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert not c.live
    with pytest.raises(freight.InvalidStateError, match="timed out"):
        c.put("b", second)
    c.close()
    with Client(url, buffer_size=MIB, timeout=CLIENT_TIMEOUT) as fresh:
        fresh.put("b", second)
        assert fresh.get_many(["a", "b"]) == [first, second]
    stop(proc, out)


@pytest.mark.timeout(120)
def test_kv_bench_embedded_and_its_usage_errors():
    p = cli("kv-bench", "--embedded", "--num-keys", "100", "--value-size", "1KiB", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["embedded"] is True and report["num_keys"] == 100 and report["value_size"] == 1024
    assert report["read"]["ops"] == 100 and report["latency_us"]["samples"] > 0
    assert "Write Phase" in p.stderr, "with --json the phases' text goes to stderr"

    p = cli("kv-bench", "--embedded", "--num-keys", "10", "--value-size", "2MiB", "--buffer-mb", "1")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.replace(" ", "")
    assert "--value-size2MiB" in err and "--buffer-mb1" in err, p.stderr
    p = cli("kv-bench", "--value-size", "lots")
    assert p.returncode == 2, (p.returncode, p.stderr)


@pytest.mark.timeout(60)
def test_serve_and_kv_bench_help():
    p = cli("serve", "--help")
    assert p.returncode == 0, p.stderr
    for option in ("--listen", "--memory-mb", "--no-evict", "--data-listen", "--transport"):
        assert option in p.stdout, option
    p = cli("kv-bench", "--help")
    assert p.returncode == 0, p.stderr
    for option in ("--server-addr", "--num-keys", "--value-size", "--num-threads", "--buffer-mb", "--ttl",
                   "--warmup", "--embedded", "--verify", "--json"):
        assert option in p.stdout, option
    p = cli("kv-server", "--help")
    assert p.returncode == 0 and "--listen" in p.stdout, "kv-server is serve's other name"
    p = cli("serve", "--listen", "nonsense", "--memory-mb", "1")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
