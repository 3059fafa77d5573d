"""The other process of the store and cache engine tests (tests/test_py_storage.py,
tests/test_py_cache.py).

Run as ``python -c <this file's text> '<json args>' <tests folder>`` (or as a script).
``args["role"]``:

    put       open a StoreSender to args["addr"] (commit_size args["commit"]) and put
              stream_peer.objects(args["set"], prefix, count, size) one by one (with
              "many": all in one put_many); with "stop_after", put that many, commit,
              print {"sent": n} and wait to be killed. Then close, and print {"done":
              true, "commits": [CommitStats as dicts], "regions": [before, after],
              "path": transport}; a freight error instead prints {"error": class name,
              "message": str, "pending": pending keys}
    prefill   open a StoreSender to args["addr"] and a CacheEngine (MODEL, chunks of
              CHUNK tokens) with it as remote sink; store prompt(n, salt) for each
              [n, salt] of args["prompts"] from kv_for(n, salt) (paged with "paged");
              print {"stored": [store reports]}; at stdin's end close the engine and
              print {"closed": true}

With "device" (e.g. "cuda:0"), puts are torch tensors on that GPU. Every role uses
AgentConfig(require=args.get("require")) and waits for stdin to close before exiting
(with "linger": false they exit at once).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

if __name__ == "__main__" and len(sys.argv) > 2:
    sys.path.insert(0, sys.argv[2])

import freight  # noqa: E402
from stream_peer import linger, objects, say, to_device  # noqa: E402

#: The test model: layers, KV heads, head_dim, dtype.
MODEL = dict(layers=3, heads=2, head_dim=8, dtype="float16")
CHUNK = 16
#: Bytes of a full chunk of MODEL: layers x (K, V) x CHUNK tokens x heads x head_dim x 2 bytes.
CHUNK_BYTES = 3 * 2 * CHUNK * 2 * 8 * 2


def prompt(n: int, salt: int) -> np.ndarray:
    """A deterministic prompt of ``n`` token ids."""
    return (np.arange(n, dtype=np.uint64) * 7919 ^ salt).astype(np.uint32)


def kv_for(tokens: int, seed: int, model: dict = MODEL) -> np.ndarray:
    """Contiguous KV memory (layers, 2, tokens, heads, head_dim) of random bytes."""
    shape = (model["layers"], 2, tokens, model["heads"], model["head_dim"])
    dt = np.dtype(model["dtype"])
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def paged(kv: np.ndarray, block_size: int, num_blocks: int, table: list) -> np.ndarray:
    """The same KV as paged memory: token t in block table[t // block_size]."""
    L, _, T, H, D = kv.shape
    out = np.zeros((L, 2, num_blocks, block_size, H, D), dtype=kv.dtype)
    for t in range(T):
        out[:, :, table[t // block_size], t % block_size] = kv[:, :, t]
    return out


def unpaged(kv: np.ndarray, tokens: int, table: list) -> np.ndarray:
    """Tokens 0..tokens of paged KV memory, as contiguous memory."""
    block_size = kv.shape[3]
    return np.stack([kv[:, :, table[t // block_size], t % block_size] for t in range(tokens)], axis=2)


def put(agent: freight.Agent, args: dict) -> None:
    objs = objects(args["set"], args.get("prefix", ""), args.get("count", 0), args.get("size", 0))
    keys, values = list(objs), to_device(list(objs.values()), args.get("device"))
    before = agent.registered_regions
    commits = []
    sender = freight.StoreSender(
        agent, args["addr"], commit_size=args.get("commit", 8), batch_size=args.get("batch", 4),
        timeout=args.get("timeout", 20.0),
    )
    # While the pipe is open: once it ends, the receiver gives its buffer back and no
    # memory of it is left to name a path to.
    path = agent.path_to(sender.peer).transport
    stop = args.get("stop_after")
    try:
        if stop is not None:
            commits += sender.put_many(keys[:stop], values[:stop])
            sender.commit()
            say(sent=stop)
            linger({})
            return
        if args.get("many"):
            commits += sender.put_many(keys, values)
        else:
            for k, v in zip(keys, values):
                stats = sender.put(k, v)
                if stats is not None:
                    commits.append(stats)
        last = sender.commit()
        if last is not None:
            commits.append(last)
        sender.close()
    except freight.FreightError as e:
        say(error=type(e).__name__, message=str(e), pending=sender.pending_keys)
        linger(args)
        return
    say(done=True, commits=[dataclasses.asdict(c) for c in commits], regions=[before, agent.registered_regions],
        path=path)
    linger(args)


def prefill(agent: freight.Agent, args: dict) -> None:
    sink = freight.StoreSender(agent, args["addr"], commit_size=args.get("commit", 4), timeout=args.get("timeout", 20.0))
    engine = freight.CacheEngine(agent, chunk_tokens=CHUNK, host_bytes=args.get("host_chunks", 64) * CHUNK_BYTES,
                                 remote_sink=sink, **MODEL)
    reports = []
    for n, salt in args["prompts"]:
        kv = kv_for(n, salt)
        if args.get("paged"):
            blocks = -(-n // 8)
            table = list(range(blocks))[::-1]
            reports.append(engine.store(prompt(n, salt), paged(kv, 8, blocks + 3, table), block_table=table))
        else:
            reports.append(engine.store(prompt(n, salt), kv))
    say(stored=reports)
    linger(args)
    engine.close()
    say(closed=True)


def main() -> None:
    args = json.loads(sys.argv[1])
    config = freight.AgentConfig(require=args.get("require"))
    with freight.Agent(args["name"], config) as agent:
        {"put": put, "prefill": prefill}[args["role"]](agent, args)


if __name__ == "__main__":
    main()
