#!/usr/bin/env python3
"""Notification latency between two processes of this host, through freight's Python
module: the engine benchmark's (bench/engine.py) "notif" suite.

The initiator (this process) starts the target as a child process. The target owns a
shared buffer and polls get_notifs; the initiator posts a prepared 4 KiB shm WRITE that
carries a notification, waits for it, pauses a little, and repeats. Latency is from
just before the post at the initiator to just after get_notifs returned the
notification at the target, both read with time.monotonic_ns (CLOCK_MONOTONIC: one
clock for every process of a host). The first notifications set up the target's
outbox and are not counted. Prints one JSON document:

  {"count": n, "post_to_seen_us": {"p50", "p99", "min", "max"},
   "post_to_done_us": {"p50", "p99"}, "transport": "shm"}

    python3 bench/peers/notif_latency.py --count 2000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reporting import KIB, PERCENTILE, logger, percentile  # noqa: E402

BLOCK = 4 * KIB
WARMUP = 100
log = logger("notif")


def target() -> None:
    """Owns the buffer; on "go N TIMEOUT" on stdin, polls until N notifications arrived
    (or TIMEOUT seconds passed) and prints [[monotonic_ns, message], ...]. Exits when
    stdin closes."""
    import freight

    agent = freight.Agent("notif-target")
    buf = agent.alloc(BLOCK)
    agent.register(buf)
    print(json.dumps({"md": agent.metadata().hex(), "addr": int(buf.ctypes.data)}), flush=True)
    for line in sys.stdin:
        _, n, timeout = line.split()
        seen = []
        deadline = time.monotonic() + float(timeout)
        while len(seen) < int(n) and time.monotonic() < deadline:
            for _, msg in agent.get_notifs():
                seen.append([time.monotonic_ns(), msg.decode()])
        print(json.dumps(seen), flush=True)
    agent.close()


def summary_us(samples_ns: list) -> dict:
    return {"p50": round(percentile(samples_ns, 50) / 1e3, 2), "p99": round(percentile(samples_ns, 99) / 1e3, 2),
            "min": round(min(samples_ns) / 1e3, 2), "max": round(max(samples_ns) / 1e3, 2)}


def initiator(count: int, pause: float) -> dict:
    import freight

    child = subprocess.Popen([sys.executable, __file__, "--role", "target"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(child.stdout.readline() or "{}")
        if "md" not in hello:
            raise RuntimeError("the target process failed to start")
        with freight.Agent("notif-initiator") as agent:
            name = agent.add_peer(bytes.fromhex(hello["md"]))
            src = agent.alloc(BLOCK)
            agent.register(src)
            local = agent.prepare_local([src])
            remote = agent.prepare_remote(name, [(hello["addr"], BLOCK, 0)])
            reqs = [agent.make_request("WRITE", local, None, remote, None, notif=str(i).encode())
                    for i in range(WARMUP + count)]
            child.stdin.write(f"go {len(reqs)} {60 + count * pause * 4}\n")
            child.stdin.flush()
            posted, done = [], []
            for r in reqs:
                t = time.monotonic_ns()
                r.post()
                r.wait(10)
                done.append(time.monotonic_ns() - t)
                posted.append(t)
                time.sleep(pause)
            seen = json.loads(child.stdout.readline())
            transport = reqs[0].transport
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if len(seen) != len(reqs) or [int(m) for _, m in seen] != list(range(len(reqs))):
        raise RuntimeError(f"{len(seen)} of {len(reqs)} notifications seen, or out of order")
    lat = [t - posted[int(m)] for t, m in seen[WARMUP:]]
    return {"count": count, "transport": transport, "percentile": PERCENTILE, "post_to_seen_us": summary_us(lat),
            "post_to_done_us": {k: v for k, v in summary_us(done[WARMUP:]).items() if k in ("p50", "p99")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["initiator", "target"], default="initiator")
    ap.add_argument("--count", type=int, default=2000, help="timed notifications")
    ap.add_argument("--pause", type=float, default=0.001, help="seconds between posts")
    args = ap.parse_args()
    if args.role == "target":
        target()
        return
    doc = initiator(args.count, args.pause)
    print(json.dumps(doc), flush=True)
    log(f"post to seen p50 {doc['post_to_seen_us']['p50']} us, p99 {doc['post_to_seen_us']['p99']} us")


if __name__ == "__main__":
    main()
