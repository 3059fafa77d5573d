"""Pipes and channels from Python, between real processes over real sockets.

The other side of each test runs tests/stream_peer.py in its own process. Streams are
larger than the receiver's buffer (the sender waits for space), and every byte is
checked against deterministic patterns. Failures of either side must surface as freight
errors within the timeout, never as a hang.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import freight
from conftest import Interrupted
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
            # While the channel is open, the receiver's buffer is there to reach (once
            # it closes, a peer refresh may find no memory of its in shared segments).
            assert tx.path_to(name).transport == transport
        # Objects sent unregistered were registered for their call only.
        assert tx.registered_regions == regions
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
        # The sender's end of the stream first: closing before it arrives aborts the sender.
        assert ch.recv() is None
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


# ----------------------------------------------------------------------------- in one process


def pipe_pair(rx: freight.Agent, tx: freight.Agent, **accept) -> tuple:
    """A PipeReceiver on ``rx`` and a PipeSender on ``tx`` feeding it (one process)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(tx=freight.PipeSender.connect(tx, rx.addresses[0], timeout=10)))
    t.start()
    pipe = freight.PipeListener(rx).accept(**{"buffer": MIB, "timeout": 10, **accept})
    t.join(timeout=15)
    return pipe, box["tx"]


def channel_pair(rx: freight.Agent, tx: freight.Agent, **receiver) -> tuple:
    """A ChannelReceiver on ``rx`` and a ChannelSender on ``tx`` feeding it (one process)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(tx=freight.ChannelSender(tx, rx.addresses[0], batch_size=1)))
    t.start()
    ch = freight.ChannelReceiver(rx, **{"buffer": MIB, "timeout": 10, **receiver})
    t.join(timeout=15)
    return ch, box["tx"]


def fail_in_thread(wait, then) -> dict:
    """Runs ``wait`` on a thread, and ``then`` here once it waits: the error the wait
    ended with ("error") and how long it took ("waited")."""
    outcome = {}

    def waiting():
        start = time.monotonic()
        try:
            wait()
        except freight.FreightError as e:
            outcome["error"] = e
        outcome["waited"] = time.monotonic() - start

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(0.3)
    then()
    t.join(timeout=10)
    return outcome


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


STALE_VIEW = r"""
import gc, sys, threading
import numpy as np
import freight

product = sys.argv[1]
rx, tx = freight.Agent("rx"), freight.Agent("tx")
src = np.full(1 << 19, 7, dtype=np.uint8)
if product == "pipe":
    box = {}
    t = threading.Thread(target=lambda: box.update(p=freight.PipeSender.connect(tx, rx.addresses[0], timeout=10)))
    t.start()
    end = freight.PipeListener(rx).accept(buffer=4 << 20, timeout=10)
    t.join()
    box["p"].send(src)
    box["p"].close()
    with end.recv() as item:
        view = item.view()
else:
    box = {}
    t = threading.Thread(target=lambda: box.update(c=freight.ChannelSender(tx, rx.addresses[0])))
    t.start()
    end = freight.ChannelReceiver(rx, buffer=4 << 20, timeout=10)
    t.join()
    box["c"].send(["k"], [src])
    box["c"].close()
    (item,) = end.recv()
    assert item.is_view
    with item:
        view = item.view()
end.close()
del end, item, box
gc.collect()
print(int(view.sum()), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("product", ["pipe", "channel"])
def test_a_view_kept_past_release_and_close_still_sees_mapped_memory(spawn, product):
    """The pipe's buffer goes with the receiver, but not under a view of it."""
    proc = spawn(STALE_VIEW, product)
    out, err = proc.communicate(timeout=40)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err}"
    assert int(out) == 7 << 19


@pytest.mark.timeout(60)
def test_a_viewed_reassembled_object_is_not_reused_before_the_object_goes():
    with agent("rx") as rx, agent("tx") as tx:
        ch, sender = channel_pair(rx, tx)
        first, second = pattern(1, 3 * MIB), pattern(2, 3 * MIB)  # three times the buffer
        t = in_thread(lambda: (sender.send(["a", "b"], [first, second]), sender.close()))
        (a,) = ch.recv()
        assert a.key == "a" and not a.is_view
        view = a.view()
        a.release()
        (b,) = ch.recv()  # reassembled in memory of the same size
        assert b.key == "b"
        np.testing.assert_array_equal(b.view(), second)
        np.testing.assert_array_equal(view, first)
        t.join(timeout=15)
        ch.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("product", ["pipe", "channel", "store"])
def test_ctrl_c_interrupts_a_receiver_waiting_for_its_senders(ctrl_c_soon, product):
    with agent("rx") as rx:
        start = time.monotonic()
        with pytest.raises(Interrupted):
            if product == "pipe":
                freight.PipeListener(rx).accept(buffer=MIB, timeout=10)
            elif product == "channel":
                freight.ChannelReceiver(rx, buffer=MIB, timeout=10)
            else:
                freight.StoreReceiver(rx, buffer=MIB, timeout=10)
        assert time.monotonic() - start < 3


@pytest.mark.timeout(30)
def test_ctrl_c_interrupts_a_send_waiting_for_room_and_the_pipe_goes_on(ctrl_c_soon):
    with agent("rx") as rx, agent("tx") as tx:
        pipe, sender = pipe_pair(rx, tx, buffer=64 * KIB)
        src = np.zeros(32 * KIB, dtype=np.uint8)
        tx.register(src)
        sender.send(src)
        sender.send(src)
        held = [pipe.recv(), pipe.recv()]  # the buffer is full, and stays so
        start = time.monotonic()
        with pytest.raises(Interrupted):
            sender.send(src)
        assert time.monotonic() - start < 3
        for m in held:
            m.release()
        sender.send(src)  # nothing was taken or broken
        sender.close()
        assert pipe.recv().nbytes == 32 * KIB
        assert pipe.recv() is None


@pytest.mark.timeout(30)
def test_ctrl_c_interrupts_a_recv_and_the_pipe_goes_on(ctrl_c_soon):
    with agent("rx") as rx, agent("tx") as tx:
        pipe, sender = pipe_pair(rx, tx, buffer=64 * KIB)
        start = time.monotonic()
        with pytest.raises(Interrupted):
            pipe.recv(timeout=10)
        assert time.monotonic() - start < 3
        src = np.arange(100, dtype=np.uint8)
        tx.register(src)
        sender.send(src)
        sender.close()
        np.testing.assert_array_equal(pipe.recv().view(), src)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("product", ["pipe", "store"])
def test_close_ends_a_wait_on_another_thread(product):
    with agent("rx") as rx, agent("tx") as tx:
        if product == "pipe":
            end, sender = pipe_pair(rx, tx, buffer=64 * KIB)
            wait = lambda: end.recv(timeout=20)  # noqa: E731
        else:
            box = {}
            t = threading.Thread(target=lambda: box.update(rx=freight.StoreReceiver(rx, buffer=MIB, timeout=10)))
            t.start()
            sender = freight.StoreSender(tx, rx.addresses[0], timeout=10)
            t.join(timeout=15)
            end = box["rx"]
            wait = lambda: end.wait_for(["never"], timeout=20)  # noqa: E731
        outcome = fail_in_thread(wait, then=end.close)
        assert isinstance(outcome.get("error"), freight.InvalidStateError), outcome
        assert outcome["waited"] < 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("product", ["pipe", "channel"])
def test_abort_from_another_thread_ends_a_waiting_send_and_tells_the_receiver(product):
    with agent("rx") as rx, agent("tx") as tx:
        # Whole messages held by the receiver fill its 64 KiB buffer (a channel's
        # objects stay whole up to a quarter of it).
        fill, src = (2, np.zeros(24 * KIB, dtype=np.uint8)) if product == "pipe" else (4, np.zeros(15 * KIB, np.uint8))
        tx.register(src)
        if product == "pipe":
            end, sender = pipe_pair(rx, tx, buffer=64 * KIB)
            send = lambda: sender.send(src)  # noqa: E731
            take = lambda: [end.recv(timeout=10)]  # noqa: E731
        else:
            end, sender = channel_pair(rx, tx, buffer=64 * KIB)
            send = lambda: sender.send(["k"], [src])  # noqa: E731
            take = lambda: end.recv(timeout=10)  # noqa: E731
        held = []
        for _ in range(fill):
            send()
            held += take()  # the buffer fills, and stays so
        outcome = fail_in_thread(send, then=lambda: sender.abort("the prefill was cancelled"))
        assert isinstance(outcome.get("error"), freight.InvalidStateError), outcome
        assert "the prefill was cancelled" in str(outcome["error"])
        assert outcome["waited"] < 5
        with pytest.raises(freight.InvalidStateError, match="aborted"):
            send()
        for m in held:
            m.release()
        # The receiver learns why, instead of seeing the end of a whole stream.
        with pytest.raises(freight.FreightError, match="the prefill was cancelled"):
            take()
        sender.abort("again")  # harmless
        sender.close()  # the abort ended the stream already
        sender.abort("after close")
        with pytest.raises(freight.InvalidStateError, match="closed"):
            send()


@pytest.mark.timeout(30)
def test_a_zero_accept_timeout_is_refused():
    with agent("rx") as rx:
        with pytest.raises(freight.InvalidArgumentError, match="positive"):
            freight.PipeListener(rx).accept(buffer=MIB, timeout=0)


RING_BYTES = 1 << 20  # the engine's notification ring (see test_py_doorbell.py)


@pytest.mark.timeout(90)
def test_a_credit_the_sender_does_not_take_fails_recv_instead_of_being_waited_out(spawn):
    from test_py_doorbell import stop

    with freight.Agent("rx", freight.AgentConfig(peer_timeout=1.0)) as rx:
        peer = start(spawn, role="pipe-send", name="tx", addr=rx.addresses[0], count=10, size=256 * KIB,
                     stop_after=2)
        pipe = freight.PipeListener(rx).accept(buffer=MIB, timeout=20, credit_batch=MIB)
        assert line(peer) == {"sent": 2}
        first, second = pipe.recv(), pipe.recv()
        first.release()  # the second is held: no credit is due until recv waits
        stop(peer.pid)
        try:
            # The stopped sender's notification ring fills up, to the last bytes.
            for size in (1000, 1):
                with pytest.raises(freight.TimeoutError):
                    for _ in range(2 * RING_BYTES // size):
                        rx.notify("tx", b"x" * size)
            t0 = time.monotonic()
            with pytest.raises(freight.TimeoutError, match="took no notifications"):
                pipe.recv(timeout=8)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        kill(peer)
        pipe.close()
        del second  # its credit cannot go anywhere: logged, not raised


@pytest.mark.timeout(30)
def test_negative_numbers_and_plain_buffers():
    with agent("rx") as rx, agent("tx") as tx:
        with pytest.raises(freight.InvalidArgumentError, match="credit_batch"):
            freight.PipeListener(rx).accept(buffer=MIB, credit_batch=-1)
        with pytest.raises(freight.InvalidArgumentError, match="credit_batch"):
            freight.ChannelReceiver(rx, buffer=MIB, credit_batch=-1)
        pipe, sender = pipe_pair(rx, tx)
        src = np.arange(8, dtype=np.uint8)
        with pytest.raises(freight.InvalidArgumentError, match="offset"):
            sender.send_scattered(src, [(-1, 8)])
        sender.send_scattered(src, [(4, 4), (0, 4)])
        with pipe.recv() as msg:
            assert msg.view().tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
        sender.close()
        pipe.close()

        ch, chan = channel_pair(rx, tx)
        chan.send(["f"], [np.arange(4, dtype=np.float32)])
        (r,) = ch.recv()
        out = bytearray(16)  # a plain buffer takes the raw bytes
        assert r.copy_to(out) is out and bytes(out) == np.arange(4, dtype=np.float32).tobytes()
        with pytest.raises(freight.InvalidArgumentError, match="holds 8 bytes"):
            r._raw.copy_to("DRAM", np.zeros(8, np.uint8).ctypes.data, 8)  # the native check itself
        r.release()
        chan.close()
        ch.close()


@pytest.mark.timeout(30)
def test_temporary_registrations_go_with_ends_dropped_without_close():
    with agent("rx") as rx, agent("tx") as tx:
        regions = rx.registered_regions, tx.registered_regions
        pipe, sender = pipe_pair(rx, tx, buffer=np.zeros(MIB, dtype=np.uint8))
        sender.send(np.ones(1000, dtype=np.uint8))  # registered until the next flush
        assert (rx.registered_regions, tx.registered_regions) == (regions[0] + 1, regions[1] + 1)
        msg = pipe.recv()
        del pipe, sender
        gc.collect()
        assert (rx.registered_regions, tx.registered_regions) == regions
        assert msg.view().sum() == 1000, "a message outlives its receiver"
        del msg

        ch, chan = channel_pair(rx, tx, buffer=np.zeros(MIB, dtype=np.uint8))
        assert rx.registered_regions == regions[0] + 1
        del ch, chan
        gc.collect()
        assert rx.registered_regions == regions[0]


# ----------------------------------------------------------------------------- temporary registrations after failures

BIG = 64 * MIB

# A pipe receiver in a process of its own, over tcp, so that stopping it holds the
# sender's writes up on their way. With "stop_after_first" it stops itself once the
# first message landed. A line on stdin makes it abort the pipe; closing stdin, exit.
RECEIVER = r"""
import json, os, signal, sys
import freight

args = json.loads(sys.argv[1])
with freight.Agent("rx", freight.AgentConfig(require="tcp")) as rx:
    listener = freight.PipeListener(rx)
    print(json.dumps({"addr": rx.addresses[0]}), flush=True)
    pipe = listener.accept(buffer=args["buffer"], timeout=20)
    if args.get("stop_after_first"):
        first = pipe.recv()
        print(json.dumps({"got": first.seq}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        print(json.dumps({"accepted": True}), flush=True)
    if sys.stdin.readline():
        pipe.close()
    sys.stdin.read()
"""


def receiver_process(spawn, buffer: int, stop_after_first: bool = False) -> tuple:
    """A RECEIVER process and the address it listens at."""
    peer = spawn(RECEIVER, json.dumps({"buffer": buffer, "stop_after_first": stop_after_first}), stdin=True)
    return peer, line(peer)["addr"]


def tcp_agent(name: str) -> freight.Agent:
    # A receiver the test stopped must not be taken for dead meanwhile.
    return freight.Agent(name, freight.AgentConfig(require="tcp", peer_timeout=120.0))


def writes_held_up(spawn, tx: freight.Agent, timeout: float = 20) -> tuple:
    """A PipeSender on ``tx`` that sent 4 x 64 MiB of memory not registered before, to a
    receiver process stopped meanwhile: the writes stay on their way until it goes on
    (SIGCONT). Returns the process, the sender and the arrays."""
    from test_py_doorbell import stop

    peer, addr = receiver_process(spawn, buffer=4 * BIG + MIB)
    sender = freight.PipeSender.connect(tx, addr, timeout=timeout)
    assert line(peer) == {"accepted": True}
    sender.send(np.ones(MIB, dtype=np.uint8))  # opens the data path while the receiver answers
    sender.flush()
    stop(peer.pid)
    arrays = [np.full(BIG, i, dtype=np.uint8) for i in range(4)]
    for a in arrays:
        sender.send(a)
    return peer, sender, arrays


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """SIGINT to this process in ``seconds``, raising Interrupted (as the ctrl_c_soon
    fixture does, but timed from here)."""

    def interrupted(*_):
        raise Interrupted()

    previous = signal.signal(signal.SIGINT, interrupted)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(90)
def test_closing_after_an_abort_deregisters_temporary_regions_once_their_writes_land(spawn, caplog):
    with tcp_agent("tx") as tx:
        regions = tx.registered_regions
        peer, sender, _arrays = writes_held_up(spawn, tx)
        assert tx.registered_regions == regions + 4
        sender.abort("the prefill was cancelled")
        os.kill(peer.pid, signal.SIGCONT)  # the writes go on, and take a while
        with caplog.at_level(logging.WARNING, logger="freight.stream"):
            sender.close()
        assert tx.registered_regions == regions, "a temporary registration outlived the abort"
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        finish(peer)


@pytest.mark.timeout(90)
def test_ctrl_c_interrupts_the_wait_for_writes_after_an_abort_and_close_waits_again(spawn):
    with tcp_agent("tx") as tx:
        regions = tx.registered_regions
        peer, sender, _arrays = writes_held_up(spawn, tx)
        sender.abort("the prefill was cancelled")
        start = time.monotonic()
        # The flush fails at once (aborted); its temporary regions then wait for the
        # writes that still read them, which a stopped receiver holds up.
        with ctrl_c_after(0.3), pytest.raises(Interrupted):
            sender.flush()
        assert time.monotonic() - start < 3
        assert tx.registered_regions == regions + 4, "regions still in use stay registered"
        os.kill(peer.pid, signal.SIGCONT)
        sender.close()
        assert tx.registered_regions == regions
        finish(peer)


@pytest.mark.timeout(90)
def test_regions_still_in_use_when_a_close_gives_up_are_deregistered_on_a_later_try(spawn):
    with tcp_agent("tx") as tx:
        regions = tx.registered_regions
        peer, sender, _arrays = writes_held_up(spawn, tx, timeout=1)
        sender.abort("the prefill was cancelled")
        with pytest.raises(freight.TimeoutError):
            sender.close()  # the writes do not land within the pipe's timeout
        assert tx.registered_regions == regions + 4
        os.kill(peer.pid, signal.SIGCONT)
        # The writes land in a while; each close tries the regions again until then.
        deadline = time.monotonic() + 30
        while tx.registered_regions != regions:
            assert time.monotonic() < deadline, "the regions in use were forgotten, not deregistered"
            sender.close()
            time.sleep(0.05)
        finish(peer)


@pytest.mark.timeout(90)
def test_a_receiver_that_aborts_mid_send_leaves_no_temporary_registrations(spawn, caplog):
    from test_py_doorbell import stopped

    with tcp_agent("tx") as tx:
        regions = tx.registered_regions
        # Objects of 64 MiB go in two messages of 32 MiB, four of which fill the buffer.
        peer, addr = receiver_process(spawn, buffer=2 * BIG, stop_after_first=True)
        chan = freight.ChannelSender(tx, addr, batch_size=1, timeout=20)
        arrays = [np.full(BIG, i, dtype=np.uint8) for i in range(4)]
        outcome = {}

        def send():
            try:
                chan.send([f"k{i}" for i in range(4)], arrays)
            except freight.FreightError as e:
                outcome["error"] = e

        with caplog.at_level(logging.WARNING, logger="freight.stream"):
            t = in_thread(send)
            # The first message landed; the receiver stopped itself with the next on their way.
            assert line(peer) == {"got": 0}
            deadline = time.monotonic() + 10
            while not stopped(peer.pid):
                assert time.monotonic() < deadline, "the receiver did not stop"
                time.sleep(0.01)
            peer.stdin.write("abort\n")
            peer.stdin.flush()
            os.kill(peer.pid, signal.SIGCONT)
            t.join(timeout=60)
        assert isinstance(outcome.get("error"), freight.PeerDisconnectedError), outcome
        assert tx.registered_regions == regions, "a temporary registration outlived the failed send"
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        finish(peer)


@pytest.mark.timeout(60)
def test_huge_timeouts_wait_like_long_ones_and_bad_ones_are_refused():
    with agent("rx") as rx, agent("tx") as tx:
        box = {}
        connect = lambda: box.update(tx=freight.PipeSender.connect(tx, rx.addresses[0], timeout=1e19))  # noqa: E731
        t = threading.Thread(target=connect)
        t.start()
        pipe = freight.PipeListener(rx).accept(buffer=MIB, timeout=1e19)
        t.join(timeout=15)
        sender = box["tx"]
        src = np.arange(10, dtype=np.uint8)
        tx.register(src)
        sender.send(src)
        with pipe.recv(timeout=1e19) as msg:
            assert msg.view().tolist() == list(range(10))
        for bad in (-1.0, float("nan")):
            with pytest.raises(freight.InvalidArgumentError, match="finite number of seconds"):
                pipe.recv(timeout=bad)
            with pytest.raises(freight.InvalidArgumentError, match="finite number of seconds"):
                freight.PipeListener(rx).accept(buffer=MIB, timeout=bad)
        sender.drain()
        sender.close()
        assert pipe.recv(timeout=1e300) is None
        pipe.close()

        ch, chan = channel_pair(rx, tx)
        chan.send(["k"], [np.arange(4, dtype=np.float32)])
        (r,) = ch.recv(timeout=1e19)
        assert r.key == "k" and r.view().tolist() == [0, 1, 2, 3]
        r.release()
        with pytest.raises(freight.InvalidArgumentError, match="finite number of seconds"):
            ch.recv(timeout=-1)
        chan.close()
        assert ch.recv(timeout=1e19) is None
        ch.close()
