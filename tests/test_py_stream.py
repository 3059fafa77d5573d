"""Pipes and channels from Python, between real processes over real sockets.

The other side of each test runs tests/stream_peer.py in its own process. Streams are
larger than the receiver's buffer (the sender waits for space), and every byte is
checked against deterministic patterns. Failures of either side must surface as freight
errors within the timeout, never as a hang.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import freight
from stream_peer import notifs_until, objects, pattern, sha
from test_py_transfer import readline

HERE = Path(__file__).resolve().parent
PEER = (HERE / "stream_peer.py").read_text()
KIB, MIB = 1 << 10, 1 << 20
TRANSPORTS = ["shm", "tcp"]


def start(spawn, **args) -> subprocess.Popen:
    """A stream_peer.py process with these arguments."""
    return spawn(PEER, json.dumps(args), stdin=True)


def line(proc: subprocess.Popen) -> dict:
    return json.loads(readline(proc))


def finish(proc: subprocess.Popen) -> None:
    """Lets a peer that lingers exit, and checks that it exited cleanly."""
    proc.stdin.close()
    assert proc.wait(timeout=15) == 0, proc.stderr.read()


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def agent(name: str, transport: str = None) -> freight.Agent:
    return freight.Agent(name, freight.AgentConfig(require=transport))


def plain_notifs(a: freight.Agent, last: str, timeout: float = 10.0) -> list:
    """Notifications by polling get_notifs (the non-blocking path) until ``last``."""
    got: list = []
    deadline = time.monotonic() + timeout
    while last not in got and time.monotonic() < deadline:
        got += [m.decode() for _, m in a.get_notifs()]
        time.sleep(0.01)
    return got


# ----------------------------------------------------------------------------- pipe


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pipe_streams_more_than_its_buffer_whole_and_in_order(spawn, transport):
    with agent("rx", transport) as rx:
        listener = freight.PipeListener(rx)
        peer = start(spawn, role="pipe-send", name="tx", addr=rx.addresses[0], require=transport,
                     count=40, size=256 * KIB, seed=7)
        with listener.accept(buffer=MIB, timeout=20) as pipe:
            assert (pipe.capacity, pipe.kind, pipe.peer) == (MIB, "DRAM", "tx")
            seqs = []
            for msg in pipe:
                with msg:
                    assert msg.tag == f"obj-{msg.seq}".encode()
                    assert (len(msg), msg.kind) == (256 * KIB, "DRAM")
                    view = msg.view()
                    assert view.dtype == np.uint8 and view.shape == (256 * KIB,)
                    np.testing.assert_array_equal(view, pattern(7 + msg.seq, 256 * KIB))
                    seqs.append(msg.seq)
                assert msg.released
                with pytest.raises(freight.InvalidStateError):
                    msg.view()
            assert seqs == list(range(40))
            assert pipe.recv(timeout=1) is None  # the end stays the end
            assert pipe.finished and pipe.held == 0
        assert line(peer) == {"done": True, "path": transport}
        # Notifications beside the pipe still reach the agent, pipe messages do not.
        assert plain_notifs(rx, "after") == ["before", "after"]
        finish(peer)


@pytest.mark.timeout(30)
def test_pipe_receiver_buffer_can_be_a_caller_array_and_messages_release_out_of_order(spawn):
    with agent("rx") as rx:
        buf = np.zeros(MIB, dtype=np.uint8)  # not registered: accept registers it
        listener = freight.PipeListener(rx)
        peer = start(spawn, role="pipe-send", name="tx", addr=rx.addresses[0], count=12, size=200 * KIB, seed=3)
        regions = rx.registered_regions
        pipe = listener.accept(buffer=buf, timeout=20)
        assert rx.registered_regions == regions + 1 and pipe.capacity == MIB
        held = []
        for i in range(12):
            msg = pipe.recv()
            view = msg.view()
            # Zero-copy: the view is the caller's buffer.
            assert buf.ctypes.data <= view.ctypes.data < buf.ctypes.data + MIB
            np.testing.assert_array_equal(view, pattern(3 + i, 200 * KIB))
            held.append(msg)
            if len(held) == 3:  # release the newest first: space frees once the oldest goes
                for m in reversed(held):
                    m.release()
                held.clear()
        for m in held:
            m.release()
        assert pipe.recv() is None
        pipe.close()
        assert rx.registered_regions == regions
        assert line(peer)["done"]
        finish(peer)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("product", ["pipe", "channel"])
def test_a_sender_may_exit_right_after_closing(spawn, product):
    """Everything sent before close arrives, although the sender is gone by then."""
    with agent("rx") as rx:
        args = dict(name="tx", addr=rx.addresses[0], count=4, size=200 * KIB, linger=False)  # fits the buffer
        if product == "pipe":
            listener = freight.PipeListener(rx)
            peer = start(spawn, role="pipe-send", **args)
            end = listener.accept(buffer=MIB, timeout=20)
        else:
            peer = start(spawn, role="chan-send", set="flat", **args)
            end = freight.ChannelReceiver(rx, buffer=MIB, timeout=20)
        assert line(peer)["done"]
        assert peer.wait(timeout=15) == 0
        got = []
        for item in end:
            for x in item if product == "channel" else [item]:
                with x:
                    got.append(sha(x.view()))
        assert got == [sha(pattern(i, 200 * KIB)) for i in range(4)]
        end.close()


# ----------------------------------------------------------------------------- channel


class FakeCudaTensor:
    """Looks like a CUDA tensor to freight's duck typing (never touched: the send is
    refused before)."""

    dtype = "torch.float32"
    shape = (4,)
    device = SimpleNamespace(type="cuda", index=0)

    def data_ptr(self):
        return 0x7F0000000000

    def numel(self):
        return 4

    def element_size(self):
        return 4

    def is_contiguous(self):
        return True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_channel_streams_more_than_its_buffer_and_survives_bad_input(spawn, transport):
    peer = start(spawn, role="chan-recv", name="rx", require=transport, buffer=MIB)
    addr = line(peer)["addr"]
    objs = objects("flat", count=40, size=256 * KIB)
    keys = list(objs)
    with agent("tx", transport) as tx:
        name = tx.connect(addr)
        tx.notify(name, b"before")
        regions = tx.registered_regions
        with freight.ChannelSender(tx, addr, batch_size=8) as ch:
            assert ch.capacity == MIB and ch.peer == "rx"
            ch.send(keys[:20], [objs[k] for k in keys[:20]])
            a = np.ones(4, dtype=np.float32)
            bad = [
                (["a", "b"], [a], "2 keys for 1 objects"),
                (["a", "a"], [a, a], "appears twice"),
                ([""], [a], "must not be empty"),
                ([7], [a], "keys must be str"),
                (["a"], [np.ones((4, 4))[:, ::2]], "not C-contiguous"),
                (["a"], [np.ones(0)], "empty"),
                (["a", "b"], [a, FakeCudaTensor()], "same kind of memory"),
            ]
            for ks, ts, why in bad:
                with pytest.raises(freight.InvalidArgumentError, match=why):
                    ch.send(ks, ts)
            with pytest.raises(TypeError):
                ch.send(["a"], [b"bytes are not arrays"])
            ch.send(keys[20:], [objs[k] for k in keys[20:]])
        # Objects sent unregistered were registered for their call only.
        assert tx.registered_regions == regions
        assert tx.path_to(name).transport == transport
        tx.notify(name, b"after")
        summary = line(peer)
    assert [o["key"] for o in summary["objects"]] == keys
    for o in summary["objects"]:
        assert o["sha256"] == sha(objs[o["key"]]), o["key"]
        assert o["meta"] == {"dtype": "uint8", "shape": [256 * KIB]}
        assert o["is_view"] and o["sender"] == 0
    assert summary["peers"] == ["tx"]
    assert summary["notifs"] == ["before", "after"]


@pytest.mark.timeout(30)
def test_channel_round_trips_dtypes_shapes_and_objects_larger_than_the_buffer(spawn):
    want = objects("mixed")
    with agent("rx") as rx:
        peer = start(spawn, role="chan-send", name="tx", addr=rx.addresses[0], set="mixed", batch=3)
        calls = []

        def observer(keys, objs):
            assert all(isinstance(o, freight.Received) for o in objs) and [o.key for o in objs] == keys
            calls.append(keys)
            time.sleep(0.03)

        with freight.ChannelReceiver(rx, buffer=MIB, timeout=20) as ch:
            ch.add_observer(observer)
            views = {}
            for batch in ch:
                assert ch.last_observer_seconds >= 0.03
                for r in batch:
                    with r:
                        exp = want[r.key]
                        assert (r.dtype, r.shape, r.nbytes) == (exp.dtype.name, exp.shape, exp.nbytes)
                        assert r.meta == {"dtype": exp.dtype.name, "shape": list(exp.shape)}
                        v = r.view()
                        assert (v.dtype, v.shape) == (exp.dtype, exp.shape)
                        np.testing.assert_array_equal(v, exp)
                        dst = np.empty_like(exp)
                        assert r.copy_to(dst) is dst
                        np.testing.assert_array_equal(dst, exp)
                        with pytest.raises(freight.InvalidArgumentError, match="bytes"):
                            r.copy_to(np.empty(exp.size + 1, dtype=exp.dtype))
                        with pytest.raises(freight.InvalidArgumentError, match="C-contiguous"):
                            r.copy_to(np.empty(exp.size * 2, dtype=exp.dtype)[::2])
                        if exp.dtype != np.uint8:
                            with pytest.raises(freight.InvalidArgumentError, match=exp.dtype.name):
                                r.copy_to(np.empty(exp.nbytes, dtype=np.uint8))
                        views[r.key] = r.is_view
            assert ch.batches == len(calls) > 1
            assert ch.observer_seconds >= 0.03 * len(calls)
            assert ch.recv_seconds > 0
        assert [k for keys in calls for k in keys] == list(want)
        # The 3 MiB object cannot be a view of a 1 MiB buffer: it was reassembled.
        assert views == {k: k != "big" for k in want}
        assert line(peer)["done"]
        finish(peer)


@pytest.mark.timeout(30)
def test_channel_views_keep_the_callers_buffer_alive_after_close(spawn):
    want = objects("flat", "", 3, 10_000)
    with agent("rx") as rx:
        peer = start(spawn, role="chan-send", name="tx", addr=rx.addresses[0], set="flat", count=3, size=10_000,
                     batch=3)
        buf = np.zeros(MIB, dtype=np.uint8)
        alive = weakref.ref(buf)
        ch = freight.ChannelReceiver(rx, buffer=buf, timeout=20)
        got = ch.recv()
        assert [r.key for r in got] == list(want) and all(r.is_view for r in got)
        del buf
        ch.close()
        del ch
        gc.collect()
        assert alive() is not None, "views point into the buffer: it lives as long as they do"
        for r in got:
            np.testing.assert_array_equal(r.view(), want[r.key])
        del got, r
        gc.collect()
        assert alive() is None, "the last view gone, the buffer goes"
        assert line(peer)["done"]
        finish(peer)


@pytest.mark.timeout(30)
def test_channel_takes_two_sender_processes(spawn):
    with agent("rx") as rx:
        senders = {
            p: start(spawn, role="chan-send", name=f"tx-{p}", addr=rx.addresses[0], set="flat", prefix=f"{p}/",
                     count=15, size=100_000, batch=4)
            for p in ("a", "b")
        }
        want = {**objects("flat", "a/", 15, 100_000), **objects("flat", "b/", 15, 100_000)}
        order = {"a": [], "b": []}
        with freight.ChannelReceiver(rx, num_senders=2, buffer=2 * MIB, timeout=20) as ch:
            assert sorted(ch.peers) == ["tx-a", "tx-b"]
            for batch in ch:
                for r in batch:
                    with r:
                        np.testing.assert_array_equal(r.view(), want[r.key])
                        prefix = r.key.split("/")[0]
                        assert ch.peers[r.sender] == f"tx-{prefix}"
                        order[prefix].append(r.key)
        for p, proc in senders.items():
            assert order[p] == [k for k in want if k.startswith(p + "/")]
            assert line(proc)["done"]
            finish(proc)


# ----------------------------------------------------------------------------- failures


@pytest.mark.timeout(30)
@pytest.mark.parametrize("product", ["pipe", "channel"])
def test_a_sender_killed_mid_stream_fails_recv_within_the_timeout(spawn, product):
    with agent("rx") as rx:
        common = dict(name="tx", addr=rx.addresses[0], count=20, size=256 * KIB, stop_after=4)
        if product == "pipe":
            listener = freight.PipeListener(rx)
            peer = start(spawn, role="pipe-send", **common)
            end = listener.accept(buffer=MIB, timeout=10)
            assert line(peer) == {"sent": 4}
            for _ in range(4):
                end.recv().release()
        else:
            peer = start(spawn, role="chan-send", set="flat", batch=2, **common)
            end = freight.ChannelReceiver(rx, buffer=MIB, timeout=10)
            assert line(peer) == {"sent": 4}
            got = 0
            while got < 4:
                batch = end.recv()
                got += len(batch)
                for r in batch:
                    r.release()
        kill(peer)
        t0 = time.monotonic()
        with pytest.raises(freight.PeerDisconnectedError):
            end.recv()
        assert time.monotonic() - t0 < 5  # noticed at once, well before the timeout
        end.close()


@pytest.mark.timeout(30)
def test_a_receiver_killed_fails_the_sender(spawn):
    peer = start(spawn, role="pipe-recv", name="rx", buffer=MIB, hold=2)
    addr = line(peer)["addr"]
    with agent("tx") as tx:
        src = np.zeros(256 * KIB, dtype=np.uint8)
        tx.register(src)
        pipe = freight.PipeSender.connect(tx, addr, timeout=10)
        for _ in range(4):  # fills the buffer
            pipe.send(src)
        pipe.flush()
        assert line(peer) == {"holding": 2}
        kill(peer)
        t0 = time.monotonic()
        with pytest.raises(freight.PeerDisconnectedError):
            pipe.send(src)  # no room until the receiver releases: it never will
            pipe.drain()
        assert time.monotonic() - t0 < 5
        # The pipe stays broken, and says so at once.
        with pytest.raises(freight.FreightError):
            pipe.send(src)


def test_bad_arguments_are_refused_clearly():
    with agent("a") as a:
        listener = freight.PipeListener(a)
        with pytest.raises(freight.InvalidArgumentError):
            listener.accept(buffer=0)
        with pytest.raises(freight.InvalidArgumentError):
            listener.accept(buffer=np.zeros(0, dtype=np.uint8))
        with pytest.raises(freight.TimeoutError):
            listener.accept(buffer=MIB, timeout=0.2)
        with pytest.raises(TypeError):
            freight.PipeListener(object())
        with pytest.raises(freight.InvalidArgumentError):
            freight.ChannelReceiver(a, num_senders=0)
        with pytest.raises(freight.InvalidArgumentError):
            freight.ChannelReceiver(a, num_senders=2, buffer=256)
