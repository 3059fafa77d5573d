#!/usr/bin/env python3
"""Hardware ceilings for freight's GPU benchmarks, measured in one process on two GPUs.

  bw, engine "ce"   copy engine: one 4 GiB torch copy_ from GPU 0 to GPU 1 with peer access
                    (cudaMemcpyPeerAsync underneath)
  bw, engine "sm"   SM copy kernel (CuPy RawKernel) launched on GPU 0 over a list of
                    (src, dst, len) descriptors, 16-byte loads and stores, many blocks in
                    flight, for each block size of the transfer benchmarks (128 x 32 MiB,
                    2048 x 2 MiB, 16384 x 256 KiB, 65536 x 16 KiB, 65536 x 4 KiB), the source
                    blocks in random order; op WRITE: GPU 0 memory -> GPU 1 memory (push),
                    op READ: GPU 1 memory -> GPU 0 memory (pull, still launched on GPU 0).
                    Several launch shapes are tried; the best one is reported with its shape.
  h2d, d2h          pinned host memory <-> GPU memory, 32 x 32 MiB cudaMemcpyAsync calls on
                    one stream; measured on both GPUs, the better one is the ceiling

Each figure is bytes / median time over the timed iterations (bench/reporting.py's median,
as for freight and NIXL). Output rows have the shape
of the transfer benchmarks' rows:

  {"system": "ceiling", "test": "bw"|"h2d"|"d2h", "op": "WRITE"|"READ", "block": bytes,
   "count": n, "gbps": float, "p50_us": null, "p99_us": null, "engine": "sm"|"ce"}

    python3 bench/peers/ceilings.py --out ceilings.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reporting import BW_CASES, GIB, HOST_CASE, KIB, MIB, PERCENTILE, finish, host_machine, human, logger, median  # noqa: E402,F401

# One CUDA block per descriptor at a time (grid-stride over descriptors); each thread keeps
# four 16-byte loads in flight before storing them.
KERNEL = r"""
extern "C" __global__ void copy_blocks(const long long* __restrict__ desc, int n) {
  for (int b = blockIdx.x; b < n; b += gridDim.x) {
    const int4* __restrict__ s = (const int4*)desc[3 * b];
    int4* __restrict__ d = (int4*)desc[3 * b + 1];
    const long long n16 = desc[3 * b + 2] >> 4;
    const long long step = blockDim.x;
    long long i = threadIdx.x;
    for (; i + 3 * step < n16; i += 4 * step) {
      int4 a0 = s[i], a1 = s[i + step], a2 = s[i + 2 * step], a3 = s[i + 3 * step];
      d[i] = a0; d[i + step] = a1; d[i + 2 * step] = a2; d[i + 3 * step] = a3;
    }
    for (; i < n16; i += step) d[i] = s[i];
  }
}
"""

# (threads per CUDA block, CUDA blocks per SM). Blocks are also tried cut into pieces of
# PIECES bytes, so that 128 large blocks can still spread over every SM.
SHAPES = [(256, 4), (512, 2), (512, 8), (1024, 2)]
PIECES = [64 * KIB, 512 * KIB]


log = logger("ceilings")


def new_row(test: str, op: str, block: int, count: int, **extra) -> dict:
    return {"system": "ceiling", "test": test, "op": op, "block": block, "count": count,
            "gbps": None, "p50_us": None, "p99_us": None, **extra}


class Ceilings:
    def __init__(self, src_gpu: int, dst_gpu: int, nbytes: int, quick: bool):
        import numpy as np
        import torch
        import cupy as cp

        self.np, self.torch, self.cp = np, torch, cp
        self.a, self.b = src_gpu, dst_gpu
        self.nbytes = nbytes
        self.quick = quick
        self.rng = np.random.default_rng(12345)
        self.verify: dict = {}

    def machine(self) -> dict:
        torch, cp = self.torch, self.cp
        info = host_machine()
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cupy"] = cp.__version__
        info["peer_access"] = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j)
                               for i in (self.a, self.b) for j in (self.a, self.b) if i != j}
        return info

    # -- helpers ------------------------------------------------------------------------

    def iters(self) -> tuple[int, int]:
        return (2, 5) if self.quick else (3, 15)

    def event_median(self, dev: int, fn) -> float:
        """Median seconds of fn() on the current stream of `dev`, timed with CUDA events."""
        cp = self.cp
        warm, iters = self.iters()
        with cp.cuda.Device(dev):
            for _ in range(warm):
                fn()
            cp.cuda.Device(dev).synchronize()
            ts = []
            for _ in range(iters):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                fn()
                end.record()
                end.synchronize()
                ts.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return median(ts)

    def enable_peer(self, dev: int, peer: int) -> None:
        cp = self.cp
        with cp.cuda.Device(dev):
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(peer)
            except cp.cuda.runtime.CUDARuntimeError as e:
                if "AlreadyEnabled" not in str(e) and "already" not in str(e).lower():
                    raise

    # -- measurements -------------------------------------------------------------------

    def setup(self) -> None:
        torch = self.torch
        n = self.nbytes
        log(f"allocating {human(n)} on GPU {self.a} and on GPU {self.b}")
        gen = torch.Generator(device=f"cuda:{self.a}").manual_seed(1)
        self.buf_a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{self.a}", generator=gen)
        gen = torch.Generator(device=f"cuda:{self.b}").manual_seed(2)
        self.buf_b = torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{self.b}", generator=gen)
        self.enable_peer(self.a, self.b)
        self.enable_peer(self.b, self.a)

    def copy_engine(self) -> dict:
        torch = self.torch
        src, dst = self.buf_a, self.buf_b
        warm, iters = self.iters()

        def sync():
            torch.cuda.synchronize(self.a)
            torch.cuda.synchronize(self.b)

        for _ in range(warm):
            dst.copy_(src)
        sync()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            ts.append(time.perf_counter() - t0)
        t = median(ts)
        probe = slice(self.nbytes - MIB, self.nbytes)
        self.verify["ce_write"] = bool(torch.equal(dst[probe].cpu(), src[probe].cpu()))
        return {"gbps": round(self.nbytes / t / 1e9, 3), "median_ms": round(t * 1e3, 4), "iters": len(ts)}

    def sm_kernel(self, op: str, block: int, count: int) -> dict:
        """The SM copy kernel on GPU a over `count` blocks in random order."""
        np, cp, torch = self.np, self.cp, self.torch
        if op == "WRITE":
            src, dst = self.buf_a, self.buf_b  # push: local reads, remote writes
        else:
            src, dst = self.buf_b, self.buf_a  # pull: remote reads, local writes
        perm = self.rng.permutation(count).astype(np.int64)
        src_off = perm * block
        dst_off = np.arange(count, dtype=np.int64) * block
        best = None
        with cp.cuda.Device(self.a):
            kernel = cp.RawKernel(KERNEL, "copy_blocks")
            sms = cp.cuda.Device(self.a).attributes["MultiProcessorCount"]
            pieces = sorted({p for p in PIECES if p < block} | {block})
            for piece in pieces:
                cut = max(1, block // piece)
                plen = block // cut
                sub = np.arange(cut, dtype=np.int64) * plen
                table = np.empty((count * cut, 3), dtype=np.int64)
                table[:, 0] = (src.data_ptr() + src_off[:, None] + sub[None, :]).ravel()
                table[:, 1] = (dst.data_ptr() + dst_off[:, None] + sub[None, :]).ravel()
                table[:, 2] = plen
                desc = cp.asarray(table)
                n = np.int32(len(table))
                for threads, per_sm in SHAPES:
                    grid = sms * per_sm

                    def launch():
                        kernel((grid,), (threads,), (desc, n))

                    t = self.event_median(self.a, launch)
                    if best is None or t < best[0]:
                        best = (t, {"threads": threads, "grid": grid, "piece": plen})
        torch.cuda.synchronize(self.a)
        torch.cuda.synchronize(self.b)
        # the last launch moved block perm[k] of src to block k of dst
        ok = True
        for k in (0, count // 2, count - 1):
            s = src[src_off[k]: src_off[k] + block].cpu()
            d = dst[dst_off[k]: dst_off[k] + block].cpu()
            ok = ok and bool(torch.equal(s, d))
        self.verify[f"sm_{op.lower()}_{human(block).replace(' ', '')}"] = ok
        t, shape = best
        return {"gbps": round(block * count / t / 1e9, 3), "median_ms": round(t * 1e3, 4),
                "shape": shape, "order": "random"}

    def host(self, test: str) -> dict:
        """Pinned host <-> device, HOST_CASE blocks of cudaMemcpyAsync on one stream."""
        torch = self.torch
        block, count = HOST_CASE
        total = block * count
        hostbuf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        hostbuf.fill_(7)
        per_gpu = {}
        for g in (self.a, self.b):
            dev = torch.empty(total, dtype=torch.uint8, device=f"cuda:{g}")

            def copies():
                for i in range(count):
                    part = slice(i * block, (i + 1) * block)
                    if test == "h2d":
                        dev[part].copy_(hostbuf[part], non_blocking=True)
                    else:
                        hostbuf[part].copy_(dev[part], non_blocking=True)

            with torch.cuda.device(g):
                t = self.event_median(g, copies)
            per_gpu[str(g)] = round(total / t / 1e9, 3)
        best = max(per_gpu.values())
        return {"gbps": best, "per_gpu": per_gpu, "method": f"{count} x cudaMemcpyAsync, pinned"}


def case(rows: list, row: dict, fn) -> None:
    try:
        row.update(fn())
    except Exception as e:  # noqa: BLE001 - one failed case must not end the run
        row["error"] = f"{type(e).__name__}: {e}"
    rows.append(row)
    shown = {k: row[k] for k in ("gbps", "shape", "per_gpu", "error") if row.get(k) is not None}
    log(f"{row['test']} {row['op']} {row.get('engine', '')} {row['count']} x {human(row['block'])}: {shown}")


def table(rows: list) -> str:
    lines = [f"{'test':<5} {'engine':<6} {'op':<5} {'blocks':>16} {'GB/s':>9}  note"]
    for r in rows:
        g = "-" if r["gbps"] is None else f"{r['gbps']:.1f}"
        lines.append(f"{r['test']:<5} {r.get('engine', ''):<6} {r['op']:<5} "
                     f"{str(r['count']) + ' x ' + human(r['block']):>16} {g:>9}  {r.get('error', '')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write (default: print the table only)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, not a report)")
    ap.add_argument("--gpus", default="0,1", help="source and destination GPU (default 0,1)")
    ap.add_argument("--bytes", type=int, default=4 * GIB,
                    help="size of the buffer on each GPU; caps every case (default 4 GiB)")
    args = ap.parse_args()
    try:
        a, b = (int(x) for x in args.gpus.split(","))
    except ValueError:
        ap.error("--gpus takes two GPU indices, like 0,1")
    if args.bytes < 64 * MIB:
        ap.error("--bytes must be at least 64 MiB (two 32 MiB blocks)")

    t0 = time.monotonic()
    doc = {"tool": "ceilings", "machine": {}, "quick": args.quick, "percentile": PERCENTILE,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "config": {"gpus": [a, b], "bytes": args.bytes}, "rows": [], "verify": {}, "errors": []}
    rows = doc["rows"]
    try:
        c = Ceilings(a, b, args.bytes, args.quick)
        doc["machine"] = c.machine()
        if c.torch.cuda.device_count() < 2:
            raise RuntimeError(f"two GPUs needed, {c.torch.cuda.device_count()} visible")
        c.setup()
    except Exception as e:  # noqa: BLE001
        doc["errors"].append(f"setup: {type(e).__name__}: {e}")
        log(doc["errors"][-1])
        c = None
    if c is not None:
        case(rows, new_row("bw", "WRITE", args.bytes, 1, engine="ce"), c.copy_engine)
        for op in ("WRITE", "READ"):
            for block, count in BW_CASES:
                count = min(count, args.bytes // block)
                case(rows, new_row("bw", op, block, count, engine="sm"),
                     lambda: c.sm_kernel(op, block, count))
        block, count = HOST_CASE
        case(rows, new_row("h2d", "WRITE", block, count, engine="ce"), lambda: c.host("h2d"))
        case(rows, new_row("d2h", "READ", block, count, engine="ce"), lambda: c.host("d2h"))
        doc["verify"] = c.verify
    doc["seconds"] = round(time.monotonic() - t0, 1)
    return finish(doc, args.out, table(rows), log, need_checks=False)


if __name__ == "__main__":
    sys.exit(main())
