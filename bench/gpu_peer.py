"""A freight agent in its own process that owns one buffer (GPU or host memory) and
answers commands on stdin, one JSON object per line, with one JSON line on stdout.

The GPU benchmarks (bench/gpu.py, bench/gpu_sweep.py, bench/cache_gather.py) and the
GPU tests (tests/test_gpu.py) use it as the remote side of transfers:

    python bench/gpu_peer.py --name target --gpu 1 --size 268435456 --kind VRAM

prints ``{"addr": "127.0.0.1:PORT", "base": ADDRESS, "size": N, "kind": "VRAM"}`` once
ready, then serves:

    {"op": "fill", "seed": S}                 buffer := pattern(S)
    {"op": "scramble", "seed": S}             buffer := random bytes made on this GPU (fast,
                                              but not the same on other GPU models)
    {"op": "poison"}                          buffer := 0xA5 everywhere
    {"op": "check", "seed": S, "copies": [[src_off, dst_off, len], ...]}
        -> {"ok": bool, "detail": str}: the buffer is poison except where the copies
           put pattern(S)[src_off:src_off+len] at dst_off
    {"op": "notifs", "count": N, "timeout": T}
        -> {"seen": [[monotonic_ns, message_hex, data_ok], ...]}; data_ok checks, when
           the message is "check:S:OFF:LEN", that the bytes had landed when it arrived
    {"op": "fingerprint", "block": B, "indices": [i, ...]}
        -> {"fp": hex}: fingerprint() of blocks i (bytes [i*B, (i+1)*B)) of the buffer
    {"op": "deregister"}                      -> {"ok": true}
    {"op": "quit"}

``pattern(S)`` is the same bytes in every process: ``torch.randint`` from a generator
seeded with S, made on the CPU (so the GPU model does not matter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

POISON = 0xA5


def pattern(seed: int, size: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def fingerprint(buf, block: int, indices) -> str:
    """One number per block of `buf` named in `indices` (block i: bytes [i*block,
    (i+1)*block)), as the hex of their int64 array: the sum of each byte times a weight
    that depends on its place in the block. Any changed byte changes it, so do moved
    bytes (with all but negligible odds). Computed where `buf` is (on its GPU), so that
    gigabytes can be compared between processes without moving them."""
    import torch

    rows = buf[: buf.numel() // block * block].view(-1, block)
    idx = torch.as_tensor(list(indices), dtype=torch.int64, device=buf.device)
    # Weights 1 to 65521 (a prime): byte x weight < 2^24 fits int32; a block's sum fits
    # int64 up to 2^39 bytes.
    weight = (torch.arange(block, dtype=torch.int64, device=buf.device) * 40503 % 65521 + 1).to(torch.int32)
    per = max(1, (64 << 20) // block)  # blocks per step: 64 MiB, 256 MiB of int32
    sums = [(rows[idx[i : i + per]].to(torch.int32) * weight).sum(dim=1, dtype=torch.int64)
            for i in range(0, len(idx), per)]
    return torch.cat(sums).cpu().numpy().tobytes().hex() if sums else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="target")
    ap.add_argument("--gpu", type=int, default=0, help="GPU index in this process (VRAM only)")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--kind", choices=["VRAM", "DRAM"], default="VRAM")
    ap.add_argument("--listen", default="127.0.0.1:0")
    args = ap.parse_args()

    import torch
    import freight

    agent = freight.Agent(args.name, freight.AgentConfig(listen=args.listen))
    if args.kind == "VRAM":
        torch.cuda.set_device(args.gpu)
        buf = torch.empty(args.size, dtype=torch.uint8, device=f"cuda:{args.gpu}")
        key = agent.register(buf)
        base = buf.data_ptr()
    else:
        seg = agent.alloc(args.size)  # shared memory: the initiator maps it
        buf = torch.frombuffer(seg, dtype=torch.uint8)
        key = agent.register(seg)
        base = buf.data_ptr()
    out = sys.stdout
    print(json.dumps({"addr": agent.addresses[0], "base": base, "size": args.size, "kind": args.kind}), file=out, flush=True)

    def sync():
        if args.kind == "VRAM":
            torch.cuda.synchronize(args.gpu)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "fill":
            buf.copy_(pattern(cmd["seed"], args.size).to(buf.device))
            sync()
            reply = {"ok": True}
        elif op == "scramble":
            g = torch.Generator(device=buf.device).manual_seed(cmd["seed"])
            buf.random_(0, 256, generator=g)
            sync()
            reply = {"ok": True}
        elif op == "fingerprint":
            reply = {"fp": fingerprint(buf, cmd["block"], cmd["indices"])}
        elif op == "poison":
            buf.fill_(POISON)
            sync()
            reply = {"ok": True}
        elif op == "check":
            expected = torch.full((args.size,), POISON, dtype=torch.uint8)
            src = pattern(cmd["seed"], args.size)
            for s, d, n in cmd["copies"]:
                expected[d : d + n] = src[s : s + n]
            actual = buf.cpu()
            bad = (actual != expected).nonzero()
            if len(bad):
                first = int(bad[0])
                reply = {"ok": False, "detail": f"{len(bad)} bytes differ, first at offset {first}: {int(actual[first])} != {int(expected[first])}"}
            else:
                reply = {"ok": True, "detail": ""}
        elif op == "notifs":
            seen = []
            deadline = time.monotonic() + cmd.get("timeout", 10.0)
            while len(seen) < cmd["count"] and time.monotonic() < deadline:
                for _, msg in agent.get_notifs():
                    t = time.monotonic_ns()
                    ok = None
                    text = msg.decode(errors="replace")
                    if text.startswith("check:"):
                        _, seed, off, n = text.split(":")
                        seed, off, n = int(seed), int(off), int(n)
                        ok = bool((buf[off : off + n].cpu() == pattern(seed, args.size)[:n]).all())
                    seen.append([t, msg.hex(), ok])
            reply = {"seen": seen}
        elif op == "deregister":
            agent.deregister(key)
            reply = {"ok": True}
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), file=out, flush=True)
    agent.close()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
