#!/usr/bin/env python3
"""Gathers the JSON that scripts/stream-bench.sh wrote (one folder per run) into one
results file, with the machine named:

    python3 bench/stream_results.py --machine "1 x NVIDIA H100" --out bench/results/stream-h100x1.json \\
        same-gpu=build/gpu-results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="the machine, in words (CPU, GPUs, how the processes sat)")
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--note", default="", help="anything a reader must know about the run")
    ap.add_argument("runs", nargs="+", metavar="LABEL=DIR", help="a label and a folder of stream-*.json")
    args = ap.parse_args()
    runs = {}
    for spec in args.runs:
        label, _, folder = spec.partition("=")
        files = sorted(pathlib.Path(folder).glob("stream-*.json"))
        if not files:
            print(f"no stream-*.json in {folder}", file=sys.stderr)
            return 1
        runs[label] = {f.stem.removeprefix("stream-"): json.loads(f.read_text()) for f in files}
    doc = {"machine": args.machine, "note": args.note, "command": "scripts/stream-bench.sh", "runs": runs}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
