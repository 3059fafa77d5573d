"""Python API surface in one process: memory objects, descriptor lists, duck-typed
tensors, metadata inspection, help texts."""

from __future__ import annotations

import gc
import inspect
import sys
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

import freight


class FakeTensor:
    """Quacks like a torch.Tensor (data_ptr/numel/element_size/device/is_contiguous)."""

    def __init__(self, backing: np.ndarray, device: str = "cpu", index=None, contiguous: bool = True) -> None:
        self.backing = backing
        self.device = SimpleNamespace(type=device, index=index)
        self._contiguous = contiguous

    def data_ptr(self) -> int:
        return self.backing.ctypes.data

    def numel(self) -> int:
        return self.backing.size

    def element_size(self) -> int:
        return self.backing.itemsize

    def is_contiguous(self) -> bool:
        return self._contiguous


def test_alloc_returns_shm_array_kept_alive_by_its_base():
    with freight.Agent("a") as a:
        arr = a.alloc(10_000)
        assert arr.dtype == np.uint8 and arr.shape == (10_000,) and arr.flags.writeable and not arr.any()
        seg = arr.base
        assert isinstance(seg, freight.SharedSegment)
        assert seg.addr == arr.ctypes.data and seg.nbytes == len(seg) == 10_000
        view = arr[100:200]
        del arr, seg
        gc.collect()
        view[:] = 9  # still mapped: the view keeps the segment alive
        key = a.register(view)
        info = freight.inspect_metadata(a.metadata())
        (region,) = info["regions"]
        assert region["key"] == key and region["shared"] and region["length"] == 100 and region["kind"] == "DRAM"
        # Plain numpy memory is registered, but not shm-capable.
        plain = np.zeros(64, dtype=np.uint8)
        a.register(plain)
        shared = {r["addr"]: r["shared"] for r in freight.inspect_metadata(a.metadata())["regions"]}
        assert shared == {view.ctypes.data: True, plain.ctypes.data: False}
        assert a.registered_regions == 2


@pytest.mark.parametrize(
    "raw,message",
    [
        ((-1, 10, 0), "addr must be in [0, 2**64)"),
        ((True, 10, 0), "addr must be an int, got bool"),
        ((1.0, 10, 0), "addr must be an int, got float"),
        ((4096, 0, 0), "zero-length memory range"),
        ((1 << 64, 1, 0), "addr must be in [0, 2**64)"),
        ((1, 1 << 64, 0), "length must be in [0, 2**64)"),
        ((1, 10, -1), "device must be in [0, 2**64)"),
        ((1, 10), "a memory tuple must be (addr, length, device)"),
    ],
)
def test_a_raw_tuple_out_of_range_or_not_of_ints_is_refused_by_name_and_registers_nothing(raw, message):
    # register() takes plain in-range int tuples on a fast path; everything else must
    # still get the general path's errors, not a wrapped or truncated value.
    with freight.Agent("a") as a:
        with pytest.raises(freight.InvalidArgumentError) as e:
            a.register(raw)
        assert message in str(e.value)
        assert a.registered_regions == 0


def test_register_objects_and_kinds():
    with freight.Agent("a") as a:
        host = np.zeros(4096, dtype=np.float32)
        k1 = a.register(FakeTensor(host))
        gpu = np.zeros(1024, dtype=np.float16)  # stands in for device memory; never touched
        k2 = a.register(FakeTensor(gpu, "cuda", 1))
        with pytest.raises(freight.OverlapError):
            a.register((gpu.ctypes.data, 16, 1), kind="VRAM")
        k3 = a.register((gpu.ctypes.data, 16, 2), kind="vram")  # another device: no overlap
        with pytest.raises(freight.InvalidArgumentError):
            a.register(FakeTensor(host, "cuda", 0), kind="DRAM")
        with pytest.raises(freight.InvalidArgumentError):
            a.register(FakeTensor(np.zeros(8), contiguous=False))
        with pytest.raises(freight.InvalidArgumentError):
            a.register(FakeTensor(np.zeros(8), "mps"))
        regions = {r["key"]: r for r in freight.inspect_metadata(a.metadata())["regions"]}
        assert (regions[k1]["kind"], regions[k1]["length"]) == ("DRAM", 4096 * 4)
        assert (regions[k2]["kind"], regions[k2]["device"], regions[k2]["length"]) == ("VRAM", 1, 2048)
        assert (regions[k3]["kind"], regions[k3]["device"]) == ("VRAM", 2)
        # register_many with mixed kinds keeps the order of keys.
        more = [np.zeros(32, dtype=np.uint8), FakeTensor(np.zeros(8), "cuda", 0), bytearray(64)]
        keys = a.register_many(more)
        regions = {r["key"]: r for r in freight.inspect_metadata(a.metadata())["regions"]}
        assert [regions[k]["kind"] for k in keys] == ["DRAM", "VRAM", "DRAM"]
        for k in [k1, k2, k3, *keys]:
            a.deregister(k)
        assert a.registered_regions == 0
    assert "torch" not in sys.modules


def test_gpu_memory_has_no_transport_in_this_build():
    with freight.Agent("a") as a, freight.Agent("b") as b:
        dev = np.zeros(4096, dtype=np.uint8)
        b.register(FakeTensor(dev, "cuda", 0))
        local = np.zeros(4096, dtype=np.uint8)
        a.register(FakeTensor(local, "cuda", 0))
        a.add_peer(b.metadata())
        descs = freight.DescList([FakeTensor(local, "cuda", 0)])
        assert descs.kind == "VRAM" and descs[0] == (local.ctypes.data, 4096, 0)
        with pytest.raises(freight.TransportUnavailableError):
            a.transfer("WRITE", descs, "b", freight.DescList([(dev.ctypes.data, 4096, 0)], kind="VRAM"))


def test_desclist_forms():
    arrs = [np.zeros(n, dtype=np.uint8) for n in (10, 20, 30)]
    dl = freight.DescList(arrs)
    assert len(dl) == 3 and dl.nbytes == 60 and dl.kind == "DRAM" and dl.runs == 3
    assert list(dl) == [(a.ctypes.data, a.nbytes, 0) for a in arrs]
    rows = np.array([(1000, 10, 0), (2000, 20, 0)], dtype=np.uint64)
    for form in (rows, rows.astype(np.int64), rows.astype(np.int32), np.asfortranarray(rows)):
        assert list(freight.DescList(form)) == [(1000, 10, 0), (2000, 20, 0)]
    assert list(freight.DescList(rows[::-1])) == [(2000, 20, 0), (1000, 10, 0)]  # any strides
    s = freight.DescList.strided(0x1000, 64, 0, 128, 1_000_000)
    assert len(s) == 1_000_000 and s.runs == 1 and s.nbytes == 64_000_000 and s[-1] == (0x1000 + 999_999 * 128, 64, 0)
    both = s + [(5, 5, 0)]
    assert len(both) == 1_000_001 and both.runs == 2 and len(s) == 1_000_000
    both.extend(both)
    assert len(both) == 2_000_002 and both.runs == 4
    assert freight.DescList(s).nbytes == s.nbytes
    assert freight.DescList([(1, 2, 3), arrs[0]])[0] == (1, 2, 3)
    with pytest.raises(IndexError):
        dl[3]
    with pytest.raises(freight.InvalidArgumentError):
        freight.DescList([np.zeros(4, dtype=np.uint8), FakeTensor(np.zeros(4), "cuda", 0)])  # mixed kinds
    with pytest.raises(freight.InvalidArgumentError):
        freight.DescList(np.zeros(10, dtype=np.uint8))  # a data array is not a descriptor array
    with pytest.raises(TypeError):
        freight.DescList("not descriptors")
    with pytest.raises(freight.InvalidArgumentError):
        dl.extend([(1, 0, 0)])
    assert len(dl) == 3  # all or nothing
    v = freight.DescList(kind="VRAM").append(1, 2, 3).append_strided(100, 4, 3, 8, 5)
    assert v.kind == "VRAM" and len(v) == 6


def test_agent_basics_and_help():
    cfg = freight.AgentConfig(listen="127.0.0.1:0", transports=("tcp",))
    with freight.Agent("basic", cfg) as a:
        assert a.name == "basic" and a.config is cfg and a.peers == []
        assert len(a.addresses) == 1 and a.addresses[0].startswith("127.0.0.1:")
        extra = a.listen("127.0.0.1:0")
        assert extra in a.addresses
        assert "basic" in repr(a)
        with freight.Agent("other") as b:
            assert b.connect(extra) == "basic"  # metadata fetched from the extra listener
            assert a.connect(b.addresses[0]) == "other"
            p = a.path_to("other")
            assert isinstance(p, freight.Path) and p.transport == "tcp" and p.reason
            a.refresh_peer("other")
            a.notify("other", "hello")
            a.notify("other", b"bytes")
            got = []
            while len(got) < 2:
                got += b.wait_notifs(10)
            assert got == [("basic", b"hello"), ("basic", b"bytes")]
    assert a.closed
    for obj in (freight, freight.Agent, freight.AgentConfig, freight.DescList, freight.Request,
                freight.EtcdDirectory, freight.Agent.register, freight.Agent.make_request,
                freight.Request.wait, freight.set_log_level, freight.inspect_metadata):
        assert obj.__doc__ and len(obj.__doc__) > 40, obj


def test_object_arrays_are_not_memory():
    objs = np.array([1, "two", None], dtype=object)
    with freight.Agent("a") as a:
        with pytest.raises(freight.InvalidArgumentError, match="Python objects"):
            a.register(objs)
        with pytest.raises(freight.InvalidArgumentError, match="Python objects"):
            freight.DescList([objs])
        with pytest.raises(freight.InvalidArgumentError, match="Python objects"):
            a.register(np.zeros(2, dtype=[("x", "f4"), ("o", "O")]))


def test_negative_descriptor_fields_are_invalid_arguments():
    dl = freight.DescList()
    for args in ((-1, 4, 0), (0x1000, -4, 0), (0x1000, 4, -1)):
        with pytest.raises(freight.InvalidArgumentError):
            dl.append(*args)
    with pytest.raises(freight.InvalidArgumentError, match="count"):
        dl.append_strided(0x1000, 64, 0, 128, -1)
    with pytest.raises(freight.InvalidArgumentError, match="stride"):
        freight.DescList.strided(0x1000, 64, 0, -128, 4)
    assert len(dl) == 0
    assert len(dl.append(0x1000, 4, np.uint64(0)).append_strided(0x2000, 4, 0, 8, 3)) == 4


def test_descriptor_messages_say_what_is_wrong_plainly():
    rows = np.array([[0x1000, 10, 0], [0x2000, -1, 0], [0x3000, 10, 0]], dtype=np.int64)
    with pytest.raises(freight.InvalidArgumentError) as ei:
        freight.DescList(rows)
    assert str(ei.value).endswith("row 1 has a negative length (-1); addresses, lengths and devices are >= 0")
    with pytest.raises(freight.InvalidArgumentError, match="row 0 has a negative device"):
        freight.DescList(np.array([[0x1000, 10, -3]], dtype=np.int64))
    # More descriptors than len() can count: the list works, len() says why it cannot.
    huge = freight.DescList.strided(0x1000, 1, 0, 1, 2**63)
    assert huge.nbytes == 2**63 and huge.runs == 1
    with pytest.raises(OverflowError, match=f"{2**63} descriptors, more than len"):
        len(huge)
    assert len(freight.DescList.strided(0x1000, 1, 0, 1, 2**63 - 1)) == 2**63 - 1


def test_a_read_into_read_only_memory_is_refused():
    with freight.Agent("a") as a, freight.Agent("b") as b:
        frozen = np.zeros(4096, dtype=np.uint8)
        frozen.flags.writeable = False
        a.register(frozen, readonly_ok=True)  # peers may read it
        src = b.alloc(4096)
        src[:] = 5
        b.register(src)
        a.add_peer(b.metadata())
        remote = [(src.ctypes.data, 4096, 0)]
        with pytest.raises(freight.InvalidArgumentError, match="read-only"):
            a.transfer("read", [frozen], "b", remote)
        assert not frozen.any()
        with pytest.raises(freight.InvalidArgumentError, match="read-only"):
            a.transfer("READ", [bytes(4096)], "b", remote)
        out = a.alloc(4096)
        a.register(out)
        a.transfer("READ", [out], "b", remote).wait(10)
        assert (out == 5).all()
        a.transfer("WRITE", [frozen], "b", remote).wait(10)  # reading it is what it is for
        assert not src.any()
    assert "registered read-only" in freight.Agent.register.__doc__


def test_closing_an_agent_lets_go_of_the_objects_it_kept():
    a = freight.Agent("a")
    arr = np.zeros(4096, dtype=np.uint8)
    gone = weakref.ref(arr)
    a.register(arr)
    del arr
    gc.collect()
    assert gone() is not None, "registered memory is kept alive"
    a.close()
    gc.collect()
    assert gone() is None, "the agent closed, nothing can use it"

    # While a request of the agent exists, its memory stays.
    with freight.Agent("b") as b:
        a = freight.Agent("a2")
        arr = a.alloc(4096)
        gone = weakref.ref(arr)
        a.register(arr)
        dst = b.alloc(4096)
        b.register(dst)
        a.add_peer(b.metadata())
        remote = a.prepare_remote("b", [(dst.ctypes.data, 4096, 0)])
        req = a.make_request("WRITE", a.prepare_local([arr]), None, remote, None)
        del arr
        a.close()
        gc.collect()
        assert gone() is not None
        del req, a
        gc.collect()
        assert gone() is None


@pytest.mark.timeout(60)
def test_dropping_an_agent_lets_other_threads_run_while_it_shuts_down():
    """Closing it, and joining its pipe router's thread, takes some 20 ms: not with the
    GIL held."""
    gaps: list = []
    running = True

    def tick() -> None:
        last = time.perf_counter()
        while running:
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    worst = 0.0
    try:
        for i in range(10):
            a = freight.Agent(f"dropped-{i}")
            freight.PipeListener(a)  # starts the agent's router, which the agent keeps
            time.sleep(0.03)
            gaps.clear()
            del a
            time.sleep(0.02)
            worst = max(worst, max(gaps))
    finally:
        running = False
        ticker.join()
    assert worst < 0.01, f"another thread waited {worst * 1e3:.0f} ms for the GIL"


def test_transport_docs_name_every_transport():
    for doc in (freight.Request.transport.__doc__, inspect.getsource(freight.agent.Path)):
        assert all(t in doc for t in ("cuda", "shm", "fabric", "tcp")), doc
    assert "fabric_connections" in freight._native.Agent.connection_stats.__doc__


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_a_post_may_carry_its_own_notification_in_place_of_the_requests(shm):
    with freight.Agent("a") as a, freight.Agent("b") as b:
        src = a.alloc(4096) if shm else np.zeros(4096, np.uint8)
        dst = b.alloc(4096) if shm else np.zeros(4096, np.uint8)
        a.register(src)
        b.register(dst)
        a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        req = a.make_request("WRITE", a.prepare_local([src]), None, a.prepare_remote("b", [dst]), None, notif=b"own")

        def next_notif() -> bytes:
            got = b.wait_notifs(10.0)
            assert len(got) == 1, got
            return got[0][1]

        src[:] = 1
        req.post(notif=b"this round")
        req.wait(10)
        assert next_notif() == b"this round" and dst[0] == 1
        src[:] = 2
        req.post()
        req.wait(10)
        assert next_notif() == b"own" and dst[0] == 2
        with pytest.raises(freight.InvalidArgumentError, match="notification larger than"):
            req.post(notif=bytes((16 << 20) + 1))
        assert req.status() == "DONE"


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_post_says_whether_the_round_is_already_done(shm):
    with freight.Agent("a") as a, freight.Agent("b") as b:
        # 64 KiB: below what shm copies on the posting thread (inline_bytes), so there
        # every round is done by the time post returns.
        src = a.alloc(64 << 10) if shm else np.zeros(64 << 10, np.uint8)
        dst = b.alloc(64 << 10) if shm else np.zeros(64 << 10, np.uint8)
        a.register(src)
        b.register(dst)
        a.add_peer(b.metadata())
        req = a.make_request("WRITE", a.prepare_local([src]), None, a.prepare_remote("b", [dst]), None)
        assert req.transport == ("shm" if shm else "tcp")
        answers = set()
        for round in range(20):
            src[:] = round
            done = req.post()
            assert isinstance(done, bool)
            answers.add(done)
            if done:  # True is a promise: the bytes are there, nothing to wait for
                assert req.status() == "DONE" and dst[-1] == round
            req.wait(10)
            assert dst[-1] == round
        if shm:
            assert answers == {True}


def test_memory_kinds_are_the_engines_names_and_aliases_and_nothing_else():
    for name, want in (("dram", "DRAM"), (" Host ", "DRAM"), ("cpu", "DRAM"), ("VRAM", "VRAM"), ("gpu", "VRAM"),
                       ("Cuda", "VRAM"), ("file", "FILE")):
        assert freight.DescList([], name).kind == want, name
    for bad in ("xram", "", "dram2"):
        with pytest.raises(freight.InvalidArgumentError, match=f'unknown memory kind "{bad}"'):
            freight.DescList([], bad)
    with pytest.raises(freight.InvalidArgumentError, match="a memory kind is a str"):
        freight.DescList([], 3)
