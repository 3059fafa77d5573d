"""Descriptor lists: which bytes a transfer touches."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from . import _native
from ._objects import _uint, describe, normalize_kind
from .errors import InvalidArgumentError

__all__ = ["DescList", "as_desclist"]


class DescList:
    """A list of memory descriptors ``(addr, length, device)`` of one memory kind.

    ``DescList(descs=(), kind=None)`` where ``descs`` is

    * a list of ``(addr, length, device)`` tuples;
    * a list of numpy arrays, buffers or tensors (one descriptor per object, covering
      it entirely; they may be mixed with tuples);
    * an ``N x 3`` numpy array of uint64 or int64 rows ``(address, length, device)``,
      read in Rust without per-row Python work;
    * another DescList (copied).

    ``kind`` is "DRAM" (host memory), "VRAM" (GPU memory; ``device`` is the CUDA
    ordinal) or "FILE". When None it is "DRAM", or "VRAM" for CUDA tensors.

    A transfer moves the concatenation of the local descriptors to (WRITE) or from
    (READ) the concatenation of the remote ones: totals must match, the cuts need not.

    Strided families (e.g. one block per layer of a paged KV cache) are stored as one
    run without materialising the descriptors: see :meth:`strided` and
    :meth:`append_strided`.
    """

    __slots__ = ("_raw",)

    _raw: _native.DescList

    def __init__(self, descs: Any = (), kind: Optional[str] = None) -> None:
        if isinstance(descs, DescList):
            k = normalize_kind(kind) if kind is not None else descs.kind
            if k != descs.kind:
                raise InvalidArgumentError(f"cannot copy a {descs.kind} DescList as {k}")
            self._raw = descs._raw.copy()
            return
        if isinstance(descs, np.ndarray):
            self._raw = _native.DescList(normalize_kind(kind) if kind is not None else "DRAM")
            self._raw.extend(_triple_array(descs))
            return
        triples, inferred = _triples(descs, normalize_kind(kind) if kind is not None else None)
        self._raw = _native.DescList(inferred)
        if triples:
            self._raw.extend(triples)

    @classmethod
    def strided(
        cls, addr: int, length: int, device: int, stride: int, count: int, kind: str = "DRAM"
    ) -> "DescList":
        """``count`` descriptors of ``length`` bytes, the i-th at ``addr + i*stride``."""
        dl = cls((), kind)
        dl.append_strided(addr, length, device, stride, count)
        return dl

    def append(self, addr: int, length: int, device: int = 0) -> "DescList":
        """Appends one descriptor; returns self."""
        self._raw.push(_uint(addr, "addr"), _uint(length, "length"), _uint(device, "device"))
        return self

    def append_strided(self, addr: int, length: int, device: int, stride: int, count: int) -> "DescList":
        """Appends ``count`` descriptors of ``length`` bytes spaced ``stride`` apart (one
        run, not materialised); returns self."""
        values = zip((addr, length, device, stride, count), ("addr", "length", "device", "stride", "count"))
        self._raw.push_strided(*(_uint(v, what) for v, what in values))
        return self

    def extend(self, descs: Any) -> "DescList":
        """Appends descriptors (anything the constructor accepts, of this list's kind);
        all or nothing. Returns self."""
        if isinstance(descs, np.ndarray):
            self._raw.extend(_triple_array(descs))
            return self
        if isinstance(descs, DescList):
            self._raw.extend_runs(descs._raw.copy() if descs is self else descs._raw)
            return self
        triples, _ = _triples(descs, self.kind)
        if triples:
            self._raw.extend(triples)
        return self

    @property
    def kind(self) -> str:
        """Memory kind: "DRAM", "VRAM" or "FILE"."""
        return self._raw.kind

    @property
    def nbytes(self) -> int:
        """Total bytes over all descriptors."""
        return self._raw.nbytes

    @property
    def runs(self) -> int:
        """Number of runs (a strided family counts once)."""
        return self._raw.runs

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i: int) -> Tuple[int, int, int]:
        n = len(self._raw)
        if not isinstance(i, (int, np.integer)):
            raise TypeError("DescList indices must be integers")
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index out of range for a list of {n} descriptors")
        return self._raw.get(i)

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        for i in range(len(self._raw)):
            yield self._raw.get(i)

    def copy(self) -> "DescList":
        """An independent copy."""
        return DescList(self)

    def __add__(self, other: Any) -> "DescList":
        return self.copy().extend(other)

    def __repr__(self) -> str:
        return f"<freight.DescList {len(self)} descriptors ({self.runs} runs), {self.nbytes} bytes of {self.kind}>"


def _triple_array(arr: np.ndarray) -> np.ndarray:
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise InvalidArgumentError(
            f"a descriptor array must have shape (N, 3) (address, length, device), got {arr.shape}; "
            "to describe a data array, pass it in a list: DescList([arr])"
        )
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"a descriptor array must hold integers, got dtype {arr.dtype}")
    if arr.dtype not in (np.uint64, np.int64):
        arr = arr.astype(np.int64 if arr.dtype.kind == "i" else np.uint64)
    return arr


def _triples(descs: Any, kind: Optional[str]) -> Tuple[List[Tuple[int, int, int]], str]:
    """Triples and the kind of a list of tuples / objects."""
    if isinstance(descs, (str, bytes)) or not isinstance(descs, Iterable):
        raise TypeError(
            f"descriptors must be a list of (addr, length, device) tuples, arrays or tensors, "
            f"or an Nx3 array; got {type(descs).__name__}"
        )
    out: List[Tuple[int, int, int]] = []
    seen: Optional[str] = kind
    for i, d in enumerate(descs):
        if isinstance(d, tuple):
            out.append(d)
            continue
        r = describe(d, kind, readonly_ok=True)
        if seen is None:
            seen = r.kind
        elif r.kind != seen:
            raise InvalidArgumentError(f"descriptor {i} is {r.kind} memory but the list is {seen}")
        out.append((r.addr, r.length, r.device))
    return out, seen or "DRAM"


def as_desclist(descs: Any, kind: Optional[str] = None) -> DescList:
    """``descs`` if it is a DescList (of ``kind``, if given), else ``DescList(descs, kind)``."""
    if isinstance(descs, DescList):
        if kind is not None and normalize_kind(kind) != descs.kind:
            raise InvalidArgumentError(f"expected a {normalize_kind(kind)} DescList, got {descs.kind}")
        return descs
    return DescList(descs, kind)
