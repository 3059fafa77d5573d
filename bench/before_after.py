#!/usr/bin/env python3
"""The same figures from two builds of freight, interleaved in one run: what a change
costs, if anything.

    python3 bench/before_after.py --before /path/to/old/freight --after target/release/freight \\
        --machine "2-vCPU VM" --out bench/results/before-after.json

Rounds alternate the builds (before, after, before, after, ...), so that whatever the
machine does meanwhile hits both alike. Each figure is the median of its rounds
(bench/reporting.py's: one of the rounds, never a mean of two); beside it, the spread of the rounds (lowest to highest), and after/before. A figure counts as
"within noise" when the after median lies inside the before rounds' spread widened by
5% (or the other way round).

The figures are those of docs/bench-engine.md (shm), docs/kv.md (the KV server),
with the KV server started with a token, as a deployment runs it, and docs/bench-gpu.md
(what one GPU measures):
  shm    4 KiB WRITE, post to done, p50 (us); WRITE bandwidth at 256 KiB and 8 MiB blocks
  tcp    the same over tcp on loopback, at 64 KiB and 8 MiB blocks
  desc   freight bench descriptors: registering 10,000 regions, preparing and making
         requests of 65,536 descriptors (median of 9 repetitions, us)
  kv     GET ops/s and p50 (us) of 4 KiB and 64 KiB values, 4 client threads, over shm
         and over tcp (bench/kv.py's freight run: the median of three runs a round)
  gpu    two processes on one GPU (bench/gpu.py --only same-gpu): WRITE and READ
         bandwidth at 32 MiB, 16 KiB and 4 KiB blocks in random order, 4 KiB WRITE post
         to done p50 and p99, host to GPU and GPU to host. The builds are Python packages
         here: --before-site and --after-site name folders to put first on PYTHONPATH
         (a wheel installed with pip --target), --before and --after are not needed.

    python3 bench/before_after.py --only gpu --before-site /tmp/site-old --after-site /tmp/site-new \
        --machine "one H200" --out bench/results/before-after-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kv  # noqa: E402  (bench/kv.py: its freight_run)
from reporting import PERCENTILE, host_machine, logger, median, run_json  # noqa: E402

log = logger("before-after")
TOKEN = "before-after-token"


def p2p_figures(freight: str, transport: str, iters: int, blocks: tuple) -> dict:
    """`freight bench p2p` over `transport`: one 4 KiB WRITE, post to done, and WRITE
    bandwidth at `blocks` ("256KiB", ...)."""
    lat = run_json([freight, "bench", "p2p", "--transport", transport, "--block-sizes", "4KiB", "--batch-sizes", "1",
                    "--iters", str(iters), "--json"])
    bw = run_json([freight, "bench", "p2p", "--transport", transport, "--block-sizes", ",".join(blocks),
                   "--batch-sizes", "1", "--json"])
    for doc in (lat, bw):
        if "error" in doc:
            sys.exit(f"{freight}: {doc['error']}")
    figures = {f"{transport} 4 KiB WRITE post-to-done p50 (us)": lat["rows"][0]["transfer_us"]["p50"]}
    for r in bw["rows"]:
        size = f"{r['block_size'] >> 20} MiB" if r["block_size"] >= 1 << 20 else f"{r['block_size'] >> 10} KiB"
        figures[f"{transport} WRITE {size} blocks (GB/s)"] = r["gbps"]
    return figures


def shm_figures(freight: str) -> dict:
    return p2p_figures(freight, "shm", 20000, ("256KiB", "8MiB"))


def tcp_figures(freight: str) -> dict:
    """The tcp transport on loopback (its streams' bookkeeping is the protocol crate's)."""
    return p2p_figures(freight, "tcp", 5000, ("64KiB", "8MiB"))


def desc_figures(freight: str) -> dict:
    """`freight bench descriptors`: registering and deregistering 10,000 regions, and
    building requests of 65,536 descriptors (median of its repetitions). A row the
    build does not have (added since) is left out of its figures."""
    doc = run_json([freight, "bench", "descriptors", "--reps", "9", "--json"])
    if "error" in doc:
        sys.exit(f"{freight}: {doc['error']}")
    return {f"desc {r['operation']} (us)": r["median_us"] for r in doc["rows"]}


def kv_figures(freight: str, scale: float) -> dict:
    out = {}
    # freight_run starts `freight serve` and runs kv-bench against it; both get the token.
    command = [freight]
    for name, size, keys in (("4 KiB", 4096, 50000), ("64 KiB", 65536, 10000)):
        keys = max(100, int(keys * scale))
        for transport in ("shm", "tcp"):
            r = kv.freight_run(command, size, keys, transport)
            out[f"kv {name} GET over {transport} (ops/s)"] = r["ops_per_sec"]
            out[f"kv {name} GET over {transport} p50 (us)"] = r["p50_us"]
    return out


def gpu_figures(site: str) -> dict:
    """bench/gpu.py --only same-gpu with the freight package in `site`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpu.json"
        env = {**os.environ, "PYTHONPATH": site + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, str(HERE / "gpu.py"), "--only", "same-gpu", "--out", str(out)], env=env,
                       check=True, timeout=600)
        rows = json.loads(out.read_text())["rows"]
    figures = {}
    for r in rows:
        block = f"{r['block'] >> 20} MiB" if r["block"] >= 1 << 20 else f"{r['block'] >> 10} KiB"
        if r["test"] == "bw" and r.get("order") == "random":
            figures[f"gpu {r['op']} {block} blocks x {r['count']} (GB/s)"] = r["gbps"]
        elif r["test"] == "lat4k":
            figures["gpu 4 KiB WRITE post-to-done p50 (us)"] = r["p50_us"]
            figures["gpu 4 KiB WRITE post-to-done p99 (us)"] = r["p99_us"]
        elif r["test"] in ("h2d", "d2h"):
            figures[f"gpu {r['test']} 32 x 32 MiB (GB/s)"] = r["gbps"]
    return figures


def judge(before: list, after: list, higher_is_better: bool) -> dict:
    b, a = median(before), median(after)
    lo, hi = min(before), max(before)
    within = lo * 0.95 <= a <= hi * 1.05 or min(after) * 0.95 <= b <= max(after) * 1.05
    return {
        "before": b, "after": a, "ratio": a / b if b else None,
        "before_rounds": before, "after_rounds": after,
        "within_noise": within,
        "better_or_equal": (a >= b) if higher_is_better else (a <= b),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the freight binary before the change (shm, kv)")
    ap.add_argument("--after", help="the freight binary after it (shm, kv)")
    ap.add_argument("--before-site", help="the freight Python package before the change, a folder for PYTHONPATH (gpu)")
    ap.add_argument("--after-site", help="the freight Python package after it (gpu)")
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each build (default 3)")
    ap.add_argument("--scale", type=float, default=0.5, help="multiplies the KV runs' numbers of keys")
    ap.add_argument("--only", choices=["shm", "tcp", "kv", "desc", "gpu"], action="append",
                    help="one suite (repeatable; default shm and kv)")
    args = ap.parse_args()
    suites = args.only or ["shm", "kv"]
    for suite, needs in (("shm", ("before", "after")), ("tcp", ("before", "after")), ("kv", ("before", "after")),
                         ("desc", ("before", "after")),
                         ("gpu", ("before_site", "after_site"))):
        missing = [n for n in needs if suite in suites and not getattr(args, n)]
        if missing:
            ap.error(f"the {suite} suite needs " + " and ".join("--" + n.replace("_", "-") for n in missing))
    # The KV runs of bench/kv.py with the server's token: `freight serve` and `freight
    # kv-bench` both read it from the environment.
    os.environ["FREIGHT_KV_TOKEN"] = TOKEN
    started = time.time()
    rounds: dict = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in ("before", "after"):
            binary, site = getattr(args, side), getattr(args, f"{side}_site")
            log(f"round {r + 1}/{args.rounds}: {side} ({binary or site})")
            figures = {}
            if "shm" in suites:
                figures.update(shm_figures(binary))
            if "tcp" in suites:
                figures.update(tcp_figures(binary))
            if "kv" in suites:
                figures.update(kv_figures(binary, args.scale))
            if "desc" in suites:
                figures.update(desc_figures(binary))
            if "gpu" in suites:
                figures.update(gpu_figures(site))
            rounds[side].append(figures)
    # Figures both builds report (a row added since is in the after build only).
    names = [n for n in rounds["after"][0] if n in rounds["before"][0]]
    table = {}
    for name in names:
        higher = not name.endswith("(us)")
        table[name] = judge([f[name] for f in rounds["before"]], [f[name] for f in rounds["after"]], higher)
    doc = {
        "tool": "bench/before_after.py",
        "machine": {"label": args.machine, **host_machine()},
        "percentile": PERCENTILE,
        "before": args.before or args.before_site, "after": args.after or args.after_site,
        "suites": suites, "rounds": args.rounds, "kv_scale": args.scale,
        "kv_token": True,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started),
        "figures": table,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'figure':48} {'before':>10} {'after':>10} {'after/before':>12}  within noise")
    for name, t in table.items():
        print(f"{name:48} {t['before']:>10.4g} {t['after']:>10.4g} {t['ratio']:>12.3f}  {'yes' if t['within_noise'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
