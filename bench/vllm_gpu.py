#!/usr/bin/env python3
"""FreightConnector's worker path on one GPU beside freight's raw cuda transfer, in one run.

A prefill worker process and this process (the decode worker) each hold KV caches laid
out as vLLM lays them on GPUs (tests/vllm_gpu_peer.py: 32 layers, 64 KiB per block and
layer, NHD), both driven by :class:`freight.vllm.worker.WorkerSide`, the code vLLM
calls. For prompts of 16 to 256 blocks (256 to 4096 tokens, 32 MiB to 512 MiB of KV)
the decode worker loads the blocks (one READ of every layer's blocks, the prefill side
told when it is done), timed from handing the step's load over to seeing it received;
then the same bytes move as one contiguous READ between plain buffers of the same two
processes (freight's raw cuda figure). Every loaded block's bytes are checked once.
Two more measurements of the same blocks: the posting of a load step by step
(descriptor lists built per load against prepared lists picked by index), and push
(a WRITE per layer, as a prefill worker would post them from ``save_kv_layer``)
against the connector's pull. Prints tables last; ``--out`` writes the JSON.
``--device cpu`` runs it all on host memory over shm (no GPU needed).

    python3 bench/vllm_gpu.py --machine "1 x H200" --out bench/results/vllm-gpu-h200x1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import subprocess
import sys
import time
from typing import Dict

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import vllm_gpu_peer as peer  # noqa: E402
from reporting import PERCENTILE, median  # noqa: E402

TOKEN = "bench-token"
BLOCKS = (16, 64, 256)
REPEATS = 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", default=platform.node(), help="what the results name as the machine")
    ap.add_argument("--out", help="write the results here as JSON")
    ap.add_argument("--repeats", type=int, default=REPEATS, help=f"loads per size (default {REPEATS})")
    ap.add_argument("--layout", default="NHD", choices=peer.LAYOUTS, help="KV cache layout (default NHD)")
    ap.add_argument("--device", default="cuda:0",
                    help="where both KV caches live (default cuda:0; cpu runs the same over shm, to try the script)")
    ap.add_argument("--agent", default="{}", metavar="JSON",
                    help="AgentConfig fields for the decode worker's agent, to try the cuda transport's settings, "
                         "e.g. '{\"cuda_kernel_item_bytes\": 262144}' (recorded in the JSON)")
    args = ap.parse_args()
    agent_extra = json.loads(args.agent)
    if not isinstance(agent_extra, dict):
        ap.error("--agent takes a JSON object")

    import torch

    import freight
    from freight.vllm.config import Settings
    from freight.vllm.layout import LayerBlocks, block_descs, block_indices
    from freight.vllm.params import Handoff, Load, done_message
    from freight.vllm.worker import WorkerSide

    shape = peer.Shape(num_layers=32, num_blocks=512, block_size=16, kv_heads=8, head_size=128, layout=args.layout)
    block_bytes = shape.block_size * shape.kv_heads * 2 * shape.head_size * 2
    raw_bytes = max(BLOCKS) * shape.num_layers * block_bytes
    spec = json.dumps({"shape": peer.asdict(shape), "token": TOKEN, "raw_bytes": raw_bytes, "device": args.device})
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import vllm_gpu_peer; vllm_gpu_peer.main()"
    proc = subprocess.Popen([sys.executable, "-c", code, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    hello = json.loads(proc.stdout.readline())
    caches = peer.kv_caches(shape, args.device)
    on_gpu = args.device.startswith("cuda")
    side = WorkerSide(Settings(role="kv_consumer", token=TOKEN))
    if agent_extra:
        settings_config = side.agent_config
        side.agent_config = lambda: dataclasses.replace(settings_config(), **agent_extra)
    side.register_kv_caches(caches, peer.instance(shape, "decode"))
    raw = torch.empty(raw_bytes, dtype=torch.uint8, device=args.device)
    side.agent.register(raw)
    ids = iter(range(1 << 30))

    def ask(blocks):
        rid = f"r{next(ids)}"
        proc.stdin.write(json.dumps({"request": rid, "blocks": blocks}) + "\n")
        proc.stdin.flush()
        return rid, json.loads(proc.stdout.readline())

    phases = {"post_s": [], "engine_s": []}

    def load(n: int) -> float:
        remote = list(range(1, 1 + n))
        local = list(range(shape.num_blocks - n, shape.num_blocks))
        rid, params = ask(remote)
        started = time.perf_counter()
        side.start_load({rid: Load(local_blocks=local, params=params)}, {})
        posted = time.perf_counter()
        _, received = side.finished()
        while rid not in received:
            _, received = side.finished()
        took = time.perf_counter() - started
        numbers = side.take_stats()
        phases["post_s"].append(posted - started)
        phases["engine_s"].append(numbers.data["transfer_seconds"][-1] if numbers else float("nan"))
        assert side.take_load_errors() == set(), "a load failed"
        freed = json.loads(proc.stdout.readline())
        assert freed == {"freed": rid}, freed
        return took

    def phases_of_a_load(n: int) -> Dict[str, float]:
        """The connector's posting, step by step, for the same blocks: descriptor lists
        built per load (what it does today) against prepared lists picked by index."""
        remote_ids = list(range(1, 1 + n))
        local = list(range(shape.num_blocks - n, shape.num_blocks))
        _, params = ask(remote_ids)
        place = Handoff.from_params(params).ranks[0]
        agent, kind, dev = side.agent, side.kind, side.device
        remote_layers = [LayerBlocks(l.name, base, stride, l.block_bytes, place.num_blocks)
                         for l, base, stride in zip(side.layers, place.layer_bases, place.layer_strides)]
        t = [time.perf_counter()]
        mine = freight.DescList(block_descs(side.layers, local, dev), kind)
        theirs = freight.DescList(block_descs(remote_layers, remote_ids, dev), kind)
        t.append(time.perf_counter())
        pl, pr = agent.prepare_local(mine), agent.prepare_remote(peer_name, theirs)
        t.append(time.perf_counter())
        req = agent.make_request("READ", pl, None, pr, None)
        t.append(time.perf_counter())
        req.post()
        t.append(time.perf_counter())
        req.wait(60)
        t.append(time.perf_counter())
        req.post()
        req.wait(60)
        t.append(time.perf_counter())
        everything = side.remote_blocks(place, peer_name)
        t.append(time.perf_counter())
        li = block_indices(len(side.layers), side.num_blocks, local)
        ri = block_indices(len(side.layers), place.num_blocks, remote_ids)
        t.append(time.perf_counter())
        req = agent.make_request("READ", side.all_blocks, li, everything, ri)
        t.append(time.perf_counter())
        req.post()
        req.wait(60)
        t.append(time.perf_counter())
        d = [b - a for a, b in zip(t, t[1:])]
        # The prefill side holds the blocks until told: tell it (this READ sent nothing).
        agent.notify(peer_name, done_message(Handoff.from_params(params).request_id))
        json.loads(proc.stdout.readline())
        return {"descs_s": d[0], "prepare_s": d[1], "make_request_s": d[2], "post_s": d[3], "wait_s": d[4],
                "repost_s": d[5], "indices_s": d[7], "make_indexed_s": d[8], "indexed_post_wait_s": d[9]}

    def push_of_a_load(n: int) -> Dict[str, float]:
        """Push, as a prefill worker would do it from ``save_kv_layer``: one WRITE per
        layer of that layer's blocks, each posted when its layer is done (here: when the
        one before it landed, as if each layer's compute took longer than its WRITE).
        Measured in the other direction (this process writes the same bytes into the
        peer's plain buffer, layer after layer), which costs the engine the same. What a
        push leaves after the forward pass is its last layer's WRITE; what it costs in
        all is the sum."""
        local = list(range(shape.num_blocks - n, shape.num_blocks))
        agent, kind, dev = side.agent, side.kind, side.device
        one = side.layers[0].block_bytes
        each = []
        for i, layer in enumerate(side.layers):
            started = time.perf_counter()
            agent.transfer("WRITE", freight.DescList(block_descs([layer], local, dev), kind), peer_name,
                           freight.DescList([(hello["raw"] + i * n * one, n * one, dev)], kind)).wait(60)
            each.append(time.perf_counter() - started)
        return {"push_sum_s": sum(each), "push_last_layer_s": each[-1]}

    def check(n: int) -> None:
        if on_gpu:
            torch.cuda.synchronize()
        local = list(range(shape.num_blocks - n, shape.num_blocks))
        for layer, t in enumerate(caches.values()):
            for mine, theirs in zip(local, range(1, 1 + n)):
                want = peer.expected(layer, theirs, t).contiguous().view(torch.int16)
                assert torch.equal(t[mine].contiguous().view(torch.int16), want), (layer, mine)

    load(1)  # connects (the handshake is not what is measured)
    peer_name = hello["place"]["agent_name"]
    want = "cuda" if on_gpu else "shm"
    assert side.agent.path_to(peer_name).transport == want, side.agent.path_to(peer_name)
    rows = []
    for n in BLOCKS:
        nbytes = n * shape.num_layers * block_bytes
        load(n)
        check(n)
        for v in phases.values():
            v.clear()
        caches_s = [load(n) for _ in range(args.repeats)]
        post_s, engine_s = list(phases["post_s"]), list(phases["engine_s"])
        raw_s = []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            req = side.agent.transfer("READ", freight.DescList([(raw.data_ptr(), nbytes, 0)], side.kind), peer_name,
                                      freight.DescList([(hello["raw"], nbytes, 0)], side.kind))
            req.wait(60)
            raw_s.append(time.perf_counter() - started)
        raw_s = raw_s[1:]
        load_phases = [phases_of_a_load(n) for _ in range(args.repeats)]
        steps = {k: median(p[k] for p in load_phases) for k in load_phases[0]}
        pushes = [push_of_a_load(n) for _ in range(args.repeats)]
        push = {k: median(p[k] for p in pushes) for k in pushes[0]}
        connector = median(caches_s)
        plain = median(raw_s)
        rows.append({"blocks": n, "tokens": n * shape.block_size, "bytes": nbytes,
                     "descriptors": n * shape.num_layers,
                     "connector_s": caches_s, "raw_s": raw_s, "post_s": post_s, "engine_s": engine_s,
                     "connector_gbps": nbytes / connector / 1e9, "raw_gbps": nbytes / plain / 1e9,
                     "ratio": plain / connector, "posting_steps_s": steps, "push": push,
                     "push_runs": pushes})
    side.close()
    proc.stdin.write(json.dumps({"exit": True}) + "\n")
    proc.stdin.flush()
    proc.wait(timeout=30)

    result = {"benchmark": "vllm-connector-gpu", "machine": args.machine, "layout": args.layout,
              "percentile": PERCENTILE, "shape": peer.asdict(shape), "block_bytes_per_layer": block_bytes, "repeats": args.repeats,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
              "device": args.device, "agent_config": agent_extra, "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| KV per request | descriptors | connector GB/s | raw GB/s | connector / raw | "
          "posting (ms) | engine (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['bytes'] >> 20} MiB ({r['tokens']} tokens) | {r['descriptors']} | {r['connector_gbps']:.1f} | "
              f"{r['raw_gbps']:.1f} | {r['ratio']:.2f} | {median(r['post_s']) * 1e3:.3f} | "
              f"{median(r['engine_s']) * 1e3:.3f} |")
    print()
    print("| KV per request | pull: one READ of all layers (ms) | push: a WRITE per layer, summed (ms) | "
          "push: the last layer's WRITE (ms) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        p = r["push"]
        print(f"| {r['bytes'] >> 20} MiB | {median(r['connector_s']) * 1e3:.3f} | "
              f"{p['push_sum_s'] * 1e3:.3f} | {p['push_last_layer_s'] * 1e3:.3f} |")
    print()
    print("posting steps (ms, median): " + ", ".join(rows[0]["posting_steps_s"]))
    for r in rows:
        print(f"  {r['descriptors']:>5} descriptors: " + "  ".join(
            f"{k[:-2]}={v * 1e3:.3f}" for k, v in r["posting_steps_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
