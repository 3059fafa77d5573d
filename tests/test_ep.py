"""Expert parallelism (freight.ep): rank coordination across real processes and sockets
(runs everywhere), the kernels' compile check (needs NVRTC only), and dispatch/combine
between rank processes on the GPUs (tests/ep_rank.py; skipped with the reason where
there is no GPU or no PyTorch). Several ranks may share one GPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import freight
from freight import ep

HERE = Path(__file__).resolve().parent
CUDA_OK, CUDA_WHY = freight.cuda_status()
try:
    import torch

    TORCH_GPUS = torch.cuda.device_count() if CUDA_OK else 0
except ImportError:  # the CPU-only CI has no PyTorch
    TORCH_GPUS = 0

needs_gpu = pytest.mark.skipif(
    TORCH_GPUS == 0, reason=f"no GPU here ({CUDA_WHY or 'PyTorch is not installed or sees no GPU'})"
)

# A rank in its own process: joins, all-gathers its rank's name, then either leaves or
# waits for a death notice and reports the error it gets.
RANK = """
import json, sys, time
import freight
from freight import ep
rank, world, server, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
g = ep.Group.join(rank, world, server, timeout=20)
blobs = g.all_gather(f"rank-{rank}".encode(), timeout=20)
print(json.dumps({"gathered": [b.decode() for b in blobs]}), flush=True)
if mode == "leave":
    g.barrier(20)
    g.leave()
elif mode == "wait":
    t0 = time.monotonic()
    try:
        g.barrier(30)
        print(json.dumps({"error": None}), flush=True)
    except freight.FreightError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "after": time.monotonic() - t0, "dead": g.dead()}), flush=True)
elif mode == "die":
    import os
    os._exit(3)
"""


def _free_address() -> str:
    from conftest import free_port

    return f"127.0.0.1:{free_port()}"


def _lines(proc, n, timeout=30):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(json.loads(line))
    return out


def test_ranks_join_in_any_order_and_gather_in_rank_order(spawn):
    address = _free_address()
    world = 3
    order = list(range(world))
    random.shuffle(order)
    # The first rank starts before the server exists: it must keep retrying.
    procs = {order[0]: spawn(RANK, order[0], world, address, "leave")}
    time.sleep(0.5)
    server = ep.RankServer(address, world)
    for r in order[1:]:
        procs[r] = spawn(RANK, r, world, address, "leave")
    for r, p in procs.items():
        (line,) = _lines(p, 1)
        assert line["gathered"] == [f"rank-{i}" for i in range(world)]
        assert p.wait(timeout=30) == 0, p.stderr.read()
    server.close()


def test_a_rank_that_dies_fails_the_others_quickly_and_by_name(spawn):
    address = _free_address()
    server = ep.RankServer(address, 3)
    survivors = [spawn(RANK, r, 3, address, "wait") for r in (0, 2)]
    victim = spawn(RANK, 1, 3, address, "die")
    assert victim.wait(timeout=30) == 3
    for p in survivors:
        gathered, result = _lines(p, 2)
        assert result["error"] == "PeerDisconnectedError", result
        assert "rank 1" in result["message"]
        assert result["after"] < 10, "a death must be noticed well before the 30 s timeout"
        assert result["dead"][0] == 1
    server.close()


def test_a_taken_rank_and_a_wrong_world_are_refused():
    address = _free_address()
    server = ep.RankServer(address, 2)
    first = ep.Group.join(0, 2, address, timeout=5)
    with pytest.raises(freight.RemoteRejectedError, match="rank 0"):
        ep.Group.join(0, 2, address, timeout=5)
    with pytest.raises(freight.RemoteRejectedError, match="3"):
        ep.Group.join(1, 3, address, timeout=5)
    with pytest.raises(freight.InvalidArgumentError):
        ep.Group.join(2, 2, address, timeout=5)
    first.leave()
    server.close()


def test_a_rank_server_with_a_token_lets_in_only_the_ranks_that_have_it(spawn):
    """The blobs ranks swap (CUDA IPC handles) open their GPU memory: a stranger that
    reaches the rank server must not join in place of a rank."""
    address = _free_address()
    server = ep.RankServer(address, 2, "ep-secret")
    with pytest.raises(freight.RemoteRejectedError, match="requires a token"):
        ep.Group.join(0, 2, address, timeout=5)
    with pytest.raises(freight.RemoteRejectedError, match="requires a token"):
        ep.Group.join(0, 2, address, timeout=5, token="a-guess")
    # Ranks in their own processes find the token in their environment.
    env = {**os.environ, ep.TOKEN_ENV: "ep-secret"}
    procs = [spawn(RANK, r, 2, address, "leave", env=env) for r in range(2)]
    for p in procs:
        (line,) = _lines(p, 1)
        assert line["gathered"] == ["rank-0", "rank-1"]
        assert p.wait(timeout=30) == 0, p.stderr.read()
    server.close()


def test_a_missing_rank_times_out_naming_it():
    address = _free_address()
    server = ep.RankServer(address, 2)
    alone = ep.Group.join(0, 2, address, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(freight.TimeoutError, match="1"):
        alone.barrier(1.0)
    assert time.monotonic() - t0 < 5
    server.close()


def test_ranks_meet_through_etcd(etcd_endpoint):
    import threading
    import uuid

    name = f"test-{uuid.uuid4().hex[:8]}"
    gathered = {}

    def rank(r):
        g = ep.Group.join_etcd(r, 2, [etcd_endpoint], name, timeout=20)
        gathered[r] = g.all_gather(f"from-{r}".encode(), timeout=20)
        g.barrier(20)
        g.leave()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert gathered == {0: [b"from-0", b"from-1"], 1: [b"from-0", b"from-1"]}


def test_processes_racing_for_one_rank_through_etcd_let_one_join(etcd_endpoint):
    """Ranks that all find rank 0 free and join at once: exactly one becomes rank 0, the
    others are refused as taken."""
    import threading
    import uuid

    name = f"test-{uuid.uuid4().hex[:8]}"
    start = threading.Barrier(6)
    outcomes = []

    def claim():
        start.wait()
        try:
            outcomes.append(ep.Group.join_etcd(0, 2, [etcd_endpoint], name, timeout=20))
        except freight.RemoteRejectedError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    joined = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(joined) == 1 and len(refused) == 5, outcomes
    assert all("already taken" in str(e) for e in refused), refused
    joined[0].leave()


def test_a_server_address_that_is_not_one_is_refused():
    with pytest.raises(freight.InvalidArgumentError, match="host:port"):
        ep.RankServer("not an address", 2)


def test_expert_parallel_kernels_compile_for_hopper():
    from conftest import check_kernel_compile

    check_kernel_compile(ep.compile_kernels)


EP_BENCH = HERE.parent / "bench" / "ep_bench.py"


def run_ep_bench(*args: str, env: "dict | None" = None) -> subprocess.CompletedProcess:
    """bench/ep_bench.py, as a person runs it: a script of the source tree."""
    return subprocess.run([sys.executable, str(EP_BENCH), *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_the_benchmark_explains_itself_and_refuses_what_it_cannot_do():
    helped = run_ep_bench("--help")
    assert helped.returncode == 0
    for option in ("--num-processes", "--mode", "--tokens", "--hidden", "--experts-per-rank", "--topk",
                   "--nvlink-backend", "--warmup", "--iters", "--low-latency", "--cuda-graph", "--json",
                   "--log-level"):
        assert option in helped.stdout
    graph = run_ep_bench("--cuda-graph")
    assert graph.returncode == 2 and "--low-latency" in graph.stderr
    backend = run_ep_bench("--nvlink-backend", "none", "--low-latency")
    assert backend.returncode == 2 and "needs --nvlink-backend ipc" in backend.stderr
    bad = run_ep_bench("--mode", "sideways")
    assert bad.returncode == 2
    # --log-level (freight's, for the engine in every rank) may stand anywhere; the
    # benchmark gets to its own checks (an invalid --num-processes, so no GPU is needed).
    for args in (("--log-level", "debug", "--num-processes", "0"), ("--num-processes", "0", "--log-level=debug")):
        p = run_ep_bench(*args)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip() == "bench/ep_bench.py: --num-processes must be positive", p.stderr


# Stand-ins for PyTorch, first on the path: one that does not import, one without a GPU.
NO_TORCH = "raise ImportError('No module named torch (hidden by the test)')\n"
NO_GPU = """
__version__ = "0.0-test"
class version:
    cuda = None
class cuda:
    is_available = staticmethod(lambda: False)
    device_count = staticmethod(lambda: 0)
"""


@pytest.mark.parametrize(
    "torch_source, message",
    [(NO_TORCH, "needs PyTorch, which cannot be imported here"), (NO_GPU, "needs a GPU that PyTorch can use")],
    ids=["no-torch", "no-gpu"],
)
def test_the_benchmark_without_what_it_needs_says_so_once(tmp_path, torch_source, message):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(torch_source)
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    p = run_ep_bench("--num-processes", "2", env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"bench/ep_bench.py: {message}") and p.stderr.count("\n") == 1, p.stderr
    assert "ranks passed" not in p.stdout, p.stdout


def _run_ranks(world: int, scenario: str, timeout: float = 240, **opts) -> list:
    address = _free_address()
    server = ep.RankServer(address, world)
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "ep_rank.py"), f"--rank={r}", f"--world={world}", f"--server={address}",
             f"--scenario={scenario}", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            results.append(lines[-1] if lines else {"rank": None, "passed": [], "failed": [f"no result; stderr: {err[-3000:]}"]})
    finally:
        for p in procs:
            p.kill()
        server.close()
    return results


@needs_gpu
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_between_rank_processes(world):
    results = _run_ranks(world, "correctness")
    failures = [f for r in results for f in r["failed"]]
    assert not failures, "\n".join(failures)
    assert all(len(r["passed"]) >= 20 for r in results), results


@needs_gpu
@pytest.mark.parametrize("backend", ["freight", "none"])
def test_dispatch_and_combine_through_the_engine(backend):
    results = _run_ranks(3, "correctness", backend=backend)
    failures = [f for r in results for f in r["failed"]]
    assert not failures, "\n".join(failures)
    assert all(len(r["passed"]) >= 20 for r in results), results


@needs_gpu
def test_dispatch_at_full_hidden_size():
    results = _run_ranks(2, "correctness", hidden=7168, max_tokens=32, experts_per_rank=8, topk=8, linear=0)
    failures = [f for r in results for f in r["failed"]]
    assert not failures, "\n".join(failures)


@needs_gpu
def test_dispatch_with_a_top_k_wider_than_eight():
    """More than eight choices per token take the layout kernel's other path."""
    results = _run_ranks(2, "correctness", experts_per_rank=12, topk=12, linear=0)
    failures = [f for r in results for f in r["failed"]]
    assert not failures, "\n".join(failures)
    assert all(len(r["passed"]) >= 20 for r in results), results


@needs_gpu
def test_ranks_that_disagree_on_fp8_refuse_the_dispatch():
    """A rank that decoded its peers' rows in the wrong format would hand out garbage:
    every rank refuses the dispatch instead, and the buffer stays refused."""
    results = _run_ranks(3, "fp8_mismatch", timeout=120)
    failures = [f for r in results for f in r["failed"]]
    assert not failures, "\n".join(failures)
    assert all(len(r["passed"]) == 2 for r in results), results


@needs_gpu
def test_a_rank_that_dies_fails_dispatch_on_the_others():
    results = _run_ranks(3, "die", timeout=120)
    survivors = [r for r in results if r["rank"] in (0, 2)]
    assert len(survivors) == 2, results
    for r in survivors:
        assert not r["failed"], r
        assert r["passed"] and r["passed"][0].startswith("PeerDisconnectedError"), r


def test_a_dispatch_that_fails_between_its_halves_abandons_the_buffer(monkeypatch):
    """Runs without a GPU: whatever fails between dispatch_begin and dispatch_finish (here
    no memory for the outputs) makes the Python layer abandon the dispatch, which marks
    the buffer unusable (and is a no-op where no dispatch is half done)."""
    import types

    calls = []

    class Native:
        def dispatch_begin(self, stream, inputs):
            calls.append("begin")
            return [3], [3]

        def dispatch_finish(self, *args):
            calls.append("finish")

        def abandon(self):
            calls.append("abandon")

    def out_of_memory(*args):
        raise MemoryError("no memory for the outputs")

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    buf = ep.Buffer.__new__(ep.Buffer)
    buf._native, buf.hidden = Native(), 8
    monkeypatch.setattr(buf, "_inputs", lambda *a: ((0, 0, 0, 3, 0, False), None, None))
    monkeypatch.setattr(buf, "_stream", lambda: 0)
    monkeypatch.setattr(buf, "_received_rows", out_of_memory)
    with pytest.raises(MemoryError):
        buf.dispatch(None, None, None)
    assert calls == ["begin", "abandon"]


@needs_gpu
def test_one_rank_in_process_routing_errors_and_an_abandoned_dispatch():
    """One rank in this process: device "cuda" is the current GPU; a repeated expert is
    dropped in low-latency mode (the expert gets the token once, combine adds it once) and
    reported by synchronize(), and refused by dispatch() with its outputs attached, which
    combine takes; a dispatch that fails between
    its halves leaves the buffer unusable, saying so."""
    address = _free_address()
    server = ep.RankServer(address, 1)
    try:
        group = ep.Group.join(0, 1, address, timeout=20)
        buf = ep.Buffer(group, 512, 16, 4, 2, device="cuda", timeout=20)
        assert buf.device == torch.device("cuda", torch.cuda.current_device())
        x = torch.randn((4, 512), device=buf.device).to(torch.bfloat16)
        w = torch.ones((4, 2), device=buf.device)
        twice = torch.tensor([[0, 1], [2, 2], [3, -1], [1, 0]], dtype=torch.int64, device=buf.device)

        recv, counts, _, handle = buf.low_latency_dispatch(x, twice, w)
        out = buf.low_latency_combine(recv, handle)
        with pytest.raises(freight.InvalidArgumentError, match="same expert twice"):
            buf.synchronize()
        buf.synchronize()  # reported once: the buffer goes on
        assert counts.tolist() == [2, 2, 1, 1]
        kept = torch.tensor([2.0, 1.0, 1.0, 2.0], device=buf.device)[:, None]
        torch.testing.assert_close(out.float(), x.float() * kept, rtol=2e-2, atol=2e-2)

        with pytest.raises(freight.InvalidArgumentError, match="same expert twice") as refused:
            buf.dispatch(x, twice, w)
        # The error carries the completed dispatch, for the combine the peers expect.
        recv, _, _, per_expert, handle = refused.value.result
        assert per_expert == [2, 2, 1, 1]
        out = buf.combine(recv, handle)
        torch.testing.assert_close(out.float(), x.float() * kept, rtol=2e-2, atol=2e-2)
        fine = torch.tensor([[0, 1], [2, 3], [3, -1], [1, 0]], dtype=torch.int64, device=buf.device)
        recv, _, _, _, handle = buf.dispatch(x, fine, w)
        out = buf.combine(recv, handle)
        kept = torch.tensor([2.0, 2.0, 1.0, 2.0], device=buf.device)[:, None]
        torch.testing.assert_close(out.float(), x.float() * kept, rtol=2e-2, atol=2e-2)

        def out_of_memory(*args):
            raise MemoryError("no memory for the outputs")

        buf._received_rows = out_of_memory
        with pytest.raises(MemoryError):
            buf.dispatch(x, fine, w)
        del buf._received_rows
        with pytest.raises(freight.InvalidStateError, match="unusable"):
            buf.dispatch(x, fine, w)
        group.leave()
    finally:
        server.close()
