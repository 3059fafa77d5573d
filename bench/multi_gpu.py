#!/usr/bin/env python3
"""The multi-GPU runs in one command, for any number of GPUs (8 on the machine that has
them): the expert-parallel benchmark (bench/ep_bench.py) with the seed's configuration
(128 tokens, hidden 7168, top-8, 36 experts per rank; dispatch, combine and e2e) and at
4096 tokens, each beside its NCCL baseline; then the full-mesh point-to-point benchmark (every process
writes to every other at once, one GPU each, block sizes 4 KiB to 64 MiB) beside NCCL's
all-to-all and send/recv on the same machine (bench/peers/nccl_mesh.py).

    python3 bench/multi_gpu.py --machine "8x H200" --out bench/results/multi-gpu-h200x8.json

Prints a markdown table of each part last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reporting import PERCENTILE, host_machine, run_json  # noqa: E402

SIZES = ["4KiB", "64KiB", "1MiB", "16MiB", "64MiB"]
EP_CASES = [
    # (case, tokens, mode, extra flags)
    ("seed config", 128, "dispatch", []),
    ("seed config", 128, "combine", []),
    ("seed config", 128, "e2e", []),
    ("seed config, low-latency, CUDA graph", 128, "e2e", ["--low-latency", "--cuda-graph"]),
    ("4096 tokens", 4096, "dispatch", []),
    ("4096 tokens", 4096, "combine", []),
]


def gpu_count() -> int:
    return len(host_machine().get("gpus", []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--freight", default=f"{sys.executable} -m freight", help="the freight command (full mesh)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter that runs bench/ep_bench.py (it needs freight and PyTorch)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs (ranks) to use; default: all")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--mesh-seconds", default="2s")
    p.add_argument("--share-gpus", action="store_true",
                   help="allow more ranks than GPUs (a smoke run of this script on a smaller machine: ranks share "
                        "GPUs, so the figures mean nothing, and NCCL refuses two ranks on one GPU)")
    args = p.parse_args()
    gpus = args.gpus or gpu_count()
    if gpus < 2:
        raise SystemExit(f"the multi-GPU runs need at least 2 ranks ({gpus} asked)")
    if gpus > gpu_count() and not args.share_gpus:
        raise SystemExit(f"{gpus} ranks asked, {gpu_count()} GPUs here (--share-gpus for a smoke run)")
    freight = args.freight.split()
    report = {"machine": args.machine, "gpus": gpus, "gpus_here": gpu_count(), "percentile": PERCENTILE, "ep": [],
              "mesh": [], "nccl_mesh": None}

    for case, tokens, mode, extra in EP_CASES:
        print(f"[multi-gpu] ep: {case}, {mode}", file=sys.stderr, flush=True)
        doc = run_json([*args.python.split(), str(HERE / "ep_bench.py"), f"--num-processes={gpus}",
                        f"--tokens={tokens}", "--hidden=7168", "--topk=8", "--experts-per-rank=36", f"--mode={mode}",
                        f"--iters={args.iters}", "--json", *extra])
        report["ep"].append({"case": case, "tokens": tokens, "mode": mode, **doc})

    for block in SIZES:
        print(f"[multi-gpu] full mesh: {block}", file=sys.stderr, flush=True)
        doc = run_json(freight + ["bench", "p2p", f"--full-mesh={gpus}", f"--block-sizes={block}",
                                  f"--duration={args.mesh_seconds}", "--json"])
        report["mesh"].append({"block": block, **doc})

    print("[multi-gpu] NCCL all-to-all and send/recv", file=sys.stderr, flush=True)
    report["nccl_mesh"] = run_json([sys.executable, str(HERE / "peers" / "nccl_mesh.py"), "--sizes", ",".join(SIZES),
                                   f"--world={gpus}"])
    Path(args.out).write_text(json.dumps(report, indent=1))

    print(f"\nExpert parallelism, {gpus} ranks, hidden 7168, top-8, 36 experts per rank ({args.machine})\n")
    print("| case | mode | passed | freight us | GB/s per rank | NCCL us | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in report["ep"]:
        f, n = r.get("freight"), r.get("nccl")
        if not f:
            print(f"| {r['case']} | {r['mode']} | failed: {r.get('error', '')[:60]} | | | | |")
            continue
        nccl = f"{n['latency_us']['avg']:.1f}" if n else "not run"
        speedup = f"{r['speedup_vs_nccl']:.2f}x" if "speedup_vs_nccl" in r else ""
        print(f"| {r['case']} | {r['mode']} | {r['ranks_passed']}/{gpus} | {f['latency_us']['avg']:.1f} | "
              f"{f['bandwidth_gbps']['avg']:.1f} | {nccl} | {speedup} |")

    print(f"\nFull mesh, {gpus} processes (GB/s per process, average; total in brackets)\n")
    print("| block | freight | NCCL all-to-all | NCCL send/recv |")
    print("| --- | --- | --- | --- |")
    nccl = (report["nccl_mesh"] or {}).get("sizes", {})
    for block, r in zip(SIZES, report["mesh"]):
        total = r.get("total_gbps")
        ours = f"{total / gpus:.1f} [{total:.1f}]" if total is not None else f"failed: {r.get('error', '')[:40]}"
        ref = nccl.get(str(_bytes(block)), {})
        cell = lambda k: f"{ref[k]['avg_per_rank']:.1f} [{ref[k]['total']:.1f}]" if k in ref else "not run"  # noqa: E731
        print(f"| {block} | {ours} | {cell('all_to_all_gbps')} | {cell('sendrecv_gbps')} |")


def _bytes(text: str) -> int:
    for unit, factor in {"KiB": 1 << 10, "MiB": 1 << 20}.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


if __name__ == "__main__":
    main()
