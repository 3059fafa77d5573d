#!/usr/bin/env python3
"""GETs from the KV server into GPU memory, beside GETs into host memory, in one run.

Starts `freight serve` on loopback, stores KEYS values of each size with one client,
then reads them with READERS clients (each on a thread of its own, as `freight
kv-bench` does) into a torch tensor on the GPU and into a numpy array in host memory,
checking every value read. Prints a table last; `--out` writes the JSON.

    python3 bench/kv_gpu.py --machine "1 x H100" --out bench/results/kv-gpu-h100.json

Needs PyTorch with CUDA (`--device cpu` runs the same reads into CPU tensors, to try
the script on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reporting import free_port, host_machine  # noqa: E402

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
KEYS = 64
READERS = 4
ROUNDS = 5  # each reader reads every key this many times


def value(i: int, size: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.uint32) * 2654435761 + i * 7919) >> 13).astype(np.uint8)


def read_all(url: str, size: int, into: str, torch, device: str) -> float:
    """GET ops/s of READERS clients reading every key ROUNDS times into `into` memory."""
    from freight.kv import Client

    errors: list = []
    ends: list = []
    barrier = threading.Barrier(READERS + 1)

    def reader(r: int) -> None:
        try:
            with Client(url, buffer_size=size + (1 << 20)) as c:
                out = torch.empty(size, dtype=torch.uint8, device=device) if into == "gpu" else np.empty(size, np.uint8)
                barrier.wait()
                for _ in range(ROUNDS):
                    for i in range(KEYS):
                        if c.get_into(f"v{i}", out) != size:
                            raise RuntimeError(f"key v{i} came back short")
                ends.append(time.perf_counter())
                # Every value is checked after the timed reads, once per reader.
                for i in range(KEYS):
                    c.get_into(f"v{i}", out)
                    got = out.cpu().numpy() if into == "gpu" else out
                    if not np.array_equal(got, value(i, size)):
                        raise RuntimeError(f"key v{i} read into {into} memory differs from what was stored")
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=reader, args=(r,)) for r in range(READERS)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # The timed part ends when the last reader has done its rounds (the checks excluded).
    return READERS * ROUNDS * KEYS / (max(ends) - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--freight", default=f"{sys.executable} -m freight", help="the freight command")
    ap.add_argument("--device", default="cuda", help="torch device of the GPU reads (cuda, or cpu to try)")
    args = ap.parse_args()
    import torch

    from freight.kv import Client

    port = free_port()
    memory_mb = KEYS * max(SIZES.values()) * 2 >> 20
    server = subprocess.Popen([*args.freight.split(), "serve", "--listen", f"127.0.0.1:{port}", "--memory-mb",
                               str(memory_mb)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit("freight serve did not start")
                time.sleep(0.05)
        for name, size in SIZES.items():
            with Client(url, buffer_size=size + (1 << 20)) as c:
                for i in range(KEYS):
                    c.put(f"v{i}", value(i, size))
            host = read_all(url, size, "host", torch, args.device)
            gpu = read_all(url, size, "gpu", torch, args.device)
            rows.append({"size": name, "bytes": size, "host_ops_per_sec": host, "gpu_ops_per_sec": gpu,
                         "gpu_gb_per_sec": gpu * size / 1e9, "gpu_vs_host": gpu / host})
            print(f"[kv-gpu] {name}: host {host:.0f} ops/s, {args.device} {gpu:.0f} ops/s", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=20)
    doc = {"benchmark": "bench/kv_gpu.py", "machine": args.machine, "device": args.device,
           "host": host_machine(),
           "readers": READERS, "keys": KEYS, "rounds": ROUNDS, "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n| value | GET into host memory ops/s | GET into {args.device} memory ops/s | GB/s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['size']} | {r['host_ops_per_sec']:.0f} | {r['gpu_ops_per_sec']:.0f} | "
              f"{r['gpu_gb_per_sec']:.2f} | {r['gpu_vs_host']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
