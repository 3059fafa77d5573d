"""FreightConnector's worker path on a GPU, without vLLM: KV caches laid out as vLLM's
GPU attention backends lay them (tests/vllm_gpu_peer.py), a prefill worker in another
process on the same GPU, and this process as the decode worker, both through
:class:`freight.vllm.worker.WorkerSide`, the code vLLM calls. Every byte of every
block moved is checked, and every block not asked for is checked untouched.

Runs in the GPU suite (scripts/gpu-test.sh); skipped, saying why, without a GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import vllm_gpu_peer as peer
from gpu_env import needs_gpu, torch
from test_py_transfer import readline

HERE = Path(__file__).resolve().parent

pytestmark = needs_gpu
TOKEN = "gpu-kv-token"
PEER = f"import sys; sys.path.insert(0, {str(HERE)!r}); import vllm_gpu_peer; vllm_gpu_peer.main()"


def start_prefill(spawn, shape: peer.Shape):
    proc = spawn(PEER, json.dumps({"shape": peer.asdict(shape), "token": TOKEN}), stdin=True)
    hello = json.loads(readline(proc, timeout=120))
    return proc, hello


def ask(proc, request: str, blocks) -> dict:
    proc.stdin.write(json.dumps({"request": request, "blocks": list(blocks)}) + "\n")
    proc.stdin.flush()
    return json.loads(readline(proc, timeout=60))


def load(side, request: str, local, params, timeout: float = 60.0) -> None:
    from freight.vllm.params import Load

    # A READ may be done (or refused) by the end of the step that posts it.
    _, received = side.finished(loads={request: Load(local_blocks=list(local), params=params)})
    deadline = time.monotonic() + timeout
    while request not in received:
        _, received = side.finished()
        if request in received:
            return
        assert time.monotonic() < deadline, f"request {request} not loaded within {timeout} s"
        time.sleep(0.0005)


def same_bits(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", peer.LAYOUTS)
def test_decode_worker_reads_the_blocks_it_lacks_from_a_prefill_worker_on_the_same_gpu(spawn, layout):
    from freight.vllm.config import Settings
    from freight.vllm.worker import WorkerSide

    shape = peer.Shape(layout=layout)
    proc, hello = start_prefill(spawn, shape)
    caches = peer.kv_caches(shape)
    side = WorkerSide(Settings(role="kv_consumer", token=TOKEN))
    side.register_kv_caches(caches, peer.instance(shape, "decode"))
    try:
        # The prompt's blocks are 5..16 there; this side has the first 4 cached and
        # lacks the last 8, which go to its blocks 40..47, in that order.
        remote = list(range(5, 17))
        local = list(range(40, 48))
        params = ask(proc, "req-1", remote)
        assert params["freight"]["geometry"]["dim_order"] == list(side.geometry.dim_order)
        load(side, "req-1", local, params)
        assert side.take_load_errors() == set()
        assert side.agent.path_to(hello["place"]["agent_name"]).transport == "cuda"
        # The prefill side was told it may free them.
        assert json.loads(readline(proc, timeout=60)) == {"freed": "req-1"}
        torch.cuda.synchronize()
        for layer, t in enumerate(caches.values()):
            for mine, theirs in zip(local, remote[-len(local):]):
                assert same_bits(t[mine], peer.expected(layer, theirs, t)), (layout, layer, mine, theirs)
            untouched = [b for b in range(shape.num_blocks) if b not in local]
            assert not t[untouched].view(torch.int16).any(), f"{layout}: a block not asked for was written"
        numbers = side.take_stats()
        assert numbers is not None and numbers.data["transfer_bytes"] == [
            len(local) * shape.num_layers * side.layers[0].block_bytes]
        assert len(numbers.data["handshake_seconds"]) == 1
    finally:
        side.close()
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        proc.wait(timeout=30)


@pytest.mark.timeout(300)
def test_a_load_from_a_prefill_worker_of_another_layout_is_a_load_error_not_a_crash(spawn):
    from freight.vllm.config import Settings
    from freight.vllm.worker import WorkerSide

    proc, _ = start_prefill(spawn, peer.Shape(layout="HND"))
    shape = peer.Shape(layout="NHD")
    side = WorkerSide(Settings(role="kv_consumer", token=TOKEN))
    side.register_kv_caches(peer.kv_caches(shape), peer.instance(shape, "decode"))
    try:
        params = ask(proc, "req-2", [1, 2, 3])
        load(side, "req-2", [7, 8, 9], params)
        assert side.take_load_errors() == {7, 8, 9}
        assert side.reading == {}, "a refused load must leave nothing in flight"
    finally:
        side.close()
        proc.kill()
