"""The keyed store from Python: puts committed in batches from another process over
real sockets (shm and tcp), more data than the pipe buffer, every byte checked; a full
store, a killed sender and bad puts give clear errors and lose nothing committed.

The putting side of the cross-process tests runs tests/store_peer.py in its own process.
"""

from __future__ import annotations

import gc
import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import freight
from stream_peer import objects, pattern
from test_py_stream import FakeCudaTensor, agent, finish, kill, line

HERE = Path(__file__).resolve().parent
PEER = (HERE / "store_peer.py").read_text()
KIB, MIB = 1 << 10, 1 << 20


def start(spawn, **args) -> subprocess.Popen:
    """A store_peer.py process with these arguments."""
    return spawn(PEER, json.dumps(args), str(HERE), stdin=True)


def connected(rx: freight.Agent, tx: freight.Agent, receiver: dict = None, sender: dict = None):
    """A StoreReceiver on ``rx`` and a StoreSender on ``tx`` feeding it (one process)."""
    box = {}

    def accept():
        try:
            box["rx"] = freight.StoreReceiver(rx, **{"buffer": MIB, "timeout": 10, **(receiver or {})})
        except BaseException as e:  # noqa: BLE001 - handed to the test below
            box["error"] = e

    t = threading.Thread(target=accept)
    t.start()
    tx_end = freight.StoreSender(tx, rx.addresses[0], **{"timeout": 10, **(sender or {})})
    t.join(timeout=15)
    if "error" in box:
        raise box["error"]
    return box["rx"], tx_end


# ----------------------------------------------------------------------------- puts


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_puts_from_another_process_arrive_whole_and_commits_report_their_figures(spawn, transport):
    size, count = 200 * KIB, 30
    want = objects("flat", count=count, size=size)
    with agent("rx", transport) as rx:
        peer = start(spawn, role="put", name="tx", addr=rx.addresses[0], require=transport, set="flat",
                     count=count, size=size, commit=8)
        with freight.StoreReceiver(rx, buffer=MIB, timeout=20) as store:
            assert store.peers == ["tx"] and store.capacity is None
            report = line(peer)
            assert report["done"] and report["path"] == transport
            # A commit returns once the store holds its objects: the last one is there.
            assert len(store) == count and store.received == count
            store.wait_closed(10)
            assert sorted(store.keys()) == sorted(want) and store.nbytes == count * size
            for key, exp in want.items():
                assert key in store and store.contains(key)
                obj = store.get(key)
                assert (obj.key, obj.kind, obj.device, obj.sender, obj.nbytes) == (key, "DRAM", 0, 0, size)
                assert obj.meta == {"dtype": "uint8", "shape": [size]} and (obj.dtype, obj.shape) == ("uint8", (size,))
                np.testing.assert_array_equal(obj.view(), exp)
        # 30 puts, commits of 8: three full ones and the rest.
        commits = [freight.CommitStats(**c) for c in report["commits"]]
        assert [c.objects for c in commits] == [8, 8, 8, 6]
        assert [c.bytes for c in commits] == [8 * size, 8 * size, 8 * size, 6 * size]
        for c in commits:
            assert c.transfer_seconds > 0 and c.wait_receiver_seconds >= 0 and c.transfer_gbps > 0
            assert c.total_seconds == pytest.approx(c.transfer_seconds + c.wait_receiver_seconds)
        # Objects put unregistered were registered until their commit returned.
        assert report["regions"][0] == report["regions"][1]
        finish(peer)


@pytest.mark.timeout(30)
def test_dtypes_shapes_and_objects_larger_than_the_buffer_round_trip(spawn):
    want = objects("mixed")
    with agent("rx") as rx:
        peer = start(spawn, role="put", name="tx", addr=rx.addresses[0], set="mixed", many=True, commit=3)
        with freight.StoreReceiver(rx, buffer=MIB, timeout=20) as store:
            assert line(peer)["done"]
            store.wait_for(list(want), timeout=10)
            for key, exp in want.items():
                obj = store[key]
                assert (obj.dtype, obj.shape, obj.nbytes) == (exp.dtype.name, exp.shape, exp.nbytes)
                v = obj.view()
                assert (v.dtype, v.shape) == (exp.dtype, exp.shape)
                # Bytes, not values: the patterns hold NaNs.
                assert v.tobytes() == exp.tobytes(), key
                dst = np.empty_like(exp)
                assert obj.copy_to(dst) is dst and dst.tobytes() == exp.tobytes()
                with pytest.raises(freight.InvalidArgumentError, match="bytes"):
                    obj.copy_to(np.empty(exp.size + 1, dtype=exp.dtype))
                with pytest.raises(freight.InvalidArgumentError, match="C-contiguous"):
                    obj.copy_to(np.empty(exp.size * 2, dtype=exp.dtype)[::2])
                if exp.dtype != np.uint8:
                    with pytest.raises(freight.InvalidArgumentError, match=exp.dtype.name):
                        obj.copy_to(np.empty(exp.nbytes, dtype=np.uint8))
            # The 3 MiB object went through a 1 MiB buffer; the store holds it whole.
            assert store["big"].nbytes == 3 * MIB
            # A view keeps its object alive after the store lets go of it.
            view = store.remove("big").view()
            assert "big" not in store and store.get("big") is None and store.remove("big") is None
            with pytest.raises(KeyError):
                store["big"]
            assert view.tobytes() == want["big"].tobytes()
            assert store.nbytes == sum(a.nbytes for k, a in want.items() if k != "big")
        finish(peer)


# ----------------------------------------------------------------------------- failures


@pytest.mark.timeout(30)
def test_a_full_store_fails_the_commit_and_keeps_what_it_holds(spawn):
    size = 200_000
    with agent("rx") as rx:
        peer = start(spawn, role="put", name="tx", addr=rx.addresses[0], set="flat", count=4, size=size, commit=2)
        with freight.StoreReceiver(rx, buffer=MIB, timeout=20, capacity=500_000) as store:
            assert store.capacity == 500_000
            report = line(peer)
            assert report["error"] == "PeerDisconnectedError", report
            assert "out of space" in report["message"]
            assert report["pending"] == ["obj-002", "obj-003"], "the failed commit stays queued"
            t0 = time.monotonic()
            with pytest.raises(freight.NoSpaceError, match="500000 bytes"):
                store.wait_closed(10)
            with pytest.raises(freight.NoSpaceError):
                store.wait_for(["obj-003"], 10)
            assert time.monotonic() - t0 < 2
            assert sorted(store.keys()) == ["obj-000", "obj-001"] and store.nbytes == 2 * size
            for key in ("obj-000", "obj-001"):
                np.testing.assert_array_equal(store[key].view(), objects("flat", count=2, size=size)[key])
        finish(peer)


@pytest.mark.timeout(30)
def test_a_killed_sender_fails_the_receivers_waits_within_the_timeout(spawn):
    with agent("rx") as rx:
        peer = start(spawn, role="put", name="tx", addr=rx.addresses[0], set="flat", count=10, size=100 * KIB,
                     stop_after=3)
        store = freight.StoreReceiver(rx, buffer=MIB, timeout=20)
        assert line(peer) == {"sent": 3}
        store.wait_for(["obj-000", "obj-001", "obj-002"], timeout=5)
        kill(peer)
        t0 = time.monotonic()
        with pytest.raises(freight.PeerDisconnectedError):
            store.wait_for(["obj-009"], timeout=20)
        assert time.monotonic() - t0 < 5, "noticed at once, well before the timeout"
        with pytest.raises(freight.PeerDisconnectedError):
            store.wait_closed()
        assert len(store) == 3, "what was committed stays"
        np.testing.assert_array_equal(store["obj-001"].view(), pattern(1, 100 * KIB))
        store.close()
        assert store.closed
        with pytest.raises(freight.InvalidStateError, match="closed"):
            store.get("obj-001")
        store.close()  # harmless


# ----------------------------------------------------------------------------- one process


@pytest.mark.timeout(30)
def test_bad_puts_are_refused_and_lose_nothing():
    with agent("rx") as rx, agent("tx") as tx:
        store, sender = connected(rx, tx, sender={"commit_size": 4})
        regions = tx.registered_regions
        kept = np.arange(1000, dtype=np.int32)
        tx.register(kept)
        assert sender.put("kept", kept) is None  # registered by the caller: left as it is
        # Not registered and not referenced elsewhere: the sender keeps it alive and
        # registered until its commit returns.
        assert sender.put("temp", np.full(5000, 7, dtype=np.uint8)) is None
        assert tx.registered_regions == regions + 2
        a = np.ones(4, dtype=np.float32)
        bad = [
            ("kept", a, "already waiting"),
            ("", a, "must not be empty"),
            (7, a, "keys must be str"),
            ("nc", np.ones((4, 4))[:, ::2], "not C-contiguous"),
            ("empty", np.ones(0), "empty"),
            ("gpu", FakeCudaTensor(), "commit first"),
        ]
        for key, obj, why in bad:
            with pytest.raises(freight.InvalidArgumentError, match=why):
                sender.put(key, obj)
        with pytest.raises(TypeError):
            sender.put("bytes", b"bytes are not arrays")
        # put_many checks everything before it queues anything.
        for keys, objs, why in [
            (["x", "y"], [a], "2 keys for 1 objects"),
            (["x", "x"], [a, a], "appears twice"),
            (["x", "kept"], [a, a], "already waiting"),
            (["x", "gpu"], [a, FakeCudaTensor()], "commit first"),
        ]:
            with pytest.raises(freight.InvalidArgumentError, match=why):
                sender.put_many(keys, objs)
        assert sender.pending_keys == ["kept", "temp"] and sender.pending == 2
        assert tx.registered_regions == regions + 2, "refused puts leave no registration behind"
        stats = sender.put_many(["a", "b", "c"], [a, a * 2, a * 3])  # the fourth put commits
        assert [s.objects for s in stats] == [4] and sender.pending_keys == ["c"]
        assert tx.registered_regions == regions + 2, "'kept' by the caller, 'c' until its commit"
        last = sender.commit()
        assert last.objects == 1 and last.bytes == 16
        assert sender.commit() is None, "nothing queued, nothing sent"
        assert tx.registered_regions == regions + 1
        sender.close()
        sender.close()  # harmless
        with pytest.raises(freight.InvalidStateError, match="closed"):
            sender.put("late", a)
        store.wait_closed(10)
        assert sorted(store.keys()) == ["a", "b", "c", "kept", "temp"]
        np.testing.assert_array_equal(store["kept"].view(), kept)
        np.testing.assert_array_equal(store["temp"].view(), np.full(5000, 7, dtype=np.uint8))
        np.testing.assert_array_equal(store["c"].view(), a * 3)
        with pytest.raises(freight.InvalidStateError, match="closed before"):
            store.wait_for(["a", "never"], timeout=5)
        store.close()


@pytest.mark.timeout(30)
def test_the_receiver_counts_replaces_and_times_out_clearly():
    with agent("rx") as rx, agent("tx") as tx:
        store, sender = connected(rx, tx, receiver={"timeout": 5}, sender={"commit_size": 2})
        with sender:
            assert repr(store).startswith("<freight.StoreReceiver from ['tx']: 0 objects")
            sender.put("k0", np.zeros(100, dtype=np.uint8))
            assert sender.put("k1", np.zeros(200, dtype=np.uint8)).objects == 2
            store.wait_received(2, timeout=5)
            t0 = time.monotonic()
            with pytest.raises(freight.TimeoutError, match="1 of 2 keys within 0.3s"):
                store.wait_for(["k0", "k2"], timeout=0.3)
            with pytest.raises(freight.TimeoutError, match=r"3 objects \(got 2\)"):
                store.wait_received(3, timeout=0.2)
            assert time.monotonic() - t0 < 3
            # A key put again replaces what the store holds under it.
            sender.put("k0", np.ones(300, dtype=np.uint16))
            sender.commit()
            assert store.received == 3 and len(store) == 2 and store.nbytes == 600 + 200
            assert store["k0"].dtype == "uint16" and store["k0"].view().sum() == 300
            store.wait_for("k1", timeout=1)  # one key as a str
            with pytest.raises(freight.InvalidArgumentError):
                store.wait_for([1], timeout=1)
            assert isinstance(store.remove("k1"), freight.StoredObject) and len(store) == 1
        store.wait_closed(5)  # the sender closed on leaving the block
        assert sorted(store.keys()) == ["k0"]
        store.close()


@pytest.mark.timeout(30)
def test_an_evicting_store_drops_the_oldest_unread_objects_instead_of_filling_up():
    size = 10 * KIB
    arrays = {f"k{i}": np.full(size, i, dtype=np.uint8) for i in range(10)}
    with agent("rx") as rx, agent("tx") as tx:
        store, sender = connected(rx, tx, receiver={"capacity": 4 * size, "evict": True}, sender={"commit_size": 1})
        assert (store.capacity, store.evict, store.evicted) == (4 * size, True, 0)
        for key in ["k0", "k1", "k2", "k3"]:
            sender.put(key, arrays[key])  # commits of one: each returns once the store holds it
        reading = store["k0"]  # alive, so never evicted
        assert store.get("k1") is not None  # got, then let go of: used recently
        gc.collect()
        assert "k2" in store and store.contains("k3"), "looking is not using"
        sender.put("k4", arrays["k4"])
        sender.put("k5", arrays["k5"])
        assert sorted(store.keys()) == ["k0", "k1", "k4", "k5"], "the oldest unread went"
        # k0 is the oldest now, but it is being read: k1 goes instead.
        sender.put("k6", arrays["k6"])
        assert sorted(store.keys()) == ["k0", "k4", "k5", "k6"]
        np.testing.assert_array_equal(reading.view(), arrays["k0"])
        del reading
        gc.collect()
        for key in ["k7", "k8", "k9"]:
            sender.put(key, arrays[key])
        assert sorted(store.keys()) == ["k6", "k7", "k8", "k9"]
        assert (store.evicted, store.received, store.nbytes, len(store)) == (6, 10, 4 * size, 4)
        for key in store.keys():
            np.testing.assert_array_equal(store[key].view(), arrays[key])
        sender.close()
        store.wait_closed(5)  # nothing failed on the way
        store.close()


def test_bad_arguments_are_refused_clearly():
    with agent("a") as a:
        with pytest.raises(freight.InvalidArgumentError):
            freight.StoreReceiver(a, num_senders=0)
        with pytest.raises(freight.InvalidArgumentError):
            freight.StoreReceiver(a, capacity=-1)
        with pytest.raises(freight.InvalidArgumentError, match="needs a capacity"):
            freight.StoreReceiver(a, evict=True)
        with pytest.raises(freight.InvalidArgumentError, match="True or False"):
            freight.StoreReceiver(a, capacity=MIB, evict="yes")
        with pytest.raises(freight.InvalidArgumentError, match="too small"):
            freight.StoreReceiver(a, num_senders=2, buffer=256)
        with pytest.raises(freight.TimeoutError):
            freight.StoreReceiver(a, buffer=MIB, timeout=0.2)
        with pytest.raises(freight.InvalidArgumentError, match="commit_size"):
            freight.StoreSender(a, a.addresses[0], commit_size=0)
        with pytest.raises(TypeError):
            freight.StoreSender(object(), "127.0.0.1:1")


@pytest.mark.timeout(30)
def test_ends_dropped_without_close_let_go_of_their_temporary_registrations():
    with agent("rx") as rx, agent("tx") as tx:
        regions = rx.registered_regions, tx.registered_regions
        store, sender = connected(rx, tx, receiver={"buffer": np.zeros(MIB, dtype=np.uint8)},
                                  sender={"commit_size": 100})
        sender.put("k", np.arange(1000, dtype=np.int32))  # registered until its commit
        assert (rx.registered_regions, tx.registered_regions) == (regions[0] + 1, regions[1] + 1)
        del sender  # closing commits: the object arrives, then its memory is let go
        gc.collect()
        assert tx.registered_regions == regions[1]
        store.wait_for("k", timeout=5)
        obj = store["k"]
        del store
        gc.collect()
        assert rx.registered_regions == regions[0]
        out = bytearray(4000)  # a plain buffer takes the raw bytes
        assert obj.copy_to(out) is out and bytes(out) == np.arange(1000, dtype=np.int32).tobytes()
        with pytest.raises(freight.InvalidArgumentError, match="holds 100 bytes"):
            obj._raw.copy_to("DRAM", np.zeros(100, np.uint8).ctypes.data, 100)


@pytest.mark.timeout(30)
def test_huge_timeouts_wait_like_long_ones_and_bad_ones_are_refused():
    with agent("rx") as rx, agent("tx") as tx:
        store, sender = connected(rx, tx, receiver={"timeout": 1e19}, sender={"timeout": 1e19, "commit_size": 1})
        sender.put("k", np.arange(10, dtype=np.uint8))
        store.wait_for("k", timeout=1e19)
        store.wait_received(1, timeout=1e19)
        store.wait_for("k")  # the receiver's own timeout, as long
        for bad in (-1.0, float("nan")):
            with pytest.raises(freight.InvalidArgumentError, match="finite number of seconds"):
                store.wait_for("k", timeout=bad)
        sender.close()
        store.wait_closed(1e19)
        store.close()


@pytest.mark.timeout(30)
def test_a_put_whose_early_batch_fails_stays_queued_like_a_failed_commit():
    with agent("rx") as rx, agent("tx") as tx:
        # Batches of one: every put sends its object at once.
        store, sender = connected(rx, tx, sender={"commit_size": 100, "batch_size": 1})
        regions = tx.registered_regions
        sender.put("a", np.arange(100, dtype=np.uint8))
        store.wait_for("a", timeout=5)
        tx.remove_peer("rx")  # the next batch cannot go
        with pytest.raises(freight.FreightError):
            sender.put("b", np.arange(200, dtype=np.uint8))
        assert sender.pending_keys == ["a", "b"], "the object stays queued, as a failed commit's do"
        assert tx.registered_regions == regions + 2, "and keeps its registration meanwhile"
        with pytest.raises(freight.InvalidArgumentError, match="already waiting"):
            sender.put("b", np.zeros(10, dtype=np.uint8))
        with pytest.raises(freight.FreightError):
            sender.commit()
        assert sender.pending_keys == ["a", "b"]
        with pytest.raises(freight.FreightError):
            sender.close()
        assert tx.registered_regions == regions, "closing lets go of what stayed queued"
        store.close()
