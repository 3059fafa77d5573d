#!/usr/bin/env python3
"""Expert-parallel benchmarks of the EP issue, each beside its NCCL baseline in the same
run: bench/ep_bench.py with 2 and 4 ranks (as many as the machine has GPUs, one rank
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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import PERCENTILE, host_machine, run_json  # noqa: E402

EP_BENCH = Path(__file__).resolve().parent / "ep_bench.py"

CASES = [
    # (name, tokens, mode, extra flags)
    ("128 tokens e2e, low-latency, CUDA graph", 128, "e2e", ["--low-latency", "--cuda-graph"]),
    ("128 tokens e2e, normal", 128, "e2e", []),
    ("4096 tokens dispatch", 4096, "dispatch", []),
    ("4096 tokens combine", 4096, "combine", []),
]


def run(python: list, world: int, tokens: int, mode: str, extra: list, iters: int) -> dict:
    return run_json(python + [str(EP_BENCH), f"--num-processes={world}", f"--tokens={tokens}", "--hidden=7168",
                              "--topk=8", "--experts-per-rank=8", f"--mode={mode}", f"--iters={iters}", "--json",
                              *extra])


def interpreter(args, p: argparse.ArgumentParser) -> list:
    """--python; or the interpreter of the older --freight 'PYTHON -m freight', from when
    the benchmark was a freight command."""
    if not args.freight:
        return args.python.split()
    words = args.freight.split()
    if words[-2:] != ["-m", "freight"] or len(words) < 3:
        p.error("--freight takes 'PYTHON -m freight' (its PYTHON runs bench/ep_bench.py); or give --python")
    return words[:-2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", required=True, help="what the machine is, for the results")
    p.add_argument("--out", required=True, help="JSON file for all results")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter that runs bench/ep_bench.py (it needs freight and PyTorch)")
    p.add_argument("--freight", help="the older way to name that interpreter: 'PYTHON -m freight'")
    p.add_argument("--worlds", default="2,4", help="rank counts to run (those above the GPU count are skipped)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--ceiling-gbps", type=float, default=370.0, help="NVLink copy ceiling per direction")
    args = p.parse_args()
    python = interpreter(args, p)
    gpus = len(host_machine().get("gpus", []))
    rows, runs = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        if world > gpus:
            print(f"[ep] {world} ranks skipped: {gpus} GPUs here", file=sys.stderr)
            continue
        for name, tokens, mode, extra in CASES:
            print(f"[ep] {world} ranks: {name}", file=sys.stderr, flush=True)
            report = run(python, world, tokens, mode, extra, args.iters)
            runs.append({"ranks": world, "case": name, **report})
            f, n = report.get("freight"), report.get("nccl")
            rows.append((world, name, report.get("ranks_passed"), f, n, report.get("speedup_vs_nccl")))
    json.dump({"machine": args.machine, "host": platform.node(), "gpus": gpus, "ceiling_gbps": args.ceiling_gbps,
               "percentile": PERCENTILE, "runs": runs}, open(args.out, "w"), indent=1)
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
