#!/usr/bin/env python3
"""freight over tcp between two "hosts" joined by 1, 2 and 4 NICs, beside iperf3 on the
same links, in one run.

The hosts are two network namespaces joined by veth pairs (scripts/netns.sh), each pair
a NIC with a subnet of its own. For each number of pairs: `freight bench p2p` moves
64 MiB requests (host memory, WRITE, every row verified) from side a to side b with its
data streams bound to every local address (two streams per pair), then iperf3 runs one
client per pair (two parallel streams each, bound to that pair's addresses) at once.
Both report 10^9 bytes per second; the table is printed last, `--out` writes the JSON.

    sudo python3 bench/netns.py --machine "2-vCPU VM" --out bench/results/netns-dev-vm-2cpu.json

Needs root, iproute2 and iperf3 (scripts/setup.sh installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NETNS = ROOT / "scripts" / "netns.sh"
PAIRS = (1, 2, 4)
SECONDS = 3
ENV = dict(os.environ, FREIGHT_NETNS=f"fb{os.getpid() % 100000}")


def netns(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], env=ENV, check=True, capture_output=True, text=True, **kw)


def in_ns(side: str, cmd: list, **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(NETNS), "exec", side, *cmd], env=ENV, **kw)


def freight_run(freight: list, pairs: int) -> float:
    target = in_ns("b", [*freight, "bench", "p2p", "--role", "target", "--listen", "0.0.0.0:7200"],
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        target.stdout.readline()  # listening on ...
        local = ",".join(f"10.77.{i}.1" for i in range(pairs))
        out = netns("exec", "a", *freight, "bench", "p2p", "--connect", "10.77.0.2:7200", "--transport", "tcp",
                    "--streams", str(2 * pairs), "--local-addrs", local, "--block-sizes", "64MiB",
                    "--batch-sizes", "1", "--duration", f"{SECONDS}s", "--json", timeout=300).stdout
        doc = json.loads(out)
        if not doc["verified"]:
            sys.exit("freight's transfers did not verify")
        return doc["rows"][0]["gbps"]
    finally:
        target.kill()
        target.wait(timeout=10)


def iperf_run(pairs: int) -> float:
    servers = [in_ns("b", ["iperf3", "-s", "-1", "-B", f"10.77.{i}.2", "-p", str(5300 + i)],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(pairs)]
    time.sleep(0.5)
    try:
        clients = [in_ns("a", ["iperf3", "-c", f"10.77.{i}.2", "-B", f"10.77.{i}.1", "-p", str(5300 + i), "-P", "2",
                               "-t", str(SECONDS), "-J"], stdout=subprocess.PIPE, text=True) for i in range(pairs)]
        total = 0.0
        for c in clients:
            out, _ = c.communicate(timeout=SECONDS + 60)
            total += json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
        return total
    finally:
        for s in servers:
            s.kill()
            s.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--freight", default=f"{sys.executable} -m freight", help="the freight command")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("network namespaces need root")
    freight = args.freight.split()
    rows = []
    try:
        for pairs in PAIRS:
            netns("up", str(pairs))
            f, i = freight_run(freight, pairs), iperf_run(pairs)
            rows.append({"pairs": pairs, "freight_gbps": f, "iperf3_gbps": i, "ratio": f / i})
            print(f"[netns] {pairs} pair(s): freight {f:.2f} GB/s, iperf3 {i:.2f} GB/s", flush=True)
    finally:
        netns("down")
    doc = {"benchmark": "bench/netns.py", "machine": args.machine,
           "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "request_bytes": 64 << 20, "seconds": SECONDS, "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n| veth pairs | freight tcp GB/s | iperf3 GB/s | freight / iperf3 |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['pairs']} | {r['freight_gbps']:.2f} | {r['iperf3_gbps']:.2f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
