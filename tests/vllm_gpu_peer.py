"""KV caches on a GPU laid out as vLLM's GPU attention backends lay them, and a prefill
worker process that serves them through the connector's worker path
(:class:`freight.vllm.worker.WorkerSide`, the code vLLM calls), for
tests/test_vllm_gpu.py and bench/vllm_gpu.py.

vLLM (0.26 and 0.32, FlashAttention and FlashInfer) keeps a layer's KV cache as the
logical shape ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (K and V side by
side in the last dimension) over memory in one of these physical orders:

- ``NHD``: ``[num_blocks, block_size, kv_heads, 2 * head_size]``, a tensor per layer
  (the default);
- ``HND``: the logical order itself, a tensor per layer;
- ``cross-layer NHD``: one allocation ``[num_blocks, num_layers, block_size, kv_heads,
  2 * head_size]``, each layer a view (block ``b`` of every layer side by side).

Run as a script, it is the prefill side: it fills its blocks with :func:`expected`,
prints its handshake as a JSON line, then for each request line on stdin
(``{"request": id, "blocks": [...]}``) holds the blocks, prints the request's
``kv_transfer_params``, and prints ``{"freed": id}`` once the decode side said it has
them; ``{"exit": true}`` ends it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict

LAYOUTS = ("NHD", "HND", "cross-layer NHD")


@dataclass(frozen=True)
class Shape:
    num_layers: int = 4
    num_blocks: int = 64
    block_size: int = 16
    kv_heads: int = 4
    head_size: int = 64
    layout: str = "NHD"


def kv_caches(shape: Shape, device: str = "cuda:0") -> Dict[str, Any]:
    """Zeroed KV caches by layer name, as vLLM hands them to ``register_kv_caches``."""
    import torch

    b, n, h, c = shape.num_blocks, shape.block_size, shape.kv_heads, 2 * shape.head_size
    out: Dict[str, Any] = {}
    if shape.layout == "cross-layer NHD":
        raw = torch.zeros((b, shape.num_layers, n, h, c), dtype=torch.bfloat16, device=device)
        for layer in range(shape.num_layers):
            out[f"model.layers.{layer}.self_attn.attn"] = raw[:, layer].permute(0, 2, 1, 3)
        return out
    for layer in range(shape.num_layers):
        if shape.layout == "NHD":
            t = torch.zeros((b, n, h, c), dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3)
        elif shape.layout == "HND":
            t = torch.zeros((b, h, n, c), dtype=torch.bfloat16, device=device)
        else:
            raise ValueError(f"layout {shape.layout!r}: one of {LAYOUTS}")
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def expected(layer: int, block: int, like: Any) -> Any:
    """What the prefill side writes into ``block`` of ``layer`` (a tensor shaped as one
    block of ``like``), from its numbers alone so that both sides can compute it."""
    import torch

    numel = like[0].numel()
    i = torch.arange(numel, device=like.device, dtype=torch.int64)
    bits = ((i * 2654435761 + layer * 40503 + block * 9973) % 65521).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(like[0].shape)


def fill(caches: Dict[str, Any]) -> None:
    for layer, t in enumerate(caches.values()):
        for block in range(t.shape[0]):
            t[block].copy_(expected(layer, block, t))


def instance(shape: Shape, engine_id: str) -> Any:
    from freight.vllm.worker import Instance

    return Instance(engine_id=engine_id, model="gpu-layout-test", block_size=shape.block_size,
                    kv_heads=shape.kv_heads, head_size=shape.head_size, num_blocks=shape.num_blocks)


def main() -> None:
    import torch

    from freight.vllm.config import Settings
    from freight.vllm.params import Handoff
    from freight.vllm.worker import WorkerSide

    args = json.loads(sys.argv[1])
    shape = Shape(**args["shape"])
    device = args.get("device", "cuda:0")
    caches = kv_caches(shape, device)
    fill(caches)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    side = WorkerSide(Settings(role="kv_producer", token=args["token"], listen=args.get("listen", "127.0.0.1:0")))
    side.register_kv_caches(caches, instance(shape, "prefill"))
    hello: Dict[str, Any] = {}
    kept = []  # shared segments, alive as long as this process serves
    if args.get("raw_bytes"):
        # A plain buffer beside the KV cache, for a benchmark's raw transfers.
        raw = torch.empty(int(args["raw_bytes"]), dtype=torch.uint8, device=device)
        if device == "cpu":
            # Host memory reaches a same-host peer through shm once it is shared.
            kept.append(side.agent.share_in_place(raw))
        side.agent.register(raw)
        hello["raw"] = raw.data_ptr()
    place, geometry = side.handshake()
    print(json.dumps({"place": place.to_dict(), "geometry": geometry.to_dict(), **hello}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        rid = cmd["request"]
        sent, _ = side.finished(sends={rid: 60.0})
        handoff = Handoff(request_id=rid, engine_id="prefill", block_ids=cmd["blocks"], ranks=[place],
                          geometry=geometry)
        print(json.dumps(handoff.to_params()), flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if rid not in sent:
                sent, _ = side.finished()
            if rid in sent:
                print(json.dumps({"freed": rid}), flush=True)
                break
            time.sleep(0.0002)
        else:
            print(json.dumps({"error": f"no decode side read {rid}"}), flush=True)
    side.close()


if __name__ == "__main__":
    main()


__all__ = ["LAYOUTS", "Shape", "asdict", "expected", "fill", "kv_caches", "instance"]
