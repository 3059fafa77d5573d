"""GPU memory: the cuda transport between processes, GPU<->host paths, path reports and
bad input. Runs for real where CUDA and PyTorch see a GPU; elsewhere every GPU test
skips and says why. The kernel compile check needs NVRTC only (CI installs it from PyPI).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import freight
from conftest import check_kernel_compile, libfabric_missing

# The remote side of the transfers, which the GPU benchmarks use too.
GPU_PEER = Path(__file__).resolve().parent.parent / "bench" / "gpu_peer.py"
from gpu_env import CUDA_OK, CUDA_WHY, TORCH_GPUS, needs_gpu, torch  # noqa: F401
MIB = 1 << 20


def vram(triples):
    return freight.DescList(triples, kind="VRAM")


def test_cuda_status_says_why_when_there_is_no_gpu():
    ok, why = freight.cuda_status()
    assert isinstance(ok, bool)
    assert ok == (why == ""), "a reason must be given exactly when CUDA is unusable"
    if not ok:
        assert "CUDA" in why


def test_copy_kernel_compiles_for_hopper():
    check_kernel_compile(freight.compile_copy_kernel)


def test_gpu_memory_without_cuda_is_refused_with_the_reason():
    if CUDA_OK:
        pytest.skip("CUDA is present: this checks the behaviour without it")
    with freight.Agent("a") as a, freight.Agent("b") as b:
        a.register((0x7F0000000000, 4096, 0), kind="VRAM")
        dst = b.alloc(4096)
        b.register(dst)
        a.add_peer(b.metadata())
        with pytest.raises(freight.TransportUnavailableError, match="CUDA is not available"):
            a.path_to("b")
        with pytest.raises(freight.TransportUnavailableError, match="cuda: .*CUDA is not available"):
            a.transfer("WRITE", vram([(0x7F0000000000, 4096, 0)]), "b", [dst])


class Peer:
    """A bench/gpu_peer.py process: the remote side of the transfers."""

    def __init__(self, size: int, kind: str = "VRAM", gpu: int = 0, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, str(GPU_PEER), "--size", str(size), "--kind", kind, "--gpu", str(gpu)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )
        hello = json.loads(self.proc.stdout.readline() or "{}")
        assert "addr" in hello, "the peer process failed to start"
        self.addr, self.base, self.size = hello["addr"], hello["base"], hello["size"]

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the peer process died (exit {self.proc.poll()})"
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.call(op="quit")
            except (AssertionError, BrokenPipeError):
                pass
            self.proc.wait(timeout=20)


@pytest.fixture
def gpu_pair():
    """An initiator agent here on GPU 0 and a peer process with 256 MiB on the last GPU."""
    peer = Peer(256 * MIB, gpu=TORCH_GPUS - 1)
    agent = freight.Agent("initiator")
    name = agent.connect(peer.addr)
    yield agent, name, peer
    agent.close()
    peer.close()


def pattern(seed: int, size: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def random_copies(rng: random.Random, space: int, total_max: int, count: int):
    """(src_off, dst_off, len) with sizes from 1 byte to 64 MiB (log-uniform), random
    offsets, no two destinations overlapping, in random order."""
    copies, used, total = [], [], 0
    for _ in range(count * 4):
        if len(copies) == count:
            break
        n = min(int(2 ** rng.uniform(0, 26)), 64 * MIB, total_max - total)
        if n <= 0:
            break
        d = rng.randrange(0, space - n + 1)
        if any(d < e and s < d + n for s, e in used):
            continue
        copies.append((rng.randrange(0, space - n + 1), d, n))
        used.append((d, d + n))
        total += n
    rng.shuffle(copies)
    return copies


def seed_source(op: str, local, peer, seed: int):
    """The source side gets pattern(seed), the destination side poison."""
    if op == "WRITE":
        local.copy_(pattern(seed, peer.size).to(local.device))
        # freight copies on a stream of its own: torch's work must be done first.
        torch.cuda.synchronize()
        peer.call(op="poison")
    else:
        peer.call(op="fill", seed=seed)
        local.fill_(0xA5)
        torch.cuda.synchronize()


def transfer_copies(agent, name: str, op: str, here, there, copies):
    """Moves `copies` ((source offset, destination offset, length) triples) between
    `here` and `there`, each (base address, memory kind, device), in one request."""
    pairs = [(s, d, n) if op == "WRITE" else (d, s, n) for s, d, n in copies]
    ldesc = freight.DescList([(here[0] + lo, n, here[2]) for lo, _, n in pairs], kind=here[1])
    rdesc = freight.DescList([(there[0] + ro, n, there[2]) for _, ro, n in pairs], kind=there[1])
    req = agent.transfer(op, ldesc, name, rdesc)
    req.wait(timeout=60)
    assert req.status() == "DONE"


def check_destination(op: str, local, peer, seed: int, copies, what: str = ""):
    """Every byte of the destination: the copies' bytes where they landed, poison elsewhere."""
    if op == "WRITE":
        res = peer.call(op="check", seed=seed, copies=copies)
        assert res["ok"], f"{what}: {res['detail']}"
    else:
        expected = torch.full((peer.size,), 0xA5, dtype=torch.uint8)
        src = pattern(seed, peer.size)
        for s, d, n in copies:
            expected[d : d + n] = src[s : s + n]
        assert torch.equal(local.cpu(), expected), what


@pytest.fixture(params=["cuda", "tcp"])
def gpu_pair_over(request, gpu_pair):
    """gpu_pair, with the initiator on each transport in turn: the fixture's agent for
    cuda, a second agent that must use tcp (staging GPU memory through pinned buffers)."""
    agent, name, peer = gpu_pair
    if request.param == "cuda":
        yield agent, name, peer
        return
    with freight.Agent("via-tcp", freight.AgentConfig(require="tcp")) as other:
        yield other, other.connect(peer.addr), peer


def move_random_copies(agent, name, peer, op: str, rng: random.Random, rounds: int):
    """Rounds of random copies (see random_copies) between a local GPU buffer and the
    peer's; checks every byte of the destination, poison where nothing was copied."""
    size = peer.size
    local = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    agent.register(local)
    for round_ in range(rounds):
        seed = rng.randrange(1 << 30)
        copies = random_copies(rng, size, 160 * MIB, 200)
        seed_source(op, local, peer, seed)
        if op == "WRITE":
            ldesc = [(local.data_ptr() + s, n, 0) for s, _, n in copies]
            rdesc = [(peer.base + d, n, TORCH_GPUS - 1) for _, d, n in copies]
        else:
            ldesc = [(local.data_ptr() + d, n, 0) for _, d, n in copies]
            rdesc = [(peer.base + s, n, TORCH_GPUS - 1) for s, _, n in copies]
        req = agent.transfer(op, freight.DescList(ldesc, kind="VRAM"), name, freight.DescList(rdesc, kind="VRAM"))
        req.wait(timeout=60)
        assert req.status() == "DONE"
        check_destination(op, local, peer, seed, copies, f"round {round_}")


@needs_gpu
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_random_descriptor_lists_move_every_byte(gpu_pair_over, op):
    agent, name, peer = gpu_pair_over
    move_random_copies(agent, name, peer, op, random.Random(7 if op == "WRITE" else 8), rounds=4)


# Launch shapes and item sizes other than the default, with the other completion mode:
# every combination must move the same bytes (sizes from 1 byte, odd alignments).
KERNEL_KNOBS = {
    "block-1024x2": dict(cuda_kernel_mode="block", cuda_kernel_threads=1024, cuda_kernel_blocks_per_sm=2),
    "block-128-small-items": dict(cuda_kernel_mode="block", cuda_kernel_threads=128, cuda_kernel_item_bytes=1040),
    "warp-512x4-16k-poll": dict(cuda_kernel_threads=512, cuda_kernel_blocks_per_sm=4,
                                cuda_kernel_item_bytes=16 << 10, cuda_completion="poll"),
    "warp-128-small-items": dict(cuda_kernel_threads=128, cuda_kernel_blocks_per_sm=32, cuda_kernel_item_bytes=1040),
}


@pytest.fixture(scope="module")
def shared_peer():
    """One peer process for the tests of kernel knobs (starting one takes seconds)."""
    peer = Peer(256 * MIB, gpu=TORCH_GPUS - 1)
    yield peer
    peer.close()


@needs_gpu
@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("knobs", list(KERNEL_KNOBS))
def test_every_kernel_shape_moves_every_byte(shared_peer, knobs, op):
    with freight.Agent(f"initiator-{knobs}-{op}", freight.AgentConfig(**KERNEL_KNOBS[knobs])) as agent:
        name = agent.connect(shared_peer.addr)
        move_random_copies(agent, name, shared_peer, op, random.Random(f"{knobs}-{op}"), rounds=2)
        agent.remove_peer(name)


def test_kernel_occupancy_is_reported_for_every_shape():
    if not CUDA_OK:
        with pytest.raises(freight.TransportUnavailableError):
            freight.copy_kernel_occupancy()
        return
    try:
        occupancy = freight.copy_kernel_occupancy(0)
    except freight.TransportUnavailableError as e:
        pytest.skip(f"NVRTC is not installed: {e}")
    assert set(occupancy) == {(m, t) for m in ("warp", "block") for t in (128, 256, 512, 1024)}
    assert all(blocks >= 1 for blocks in occupancy.values()), occupancy


@needs_gpu
def test_many_requests_in_flight_and_reposted(gpu_pair):
    agent, name, peer = gpu_pair
    local = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0")
    local.copy_(pattern(5, 64 * MIB).cuda())
    torch.cuda.synchronize()
    agent.register(local)
    peer.call(op="poison")
    reqs = []
    for i in range(8):
        off = i * 8 * MIB
        lp = agent.prepare_local(freight.DescList([(local.data_ptr() + off, 8 * MIB, 0)], kind="VRAM"))
        rp = agent.prepare_remote(name, freight.DescList([(peer.base + off, 8 * MIB, TORCH_GPUS - 1)], kind="VRAM"))
        reqs.append(agent.make_request("WRITE", lp, None, rp, None))
    for _ in range(3):
        for r in reqs:
            r.post()
        for r in reqs:
            r.wait(timeout=30)
        assert [r.status() for r in reqs] == ["DONE"] * 8
    assert peer.call(op="check", seed=5, copies=[[0, 0, 64 * MIB]])["ok"]


@needs_gpu
def test_work_tables_reused_by_later_requests_move_every_byte(gpu_pair):
    """Requests made once and posted once (a KV connector's loads) take their work
    tables from the ones earlier requests gave back: rounds of four requests in flight
    at once, each of many copies into its own quarter of the peer's buffer, every byte
    of the destination checked after each round. Each round first makes requests that
    are dropped unposted: their tables go back to the pool with their uploads perhaps
    still queued, and the round's requests take them over."""
    agent, name, peer = gpu_pair
    local = torch.empty(peer.size, dtype=torch.uint8, device="cuda:0")
    agent.register(local)
    quarter = peer.size // 4
    rng = random.Random(11)
    for round_ in range(6):
        seed = rng.randrange(1 << 30)
        seed_source("WRITE", local, peer, seed)
        for n in (60, 200, 400):
            unposted = [(s, d, min(k, 1 << 20)) for s, d, k in random_copies(rng, peer.size, 24 * MIB, n)]
            agent.make_request(
                "WRITE", agent.prepare_local(freight.DescList([(local.data_ptr() + s, k, 0) for s, _, k in unposted],
                                                              kind="VRAM")),
                None, agent.prepare_remote(name, freight.DescList([(peer.base + d, k, TORCH_GPUS - 1)
                                                                   for _, d, k in unposted], kind="VRAM")), None)
        everything, reqs = [], []
        for q in range(4):
            # Up to 1 MiB a copy: all of them go through the kernel's table.
            copies = [(s + q * quarter, d + q * quarter, min(n, 1 << 20))
                      for s, d, n in random_copies(rng, quarter, 24 * MIB, 50 + 150 * q)]
            everything += copies
            ldesc = freight.DescList([(local.data_ptr() + s, n, 0) for s, _, n in copies], kind="VRAM")
            rdesc = freight.DescList([(peer.base + d, n, TORCH_GPUS - 1) for _, d, n in copies], kind="VRAM")
            req = agent.make_request("WRITE", agent.prepare_local(ldesc), None, agent.prepare_remote(name, rdesc), None)
            assert req.transport == "cuda"
            reqs.append(req)
        for r in reqs:
            r.post()
        for r in reqs:
            r.wait(timeout=60)
        assert [r.status() for r in reqs] == ["DONE"] * 4
        del reqs
        check_destination("WRITE", local, peer, seed, everything, f"round {round_}")


@needs_gpu
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_requests_of_a_few_small_copies_move_every_byte_each_post(gpu_pair, op):
    """Up to eight work items ride in the kernel's launch and its end is learned from a
    flag in host memory; nine go through the table in GPU memory. Each request is
    posted again after its source changed: every post must move the new bytes."""
    agent, name, peer = gpu_pair
    local = torch.empty(peer.size, dtype=torch.uint8, device="cuda:0")
    agent.register(local)
    rng = random.Random(f"few-{op}")
    for count in (1, 3, 8, 9):
        # Copies of 1 byte to 4 KiB at odd offsets, each in a 64 KiB slot of its own.
        copies = [(rng.randrange(MIB), i * 65536 + rng.randrange(60000), rng.randrange(1, 4097)) for i in range(count)]
        pairs = [(s, d, n) if op == "WRITE" else (d, s, n) for s, d, n in copies]
        lp = agent.prepare_local(vram([(local.data_ptr() + lo, n, 0) for lo, _, n in pairs]))
        rp = agent.prepare_remote(name, vram([(peer.base + ro, n, TORCH_GPUS - 1) for _, ro, n in pairs]))
        req = agent.make_request(op, lp, None, rp, None)
        for post in range(3):
            seed = 1000 * count + post
            seed_source(op, local, peer, seed)
            req.post()
            req.wait(timeout=30)
            assert req.status() == "DONE"
            check_destination(op, local, peer, seed, copies, f"{count} copies, post {post}")


@needs_gpu
def test_notification_arrives_after_the_data(gpu_pair):
    agent, name, peer = gpu_pair
    n = 32 * MIB
    local = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    local.copy_(pattern(9, n).cuda())
    torch.cuda.synchronize()
    agent.register(local)
    peer.call(op="poison")
    req = agent.transfer("WRITE", vram([(local.data_ptr(), n, 0)]), name, vram([(peer.base, n, TORCH_GPUS - 1)]),
                         notif=f"check:9:0:{n}".encode())
    req.wait(timeout=30)
    assert req.status() == "DONE"
    seen = peer.call(op="notifs", count=1, timeout=10)["seen"]
    assert len(seen) == 1 and seen[0][2] is True, seen


@needs_gpu
def test_path_report_names_cuda_and_the_link(gpu_pair):
    agent, name, peer = gpu_pair
    local = torch.empty(MIB, dtype=torch.uint8, device="cuda:0")
    agent.register(local)
    path = agent.path_to(name)
    assert path.transport == "cuda", path
    assert "same host" in path.reason and "GPU" in path.reason, path.reason
    if TORCH_GPUS > 1:
        assert "NVLink" in path.reason or "PCIe" in path.reason, path.reason


@needs_gpu
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_gpu_to_a_peers_host_memory_and_back(op):
    """VRAM here <-> the peer's shared host memory; then host memory here <-> VRAM there."""
    size = 96 * MIB
    peer = Peer(size, kind="DRAM")
    try:
        with freight.Agent("initiator") as agent:
            name = agent.connect(peer.addr)
            local = torch.empty(size, dtype=torch.uint8, device="cuda:0")
            agent.register(local)
            copies = [(0, 0, 64 * MIB), (64 * MIB + 3, 64 * MIB + 1, 65536), (70 * MIB, 80 * MIB, 5 * MIB)]
            seed_source(op, local, peer, 3)
            pairs = [(s, d, n) if op == "WRITE" else (d, s, n) for s, d, n in copies]
            ldesc = freight.DescList([(local.data_ptr() + lo, n, 0) for lo, _, n in pairs], kind="VRAM")
            rdesc = freight.DescList([(peer.base + ro, n, 0) for _, ro, n in pairs], kind="DRAM")
            assert agent.path_to(name).transport == "cuda"
            req = agent.transfer(op, ldesc, name, rdesc)
            req.wait(timeout=60)
            assert req.status() == "DONE"
            check_destination(op, local, peer, 3, copies)
    finally:
        peer.close()


@needs_gpu
@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("transport,provider", [("tcp", None), ("fabric", "tcp"), ("fabric", "shm")])
def test_gpu_memory_on_either_side_of_a_network_transport(transport, provider, op, monkeypatch):
    """VRAM here <-> the peer's host memory, host memory here <-> the peer's VRAM, and
    VRAM to VRAM, forced onto a network transport: tcp stages GPU memory through pinned
    host memory on both sides; fabric registers it with the provider where it can
    (FI_HMEM), else stages it through its rails' buffers here and the landing buffers
    the peer lends there, with 1 MiB operations, so that a request needs more of them
    than there are buffers. libfabric's tcp provider offers no FI_HMEM; its shm provider
    does, and where libfabric was built without CUDA (Debian's) its GPU registrations
    fail: the rails then fall back to staging, and every byte still arrives."""
    cfg = freight.AgentConfig(require=transport)
    if transport == "fabric":
        why = libfabric_missing()
        if why:
            pytest.skip(why)
        # The peer processes inherit these, and so open the same provider.
        monkeypatch.setenv("FREIGHT_FABRIC_PROVIDER", provider)
        if provider == "tcp":
            monkeypatch.setenv("FREIGHT_FABRIC_DOMAINS", "lo")
        cfg = freight.AgentConfig(require=transport, fabric_chunk_size=1 * MIB)
    size = 24 * MIB
    copies = [(0, 0, 8 * MIB), (8 * MIB + 3, 9 * MIB + 1, 70001), (10 * MIB, 16 * MIB, 5 * MIB), (20 * MIB, 22 * MIB, 1)]
    for here, there in (("VRAM", "DRAM"), ("DRAM", "VRAM"), ("VRAM", "VRAM")):
        peer = Peer(size, kind=there, gpu=TORCH_GPUS - 1)
        try:
            with freight.Agent("initiator", cfg) as agent:
                name = agent.connect(peer.addr)
                if here == "VRAM":
                    local = torch.empty(size, dtype=torch.uint8, device="cuda:0")
                    agent.register(local)
                else:
                    seg = agent.alloc(size)
                    agent.register(seg)
                    local = torch.from_numpy(seg)
                path = agent.path_to(name)
                assert path.transport == transport, path
                if provider != "shm":
                    assert "staged" in path.reason, path
                elif here == "VRAM":
                    # Registered with the provider as it was registered here: the path
                    # says whether that worked (FI_HMEM) or the rails stage it.
                    assert "GPU memory here registered with the provider (FI_HMEM)" in path.reason \
                        or "GPU memory here staged through pinned host buffers" in path.reason, path
                if transport == "fabric":
                    assert ("landing buffers" in path.reason) == (there == "VRAM"), path
                seed_source(op, local, peer, 6)
                rdev = TORCH_GPUS - 1 if there == "VRAM" else 0
                for _ in range(2):  # twice: the second time with connections, keys and buffers in place
                    transfer_copies(agent, name, op, (local.data_ptr(), here, 0), (peer.base, there, rdev), copies)
                check_destination(op, local, peer, 6, copies, f"{here} {op} {there} over {transport} {provider}")
        finally:
            peer.close()


@needs_gpu
def test_host_memory_here_to_a_peers_gpu(gpu_pair):
    agent, name, peer = gpu_pair
    n = 48 * MIB
    host = agent.alloc(n)
    host[:] = pattern(4, n).numpy()
    agent.register(host)
    peer.call(op="poison")
    req = agent.transfer("WRITE", freight.DescList([(host.ctypes.data, n, 0)], kind="DRAM"), name,
                         freight.DescList([(peer.base, n, TORCH_GPUS - 1)], kind="VRAM"))
    req.wait(timeout=60)
    assert req.status() == "DONE"
    res = peer.call(op="check", seed=4, copies=[[0, 0, n]])
    assert res["ok"], res["detail"]


@needs_gpu
def test_bad_gpu_input_gets_clear_errors(gpu_pair):
    agent, name, peer = gpu_pair
    t = torch.empty(MIB, dtype=torch.uint8, device="cuda:0")
    if TORCH_GPUS > 1:
        other = torch.empty(MIB, dtype=torch.uint8, device="cuda:1")
        with pytest.raises(freight.InvalidArgumentError, match="GPU 1, not of GPU 0"):
            agent.register((other.data_ptr(), MIB, 0), kind="VRAM")
    host = np.zeros(MIB, dtype=np.uint8)
    with pytest.raises(freight.InvalidArgumentError, match="not GPU memory"):
        agent.register((host.ctypes.data, MIB, 0), kind="VRAM")
    with pytest.raises(freight.InvalidArgumentError):
        agent.register((t.data_ptr(), MIB, 99), kind="VRAM")
    agent.register(t)
    with pytest.raises(freight.OutOfBoundsError):
        agent.prepare_local(freight.DescList([(t.data_ptr() + MIB - 10, 20, 0)], kind="VRAM"))
    with pytest.raises(freight.NotRegisteredError):
        agent.prepare_local(freight.DescList([(t.data_ptr() + 2 * MIB, 20, 0)], kind="VRAM"))
    with pytest.raises(freight.OutOfBoundsError):
        agent.prepare_remote(name, freight.DescList([(peer.base + peer.size - 8, 16, TORCH_GPUS - 1)], kind="VRAM"))
    with freight.Agent("strict", freight.AgentConfig(require="cuda")) as strict, freight.Agent("host") as host:
        mine, theirs = strict.alloc(4096), host.alloc(4096)
        strict.register(mine)
        host.register(theirs)
        strict.add_peer(host.metadata())
        with pytest.raises(freight.TransportUnavailableError, match="required transport cuda.*no GPU memory"):
            strict.transfer("WRITE", [mine], "host", [theirs])


@needs_gpu
def test_a_revoked_gpu_region_fails_the_next_post(gpu_pair):
    agent, name, peer = gpu_pair
    local = torch.empty(MIB, dtype=torch.uint8, device="cuda:0")
    agent.register(local)
    req = agent.transfer("WRITE", vram([(local.data_ptr(), MIB, 0)]), name, vram([(peer.base, MIB, TORCH_GPUS - 1)]))
    req.wait(timeout=30)
    assert req.status() == "DONE"
    assert peer.call(op="deregister")["ok"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            req.post()
            req.wait(timeout=30)
        except freight.RemoteRejectedError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the revoked region was still written to")


@needs_gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["cuda", "tcp"])
def test_a_killed_peer_fails_gpu_transfers_instead_of_hanging(transport):
    """Transfers in flight when the target dies finish or fail with
    PeerDisconnectedError; later ones fail; nothing hangs."""
    size = 64 * MIB
    peer = Peer(size, gpu=TORCH_GPUS - 1)
    try:
        config = freight.AgentConfig(require=transport, peer_timeout=2.0)
        with freight.Agent("initiator", config) as agent:
            name = agent.connect(peer.addr)
            local = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
            agent.register(local)
            ldesc, rdesc = vram([(local.data_ptr(), size, 0)]), vram([(peer.base, size, TORCH_GPUS - 1)])
            agent.transfer("WRITE", ldesc, name, rdesc).wait(timeout=30)
            in_flight = [agent.transfer("WRITE", ldesc, name, rdesc, notif=b"x") for _ in range(4)]
            peer.proc.kill()
            peer.proc.wait(timeout=20)
            for r in in_flight:
                try:
                    r.wait(timeout=30)
                except freight.PeerDisconnectedError:
                    pass
            start = time.monotonic()
            with pytest.raises(freight.PeerDisconnectedError):
                for _ in range(200):
                    agent.transfer("WRITE", ldesc, name, rdesc, notif=b"y").wait(timeout=30)
                    time.sleep(0.05)
            assert time.monotonic() - start < 30
    finally:
        peer.close()


# ----------------------------------------------------------------------------- pipe and channel


def _stream_helpers():
    """The process helpers of the stream tests (imported lazily: this module also runs
    where they are not needed)."""
    from stream_peer import objects as stream_objects, pattern as np_pattern
    from test_py_stream import finish, line, start

    return start, line, finish, stream_objects, np_pattern


@needs_gpu
@pytest.mark.timeout(120)
def test_pipe_into_a_gpu_buffer_from_cuda_tensors(spawn):
    """A sender process streams CUDA tensors (GPU 0) through a 1 MiB VRAM buffer (the
    last GPU) four times its size; every message is read in place with torch."""
    start, line, finish, _, np_pattern = _stream_helpers()
    gpu = TORCH_GPUS - 1
    buf = torch.empty(MIB, dtype=torch.uint8, device=f"cuda:{gpu}")
    size, count = 256 << 10, 16
    with freight.Agent("rx") as rx:
        listener = freight.PipeListener(rx)
        peer = start(spawn, role="pipe-send", name="tx", addr=rx.addresses[0], count=count, size=size, seed=11,
                     device="cuda:0", timeout=60)
        with listener.accept(buffer=buf, timeout=60) as pipe:
            assert (pipe.kind, pipe.device, pipe.capacity) == ("VRAM", gpu, MIB)
            seqs = []
            for msg in pipe:
                with msg:
                    assert (msg.kind, msg.device, len(msg)) == ("VRAM", gpu, size)
                    view = msg.view()
                    assert view.__cuda_array_interface__["typestr"] == "|u1"
                    t = torch.as_tensor(view, device=f"cuda:{gpu}")
                    assert t.dtype == torch.uint8 and t.shape == (size,)
                    assert buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + MIB, "not a view of the buffer"
                    assert torch.equal(t.cpu(), torch.from_numpy(np_pattern(11 + msg.seq, size))), f"message {msg.seq}"
                    seqs.append(msg.seq)
            assert seqs == list(range(count))
        assert line(peer)["done"]
        finish(peer)


@needs_gpu
@pytest.mark.timeout(120)
def test_channel_into_a_gpu_buffer_from_cuda_tensors(spawn):
    """Mixed dtypes and shapes as CUDA tensors into a VRAM buffer: views keep dtype and
    shape for torch, an object larger than the buffer is reassembled on the GPU, and
    copy_to fills caller tensors (GPU and host) or refuses them clearly."""
    start, line, finish, stream_objects, _ = _stream_helpers()
    gpu = TORCH_GPUS - 1
    dev = f"cuda:{gpu}"
    buf = torch.empty(MIB, dtype=torch.uint8, device=dev)
    want = stream_objects("mixed")
    with freight.Agent("rx") as rx:
        peer = start(spawn, role="chan-send", name="tx", addr=rx.addresses[0], set="mixed", batch=3,
                     device="cuda:0", timeout=60)
        seen = {}
        with freight.ChannelReceiver(rx, buffer=buf, timeout=60) as ch:
            for batch in ch:
                for r in batch:
                    with r:
                        exp = want[r.key]
                        assert (r.kind, r.device, r.dtype, r.shape) == ("VRAM", gpu, exp.dtype.name, exp.shape)
                        t = torch.as_tensor(r.view(), device=dev)
                        assert tuple(t.shape) == exp.shape and str(t.dtype) == f"torch.{exp.dtype.name}"
                        # Bytes, not values: the patterns hold NaNs.
                        assert t.cpu().numpy().tobytes() == exp.tobytes(), r.key
                        on_gpu = torch.empty(exp.shape, dtype=t.dtype, device=dev)
                        assert r.copy_to(on_gpu).cpu().numpy().tobytes() == exp.tobytes(), r.key
                        on_host = np.empty_like(exp)
                        assert r.copy_to(on_host).tobytes() == exp.tobytes(), r.key
                        with pytest.raises(freight.InvalidArgumentError):
                            r.copy_to(torch.empty(exp.size + 1, dtype=t.dtype, device=dev))
                        seen[r.key] = r.is_view
        assert seen == {k: k != "big" for k in want}
        assert line(peer)["done"]
        finish(peer)


# ----------------------------------------------------------------------------- store and cache engine


@needs_gpu
@pytest.mark.timeout(120)
def test_store_of_cuda_tensors_into_a_gpu_buffer(spawn):
    """A sender process puts CUDA tensors (GPU 0) into a store whose pipe buffer is on
    the last GPU: the store holds them on that GPU, views keep dtype and shape for
    torch, and copy_to fills caller tensors on the GPU and on the host."""
    from stream_peer import objects as stream_objects
    from test_py_storage import start as start_put
    from test_py_stream import finish, line

    gpu = TORCH_GPUS - 1
    dev = f"cuda:{gpu}"
    buf = torch.empty(MIB, dtype=torch.uint8, device=dev)
    want = stream_objects("mixed")
    with freight.Agent("rx") as rx:
        peer = start_put(spawn, role="put", name="tx", addr=rx.addresses[0], set="mixed", commit=3,
                         device="cuda:0", timeout=60)
        with freight.StoreReceiver(rx, buffer=buf, timeout=60) as store:
            report = line(peer)
            assert report["done"], report
            assert sum(c["objects"] for c in report["commits"]) == len(want)
            store.wait_closed(30)
            assert sorted(store.keys()) == sorted(want)
            for key, exp in want.items():
                obj = store[key]
                assert (obj.kind, obj.device, obj.dtype, obj.shape) == ("VRAM", gpu, exp.dtype.name, exp.shape)
                t = torch.as_tensor(obj.view(), device=dev)
                assert tuple(t.shape) == exp.shape and str(t.dtype) == f"torch.{exp.dtype.name}"
                # Bytes, not values: the patterns hold NaNs.
                assert t.cpu().numpy().tobytes() == exp.tobytes(), key
                on_gpu = torch.empty(exp.shape, dtype=t.dtype, device=dev)
                assert obj.copy_to(on_gpu).cpu().numpy().tobytes() == exp.tobytes(), key
                on_host = np.empty_like(exp)
                assert obj.copy_to(on_host).tobytes() == exp.tobytes(), key
                with pytest.raises(freight.InvalidArgumentError):
                    obj.copy_to(torch.empty(exp.size + 1, dtype=t.dtype, device=dev))
        assert report["regions"][0] == report["regions"][1]
        finish(peer)


def _cache_model():
    from store_peer import CHUNK, CHUNK_BYTES, MODEL, prompt

    return CHUNK, CHUNK_BYTES, MODEL["layers"], MODEL["heads"], MODEL["head_dim"], prompt


def _cuda_kv(shape, seed: int, dtype, device: str = "cuda:0"):
    """A CUDA tensor of random bytes (NaNs included), ready for the engine to read."""
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    t = raw.view(dtype).reshape(shape).to(device)
    torch.cuda.synchronize(device)  # the engine reads the memory, not a stream
    return t


def _zeros(shape, dtype, device: str = "cuda:0"):
    t = torch.zeros(shape, dtype=dtype, device=device)
    torch.cuda.synchronize(device)  # or the fill could land after the engine's writes
    return t


def _bits(t):
    """The bytes of a 2-byte tensor, on the host, to compare exactly."""
    return t.detach().cpu().contiguous().view(torch.int16)


def _unpaged(pool, tokens: int, table):
    """Tokens 0..tokens of paged KV memory (L, 2, blocks, block_size, H, D), contiguous."""
    bs = pool.shape[3]
    return torch.stack([pool[:, :, table[t // bs], t % bs] for t in range(tokens)], dim=2)


class _FakeKvOnGpu1:
    """Looks like a bfloat16 KV tensor on cuda:1 to freight's duck typing (refused
    before its memory is touched)."""

    dtype = "torch.bfloat16"
    device = type("Device", (), {"type": "cuda", "index": 1})()

    def __init__(self, shape):
        self.shape = shape

    def data_ptr(self):
        return 0x7F0000000000

    def numel(self):
        return int(np.prod(self.shape))

    def element_size(self):
        return 2

    def is_contiguous(self):
        return True


@needs_gpu
@pytest.mark.timeout(120)
def test_cache_engine_with_a_gpu_tier_and_cuda_kv_contiguous_and_paged():
    """GPU tier of 4 chunks over a host tier (pinned for GPU 0): a 7-chunk prompt fills
    the GPU tier and spills to the host tier; it comes back whole into contiguous and
    paged CUDA KV, and into host KV; bfloat16 throughout."""
    CHUNK, CHUNK_BYTES, L, H, D, prompt = _cache_model()
    bf16 = torch.bfloat16
    with freight.Agent("ce-gpu") as a, freight.CacheEngine(
        a, chunk_tokens=CHUNK, layers=L, heads=H, head_dim=D, dtype=bf16, gpu=0,
        gpu_bytes=4 * CHUNK_BYTES, host_bytes=16 * CHUNK_BYTES,
    ) as e:
        assert (e.dtype, e.gpu) == ("bfloat16", 0)
        tokens = prompt(100, 1)
        kv = _cuda_kv((L, 2, 128, H, D), seed=1, dtype=bf16)
        assert e.store(tokens, kv) == {"chunks": 7, "new_chunks": 7, "bytes": 100 * CHUNK_BYTES // CHUNK}
        assert e.occupancy() == {"gpu": 4, "host": 3}, "the least recently used went down a tier"
        assert e.lookup(tokens) == 100

        out = _zeros((L, 2, 100, H, D), bf16)
        assert e.retrieve(tokens, out) == 100
        assert torch.equal(_bits(out), _bits(kv[:, :, :100]))

        table = [17, 3, 4, 9, 0, 12, 13, 14, 2, 19, 5, 7, 1, 6, 8, 10, 11, 15, 16, 18, 20, 21, 22, 23, 24]
        pool = _zeros((L, 2, 26, 4, H, D), bf16)
        assert e.retrieve(tokens, pool, block_table=table) == 100
        assert torch.equal(_bits(_unpaged(pool, 100, table)), _bits(kv[:, :, :100]))

        # Stored from paged CUDA memory under another prompt; back out to host memory.
        renamed = tokens.copy()
        renamed[0] = 77
        assert e.store(renamed, pool, block_table=table)["new_chunks"] == 7
        on_host = torch.zeros((L, 2, 100, H, D), dtype=bf16)
        assert e.retrieve(renamed, on_host) == 100
        assert torch.equal(_bits(on_host), _bits(kv[:, :, :100]))

        # A prompt that parts at token 70 gets the 64 tokens before.
        other = tokens.copy()
        other[70] = 1
        out = _zeros((L, 2, 100, H, D), bf16)
        assert e.retrieve(other, out) == 64
        assert torch.equal(_bits(out[:, :, :64]), _bits(kv[:, :, :64]))
        assert not out[:, :, 64:].any()

        with pytest.raises(freight.InvalidArgumentError, match="cuda:1, but this cache engine works on GPU 0"):
            e.store(tokens, _FakeKvOnGpu1((L, 2, 128, H, D)))
        with pytest.raises(freight.InvalidArgumentError, match="is float16, but this cache engine stores bfloat16"):
            e.store(tokens, kv.to(torch.float16))
        with pytest.raises(freight.InvalidArgumentError, match="not contiguous"):
            e.store(tokens, kv.transpose(3, 4))


@needs_gpu
@pytest.mark.timeout(120)
def test_cache_engine_with_a_host_tier_and_cuda_kv_uses_mapped_pinned_memory():
    """A host tier pinned and mapped for GPU 0: CUDA KV moves in and out of it with the
    copy kernel (contiguous and paged), host KV with memcpy."""
    CHUNK, CHUNK_BYTES, L, H, D, prompt = _cache_model()
    f16 = torch.float16
    with freight.Agent("ce-mapped") as a, freight.CacheEngine(
        a, chunk_tokens=CHUNK, layers=L, heads=H, head_dim=D, dtype=f16, gpu=0, host_bytes=16 * CHUNK_BYTES,
    ) as e:
        tokens = prompt(45, 3)
        table = [9, 3, 4, 0, 1, 2]
        kv = _cuda_kv((L, 2, 10, 8, H, D), seed=3, dtype=f16)  # paged, blocks of 8
        assert e.store(tokens, kv, block_table=table, block_size=8)["new_chunks"] == 3
        assert e.occupancy() == {"host": 3}
        out = _zeros((L, 2, 48, H, D), f16)
        assert e.retrieve(tokens, out) == 45
        want = _unpaged(kv, 45, table)
        assert torch.equal(_bits(out[:, :, :45]), _bits(want))
        on_host = np.zeros((L, 2, 45, H, D), dtype=np.float16)
        assert e.retrieve(tokens, on_host) == 45
        assert on_host.tobytes() == want.cpu().numpy().tobytes()
        # And from host KV into the tier, back out to paged CUDA KV.
        renamed = tokens.copy()
        renamed[0] = 5
        e.store(renamed, on_host)
        pool = _zeros((L, 2, 12, 4, H, D), f16)
        back = [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
        assert e.retrieve(renamed, pool, block_table=back) == 45
        assert torch.equal(_bits(_unpaged(pool, 45, back)), _bits(want))


@needs_gpu
@pytest.mark.timeout(120)
def test_gpu_prefill_engine_to_gpu_decode_engine_through_a_gpu_store():
    """A prefill engine with a small GPU tier puts its chunks to a store whose pipe
    buffer is on the GPU; a decode engine retrieves them into paged CUDA KV."""
    CHUNK, CHUNK_BYTES, L, H, D, prompt = _cache_model()
    from test_py_storage import connected

    f16 = torch.float16
    with freight.Agent("gpu-pre") as pa, freight.Agent("gpu-dec") as da:
        buf = torch.empty(4 * CHUNK_BYTES, dtype=torch.uint8, device="cuda:0")
        store, sink = connected(da, pa, receiver={"buffer": buf, "timeout": 30}, sender={"commit_size": 4, "timeout": 30})
        common = dict(chunk_tokens=CHUNK, layers=L, heads=H, head_dim=D, dtype=f16, gpu=0)
        prefill = freight.CacheEngine(pa, gpu_bytes=3 * CHUNK_BYTES, host_bytes=0, remote_sink=sink, **common)
        decode = freight.CacheEngine(da, gpu_bytes=2 * CHUNK_BYTES, host_bytes=0, remote_source=store, **common)
        try:
            tokens = prompt(150, 5)
            kv = _cuda_kv((L, 2, 160, H, D), seed=5, dtype=f16)
            assert prefill.store(tokens, kv)["new_chunks"] == 10
            assert decode.lookup(tokens) == 150
            table = list(range(19))[::-1]
            pool = _zeros((L, 2, 24, 8, H, D), f16)
            assert decode.retrieve(tokens, pool, block_table=table) == 150
            assert torch.equal(_bits(_unpaged(pool, 150, table)), _bits(kv[:, :, :150]))
        finally:
            prefill.close()
            decode.close()


def current_cuda_context():
    """The CUDA context current on the calling thread (0 for none), from the driver."""
    import ctypes

    ctx = ctypes.c_void_p()
    assert ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value or 0


@needs_gpu
def test_a_call_into_freight_leaves_the_threads_current_gpu_alone(gpu_pair):
    """The CUDA runtime (PyTorch) takes a thread's device from its current context: a
    thread that registers, prepares and posts GPU transfers must find it as it was."""
    import threading

    agent, name, peer = gpu_pair
    local = torch.arange(MIB, dtype=torch.int32, device="cuda:0").to(torch.uint8)
    torch.cuda.synchronize()
    seen = {}

    def fresh_thread():
        seen["before"] = current_cuda_context()
        agent.register(local)
        req = agent.transfer("WRITE", vram([(local.data_ptr(), MIB, 0)]), name, vram([(peer.base, MIB, TORCH_GPUS - 1)]))
        req.wait(timeout=30)
        seen["status"] = req.status()
        seen["after"] = current_cuda_context()

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join(60)
    assert seen.get("status") == "DONE", seen
    assert seen["before"] == 0, "a new thread starts with no current context"
    assert seen["after"] == seen["before"], "freight left its GPU's context current on the caller's thread"


@needs_gpu
def test_gpu_memory_of_a_stream_ordered_pool_registers_and_moves():
    """Memory from cudaMallocAsync has no CUDA IPC handle. It still registers; a peer
    that cannot map it reaches it through staging, and requiring cuda says why."""
    cp = pytest.importorskip("cupy")
    n = 4 * MIB
    with cp.cuda.Device(0):
        pool = cp.cuda.MemoryAsyncPool()
        mem = pool.malloc(n)
        cp.cuda.Stream.null.synchronize()
    with freight.Agent("pool-owner") as owner, freight.Agent("writer") as writer:
        owner.register((mem.ptr, n, 0), kind="VRAM")
        src = pattern(11, n).to("cuda:0")
        writer.register(src)
        name = writer.add_peer(owner.metadata())
        path = writer.path_to(name)
        req = writer.transfer("WRITE", vram([(src.data_ptr(), n, 0)]), name, vram([(mem.ptr, n, 0)]))
        req.wait(timeout=60)
        assert req.status() == "DONE"
        landed = torch.empty(n, dtype=torch.uint8)
        cp.cuda.runtime.memcpy(landed.data_ptr(), mem.ptr, n, cp.cuda.runtime.memcpyDeviceToHost)
        assert torch.equal(landed, src.cpu())
        if path.transport != "cuda":  # not exportable (as the driver answers for pools)
            assert "staged" in path.reason, path
            with freight.Agent("strict", freight.AgentConfig(require="cuda")) as strict:
                strict.register(src)
                strict.add_peer(owner.metadata())
                with pytest.raises(freight.TransportUnavailableError, match="CUDA IPC cannot share"):
                    strict.transfer("WRITE", vram([(src.data_ptr(), n, 0)]), name, vram([(mem.ptr, n, 0)]))
    del mem


@needs_gpu
def test_host_regions_sharing_a_page_stay_reachable_after_a_neighbour_goes(gpu_pair):
    """Two regions of one page (pinned as whole pages by the driver): each is read into
    from the peer's GPU, and the second still is once the first was deregistered."""
    agent, name, peer = gpu_pair
    peer.call(op="fill", seed=8)
    expected = pattern(8, 4096).numpy()
    page = agent.alloc(3 * 4096)
    first, second = page[100:1100], page[1100:3100]
    keys = [agent.register(first), agent.register(second)]

    def read_into(region, start):
        req = agent.transfer("READ", freight.DescList([(region.ctypes.data, len(region), 0)], kind="DRAM"), name,
                             freight.DescList([(peer.base + start, len(region), TORCH_GPUS - 1)], kind="VRAM"))
        req.wait(timeout=60)
        assert req.status() == "DONE"
        assert np.array_equal(region, expected[start:start + len(region)])

    read_into(first, 0)
    read_into(second, 1000)
    agent.deregister(keys[0])
    second[:] = 0
    read_into(second, 1000)
