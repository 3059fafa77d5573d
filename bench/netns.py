#!/usr/bin/env python3
"""freight over tcp and over fabric (libfabric's tcp provider) between two "hosts" joined
by 1, 2 and 4 NICs, beside iperf3 on the same links, in one run; then with netem delays;
then the effect of window, chunk size and thread pinning.

The hosts are two network namespaces joined by veth pairs (scripts/netns.sh), each pair
a NIC with a subnet of its own. For each number of pairs: `freight bench p2p` moves
64 MiB requests (host memory, WRITE, every row verified) from side a to side b with its
data streams bound to every local address (two streams per pair), then over fabric with
one rail per pair, then iperf3 runs one client per pair (two parallel streams each, bound
to that pair's addresses) at once.
Both report 10^9 bytes per second; the table is printed last, `--out` writes the JSON.

    sudo python3 bench/netns.py --machine "2-vCPU VM" --out bench/results/netns-dev-vm-2cpu.json

Needs root, iproute2, iperf3 and libfabric (scripts/setup.sh installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reporting import host_machine  # noqa: E402

NETNS = ROOT / "scripts" / "netns.sh"
PAIRS = (1, 2, 4)
SECONDS = 3
ENV = dict(os.environ, FREIGHT_NETNS=f"fb{os.getpid() % 100000}")


def netns(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], env=ENV, check=True, capture_output=True, text=True, **kw)


def in_ns(side: str, cmd: list, **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(NETNS), "exec", side, *cmd], env=ENV, **kw)


def freight_run(freight: list, pairs: int, transport: str = "tcp", extra: tuple = ()) -> float:
    """GB/s of 64 MiB WRITEs from side a to side b over `pairs` pairs: tcp with two data
    streams per pair bound to its addresses, or fabric (libfabric's tcp provider) with one
    rail per pair. `extra` are more initiator options (window, chunk size, pinning)."""
    fabric = transport == "fabric"
    rails = lambda side: ",".join(f"{ENV['FREIGHT_NETNS']}{side}{i}" for i in range(pairs))  # noqa: E731
    target_opts = ["--fabric-provider", "tcp", "--fabric-domains", rails("b")] if fabric else []
    target = in_ns("b", [*freight, "bench", "p2p", "--role", "target", "--listen", "0.0.0.0:7200", *target_opts],
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        target.stdout.readline()  # listening on ...
        if fabric:
            opts = ["--transport", "fabric", "--fabric-provider", "tcp", "--fabric-domains", rails("a")]
        else:
            local = ",".join(f"10.77.{i}.1" for i in range(pairs))
            opts = ["--transport", "tcp", "--streams", str(2 * pairs), "--local-addrs", local]
        out = netns("exec", "a", *freight, "bench", "p2p", "--connect", "10.77.0.2:7200", *opts, *extra,
                    "--block-sizes", "64MiB", "--batch-sizes", "1", "--duration", f"{SECONDS}s", "--json",
                    timeout=300).stdout
        doc = json.loads(out)
        if not doc["verified"]:
            sys.exit("freight's transfers did not verify")
        return doc["rows"][0]["gbps"]
    finally:
        target.kill()
        target.wait(timeout=10)


def gpu_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def gpu_run(pairs: int) -> dict:
    """GB/s of 64 MiB WRITEs of GPU memory into GPU memory across the pairs (tcp, staged
    through pinned buffers on both sides; bench/netns_gpu_peer.py)."""
    peer = [sys.executable, str(ROOT / "bench" / "netns_gpu_peer.py")]
    size = 64 << 20
    target = in_ns("b", [*peer, "target", "0.0.0.0:7300", str(size)], stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(target.stdout.readline())
        local = ",".join(f"10.77.{i}.1" for i in range(pairs))
        out = netns("exec", "a", *peer, "initiator", "10.77.0.2:7300", str(size), str(SECONDS), local,
                    str(hello["addr"]), timeout=300).stdout
        doc = json.loads(out.strip().splitlines()[-1])
        if not doc["verified"]:
            sys.exit("GPU memory did not arrive intact")
        return doc
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


def netem_missing() -> str:
    """Why netem delays cannot be added here ("" where they can)."""
    try:
        netns("up", "1", "1")
        return ""
    except subprocess.CalledProcessError as e:
        return f"netem is not available here: {e.stderr.strip().splitlines()[-1]}"
    finally:
        netns("down")


def scaling(freight: list, delays: tuple) -> list:
    """freight tcp, fabric and iperf3 over 1, 2 and 4 pairs, then over 2 pairs with delays;
    GPU memory over tcp too where a GPU and PyTorch are present."""
    gpu = gpu_available()
    rows = []
    for pairs, delay in [(p, 0) for p in PAIRS] + [(2, d) for d in delays]:
        netns("up", str(pairs), str(delay))
        try:
            t, f, i = freight_run(freight, pairs), freight_run(freight, pairs, "fabric"), iperf_run(pairs)
            g = gpu_run(pairs)["gbps"] if gpu else None
        finally:
            netns("down")
        rows.append({"pairs": pairs, "delay_ms": delay, "freight_gbps": t, "fabric_gbps": f, "iperf3_gbps": i,
                     "ratio": t / i, "fabric_ratio": f / i, "gpu_tcp_gbps": g})
        if g is not None:
            print(f"[netns] {pairs} pair(s), {delay} ms: GPU memory over tcp {g:.2f} GB/s", flush=True)
        print(f"[netns] {pairs} pair(s), {delay} ms: freight tcp {t:.2f}, fabric {f:.2f}, iperf3 {i:.2f} GB/s",
              flush=True)
    return rows


def tuning(freight: list) -> list:
    """freight tcp over 2 pairs as window, chunk size and pinning vary (the others at the
    defaults: window 8, chunk 1 MiB, pinning numa), without delay and with 1 ms."""
    cpus = os.cpu_count() or 2
    half = f"0-{max(cpus // 2 - 1, 0)}"
    knobs = [("window", str(w)) for w in (1, 2, 8, 32)] + [("chunk-size", c) for c in ("256KiB", "1MiB", "4MiB")] \
        + [("pin", p) for p in ("off", "numa", half)]
    rows = []
    for delay in (0, 1) if not netem_missing() else (0,):
        netns("up", "2", str(delay))
        try:
            for knob, value in knobs:
                if delay and knob != "window":
                    continue
                g = freight_run(freight, 2, extra=(f"--{knob}", value))
                rows.append({"delay_ms": delay, "knob": knob, "value": value, "gbps": g})
                print(f"[netns] tuning, {delay} ms: --{knob} {value}: {g:.2f} GB/s", flush=True)
        finally:
            netns("down")
    return rows


def gpu_only(args) -> int:
    if not gpu_available():
        sys.exit("no GPU (or no PyTorch with CUDA) here")
    rows = []
    for pairs in PAIRS:
        netns("up", str(pairs))
        try:
            doc = gpu_run(pairs)
        finally:
            netns("down")
        rows.append({"pairs": pairs, "gpu_tcp_gbps": doc["gbps"], "verified": doc["verified"], "path": doc["path"]})
        print(f"[netns] {pairs} pair(s): GPU memory over tcp {doc['gbps']:.2f} GB/s", flush=True)
    doc = {"benchmark": "bench/netns.py --gpu-only", "machine": args.machine,
           "host": host_machine(),
           "request_bytes": 64 << 20, "seconds": SECONDS, "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--freight", default=f"{sys.executable} -m freight", help="the freight command")
    ap.add_argument("--delays", default="1,5", help="netem delays (ms, comma-separated) for the 2-pair rows")
    ap.add_argument("--no-tuning", action="store_true", help="skip the window / chunk size / pinning table")
    ap.add_argument("--gpu-only", action="store_true", help="only GPU memory over tcp, over 1, 2 and 4 pairs")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("network namespaces need root")
    freight = args.freight.split()
    if args.gpu_only:
        return gpu_only(args)
    delays = tuple(int(d) for d in args.delays.split(",") if d)
    no_netem = netem_missing()
    if no_netem:
        print(f"[netns] {no_netem}: no delayed rows", flush=True)
        delays = ()
    rows = scaling(freight, delays)
    tuned = [] if args.no_tuning else tuning(freight)
    doc = {"benchmark": "bench/netns.py", "machine": args.machine,
           "host": host_machine(),
           "request_bytes": 64 << 20, "seconds": SECONDS, "results": rows, "tuning": tuned,
           "netem": no_netem or "available"}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n| veth pairs | delay ms | freight tcp GB/s | fabric (tcp provider) GB/s | iperf3 GB/s | tcp / iperf3 |"
          " fabric / iperf3 | GPU memory over tcp GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        g = "-" if r["gpu_tcp_gbps"] is None else f"{r['gpu_tcp_gbps']:.2f}"
        print(f"| {r['pairs']} | {r['delay_ms']} | {r['freight_gbps']:.2f} | {r['fabric_gbps']:.2f} | "
              f"{r['iperf3_gbps']:.2f} | {r['ratio']:.2f} | {r['fabric_ratio']:.2f} | {g} |")
    if tuned:
        print("\n| delay ms | option | value | freight tcp GB/s |")
        print("| --- | --- | --- | --- |")
        for r in tuned:
            print(f"| {r['delay_ms']} | --{r['knob']} | {r['value']} | {r['gbps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
