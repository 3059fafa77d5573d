#!/usr/bin/env python3
"""One side of a GPU-memory transfer between two network namespaces (bench/netns.py):
GPU memory on both sides, moved over tcp, staged through pinned host buffers.

    netns_gpu_peer.py target LISTEN SIZE     # prints {"listen": ..., "addr": ...}, then serves
    netns_gpu_peer.py initiator TARGET SIZE SECONDS LOCAL_ADDRS ADDR   # prints {"gbps": ..., ...}

The initiator writes SIZE bytes of its GPU memory into the target's GPU memory at ADDR
for SECONDS, one request at a time, its tcp streams bound to LOCAL_ADDRS (two per
address); then it asks the target to compare its buffer with the pattern, and the
target answers "ok" or "bad".
Needs PyTorch with CUDA and the freight package.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import freight


def pattern(size: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64, device="cuda").mul_(2654435761).remainder_(251).to(torch.uint8)


def target(listen: str, size: int) -> None:
    agent = freight.Agent("gpu-target", freight.AgentConfig(listen=listen, require="tcp"))
    buf = torch.zeros(size, dtype=torch.uint8, device="cuda")
    agent.register(buf)
    print(json.dumps({"listen": agent.addresses[0], "addr": buf.data_ptr()}), flush=True)
    while True:
        for _, msg in agent.wait_notifs(60):
            if msg == b"bye":
                return
            # A check names the initiator's addresses, to answer on.
            peer = connect_any(agent, json.loads(msg)["reply_to"])
            torch.cuda.synchronize()
            agent.notify(peer, b"ok" if torch.equal(buf, pattern(size)) else b"bad")


def connect_any(agent: freight.Agent, addrs: list) -> str:
    for a in addrs:
        try:
            return agent.connect(a)
        except freight.FreightError as e:
            error = e
    raise SystemExit(f"cannot reach the initiator at {addrs}: {error}")


def initiator(target_addr: str, size: int, seconds: float, local_addrs: str, remote_addr: int) -> None:
    cfg = freight.AgentConfig(listen="0.0.0.0:0", require="tcp", tcp_streams=2 * len(local_addrs.split(",")),
                              tcp_local_addrs=local_addrs.split(","))
    agent = freight.Agent("gpu-initiator", cfg)
    peer = agent.connect(target_addr)
    src = pattern(size)
    torch.cuda.synchronize()
    agent.register(src)
    local = agent.prepare_local(freight.DescList([src]))
    remote = agent.prepare_remote(peer, freight.DescList([(remote_addr, size, 0)], kind="VRAM"))
    req = agent.make_request("WRITE", local, None, remote, None)
    req.post()
    req.wait(60)  # warm-up: connections, staging buffers
    moved, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        req.post()
        req.wait(60)
        moved += size
    elapsed = time.perf_counter() - start
    agent.notify(peer, json.dumps({"reply_to": [a for a in agent.addresses if not a.startswith("127.")]}).encode())
    answer, deadline = None, time.monotonic() + 60
    while answer is None and time.monotonic() < deadline:
        for _, msg in agent.wait_notifs(5):
            answer = msg
    agent.notify(peer, b"bye")
    print(json.dumps({"gbps": moved / elapsed / 1e9, "verified": answer == b"ok", "path": agent.path_to(peer).reason}),
          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "target":
        target(sys.argv[2], int(sys.argv[3]))
    else:
        initiator(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
