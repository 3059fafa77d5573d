#!/usr/bin/env python3
"""Host<->GPU copy bandwidth by the kind of host memory, with the copy engines
(cudaMemcpyAsync, best of 4): memory from cudaHostAlloc (the pinned figure the cache
engine's host tier is measured against), a memfd mapping registered with
cudaHostRegister (4 KiB pages: what a cache tier in a shared segment is), and the same
with MADV_HUGEPAGE (which only helps where the kernel allows huge pages for shared
memory). Whole 1 GiB copies and 8 MiB pieces (the cache engine's staging segments).
Needs CuPy and a GPU; writes JSON (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time

import cupy as cp

rt = cp.cuda.runtime
H2D, D2H = 1, 2


def sysfs(path: str) -> str:
    try:
        return open(path).read().strip()
    except OSError:
        return "unknown"


def bandwidth(stream, dev: int, host: int, size: int, to_gpu: bool, piece: int) -> float:
    best = 0.0
    for _ in range(4):
        stream.synchronize()
        start = time.perf_counter()
        for off in range(0, size, piece):
            if to_gpu:
                rt.memcpyAsync(dev + off, host + off, piece, H2D, stream.ptr)
            else:
                rt.memcpyAsync(host + off, dev + off, piece, D2H, stream.ptr)
        stream.synchronize()
        best = max(best, size / (time.perf_counter() - start) / 1e9)
    return best


def memfd_registered(size: int, huge: bool):
    fd = os.memfd_create("host-memory-probe")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    m.write(b"\1" * size)  # touched, so that registration pins allocated pages
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    rt.hostRegister(addr, size, 0)
    return m, addr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON file for the results")
    p.add_argument("--size", type=int, default=1 << 30, help="bytes per copy run")
    args = p.parse_args()
    size = args.size
    dev = cp.cuda.alloc(size)
    stream = cp.cuda.Stream(non_blocking=True)
    kinds = {}
    pinned = rt.hostAlloc(size, 0)
    ctypes.memset(pinned, 1, size)
    kinds["cudaHostAlloc"] = pinned
    keep = []
    for huge in (False, True):
        m, addr = memfd_registered(size, huge)
        keep.append(m)
        kinds["memfd registered" + (" + MADV_HUGEPAGE" if huge else "")] = addr
    rows = []
    for name, addr in kinds.items():
        for piece in (size, 8 << 20):
            row = {"memory": name, "piece_bytes": piece,
                   "host_to_gpu_gbps": bandwidth(stream, dev.ptr, addr, size, True, piece),
                   "gpu_to_host_gbps": bandwidth(stream, dev.ptr, addr, size, False, piece)}
            rows.append(row)
            print(f"{name:36s} pieces of {piece >> 20:5d} MiB: host->GPU {row['host_to_gpu_gbps']:6.1f}, "
                  f"GPU->host {row['gpu_to_host_gbps']:6.1f} GB/s", flush=True)
    doc = {"tool": "bench/peers/host_memory.py", "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "shmem_thp": sysfs("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
           "thp": sysfs("/sys/kernel/mm/transparent_hugepage/enabled"), "bytes": size, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
