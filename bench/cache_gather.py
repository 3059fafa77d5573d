#!/usr/bin/env python3
"""Where a cache engine's gather time goes, on one GPU.

A prefill engine copies each new KV chunk out of the KV memory into its GPU tier (a
gather) before it puts the chunk to the decode peer: from contiguous KV memory one run
per layer and K/V (64 runs of 512 KiB for the seed's chunk of 256 tokens, 32 layers, 8
KV heads of 128 bf16 elements: 33.5 MB), from paged KV memory (blocks of 16 tokens)
one run per block, layer and K/V (1024 runs of 32 KiB). For each layout:

  store    the engine's store of a prompt into its GPU tier alone (no peer): the
           gathers end to end, with the engine's own overhead, per chunk
  kernel   the batched copy kernel alone on runs of that length, as one prepared
           request between two processes on this GPU (the target is
           bench/gpu_peer.py), for each launch shape and work-item size: what a launch
           could take

    python3 bench/cache_gather.py --out gather.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from gpu import Target, machine  # noqa: E402
from reporting import PERCENTILE, percentile  # noqa: E402

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, ELEM, BLOCK = 32, 8, 128, 256, 2, 16
CHUNK = LAYERS * 2 * CHUNK_TOKENS * HEADS * HEAD_DIM * ELEM
RUN = {  # bytes of one run of a chunk's gather
    "contiguous": CHUNK_TOKENS * HEADS * HEAD_DIM * ELEM,  # one layer's K (or V): 512 KiB
    "paged": BLOCK * HEADS * HEAD_DIM * ELEM,  # one block of it: 32 KiB
}

SHAPES = [  # (mode, threads, blocks per SM)
    ("warp", 256, 8), ("warp", 512, 4), ("block", 256, 2), ("block", 256, 4), ("block", 512, 2),
    ("block", 1024, 1), ("block", 1024, 2),
]
ITEMS = [4096, 16384, 65536]


def store_rate(chunks: int, rounds: int, layout: str) -> dict:
    """GB/s and microseconds per chunk of the engine's store into its GPU tier."""
    import numpy as np
    import torch
    import freight

    tokens_total = chunks * CHUNK_TOKENS
    paged = {}
    if layout == "paged":
        blocks = tokens_total // BLOCK
        kv = torch.randn((LAYERS, 2, blocks, BLOCK, HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda:0")
        # The request's blocks in a shuffled order, as an engine's allocator leaves them.
        paged = {"block_table": np.random.default_rng(1).permutation(blocks).astype(np.int32)}
    else:
        kv = torch.randn((LAYERS, 2, tokens_total, HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda:0")
    torch.cuda.synchronize()
    times = []
    with freight.Agent("gather-store") as agent:
        engine = freight.CacheEngine(agent, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                                     chunk_tokens=CHUNK_TOKENS, gpu=0, gpu_bytes=(chunks + 1) * CHUNK,
                                     host_bytes=0)
        for r in range(rounds + 1):
            # Fresh tokens each round: every chunk is new.
            tokens = np.arange(tokens_total, dtype=np.uint32) + np.uint32(r * tokens_total)
            t = time.perf_counter()
            report = engine.store(tokens, kv, **paged)
            spent = time.perf_counter() - t
            assert report["new_chunks"] == chunks, report
            if r:
                times.append(spent)
        engine.close()
    best = min(times)
    return {"layout": layout, "chunks": chunks, "chunk_bytes": CHUNK, "rounds": rounds,
            "gbps": round(chunks * CHUNK / best / 1e9, 1), "us_per_chunk": round(best / chunks * 1e6, 1),
            "all_seconds": [round(t, 5) for t in times]}


def kernel_rates(quick: bool, layout: str) -> list:
    """One prepared WRITE of a chunk's runs (scattered here, contiguous at the target)
    per launch shape and item size: p50 post-to-done."""
    import torch
    import freight

    rows = []
    run = RUN[layout]
    runs = CHUNK // run
    span = CHUNK * 2  # a run every other run's length: nothing merges
    target = Target(CHUNK, "VRAM", "0", name="gather-target")
    local = torch.ones(span, dtype=torch.uint8, device="cuda:0")
    try:
        for mode, threads, per_sm in SHAPES[:3] if quick else SHAPES:
            for item in ITEMS:
                cfg = freight.AgentConfig(cuda_kernel_mode=mode, cuda_kernel_threads=threads,
                                          cuda_kernel_blocks_per_sm=per_sm, cuda_kernel_item_bytes=item)
                with freight.Agent(f"gather-{mode}-{threads}-{per_sm}-{item}", cfg) as agent:
                    name = agent.connect(target.addr)
                    agent.register(local)
                    lp = agent.prepare_local(freight.DescList(
                        [(local.data_ptr() + 2 * i * run, run, 0) for i in range(runs)], kind="VRAM"))
                    rp = agent.prepare_remote(name, freight.DescList(
                        [(target.base + i * run, run, 0) for i in range(runs)], kind="VRAM"))
                    req = agent.make_request("WRITE", lp, None, rp, None)
                    times = []
                    for i in range(50 if quick else 300):
                        t = time.perf_counter()
                        req.post()
                        req.wait(timeout=30)
                        if i >= 10:
                            times.append(time.perf_counter() - t)
                    p50 = percentile(times, 50)
                    row = {"layout": layout, "run_bytes": run, "mode": mode, "threads": threads, "blocks_per_sm": per_sm, "item_bytes": item,
                           "us": round(p50 * 1e6, 1), "gbps": round(CHUNK / p50 / 1e9, 1)}
                    print(f"[gather] kernel {row}", flush=True)
                    rows.append(row)
    finally:
        target.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and iterations (a smoke run)")
    ap.add_argument("--chunks", type=int, default=128, help="chunks per stored prompt (default 128)")
    ap.add_argument("--layouts", default="contiguous,paged", help="KV layouts, comma-separated (default both)")
    ap.add_argument("--no-kernel", action="store_true", help="the engine's store only, not the kernel sweep")
    args = ap.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    import torch

    store, kernel = [], []
    for layout in args.layouts.split(","):
        store.append(store_rate(args.chunks, 2 if args.quick else 5, layout))
        print(f"[gather] store into the GPU tier: {store[-1]}", flush=True)
        if not args.no_kernel:
            kernel += kernel_rates(args.quick, layout)
    doc = {"tool": "bench/cache_gather.py", "percentile": PERCENTILE, "machine": machine(torch), "store": store,
           "kernel": kernel}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
