#!/usr/bin/env python3
"""NCCL beside freight's full-mesh benchmark: one process per GPU, for each block size,
(a) every rank sends a block to every other rank at once (all_to_all_single with one
block per peer), and (b) every rank sends a block to the next rank and receives one from
the previous (batched send/recv). Prints one JSON object: per block size, the average
per-rank GB/s (bytes a rank sends to other ranks / time) and the total over ranks.

    python3 bench/peers/nccl_mesh.py --sizes 4KiB,64KiB,1MiB,16MiB,64MiB
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def timed(fn, iters: int) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def worker(rank: int, world: int, port: int, sizes: list, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    results = {}
    for block in sizes:
        send = torch.ones(block * world, dtype=torch.uint8, device="cuda")
        recv = torch.empty_like(send)
        a2a = timed(lambda: dist.all_to_all_single(recv, send), iters)
        one, back = send[:block], recv[:block]

        def pair():
            ops = [dist.P2POp(dist.isend, one, (rank + 1) % world), dist.P2POp(dist.irecv, back, (rank - 1) % world)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        p2p = timed(pair, iters)
        results[block] = {"all_to_all_gbps": block * (world - 1) / a2a / 1e9, "sendrecv_gbps": block / p2p / 1e9}
    out.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB,64MiB")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--world", type=int, default=0, help="ranks, one GPU each (default: every GPU)")
    args = p.parse_args()
    here = torch.cuda.device_count()
    world = args.world or here
    if world < 2 or world > here:
        raise SystemExit(f"NCCL's full-mesh reference needs 2 or more ranks, one GPU each ({world} asked, {here} GPUs here)")
    sizes = [size(s) for s in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, sizes, args.iters, q)) for r in range(world)]
    for proc in procs:
        proc.start()
    per_rank = dict(q.get(timeout=600) for _ in range(world))
    for proc in procs:
        proc.join(60)
    report = {"world": world, "sizes": {}}
    for block in sizes:
        rows = [per_rank[r][block] for r in range(world)]
        report["sizes"][block] = {
            key: {"avg_per_rank": sum(r[key] for r in rows) / world, "total": sum(r[key] for r in rows)}
            for key in ("all_to_all_gbps", "sendrecv_gbps")
        }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
