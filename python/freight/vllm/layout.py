"""Where a vLLM instance's KV blocks lie, and whether two instances lay them out alike.

Pure functions over plain numbers (no vLLM, no torch), so that they are tested
without either. A layer's KV cache is one tensor whose first dimension is the block
(every attention backend vLLM ships lays blocks outermost: on CPUs
``[num_blocks, kv_heads, block_size, 2 * head_size]``, K rows before V rows inside a
block; on GPUs a permutation of the inner three): block ``b`` of a layer is then one
run of bytes, ``block_bytes`` long, at ``base + b * block_stride``. Whole blocks are
what moves, never token slots, so the inner order matters only in that both sides
must share it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..descs import DescList
# Raised when the other side's layout (or this side's tensors) cannot be worked with.
from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class LayerBlocks:
    """One layer's blocks: block ``b`` is ``block_bytes`` at ``base + b * stride``."""

    name: str
    base: int
    stride: int
    block_bytes: int
    num_blocks: int


def layer_blocks(name: str, data_ptr: int, shape: Sequence[int], strides: Sequence[int],
                 element_size: int, num_blocks: Optional[int] = None) -> LayerBlocks:
    """A layer's blocks from its tensor's pointer, shape and strides (in elements).

    The tensor must hold each block densely (its inner dimensions, in whatever order,
    fill exactly as many elements as they hold): otherwise a block is not one run of
    bytes and cannot move as one. Blocks may lie further apart than their size (vLLM's
    cross-layer layouts put block ``b`` of every layer side by side). ``num_blocks``,
    where known (vLLM's KV cache config says it), must be the first dimension: a
    leading dimension of another meaning (K and V apart, as older vLLM laid them) would
    look dense too."""
    if len(shape) < 2 or len(shape) != len(strides):
        raise InvalidArgumentError(f"KV cache {name}: shape {tuple(shape)} has no block dimension before the rest")
    if num_blocks is not None and shape[0] != num_blocks:
        raise InvalidArgumentError(
            f"KV cache {name}: shape {tuple(shape)} starts with {shape[0]}, not the {num_blocks} blocks allocated: "
            "blocks must be the outermost dimension"
        )
    inner = 1
    for n in shape[1:]:
        inner *= n
    reach = 1 + sum((n - 1) * s for n, s in zip(shape[1:], strides[1:]))
    if strides[0] < inner or reach != inner:
        raise InvalidArgumentError(
            f"KV cache {name}: shape {tuple(shape)} with strides {tuple(strides)} does not hold each block "
            f"densely (block stride {strides[0]}, {inner} elements a block): blocks must be the outermost dimension"
        )
    return LayerBlocks(name, data_ptr, strides[0] * element_size, inner * element_size, shape[0])


@dataclass(frozen=True)
class Geometry:
    """What both sides must agree on for blocks to mean the same thing."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_size: int
    block_bytes: int
    # A layer's tensor shape without the block count, and its dimension order
    # (strides sorted): equal shapes in another order hold other bytes.
    block_shape: Tuple[int, ...]
    dim_order: Tuple[int, ...]
    tensor_parallel: int

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["block_shape"] = list(self.block_shape)
        d["dim_order"] = list(self.dim_order)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Geometry":
        try:
            return cls(
                model=str(d["model"]), dtype=str(d["dtype"]), block_size=int(d["block_size"]),
                num_layers=int(d["num_layers"]), kv_heads=int(d["kv_heads"]), head_size=int(d["head_size"]),
                block_bytes=int(d["block_bytes"]), block_shape=tuple(int(x) for x in d["block_shape"]),
                dim_order=tuple(int(x) for x in d["dim_order"]), tensor_parallel=int(d["tensor_parallel"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"the prefill instance's KV geometry is malformed ({e!r}): {dict(d)!r}") from e


def dim_order(strides: Sequence[int]) -> Tuple[int, ...]:
    """Dimensions from outermost to innermost (by stride; ties keep their order)."""
    return tuple(sorted(range(len(strides)), key=lambda i: -strides[i]))


def mismatches(prefill: Geometry, decode: Geometry) -> List[str]:
    """Every field on which the two differ, each naming both values; [] when alike."""
    if prefill == decode:  # the usual case, checked once a request: no dicts made
        return []
    theirs, ours = prefill.to_dict(), decode.to_dict()
    return [f"{field}: prefill {p!r}, decode {ours[field]!r}" for field, p in theirs.items() if p != ours[field]]


def block_descs(layers: Sequence[LayerBlocks], block_ids: Sequence[int], device: int = 0) -> np.ndarray:
    """``N x 3`` rows (address, length, device): every layer's blocks ``block_ids``,
    layer by layer, in the order given (the engine merges neighbours into one copy)."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    if len(layers) == 0 or ids.size == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    highest = int(ids.max())
    for layer in layers:
        if highest >= layer.num_blocks:
            raise InvalidArgumentError(f"block {highest} is past the {layer.num_blocks} blocks of KV cache {layer.name}")
    bases = np.fromiter((l.base for l in layers), dtype=np.uint64, count=len(layers))
    strides = np.fromiter((l.stride for l in layers), dtype=np.uint64, count=len(layers))
    lengths = np.fromiter((l.block_bytes for l in layers), dtype=np.uint64, count=len(layers))
    rows = np.empty((len(layers), ids.size, 3), dtype=np.uint64)
    rows[:, :, 0] = bases[:, None] + ids[None, :] * strides[:, None]
    rows[:, :, 1] = lengths[:, None]
    rows[:, :, 2] = device
    return rows.reshape(-1, 3)


def every_block(layers: Sequence[LayerBlocks], device: int = 0, kind: str = "DRAM") -> DescList:
    """Every block of every layer, layer by layer, as one strided run per layer (a few
    words whatever the block count): the list a worker prepares once and picks loads
    out of with :func:`block_indices`. Its entry ``l * num_blocks + b`` is
    ``block_descs(layers, range(num_blocks))``'s; where a layer's blocks lie back to
    back, the engine takes consecutive blocks of it as one piece."""
    out = DescList((), kind)
    for layer in layers:
        out.append_strided(layer.base, layer.block_bytes, device, layer.stride, layer.num_blocks)
    return out


def block_indices(num_layers: int, num_blocks: int, block_ids: Sequence[int]) -> np.ndarray:
    """Where every layer's blocks ``block_ids`` are, layer by layer, in a list of all
    blocks of all layers (:func:`every_block`, prepared once): block ``b`` of layer
    ``l`` is entry ``l * num_blocks + b``. A uint64 array, which ``Agent.make_request``
    takes as it is (once a load: no conversion or copy there)."""
    ids = np.asarray(block_ids)
    if ids.size:
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"block ids must be a list of integers, got {ids.dtype} of shape {ids.shape}")
        lowest, highest = int(ids.min()), int(ids.max())
        if highest >= num_blocks or lowest < 0:
            bad = highest if highest >= num_blocks else lowest
            raise InvalidArgumentError(f"block {bad} is not one of the {num_blocks} blocks of the KV cache")
    return (_layer_starts(num_layers, num_blocks) + ids.astype(np.uint64)).ravel()


@functools.lru_cache(maxsize=64)
def _layer_starts(num_layers: int, num_blocks: int) -> np.ndarray:
    """Each layer's first entry in the list of all blocks, as a column (read-only: shared)."""
    starts = np.arange(0, num_layers * num_blocks, num_blocks, dtype=np.uint64)[:, None]
    starts.setflags(write=False)
    return starts


def regions(layers: Sequence[LayerBlocks]) -> List[Tuple[int, int]]:
    """The address ranges ``(start, length)`` that hold every layer's blocks, merged
    where layers interleave (vLLM's cross-layer layouts: block ``b`` of every layer
    side by side): what to register, once each. Layers that merely touch stay apart:
    they may be separate allocations that happen to meet (GPU memory is registered
    allocation by allocation)."""
    spans = sorted((l.base, l.base + (l.num_blocks - 1) * l.stride + l.block_bytes) for l in layers)
    merged: List[List[int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def page_spans(spans: Sequence[Tuple[int, int]], page: int = 4096) -> List[Tuple[int, int]]:
    """The whole pages that hold ``spans`` (``(start, length)``), merged where two
    spans touch one page: what to share in place (:meth:`freight.Agent.share_in_place`
    shares whole pages, so two allocations that meet inside a page share it once)."""
    rounded = sorted((s - s % page, -(-(s + n) // page) * page) for s, n in spans)
    merged: List[List[int]] = []
    for start, end in rounded:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]
