#!/usr/bin/env python3
"""freight's GPU benchmarks: two processes on two GPUs of one host.

The initiator (this process) uses GPU 0; the target is bench/gpu_peer.py on GPU 1,
each process seeing only its own GPU (CUDA_VISIBLE_DEVICES), as the NIXL comparison in
bench/peers/ does. Writes rows {"system": "freight", "test", "op", "block", "count",
"gbps", "p50_us", "p99_us"} that bench/gpu_report.py sets beside NIXL and the ceilings.

Remote blocks are visited in a shuffled order, so that no two descriptors are
neighbours on both sides and nothing merges: the batched kernel does every copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reporting import PERCENTILE, host_machine, percentile  # noqa: E402

MIB = 1 << 20
SIZE = 4 << 30
CASES = [(32 * MIB, 128), (2 * MIB, 2048), (256 << 10, 16384), (64 << 10, 65536), (16 << 10, 65536), (4 << 10, 65536)]


class Target:
    """bench/gpu_peer.py in its own process."""

    def __init__(self, size: int, kind: str, gpu: str, name: str = "target"):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "gpu_peer.py"), "--name", name, "--size", str(size), "--kind", kind, "--gpu", "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        hello = json.loads(self.proc.stdout.readline() or "{}")
        if "addr" not in hello:
            raise RuntimeError("the target process failed to start")
        self.addr, self.base = hello["addr"], hello["base"]

    def send(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self):
        return json.loads(self.proc.stdout.readline())

    def call(self, **cmd):
        self.send(**cmd)
        return self.reply()

    def close(self):
        if self.proc.poll() is None:
            self.send(op="quit")
            self.proc.wait(timeout=30)


def stats(samples_s):
    return percentile(samples_s, 50), percentile(samples_s, 99)


def machine(torch) -> dict:
    """What the figures were measured on: the host, and the GPU and PyTorch of this process."""
    return {**host_machine(), "gpu": torch.cuda.get_device_name(0), "host": platform.node(), "torch": torch.__version__}


def row(test, op, block, count, gbps=None, p50=None, p99=None, **extra):
    r = {"system": "freight", "test": test, "op": op, "block": block, "count": count,
         "gbps": None if gbps is None else round(gbps, 3),
         "p50_us": None if p50 is None else round(p50 * 1e6, 2),
         "p99_us": None if p99 is None else round(p99 * 1e6, 2)}
    r.update(extra)
    print(f"[gpu] {test:8s} {op:5s} {block:>10d} x {count:<6d} {extra.get('order', ''):10s} "
          + (f"{r['gbps']:8.1f} GB/s" if gbps is not None else "")
          + (f"  p50 {r['p50_us']} us p99 {r['p99_us']} us" if p50 is not None else ""), flush=True)
    return r


def timed(req, iters):
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        req.post()
        req.wait(timeout=60)  # raises if the transfer failed
        times.append(time.perf_counter() - t)
    return times


def bandwidth(agent, name, local, base, quick, cases=CASES):
    """Block i here <-> block order[i] there. In sequential order the blocks are
    neighbours on both sides and freight merges them (NIXL gets the same lists); in
    random order nothing merges and the kernel does every copy."""
    import freight

    rows = []
    rng = random.Random(1)
    for block, count in cases:
        count = min(count, SIZE // block)
        shuffled = list(range(count))
        rng.shuffle(shuffled)
        ldesc = freight.DescList([(local.data_ptr() + i * block, block, 0) for i in range(count)], kind="VRAM")
        lp = agent.prepare_local(ldesc)
        for order_name, order in (("sequential", range(count)), ("random", shuffled)):
            rdesc = freight.DescList([(base + j * block, block, 0) for j in order], kind="VRAM")
            rp = agent.prepare_remote(name, rdesc)
            for op in ("WRITE", "READ"):
                req = agent.make_request(op, lp, None, rp, None)
                timed(req, 2)
                t = timed(req, 3 if quick else 10)
                p50, _ = stats(t)
                rows.append(row("bw", op, block, count, block * count / p50 / 1e9, copies=req.copies,
                                order=order_name))
    return rows


def copy_engines(target, local, quick):
    """32 MiB blocks with every copy on the copy engines instead of the kernel, to
    check the default (the kernel for GPU-to-GPU copies)."""
    import freight

    rows = []
    cfg = freight.AgentConfig(cuda_copy_engine_min_peer=1)
    with freight.Agent("initiator-copy-engines", cfg) as agent:
        name = agent.connect(target.addr)
        agent.register(local)
        block, count = 32 * MIB, 128
        lp = agent.prepare_local(freight.DescList([(local.data_ptr() + i * block, block, 0) for i in range(count)], kind="VRAM"))
        shuffled = list(range(count))
        random.Random(3).shuffle(shuffled)
        # In sequential order the list merges into one 4 GiB copy: one copy-engine call.
        for order_name, order in (("random", shuffled), ("sequential", range(count))):
            rdesc = freight.DescList([(target.base + j * block, block, 0) for j in order], kind="VRAM")
            rp = agent.prepare_remote(name, rdesc)
            for op in ("WRITE", "READ"):
                req = agent.make_request(op, lp, None, rp, None)
                timed(req, 2)
                p50, _ = stats(timed(req, 3 if quick else 10))
                rows.append(row("bw_copy_engine", op, block, count, block * count / p50 / 1e9, copies=req.copies,
                                order=order_name))
    return rows


def oneshot(agent, name, local, base, quick):
    """128 x 32 MiB WRITE, the request created and posted each time (`transfer`), with
    the remote blocks in order and in a random order: bench/peers/nixl_p2p.py runs the
    same two lists through NIXL."""
    import freight

    block, count = 32 * MIB, 128
    ldesc = freight.DescList([(local.data_ptr() + i * block, block, 0) for i in range(count)], kind="VRAM")
    shuffled = list(range(count))
    random.Random(2).shuffle(shuffled)
    rows = []
    for order_name, order in (("sequential", range(count)), ("random", shuffled)):
        rdesc = freight.DescList([(base + j * block, block, 0) for j in order], kind="VRAM")
        times = []
        for i in range(3 if quick else 10):
            t = time.perf_counter()
            req = agent.transfer("WRITE", ldesc, name, rdesc)
            req.wait(timeout=60)
            if i:
                times.append(time.perf_counter() - t)
        p50, _ = stats(times)
        rows.append(row("oneshot", "WRITE", block, count, block * count / p50 / 1e9, order=order_name))
    return rows


def latency(agent, name, local, base, target, quick):
    """One 4 KiB WRITE at a time: post to DONE back to back, then with a notification,
    as bench/peers/nixl_p2p.py measures NIXL: each post waits for the previous one to be
    done and 300 us more (a busy pause, so that neither process goes idle), and the
    target stamps each notification when its get_notifs returns it."""
    import freight

    lp = agent.prepare_local(freight.DescList([(local.data_ptr(), 4096, 0)], kind="VRAM"))
    rp = agent.prepare_remote(name, freight.DescList([(base, 4096, 0)], kind="VRAM"))
    req = agent.make_request("WRITE", lp, None, rp, None)
    warm, iters = (50, 300) if quick else (200, 2000)
    timed(req, warm)
    p50, p99 = stats(timed(req, iters))
    rows = [row("lat4k", "WRITE", 4096, 1, p50=p50, p99=p99)]
    # One request, posted again and again (NIXL reposts one prepared transfer): its
    # notifications arrive in the order of the posts, so the i-th seen is the i-th posted.
    target.send(op="notifs", count=warm + iters, timeout=120)
    req = agent.make_request("WRITE", lp, None, rp, None, notif=b"lat4k")
    posted = []
    for _ in range(warm + iters):
        posted.append(time.monotonic_ns())
        req.post()
        req.wait(timeout=10)
        pause = time.perf_counter() + 300e-6
        while time.perf_counter() < pause:
            pass
    seen = target.reply()["seen"]
    lat = [(t - p) / 1e9 for (t, _, _), p in zip(seen, posted)][warm:]
    if len(lat) == iters:
        p50, p99 = stats(lat)
        rows.append(row("notif4k", "WRITE", 4096, 1, p50=p50, p99=p99))
    else:
        rows.append({"system": "freight", "test": "notif4k", "op": "WRITE", "block": 4096, "count": 1,
                     "error": f"{len(seen)} of {warm + iters} notifications seen"})
    return rows


def host_device(agent, quick, target_gpu="1"):
    """Host memory here <-> GPU memory of the other process (32 x 32 MiB)."""
    import numpy as np
    import freight

    block, count = 32 * MIB, 32
    target = Target(block * count, "VRAM", target_gpu, name="host-test-target")
    try:
        name = agent.connect(target.addr)
        host = np.empty(block * count, dtype=np.uint8)
        host[:] = 7
        agent.register(host)
        ldesc = freight.DescList([(host.ctypes.data + i * block, block, 0) for i in range(count)], kind="DRAM")
        rdesc = freight.DescList([(target.base + i * block, block, 0) for i in range(count)], kind="VRAM")
        lp, rp = agent.prepare_local(ldesc), agent.prepare_remote(name, rdesc)
        rows = []
        for test, op in (("h2d", "WRITE"), ("d2h", "READ")):
            req = agent.make_request(op, lp, None, rp, None)
            timed(req, 2)
            p50, _ = stats(timed(req, 3 if quick else 10))
            rows.append(row(test, op, block, count, block * count / p50 / 1e9))
        agent.remove_peer(name)
        return rows
    finally:
        target.close()


def over_network(quick, transport="tcp", target_gpu="1"):
    """GPU memory over a network transport (loopback), beside host memory over the same
    transport: 32 x 32 MiB each way. tcp stages GPU memory through pinned buffers on
    both sides; fabric (libfabric's tcp provider, or the one FREIGHT_FABRIC_PROVIDER
    names) registers it with the provider where it can (FI_HMEM), else stages it
    through its rails' pinned buffers here and the landing buffers the target lends
    there."""
    import torch
    import freight

    if transport == "fabric":
        # The target process inherits these, and so opens the same provider.
        os.environ.setdefault("FREIGHT_FABRIC_PROVIDER", "tcp")
        if os.environ["FREIGHT_FABRIC_PROVIDER"] == "tcp":
            os.environ.setdefault("FREIGHT_FABRIC_DOMAINS", "lo")
    block, count = 32 * MIB, 32
    rows = []
    with freight.Agent(f"{transport}-initiator", freight.AgentConfig(require=transport)) as agent:
        for kind in ("DRAM", "VRAM"):
            test = f"{transport}_{kind.lower()}"
            target = Target(block * count, kind, target_gpu, name=f"{test}-target")
            try:
                name = agent.connect(target.addr)
                if kind == "VRAM":
                    local = torch.full((block * count,), 7, dtype=torch.uint8, device="cuda:0")
                else:
                    local = agent.alloc(block * count)
                    local[:] = 7
                key = agent.register(local)
                base = local.data_ptr() if kind == "VRAM" else local.ctypes.data
                ldesc = freight.DescList([(base + i * block, block, 0) for i in range(count)], kind=kind)
                rdesc = freight.DescList([(target.base + i * block, block, 0) for i in range(count)], kind=kind)
                lp, rp = agent.prepare_local(ldesc), agent.prepare_remote(name, rdesc)
                print(f"[gpu] {test} path: {agent.path_to(name).reason}", flush=True)
                for op in ("WRITE", "READ"):
                    req = agent.make_request(op, lp, None, rp, None)
                    timed(req, 2)
                    p50, _ = stats(timed(req, 3 if quick else 10))
                    rows.append(row(test, op, block, count, block * count / p50 / 1e9))
                agent.remove_peer(name)
                agent.deregister(key)
            finally:
                target.close()
    return rows


#: The bandwidth rows a machine of one GPU measures (both processes on it).
ONE_GPU_CASES = [(32 * MIB, 128), (16 << 10, 65536), (4 << 10, 65536)]


def one_gpu(part, quick):
    """One part of the benchmark with the target on the same GPU (GPU 0)."""
    if part in ("tcp", "fabric"):
        return over_network(quick, part, target_gpu="0")
    if part == "same-gpu":
        return same_gpu(quick)
    import torch
    import freight

    target = Target(64 * MIB, "VRAM", "0")
    try:
        with freight.Agent("initiator") as agent:
            name = agent.connect(target.addr)
            local = torch.full((64 * MIB,), 3, dtype=torch.uint8, device="cuda:0")
            agent.register(local)
            return latency(agent, name, local, target.base, target, quick)
    finally:
        target.close()


def same_gpu(quick):
    """What one GPU measures of the cuda transport, both processes on it: bandwidth at
    32 MiB, 16 KiB and 4 KiB blocks, the 4 KiB latency and notification rows, host
    memory to and from the other process's GPU memory."""
    import torch
    import freight

    rows = []
    target = Target(SIZE, "VRAM", "0")
    try:
        with freight.Agent("initiator") as agent:
            name = agent.connect(target.addr)
            local = torch.full((SIZE,), 3, dtype=torch.uint8, device="cuda:0")
            agent.register(local)
            rows += bandwidth(agent, name, local, target.base, quick, ONE_GPU_CASES)
            rows += latency(agent, name, local, target.base, target, quick)
            rows += host_device(agent, quick, target_gpu="0")
    finally:
        target.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--only", choices=("tcp", "fabric", "latency", "same-gpu"),
                    help="on a machine with one GPU, both processes on it: only GPU memory over tcp "
                         "or fabric, only the 4 KiB latency and notification rows, or what one GPU "
                         "measures of the cuda transport (bandwidth at 32 MiB, 16 KiB and 4 KiB blocks, "
                         "the latency rows, host to and from GPU)")
    args = ap.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    import torch
    import freight

    ok, why = freight.cuda_status()
    if not ok:
        sys.exit(f"no GPU: {why}")
    if args.only:
        rows = one_gpu(args.only, args.quick)
        tool = f"bench/gpu.py --only {args.only}"
        if args.only == "fabric":
            tool += f" (provider {os.environ['FREIGHT_FABRIC_PROVIDER']})"
        doc = {"tool": tool, "percentile": PERCENTILE, "machine": machine(torch), "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        return
    rows = []
    target = Target(SIZE, "VRAM", "1")
    try:
        with freight.Agent("initiator") as agent:
            name = agent.connect(target.addr)
            local = torch.full((SIZE,), 3, dtype=torch.uint8, device="cuda:0")
            agent.register(local)
            path = agent.path_to(name)
            print(f"[gpu] path: {path.transport}: {path.reason}", flush=True)
            for part in (lambda: bandwidth(agent, name, local, target.base, args.quick),
                         lambda: copy_engines(target, local, args.quick),
                         lambda: oneshot(agent, name, local, target.base, args.quick),
                         lambda: latency(agent, name, local, target.base, target, args.quick),
                         lambda: host_device(agent, args.quick),
                         lambda: over_network(args.quick, "tcp"),
                         lambda: over_network(args.quick, "fabric")):
                try:
                    rows += part()
                except Exception as e:  # one failing part must not hide the others
                    print(f"[gpu] FAILED: {e!r}", flush=True)
                    rows.append({"system": "freight", "error": repr(e)})
    finally:
        target.close()
    doc = {"tool": "bench/gpu.py", "percentile": PERCENTILE, "machine": machine(torch),
           "path": f"{path.transport}: {path.reason}", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"[gpu] wrote {args.out}")


if __name__ == "__main__":
    main()
