#!/usr/bin/env python3
"""Expert-parallel benchmarks of the EP issue, each beside its NCCL baseline in the same
run: ``freight bench ep`` with 2 and 4 ranks (as many as the machine has GPUs, one rank
per GPU), hidden 7168, top-8, 8 experts per rank:

* 128 tokens, e2e, low-latency mode captured in a CUDA graph (target: <= 80 us on four
  H200s and >= 2x the NCCL baseline), and the same in normal mode;
* 4096 tokens, dispatch and combine measured apart (target: each >= 1.3x the NCCL
  baseline), with each rank's bandwidth set against the NVLink copy ceiling.

Writes every run's JSON report (bench/results/ep-*.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

from reporting import run_json

CASES = [
    # (name, tokens, mode, extra flags)
    ("128 tokens e2e, low-latency, CUDA graph", 128, "e2e", ["--low-latency", "--cuda-graph"]),
    ("128 tokens e2e, normal", 128, "e2e", []),
    ("4096 tokens dispatch", 4096, "dispatch", []),
    ("4096 tokens combine", 4096, "combine", []),
]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def run(freight: list, world: int, tokens: int, mode: str, extra: list, iters: int) -> dict:
    return run_json(freight + ["bench", "ep", f"--num-processes={world}", f"--tokens={tokens}", "--hidden=7168",
                               "--topk=8", "--experts-per-rank=8", f"--mode={mode}", f"--iters={iters}", "--json",
                               *extra])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", required=True, help="what the machine is, for the results")
    p.add_argument("--out", required=True, help="JSON file for all results")
    p.add_argument("--freight", default=f"{sys.executable} -m freight", help="how to start the freight CLI")
    p.add_argument("--worlds", default="2,4", help="rank counts to run (those above the GPU count are skipped)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--ceiling-gbps", type=float, default=370.0, help="NVLink copy ceiling per direction")
    args = p.parse_args()
    gpus = gpu_count()
    freight = args.freight.split()
    rows, runs = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        if world > gpus:
            print(f"[ep] {world} ranks skipped: {gpus} GPUs here", file=sys.stderr)
            continue
        for name, tokens, mode, extra in CASES:
            print(f"[ep] {world} ranks: {name}", file=sys.stderr, flush=True)
            report = run(freight, world, tokens, mode, extra, args.iters)
            runs.append({"ranks": world, "case": name, **report})
            f, n = report.get("freight"), report.get("nccl")
            rows.append((world, name, report.get("ranks_passed"), f, n, report.get("speedup_vs_nccl")))
    json.dump({"machine": args.machine, "host": platform.node(), "gpus": gpus, "ceiling_gbps": args.ceiling_gbps,
               "runs": runs}, open(args.out, "w"), indent=1)
    print("| ranks | case | passed | freight us | freight GB/s per rank | of ceiling | NCCL us | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for world, name, passed, f, n, speedup in rows:
        if not f:
            print(f"| {world} | {name} | failed | | | | | |")
            continue
        lat, bw = f["latency_us"]["avg"], f["bandwidth_gbps"]["avg"]
        nccl = f"{n['latency_us']['avg']:.1f}" if n else "not run"
        ratio = f"{speedup:.2f}x" if speedup else ""
        print(f"| {world} | {name} | {passed}/{world} | {lat:.1f} | {bw:.1f} | {bw / args.ceiling_gbps:.0%} | {nccl} | {ratio} |")


if __name__ == "__main__":
    main()
