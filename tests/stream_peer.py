"""The other process of the pipe and channel tests (tests/test_py_stream.py).

Run as ``python -c <this file's text> '<json args>'`` (or as a script). ``args["role"]``:

    pipe-send   connect a pipe to args["addr"], send args["count"] messages of
                args["size"] bytes (pattern(seed + i), tag b"obj-<i>"); with "stop_after",
                stop there, print {"sent": n} and wait to be killed
    pipe-recv   listen, print {"addr"}, accept a pipe with a buffer of args["buffer"]
                bytes, take args["hold"] messages without releasing them, print
                {"holding": n} and wait to be killed
    chan-send   open a channel to args["addr"] and send objects(args["set"], prefix,
                count, size) in batches of args["batch"]; with "stop_after" (objects),
                stop there, print {"sent": n} and wait to be killed
    chan-recv   listen, print {"addr"}, receive from args["senders"] senders into a
                buffer of args["buffer"] bytes, print a summary of every object

With "device" (e.g. "cuda:0"), senders send torch tensors on that GPU. Every role
uses AgentConfig(require=args.get("require")). Senders notify the receiver
b"before" and b"after" around the stream (plain notifications beside the pipe), print
{"done": true, "path": transport}, then wait for stdin to close before exiting, so
that the receiver reads everything while the sender is still alive (with
"linger": false they exit at once).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Dict

import numpy as np

import freight

# dtype, shape of the "mixed" set; "big" is larger than the receivers' buffers in the tests.
MIXED = [
    ("f32", "float32", (3, 5, 7)),
    ("i64", "int64", (1000,)),
    ("f16", "float16", (2, 2)),
    ("bool", "bool", (17,)),
    ("c64", "complex64", (4, 3)),
    ("u8", "uint8", (257,)),
    ("big", "float64", (3 << 17,)),  # 3 MiB
    ("i16", "int16", (64, 64)),
]


def pattern(seed: int, n: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (the same in every process)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def objects(name: str, prefix: str = "", count: int = 0, size: int = 0) -> Dict[str, np.ndarray]:
    """The test objects by key: "mixed" (MIXED, with pattern bytes) or "flat"
    (``count`` uint8 arrays of ``size`` bytes)."""
    if name == "mixed":
        out = {}
        for i, (key, dtype, shape) in enumerate(MIXED):
            dt = np.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            raw = pattern(1000 + i, n)
            if dt == np.bool_:
                raw = raw & 1
            out[prefix + key] = raw.view(dt).reshape(shape)
        return out
    return {f"{prefix}obj-{i:03d}": pattern(i, size) for i in range(count)}


def to_device(arrays: list, device) -> list:
    """The arrays as torch tensors on ``device`` (e.g. "cuda:0"), or unchanged when
    ``device`` is None. Waits for the copies: the engine reads the memory, not a stream."""
    if device is None:
        return arrays
    import torch

    out = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    torch.cuda.synchronize(device)
    return out


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def linger(args: dict) -> None:
    """Waits until the test closes stdin (or kills this process), unless
    ``args["linger"]`` is false: then the process exits at once."""
    if args.get("linger", True):
        sys.stdin.read()


def notifs_until(agent: freight.Agent, last: str, count: int = 1, timeout: float = 10.0) -> list:
    """Plain notifications (text) until ``count`` of them read ``last``."""
    got: list = []
    deadline = time.monotonic() + timeout
    while got.count(last) < count and time.monotonic() < deadline:
        got += [m.decode() for _, m in agent.wait_notifs(0.5)]
    return got


def pipe_send(agent: freight.Agent, args: dict) -> None:
    peer = agent.connect(args["addr"])
    agent.notify(peer, b"before")
    with freight.PipeSender.connect(agent, args["addr"], timeout=args.get("timeout", 20.0)) as pipe:
        device = args.get("device")
        buf = to_device([np.empty(args["size"], dtype=np.uint8)], device)[0]
        agent.register(buf)
        for i in range(args["count"]):
            if i == args.get("stop_after"):
                say(sent=i)
                time.sleep(3600)
            # The registered buffer is rewritten for every message: flush first.
            pipe.flush()
            data = pattern(args.get("seed", 0) + i, args["size"])
            if device is None:
                buf[:] = data
            else:
                import torch

                buf.copy_(torch.from_numpy(data))
                torch.cuda.synchronize(device)  # the engine reads the memory, not the stream
            pipe.send(buf, tag=f"obj-{i}".encode())
    agent.notify(peer, b"after")
    say(done=True, path=agent.path_to(peer).transport)
    linger(args)


def pipe_recv(agent: freight.Agent, args: dict) -> None:
    listener = freight.PipeListener(agent)
    say(addr=agent.addresses[0])
    pipe = listener.accept(buffer=args["buffer"], timeout=args.get("timeout", 20.0))
    held = [pipe.recv() for _ in range(args["hold"])]
    say(holding=len(held))
    time.sleep(3600)


def chan_send(agent: freight.Agent, args: dict) -> None:
    peer = agent.connect(args["addr"])
    agent.notify(peer, b"before")
    objs = objects(args["set"], args.get("prefix", ""), args.get("count", 0), args.get("size", 0))
    keys, values = list(objs), to_device(list(objs.values()), args.get("device"))
    stop = args.get("stop_after")
    with freight.ChannelSender(agent, args["addr"], batch_size=args.get("batch", 8), timeout=args.get("timeout", 20.0)) as ch:
        if stop is not None:
            ch.send(keys[:stop], values[:stop])
            ch.flush()
            say(sent=stop)
            time.sleep(3600)
        ch.send(keys, values)
    agent.notify(peer, b"after")
    say(done=True, path=agent.path_to(peer).transport)
    linger(args)


def chan_recv(agent: freight.Agent, args: dict) -> None:
    say(addr=agent.addresses[0])
    seen = []
    with freight.ChannelReceiver(
        agent, num_senders=args.get("senders", 1), buffer=args["buffer"], timeout=args.get("timeout", 20.0)
    ) as ch:
        for batch in ch:
            for r in batch:
                with r:
                    seen.append(
                        {"key": r.key, "meta": r.meta, "sha256": sha(r.view()), "is_view": r.is_view, "sender": r.sender}
                    )
        peers = ch.peers
    say(objects=seen, peers=peers, notifs=notifs_until(agent, "after", args.get("senders", 1)))


def main() -> None:
    args = json.loads(sys.argv[1])
    config = freight.AgentConfig(require=args.get("require"))
    with freight.Agent(args["name"], config) as agent:
        {"pipe-send": pipe_send, "pipe-recv": pipe_recv, "chan-send": chan_send, "chan-recv": chan_recv}[args["role"]](
            agent, args
        )


if __name__ == "__main__":
    main()
