"""FreightConnector's worker path on host memory, without vLLM serving: KV caches as
vLLM's CPU backend lays them (a tensor per layer, ``[num_blocks, kv_heads,
block_size, 2 * head_size]``), a prefill worker process (tests/vllm_gpu_peer.py on the
CPU) and this process as the decode worker, through
:class:`freight.vllm.worker.WorkerSide`. Needs PyTorch: tests/test_vllm.py runs it in
the vLLM virtualenv and reads the JSON line it prints last.

It loads blocks (every byte checked), then kills the prefill worker (SIGKILL, and waits
until it is gone) and loads the blocks of a request that worker had announced: that
load must be a load error for exactly its blocks, not a success read from the dead
worker's memory, and not a hang. A prefill worker restarted at the same address then
serves the next load.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_gpu_peer as peer  # noqa: E402

TOKEN = "cpu-kv-token"


def main() -> None:
    import torch

    from freight.vllm.config import Settings
    from freight.vllm.params import Load
    from freight.vllm.worker import WorkerSide

    # 32 MiB a layer: host KV caches smaller than that stay private (tcp), not shm.
    shape = peer.Shape(layout="HND", num_blocks=2048)
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import vllm_gpu_peer; vllm_gpu_peer.main()"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        listen = f"127.0.0.1:{probe.getsockname()[1]}"
    spec = json.dumps({"shape": peer.asdict(shape), "token": TOKEN, "device": "cpu", "listen": listen})

    def start():
        proc = subprocess.Popen([sys.executable, "-c", code, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        return proc, json.loads(proc.stdout.readline())

    proc, hello = start()
    caches = peer.kv_caches(shape, "cpu")
    side = WorkerSide(Settings(role="kv_consumer", token=TOKEN))
    side.register_kv_caches(caches, peer.instance(shape, "decode"))
    out = {}

    def ask(rid, blocks):
        proc.stdin.write(json.dumps({"request": rid, "blocks": blocks}) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    def load(rid, local, params, timeout=30.0):
        _, received = side.finished(loads={rid: Load(local_blocks=local, params=params)})
        deadline = time.monotonic() + timeout
        while rid not in received and time.monotonic() < deadline:
            time.sleep(0.001)
            _, received = side.finished()
        return rid in received, sorted(side.take_load_errors())

    try:
        remote, local = [3, 4, 5, 6], [20, 21, 22, 23]
        out["loaded"], out["load_errors"] = load("r1", local, ask("r1", remote))
        out["freed"] = json.loads(proc.stdout.readline())
        out["transport"] = side.agent.path_to(hello["place"]["agent_name"]).transport
        out["bytes_ok"] = all(torch.equal(t[m].view(torch.int16), peer.expected(layer, r, t).view(torch.int16))
                              for layer, t in enumerate(caches.values()) for m, r in zip(local, remote))
        announced = ask("r2", [7, 8, 9])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        out["after_kill_settled"], out["after_kill_errors"] = load("r2", [30, 31, 32], announced)
        out["in_flight_after"] = len(side.reading)
        proc, hello = start()
        out["restarted_at_the_same_address"] = hello["place"]["agent_address"] == listen
        remote, local = [10, 11], [40, 41]
        out["after_restart_loaded"], out["after_restart_errors"] = load("r3", local, ask("r3", remote))
        out["after_restart_bytes_ok"] = all(
            torch.equal(t[m].view(torch.int16), peer.expected(layer, r, t).view(torch.int16))
            for layer, t in enumerate(caches.values()) for m, r in zip(local, remote))
    finally:
        side.close()
        if proc.poll() is None:
            proc.kill()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
