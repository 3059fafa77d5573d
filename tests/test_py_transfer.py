"""Python API: transfers between this test process (initiator) and target processes.

The target (TARGET below) runs in its own process: it allocates and registers a buffer,
prints a JSON line (buffer address, metadata hex, listener address), then serves
commands that arrive as notifications and answers each with a notification:
    {"cmd": "check", "off", "len", "seed"}  -> ok iff buf[off:off+len] == pattern(seed)
    {"cmd": "fill",  "off", "len", "seed"}  -> writes pattern(seed) there
    {"cmd": "hash"}                         -> sha256 of the whole buffer
    {"cmd": "checkseq", "count"}            -> ok iff b"seq:<i>" arrived in order 0..count-1
    {"cmd": "exit"}
Checks run as soon as the command arrives: a check attached to a WRITE proves that the
data was visible when its notification was delivered.

Helpers here are imported by the other test_py_* modules.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import queue
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

import freight

TIMEOUT = 30.0  # generous bound on any single wait: a hang fails instead of blocking

TARGET = r"""
import hashlib, json, os, sys
import numpy as np
import freight

def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

args = json.loads(sys.argv[1])
agent = freight.Agent(args["name"], freight.AgentConfig(**args.get("config", {})))
size = args["size"]
buf = agent.alloc(size) if args.get("shm", True) else np.zeros(size, dtype=np.uint8)
if "seed" in args:
    buf[:] = pattern(args["seed"], size)
segment = agent.share_in_place(buf) if args.get("share_in_place") else None
key = agent.register(buf)
listen = agent.listen("127.0.0.1:0") if args.get("listen") else None
directory = None
if "etcd" in args:
    directory = freight.EtcdDirectory(args["etcd"]["endpoint"], prefix=args["etcd"]["prefix"])
    agent.publish_etcd(directory)
print(json.dumps({"addr": int(buf.ctypes.data), "size": size, "key": key, "pid": os.getpid(),
                  "md": agent.metadata().hex(), "listen": listen}), flush=True)
if "connect" in args:
    agent.connect(args["connect"])
elif directory is not None:
    agent.add_peer_from_etcd(directory, args["etcd"]["initiator"], timeout=30)

seqs, seq_errors = {}, []
running = True
while running:
    for peer, msg in agent.wait_notifs(1.0):
        if msg.startswith(b"seq:"):
            i, exp = int(msg[4:]), seqs.get(peer, 0)
            if i != exp:
                seq_errors.append(f"{peer}: got {i}, expected {exp}")
            seqs[peer] = i + 1
            continue
        cmd = json.loads(msg)
        c, reply = cmd["cmd"], {"id": cmd.get("id"), "ok": True}
        if c == "check":
            off, n = cmd["off"], cmd["len"]
            got, want = buf[off:off + n], pattern(cmd["seed"], n)
            reply["ok"] = bool(np.array_equal(got, want))
            if not reply["ok"]:
                bad = np.flatnonzero(got != want)
                reply["first_bad"] = int(bad[0]) + off
                reply["bad"] = int(bad.size)
        elif c == "fill":
            off, n = cmd["off"], cmd["len"]
            buf[off:off + n] = pattern(cmd["seed"], n)
        elif c == "hash":
            reply["sha256"] = hashlib.sha256(buf.tobytes()).hexdigest()
        elif c == "checkseq":
            reply["seen"] = seqs.get(peer, 0)
            reply["errors"] = seq_errors[:5]
            reply["ok"] = not seq_errors and reply["seen"] == cmd["count"]
        elif c == "exit":
            running = False
        agent.notify(peer, json.dumps(reply).encode())
agent.close()
"""


def pattern(seed: int, n: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (the same in every process)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def readline(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """One stdout line of ``proc``, or a test failure with its stderr."""
    q: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: q.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = q.get(timeout=timeout)
    except queue.Empty:
        line = ""
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"target produced no output (exit {proc.returncode}); stderr:\n{err}")
    return line


class Inbox:
    """Collects an agent's notifications; hands out replies by id."""

    def __init__(self, agent: freight.Agent) -> None:
        self.agent = agent
        self.stash: List[Tuple[str, bytes]] = []

    def reply(self, peer: str, rid: int, timeout: float = TIMEOUT) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, (p, m) in enumerate(self.stash):
                if p == peer and m.startswith(b"{"):
                    d = json.loads(m)
                    if d.get("id") == rid:
                        del self.stash[i]
                        return d
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no reply {rid} from {peer} within {timeout} s (stash: {self.stash[:5]})")
            self.stash.extend(self.agent.wait_notifs(min(left, 1.0)))


class Target:
    """A target process and the initiator's view of it."""

    _ids = iter(range(1, 1 << 30))

    def __init__(self, spawn, initiator: freight.Agent, inbox: Inbox, name: str, size: int, **args: Any) -> None:
        self.initiator, self.inbox, self.name = initiator, inbox, name
        spec = {"name": name, "size": size, **args}
        if "etcd" not in args:
            spec["connect"] = initiator.addresses[0]
        self.proc = spawn(TARGET, json.dumps(spec))
        info = json.loads(readline(self.proc))
        self.addr, self.size, self.key, self.pid = info["addr"], info["size"], info["key"], info["pid"]
        self.md = bytes.fromhex(info["md"])
        self.listen = info["listen"]

    def add(self) -> str:
        """Adds the target as a peer of the initiator (from its metadata)."""
        assert self.initiator.add_peer(self.md) == self.name
        return self.name

    def command(self, cmd: str, **kw: Any) -> Dict[str, Any]:
        """Sends a command now and waits for its reply."""
        rid = next(self._ids)
        self.initiator.notify(self.name, json.dumps({"cmd": cmd, "id": rid, **kw}))
        return self.inbox.reply(self.name, rid)

    def check_msg(self, off: int, length: int, seed: int) -> Tuple[int, bytes]:
        """(id, notification bytes) of a check command, to attach to a transfer."""
        rid = next(self._ids)
        return rid, json.dumps({"cmd": "check", "id": rid, "off": off, "len": length, "seed": seed}).encode()

    def sha256(self) -> str:
        return self.command("hash")["sha256"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("exit")
            finally:
                self.proc.wait(timeout=TIMEOUT)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def make_initiator(name: str = "initiator", **config: Any) -> freight.Agent:
    return freight.Agent(name, freight.AgentConfig(**config))


@pytest.fixture
def initiator():
    agents: List[freight.Agent] = []

    def make(transport: Optional[str] = None, name: str = "initiator", **config: Any) -> Tuple[freight.Agent, Inbox]:
        a = make_initiator(name, require=transport, **config)
        agents.append(a)
        return a, Inbox(a)

    yield make
    for a in agents:
        a.close()


TRANSPORTS = ["shm", "tcp"]


# --------------------------------------------------------------------------- basic roundtrip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange", ["metadata", "listener"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_write_with_notification_then_read_back(spawn, initiator, transport, exchange):
    agent, inbox = initiator(transport)
    size = 3 << 20
    config = {"require": transport}
    if exchange == "listener":
        config["token"] = "s3cret"
    t = Target(spawn, agent, inbox, "target", size, config=config, listen=exchange == "listener")
    if exchange == "metadata":
        t.add()
    else:
        with pytest.raises(freight.AuthError):
            agent.connect(t.listen)
        assert agent.connect(t.listen, token="s3cret") == "target"
    assert "target" in agent.peers
    assert agent.path_to("target").transport == transport
    info = freight.inspect_metadata(t.md)
    assert info["name"] == "target" and info["pid"] == t.pid
    assert [(r["addr"], r["length"], r["shared"]) for r in info["regions"]] == [(t.addr, size, True)]

    src = agent.alloc(size)
    agent.register(src)
    src[:] = pattern(1, size)
    rid, msg = t.check_msg(0, size, seed=1)
    req = agent.transfer("WRITE", [src], "target", [(t.addr, size, 0)], notif=msg)
    assert isinstance(req, freight.Request)
    assert req.transport == transport and req.op == "WRITE" and req.nbytes == size and req.peer == "target"
    assert req.path_reason
    assert req.wait(TIMEOUT) is None
    assert req.status() == "DONE" and req.error is None
    reply = inbox.reply("target", rid)
    assert reply["ok"], reply
    bad = t.command("check", off=0, len=size, seed=12345)  # negative control
    assert not bad["ok"] and bad["bad"] > 0

    # The target overwrites its buffer; read it back into memory that is not shm.
    assert t.command("fill", off=0, len=size, seed=2)["ok"]
    dst = np.zeros(size, dtype=np.uint8)
    agent.register(dst)
    req = agent.transfer("READ", freight.DescList([dst]), "target", freight.DescList([(t.addr, size, 0)]))
    req.wait(TIMEOUT)
    np.testing.assert_array_equal(dst, pattern(2, size))
    assert req.transport == transport
    t.stop()


@pytest.mark.timeout(120)
def test_private_memory_shared_in_place_keeps_its_bytes_and_is_reached_through_shm(spawn, initiator):
    """A target's ordinary numpy array (private memory, as a vLLM CPU KV cache is)
    becomes shm-reachable in place: what it held before is read back through shm, and
    the target sees through its own, unchanged array what the initiator writes."""
    agent, inbox = initiator("shm")
    # Neither the start nor the end need fall on a page; 32 MiB and more has pages of its own.
    size = (32 << 20) + 123
    private = Target(spawn, agent, inbox, "private", size, shm=False, seed=3)
    private.add()
    dst = np.zeros(size, dtype=np.uint8)
    agent.register(dst)
    # Without it, the array is private memory: the shm path cannot reach it.
    with pytest.raises(freight.FreightError):
        agent.transfer("READ", [dst], "private", [(private.addr, size, 0)]).wait(TIMEOUT)
    private.stop()

    t = Target(spawn, agent, inbox, "in-place", size, shm=False, seed=3, share_in_place=True)
    t.add()
    info = freight.inspect_metadata(t.md)
    assert [(r["addr"], r["length"], r["shared"]) for r in info["regions"]] == [(t.addr, size, True)]
    req = agent.transfer("READ", [dst], "in-place", [(t.addr, size, 0)])
    req.wait(TIMEOUT)
    assert req.transport == "shm"
    np.testing.assert_array_equal(dst, pattern(3, size))
    src = agent.alloc(size)
    agent.register(src)
    src[:] = pattern(4, size)
    rid, msg = t.check_msg(0, size, seed=4)
    agent.transfer("WRITE", [src], "in-place", [(t.addr, size, 0)], notif=msg).wait(TIMEOUT)
    assert inbox.reply("in-place", rid)["ok"]
    t.stop()


def own_pages(n: int) -> np.ndarray:
    """A writable array of ``n`` bytes on private anonymous pages of its own (what
    share_in_place takes; the allocator's heap is refused)."""
    return np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


def in_heap(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= addr < end:
                return rest[-1] == "[heap]"
    return False


def test_share_in_place_refuses_what_it_cannot_share_and_keeps_what_it_shares():
    with freight.Agent("sharer") as a:
        buf = own_pages(12 << 20)
        buf.view(np.uint32)[:] = np.arange(3 << 20, dtype=np.uint32)
        want = buf.copy()
        seg = a.share_in_place(buf)
        assert isinstance(seg, freight.SharedSegment) and seg.addr <= buf.ctypes.data
        assert seg.addr + seg.nbytes >= buf.ctypes.data + buf.nbytes and seg.nbytes % 4096 == 0
        np.testing.assert_array_equal(buf, want)
        buf[7] = 99  # still ordinary memory to this process
        assert buf[7] == 99
        # Shared already: the same segment.
        assert a.share_in_place(buf[4096:8192]).id == seg.id
        shm = a.alloc(1 << 20)
        assert a.share_in_place(shm).id == shm.base.id
        # Partly inside a shared segment: refused, naming it.
        beside = own_pages(8 << 20)
        half = a.share_in_place(beside[: 4 << 20])  # kept: dropped, it would end
        with pytest.raises(freight.InvalidArgumentError, match="overlaps the shared segment"):
            a.share_in_place(beside[(4 << 20) - 16:])
        del half
        with pytest.raises(freight.InvalidArgumentError, match="not mapped"):
            a.share_in_place((4096, 4096, 0))
        with pytest.raises(freight.InvalidArgumentError):
            a.share_in_place(b"read-only bytes" * 1000)
        # A small array sits in the process heap beside other allocations: its pages
        # are not its own to share.
        small = np.zeros(64 << 10, dtype=np.uint8)
        assert in_heap(small.ctypes.data), "a 64 KiB array of the main thread is expected in [heap]"
        with pytest.raises(freight.InvalidArgumentError, match=r"process heap .*\[heap\]"):
            a.share_in_place(small)
        # The segment outlives the handle while a region in it is registered.
        key = a.register(buf)
        del seg
        assert a.registered_regions == 1
        a.deregister(key)


# --------------------------------------------------------------------------- many requests, reposts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_requests_in_flight(spawn, initiator, transport):
    agent, inbox = initiator(transport)
    block, n = 64 << 10, 64
    size = block * n
    t = Target(spawn, agent, inbox, "target", size)
    t.add()
    src = agent.alloc(size)
    agent.register(src)
    src[:] = pattern(3, size)
    # Post everything, then wait for everything; blocks go to reversed positions.
    reqs = [
        agent.transfer("WRITE", [(src.ctypes.data + i * block, block, 0)], "target",
                       [(t.addr + (n - 1 - i) * block, block, 0)])
        for i in range(n)
    ]
    for r in reqs:
        r.wait(TIMEOUT)
    expected = src.reshape(n, block)[::-1].reshape(-1)
    assert t.sha256() == sha(expected)

    back = np.zeros(size, dtype=np.uint8)
    agent.register(back)
    reqs = [
        agent.transfer("READ", [back[i * block:(i + 1) * block]], "target", [(t.addr + i * block, block, 0)])
        for i in range(n)
    ]
    for r in reqs:
        r.wait(TIMEOUT)
    np.testing.assert_array_equal(back, expected)
    t.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_repost_a_prepared_request(spawn, initiator, transport):
    agent, inbox = initiator(transport)
    size = 1 << 20
    t = Target(spawn, agent, inbox, "target", size)
    t.add()
    src = np.zeros(size, dtype=np.uint8)
    agent.register(src)
    local = agent.prepare_local([src])
    remote = agent.prepare_remote("target", [(t.addr, size, 0)])
    assert len(local) == 1 and local.nbytes == size and remote.peer == "target" and remote.nbytes == size
    req = agent.make_request("WRITE", local, None, remote, None)
    assert req.status() == "IDLE" and req.error is None
    with pytest.raises(freight.InvalidStateError):
        req.wait(1)
    for seed in range(10, 15):
        src[:] = pattern(seed, size)
        req.post()
        req.wait(TIMEOUT)
        assert req.status() == "DONE"
        assert t.command("check", off=0, len=size, seed=seed)["ok"]
    # Same request object, READ direction through another request on the same lists.
    t.command("fill", off=0, len=size, seed=99)
    rd = agent.make_request("read", local, None, remote, None)
    rd.post()
    rd.wait(TIMEOUT)
    np.testing.assert_array_equal(src, pattern(99, size))
    t.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_requests_from_several_threads(spawn, initiator, transport):
    """Blocking calls release the GIL: threads post and wait concurrently."""
    agent, inbox = initiator(transport)
    nthreads, per, block = 4, 16, 32 << 10
    size = nthreads * per * block
    t = Target(spawn, agent, inbox, "target", size)
    t.add()
    src = agent.alloc(size)
    agent.register(src)
    src[:] = pattern(8, size)
    local = agent.prepare_local(freight.DescList.strided(src.ctypes.data, block, 0, block, nthreads * per))
    remote = agent.prepare_remote("target", freight.DescList.strided(t.addr, block, 0, block, nthreads * per))
    errors: List[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(per):
                i = k * per + j
                req = agent.make_request("WRITE", local, [i], remote, [i])
                req.post()
                req.wait(TIMEOUT)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert not any(th.is_alive() for th in threads) and not errors, errors
    assert t.sha256() == sha(src)
    t.stop()


# --------------------------------------------------------------------------- descriptors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prepared_lists_with_index_arrays_and_reordering(spawn, initiator, transport):
    agent, inbox = initiator(transport)
    block, n = 4096, 64
    size = block * n
    t = Target(spawn, agent, inbox, "target", size)
    t.add()
    src = agent.alloc(size)
    agent.register(src)
    src[:] = pattern(5, size)
    # Nx3 arrays: uint64 locally, int64 remotely.
    local_rows = np.array([(src.ctypes.data + i * block, block, 0) for i in range(n)], dtype=np.uint64)
    remote_rows = np.array([(t.addr + i * block, block, 0) for i in range(n)], dtype=np.int64)
    local = agent.prepare_local(freight.DescList(local_rows))
    remote = agent.prepare_remote("target", remote_rows)
    assert len(local) == n and len(remote) == n

    perm = np.random.default_rng(0).permutation(n)  # int64 indices
    req = agent.make_request("WRITE", local, perm, remote, np.arange(n, dtype=np.uint32))
    req.post()
    req.wait(TIMEOUT)
    expected = src.reshape(n, block)[perm].reshape(-1)
    assert t.sha256() == sha(expected)

    # READ with list indices, a subset, repeated remote blocks.
    back = np.zeros(size, dtype=np.uint8)
    agent.register(back)
    bl = agent.prepare_local(freight.DescList([back[i * block:(i + 1) * block] for i in range(n)]))
    remote_idx = [3, 3, 0, 63, 10]
    req = agent.make_request("READ", bl, list(range(5)), remote, remote_idx)
    assert req.nbytes == 5 * block
    req.post()
    req.wait(TIMEOUT)
    got = back[:5 * block].reshape(5, block)
    np.testing.assert_array_equal(got, expected.reshape(n, block)[remote_idx])
    assert not back[5 * block:].any()
    t.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_strided_and_mixed_block_sizes(spawn, initiator, transport):
    agent, inbox = initiator(transport)
    size = 1 << 20
    t = Target(spawn, agent, inbox, "target", size)
    t.add()
    model = np.zeros(size, dtype=np.uint8)  # what the target's buffer should hold
    src = agent.alloc(size)
    agent.register(src)
    src[:] = pattern(7, size)

    # 64 strided blocks of 1 KiB, every 4 KiB on the target, from one contiguous 64 KiB.
    remote = freight.DescList.strided(t.addr, 1024, 0, 4096, 64)
    assert len(remote) == 64 and remote.runs == 1 and remote.nbytes == 64 << 10
    assert remote[1] == (t.addr + 4096, 1024, 0) and remote[-1] == (t.addr + 63 * 4096, 1024, 0)
    agent.transfer("WRITE", [(src.ctypes.data, 64 << 10, 0)], "target", remote).wait(TIMEOUT)
    for i in range(64):
        model[i * 4096:i * 4096 + 1024] = src[i * 1024:(i + 1) * 1024]
    assert t.sha256() == sha(model)

    # Strided on both sides, plus an appended run and single descriptors.
    local = freight.DescList.strided(src.ctypes.data + 1000, 100, 0, 300, 50)
    local.append(src.ctypes.data + 500_000, 5000)
    rem = freight.DescList()
    rem.append_strided(t.addr + 300_000, 200, 0, 1000, 25).append(t.addr + 600_000, 5000)
    assert local.nbytes == rem.nbytes == 10_000
    agent.transfer("WRITE", local, "target", rem).wait(TIMEOUT)
    flat_src = np.concatenate([src[1000 + i * 300:1000 + i * 300 + 100] for i in range(50)] + [src[500_000:505_000]])
    pos = 0
    for i in range(25):
        model[300_000 + i * 1000:300_000 + i * 1000 + 200] = flat_src[pos:pos + 200]
        pos += 200
    model[600_000:605_000] = flat_src[pos:]
    assert t.sha256() == sha(model)

    # Mixed block sizes with different cuts on each side (1 byte to 100 KiB).
    rng = np.random.default_rng(11)
    sizes_l = [1, 7, 4096, 65537, 100, 3, 100_000, 12_345, 8]
    total = sum(sizes_l)
    cuts = np.sort(rng.choice(np.arange(1, total), size=11, replace=False))
    sizes_r = np.diff(np.concatenate([[0], cuts, [total]])).tolist()
    loff, lds = 0, []
    for s in sizes_l:
        lds.append((src.ctypes.data + loff, s, 0))
        loff += s + 13  # gaps between local blocks
    roff, rds = 700_000, []
    for s in sizes_r:
        rds.append((t.addr + roff, s, 0))
        roff += s + 5
    agent.transfer("WRITE", lds, "target", rds).wait(TIMEOUT)
    flat = np.concatenate([src[a - src.ctypes.data:a - src.ctypes.data + s] for a, s, _ in lds])
    pos = 0
    for a, s, _ in rds:
        model[a - t.addr:a - t.addr + s] = flat[pos:pos + s]
        pos += s
    assert t.sha256() == sha(model)

    # Read the same mixed bytes back with yet another cut.
    back = np.zeros(total, dtype=np.uint8)
    agent.register(back)
    bds = [back[:1], back[1:50_000], back[50_000:]]
    agent.transfer("READ", bds, "target", rds).wait(TIMEOUT)
    np.testing.assert_array_equal(back, flat)
    t.stop()


# --------------------------------------------------------------------------- notifications


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_notification_order_and_data_visibility(spawn, initiator, transport):
    # A small inline limit, so that the larger shm writes below go through copy threads
    # on every host.
    agent, inbox = initiator(transport, shm_inline_bytes=256 << 10)
    size = 2 << 20
    t = Target(spawn, agent, inbox, "target", size)
    t.add()
    src = agent.alloc(size)
    agent.register(src)

    # 200 notifications in order; every 10th rides on a (waited) WRITE.
    for i in range(200):
        if i % 10 == 0:
            agent.transfer("WRITE", [src[:4096]], "target", [(t.addr, 4096, 0)], notif=f"seq:{i}").wait(TIMEOUT)
        else:
            agent.notify("target", f"seq:{i}".encode())
    reply = t.command("checkseq", count=200)
    assert reply["ok"], reply

    # A WRITE's notification arrives only after its data is visible: the target checks
    # the bytes the moment the notification arrives. Sizes span inline and threaded
    # shm copies and multi-chunk tcp transfers; requests are not waited for first.
    pending = []
    for k, n in enumerate([1, 4096, 300_000, size, 1 << 20, size]):
        src[:n] = pattern(100 + k, n)
        rid, msg = t.check_msg(0, n, seed=100 + k)
        req = agent.transfer("WRITE", [src[:n]], "target", [(t.addr, n, 0)], notif=msg)
        reply = inbox.reply("target", rid)
        assert reply["ok"], (n, reply)
        pending.append(req)
    for r in pending:
        r.wait(TIMEOUT)
    t.stop()


# --------------------------------------------------------------------------- registration at scale


@pytest.mark.timeout(120)
def test_register_many_ten_thousand_regions():
    with freight.Agent("many") as a, freight.Agent("peer") as b:
        n, block = 10_000, 64
        big = np.zeros(n * block, dtype=np.uint8)
        views = [big[i * block:(i + 1) * block] for i in range(n)]
        keys = a.register_many(views)
        assert len(keys) == n and len(set(keys)) == n
        assert a.registered_regions == n

        # Nx3 form, on another buffer.
        other = np.zeros(n * block, dtype=np.uint8)
        rows = np.stack([other.ctypes.data + np.arange(n, dtype=np.uint64) * block,
                         np.full(n, block, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1)
        keys2 = a.register_many(rows)
        assert len(keys2) == n and not set(keys) & set(keys2)
        assert a.registered_regions == 2 * n

        # All or nothing: one overlapping entry in the middle registers nothing.
        fresh = np.zeros(100 * block, dtype=np.uint8)
        batch = [fresh[i * block:(i + 1) * block] for i in range(100)]
        batch[50] = views[123]
        with pytest.raises(freight.OverlapError) as ei:
            a.register_many(batch)
        assert ei.value.index == 50
        assert a.registered_regions == 2 * n

        # The regions work: move 100 scattered 64-byte blocks to the peer and back.
        dst = b.alloc(100 * block)
        b.register(dst)
        a.add_peer(b.metadata())
        big[:] = pattern(21, big.size)
        picks = np.random.default_rng(1).choice(n, 100, replace=False)
        local = a.prepare_local([views[i] for i in picks])
        remote = a.prepare_remote("peer", [(dst.ctypes.data, 100 * block, 0)])
        req = a.make_request("WRITE", local, None, remote, None)
        req.post()
        req.wait(TIMEOUT)
        np.testing.assert_array_equal(dst.reshape(100, block), big.reshape(n, block)[picks])

        for k in keys + keys2:
            a.deregister(k)
        assert a.registered_regions == 0
