"""The cache engine from Python: KV caches stored in chunks and retrieved through
contiguous and paged numpy KV memory, shared prefixes found, LRU eviction that keeps
prefixes, namespaces and dtypes kept apart, store ends handed over whole, bad input
refused; and a prefill process that stores with a remote sink for a decode process (this
one) that retrieves through its remote source, every byte checked.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import freight
from store_peer import CHUNK, CHUNK_BYTES, MODEL, kv_for, paged, prompt, unpaged
from test_py_storage import connected
from test_py_stream import agent, finish, line

HERE = Path(__file__).resolve().parent
PEER = (HERE / "store_peer.py").read_text()
L, H, D = MODEL["layers"], MODEL["heads"], MODEL["head_dim"]


def engine(a: freight.Agent, host_chunks: int = 64, **kw) -> freight.CacheEngine:
    return freight.CacheEngine(a, chunk_tokens=CHUNK, host_bytes=host_chunks * CHUNK_BYTES, **{**MODEL, **kw})


def zeros(tokens: int) -> np.ndarray:
    return np.zeros((L, 2, tokens, H, D), dtype=np.float16)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality (the random KV bytes hold NaNs)."""
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


# ----------------------------------------------------------------------------- one process


@pytest.mark.timeout(30)
def test_a_stored_prompt_comes_back_whole_and_shared_prefixes_are_found():
    with agent("ce") as a, engine(a) as e:
        assert (e.chunk_tokens, e.chunk_bytes, e.dtype, e.gpu) == (CHUNK, CHUNK_BYTES, "float16", None)
        tokens = prompt(100, 1)
        kv = kv_for(128, seed=1)
        report = e.store(list(tokens), kv)  # a list of ints or an array
        assert report == {"chunks": 7, "new_chunks": 7, "bytes": 100 * CHUNK_BYTES // CHUNK}
        assert e.store(tokens, kv)["new_chunks"] == 0, "stored already"
        assert e.occupancy() == {"host": 7}

        out = zeros(100)
        assert e.retrieve(tokens, out) == 100
        assert same(out, kv[:, :, :100])

        # A prompt that parts from the stored one at token 70 shares its first 4 chunks.
        other = np.concatenate([tokens, [1, 2, 3]]).astype(np.uint32)
        other[70] = 424242
        assert e.lookup(other) == 64
        out = zeros(128)
        assert e.retrieve(other, out) == 64
        assert same(out[:, :, :64], kv[:, :, :64]), "the prefix is there"
        assert not out[:, :, 64:].any(), "and nothing after it"
        assert e.lookup(prompt(100, 2)) == 0 and e.lookup([]) == 0
        assert e.retrieve([], out) == 0
    assert e.closed


@pytest.mark.timeout(30)
def test_paged_kv_memory_is_gathered_and_scattered_through_its_block_table():
    with agent("ce-paged") as a, engine(a) as e:
        tokens = prompt(45, 3)
        kv = kv_for(48, seed=3)
        e.store(tokens, kv)
        # Blocks of 4 tokens scattered over a pool of 20.
        table = [17, 3, 4, 9, 0, 12, 13, 14, 2, 19, 5, 7]
        pool = np.zeros((L, 2, 20, 4, H, D), dtype=np.float16)
        assert e.retrieve(tokens, pool, block_table=table, block_size=4) == 45
        assert same(unpaged(pool, 45, table), kv[:, :, :45])
        untouched = [b for b in range(20) if b not in table]
        assert not pool[:, :, untouched].any(), "blocks outside the table are left alone"
        # A row padded to an engine's width, with a block the prompt uses itself: the
        # padding is never reached, so it is not refused as a block named twice.
        padded_pool = np.zeros_like(pool)
        assert e.retrieve(tokens, padded_pool, block_table=table + [0, 0, 0], block_size=4) == 45
        assert same(padded_pool, pool)
        # Stored from paged memory under another prompt, back out to contiguous memory.
        renamed = tokens.copy()
        renamed[0] = 77
        assert e.store(renamed, pool, block_table=np.array(table))["new_chunks"] == 3
        out = zeros(48)
        assert e.retrieve(renamed, out) == 45
        assert same(out[:, :, :45], kv[:, :, :45]), "the same rows, under the other prompt's keys"


@pytest.mark.timeout(30)
def test_a_full_host_tier_evicts_the_least_recently_used_chunks():
    with agent("ce-lru") as a, engine(a, host_chunks=4) as e:
        p, q, r = prompt(32, 10), prompt(32, 20), prompt(16, 30)
        e.store(p, kv_for(32, seed=10))
        e.store(q, kv_for(32, seed=20))
        assert (e.lookup(p), e.lookup(q)) == (32, 32)
        out = zeros(32)
        e.retrieve(p, out)  # p is now the most recently used
        e.store(r, kv_for(16, seed=30))
        assert e.lookup(p) == 32 and e.lookup(r) == 16
        assert e.lookup(q) == 16, "q's last chunk was the least recently used; its first is still found"
        assert e.occupancy() == {"host": 4}
        out = zeros(32)
        assert e.retrieve(p, out) == 32 and same(out, kv_for(32, seed=10))


@pytest.mark.timeout(30)
def test_a_prompt_longer_than_the_tier_keeps_its_prefix():
    with agent("ce-prefix") as a, engine(a, host_chunks=4) as e:
        tokens, kv = prompt(96, 40), kv_for(96, seed=40)
        assert e.store(tokens, kv)["new_chunks"] == 6
        assert e.lookup(tokens) == 64, "the first four chunks stayed, not the last four"
        out = zeros(96)
        assert e.retrieve(tokens, out) == 64 and same(out[:, :, :64], kv[:, :, :64])


def found_across(prefill: dict, decode: dict) -> int:
    """Tokens a decode engine made with ``decode`` finds of a prompt that a prefill
    engine made with ``prefill`` put into its store."""
    with agent("ns-pre") as pa, agent("ns-dec") as da:
        store, sender = connected(da, pa, receiver={"buffer": 3 * CHUNK_BYTES}, sender={"commit_size": 4})
        p = engine(pa, remote_sink=sender, **prefill)
        d = engine(da, remote_source=store, **decode)
        try:
            tokens = prompt(40, 60)
            assert p.store(tokens, kv_for(40, seed=60))["new_chunks"] == 3
            return d.lookup(tokens)
        finally:
            p.close()  # before the receiver's end goes
            d.close()


@pytest.mark.timeout(60)
def test_engines_of_other_namespaces_or_dtypes_never_take_each_others_chunks():
    assert found_across({"namespace": "llama/tp0"}, {"namespace": b"llama/tp0"}) == 40
    assert found_across({"namespace": "llama/tp0"}, {"namespace": "llama/tp1"}) == 0, "another TP rank's KV"
    assert found_across({}, {"namespace": "adapter-7"}) == 0
    # float16 and bfloat16 take as many bytes: only the dtype's name tells them apart.
    assert found_across({}, {"dtype": "bfloat16"}) == 0
    with agent("ns-bad") as a:
        with pytest.raises(TypeError, match="namespace"):
            engine(a, namespace=5)
        with engine(a, namespace="tp0") as e:
            assert e.namespace == b"tp0"


@pytest.mark.timeout(60)
def test_a_sender_closed_while_the_engine_is_built_takes_nothing_with_it():
    """The constructor builds the tiers with the GIL released; a sender closed meanwhile
    fails it before the receiver is taken, which stays its owner's."""
    with agent("ho-pre") as pa, agent("ho-dec") as da:
        for _ in range(5):
            store, sender = connected(da, pa)
            closer = threading.Timer(0.01, sender.close)
            closer.start()
            try:
                # 128 MiB of host tier take about 0.1 s to build.
                built = engine(pa, host_chunks=(128 << 20) // CHUNK_BYTES, remote_sink=sender, remote_source=store)
            except freight.InvalidStateError as e:
                assert "closed" in str(e)
                assert store.get("anything") is None, "the receiver is still its owner's"
                store.close()
                return
            finally:
                closer.join()
            built.close()  # the close came too late to race the build: again
        pytest.skip("the sender's close never came while the engine was built")


def test_bad_input_is_refused_clearly():
    with agent("ce-bad") as a, engine(a, host_chunks=8) as e:
        tokens = prompt(40, 9)
        kv = kv_for(48, seed=9)
        pool = np.zeros((L, 2, 4, 4, H, D), dtype=np.float16)
        ro = kv.copy()
        ro.flags.writeable = False
        bad = [
            (e.store, (tokens, kv.astype(np.float32)), {}, "is float32, but this cache engine stores float16"),
            (e.store, (tokens, np.zeros((L, 2, 48, H, D + 1), np.float16)), {}, r"\(3, 2, T, 2, 8\)"),
            (e.store, (tokens, kv[:, :, ::2]), {}, "not C-contiguous"),
            (e.store, (tokens, kv_for(32, seed=1)), {}, "40 tokens do not fit"),
            (e.store, (tokens, kv), {"block_size": 4}, "give a block_table too"),
            (e.retrieve, (tokens, kv), {"block_table": [0]}, "paged KV memory must have shape"),
            (e.retrieve, (tokens, pool), {"block_table": list(range(10))}, "names block 4"),
            (e.retrieve, (tokens, pool), {"block_table": [0, 1, 2, 3]}, "do not fit"),
            (e.retrieve, (tokens[:8], pool), {"block_table": [0, -1]}, "non-negative"),
            (e.retrieve, (tokens[:8], pool), {"block_table": [0], "block_size": 8}, "blocks hold 4 tokens"),
            (e.retrieve, (tokens, ro), {}, "read-only"),
            (e.store, (np.array([[1, 2]]), kv), {}, "one-dimensional"),
            (e.store, (np.array([1.5]), kv), {}, "integers"),
            (e.lookup, ([1, -2],), {}, r"\[0, 2\*\*32\)"),
        ]
        for call, args, kw, why in bad:
            with pytest.raises(freight.InvalidArgumentError, match=why):
                call(*args, **kw)
        with pytest.raises(TypeError):
            e.store(tokens, [[0.0]])
        assert e.store(tokens, ro)["new_chunks"] == 3, "still usable; read-only memory is fine to store from"
    with pytest.raises(freight.InvalidStateError, match="closed"):
        e.lookup(tokens)
    e.close()  # harmless

    with agent("ce-config") as a:
        configs = [
            ({"host_bytes": 0}, "needs a GPU or a host tier"),
            ({"gpu_bytes": 1 << 20}, "needs a GPU"),
            ({"host_bytes": 10}, "cannot hold one chunk"),
            ({"chunk_tokens": 0}, "chunk_tokens"),
            ({"layers": 0}, "layers"),
            ({"dtype": "no-such-type"}, "unknown dtype"),
            ({"dtype": "V8"}, "number type"),
        ]
        for kw, why in configs:
            args = {"chunk_tokens": CHUNK, "host_bytes": 1 << 20, **MODEL, **kw}
            with pytest.raises(freight.InvalidArgumentError, match=why):
                freight.CacheEngine(a, **args)
        with pytest.raises(TypeError, match="StoreSender"):
            engine(a, remote_sink=object())
        for dtype, want in [(np.float16, "float16"), ("bfloat16", "bfloat16"), (np.dtype("int8"), "int8")]:
            with freight.CacheEngine(a, host_bytes=1 << 20, layers=1, heads=1, head_dim=4, dtype=dtype) as e:
                assert e.dtype == want


@pytest.mark.timeout(30)
def test_store_ends_are_handed_over_and_a_decode_engine_finds_what_prefill_put():
    with agent("pre") as pa, agent("dec") as da:
        store, sender = connected(da, pa, receiver={"buffer": 3 * CHUNK_BYTES}, sender={"commit_size": 4})
        user = np.arange(10, dtype=np.int64)
        sender.put("user", user)
        prefill = engine(pa, host_chunks=3, remote_sink=sender)  # a small tier: slots reused once committed
        store.wait_for("user", timeout=5)  # the sender's own puts were committed first
        decode = engine(da, host_chunks=2, remote_source=store)
        for end in (sender, store):
            assert end.closed
        with pytest.raises(freight.InvalidStateError, match="handed to a cache engine"):
            sender.put("late", user)
        with pytest.raises(freight.InvalidStateError, match="handed to a cache engine"):
            store.get("user")
        with pytest.raises(freight.InvalidStateError, match="handed to a cache engine"):
            engine(pa, remote_sink=sender)
        sender.close()
        store.close()  # both harmless: the engines own them now

        tokens = prompt(150, 5)
        kv = kv_for(160, seed=5)
        assert prefill.store(tokens, kv)["new_chunks"] == 10
        # `store` returned: the decode side holds every chunk.
        assert decode.lookup(tokens) == 150
        table = list(range(19))[::-1]
        pool = np.zeros((L, 2, 24, 8, H, D), dtype=np.float16)
        assert decode.retrieve(tokens, pool, block_table=table) == 150
        assert same(unpaged(pool, 150, table), kv[:, :, :150])
        prefill.close()
        decode.close()


@pytest.mark.timeout(30)
def test_a_decode_engine_whose_source_evicts_never_fills_up_and_keeps_prefixes_it_used():
    with agent("ev-pre") as pa, agent("ev-dec") as da:
        receiver = {"buffer": 3 * CHUNK_BYTES, "capacity": 6 * CHUNK_BYTES, "evict": True}
        store, sender = connected(da, pa, receiver=receiver, sender={"commit_size": 4})
        prefill = engine(pa, remote_sink=sender)
        decode = engine(da, host_chunks=1, remote_source=store)
        n = 3 * CHUNK
        kv = kv_for(n, seed=11)
        a, b, c = (prompt(n, salt) for salt in (31, 32, 33))
        prefill.store(a, kv)
        prefill.store(b, kv)  # the source is full
        assert decode.lookup(a) == n  # a is used: b is older now
        prefill.store(c, kv)
        assert (decode.lookup(b), decode.lookup(c), decode.lookup(a)) == (0, n, n), "b went, not a"
        # A prompt's chunks are used last to first: room for one more chunk takes the
        # end of the prompt used longest ago (c), and keeps its start.
        prefill.store(prompt(CHUNK, 34), kv)
        assert decode.lookup(c) == n - CHUNK
        out = zeros(n)
        assert decode.retrieve(a, out) == n and same(out, kv)
        prefill.close()
        decode.close()


@pytest.mark.timeout(30)
def test_a_prefill_engine_whose_peer_went_away_goes_on_caching_locally():
    with agent("gone-pre") as pa, agent("gone-dec") as da:
        store, sender = connected(da, pa, receiver={"buffer": 3 * CHUNK_BYTES}, sender={"commit_size": 4})
        prefill = engine(pa, remote_sink=sender)
        n = 4 * CHUNK
        kv = kv_for(n, seed=12)
        first, second, third = (prompt(n, salt) for salt in (41, 42, 43))
        assert prefill.store(first, kv)["new_chunks"] == 4
        store.close()  # the decode side goes away
        with pytest.raises(freight.PeerDisconnectedError):
            prefill.store(second, kv)  # its peer lacks these chunks
        assert prefill.store(third, kv)["new_chunks"] == 4, "later stores work, locally"
        prefill.store(second, kv)
        assert [prefill.lookup(p) for p in (first, second, third)] == [n, n, n]
        out = zeros(n)
        assert prefill.retrieve(second, out) == n and same(out, kv)
        prefill.close()


def test_object_dtypes_are_not_kv_dtypes():
    from freight.cache import dtype_info

    for dtype in (object, np.dtype("O"), "object", np.dtype([("x", "f4"), ("o", "O")])):
        with pytest.raises(freight.InvalidArgumentError, match="number type"):
            dtype_info(dtype)
    assert dtype_info("float16") == ("float16", 2)


# ----------------------------------------------------------------------------- two processes


@pytest.mark.timeout(40)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_decode_process_retrieves_what_a_prefill_process_stored(spawn, transport):
    paged_kv = transport == "tcp"
    with agent("decode", transport) as a:
        peer: subprocess.Popen = spawn(
            PEER,
            json.dumps(dict(role="prefill", name="prefill", addr=a.addresses[0], require=transport,
                            prompts=[[150, 5], [40, 6]], paged=paged_kv, host_chunks=4)),
            str(HERE),
            stdin=True,
        )
        # A pipe buffer of three chunks: chunks are cut across messages and reassembled.
        store = freight.StoreReceiver(a, buffer=3 * CHUNK_BYTES, timeout=20)
        with engine(a, host_chunks=2, remote_source=store) as decode:
            reports = line(peer)["stored"]
            assert [(r["chunks"], r["new_chunks"]) for r in reports] == [(10, 10), (3, 3)]
            long, short = prompt(150, 5), prompt(40, 6)
            assert (decode.lookup(long), decode.lookup(short)) == (150, 40)
            other = long.copy()
            other[70] = 1
            assert decode.lookup(other) == 64
            table = list(range(19))[::-1]
            pool = np.zeros((L, 2, 24, 8, H, D), dtype=np.float16)
            assert decode.retrieve(long, pool, block_table=table) == 150
            assert same(unpaged(pool, 150, table), kv_for(150, seed=5))
            out = zeros(40)
            assert decode.retrieve(short, out) == 40
            assert same(out, kv_for(40, seed=6))
            assert decode.occupancy() == {"host": 0}, "remote chunks are read where the store holds them"
            finish(peer)  # the prefill engine closes its stream and exits
