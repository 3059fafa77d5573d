"""Turning Python objects into memory ranges: (kind, addr, length, device).

Understood objects:

* numpy arrays (contiguous), and any object exporting the buffer protocol (bytearray,
  mmap, array.array, memoryview...; C-contiguous);
* PyTorch tensors and look-alikes, duck-typed (``data_ptr()``, ``numel()``,
  ``element_size()``, ``device``): CUDA tensors are VRAM on ``device.index``. torch is
  never imported here;
* explicit ``(addr, length, device)`` tuples of ints (the kind then comes from the
  caller, "DRAM" by default).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from . import _native
from .errors import InvalidArgumentError



class Range(NamedTuple):
    """One memory range described from a Python object."""

    kind: str
    addr: int
    length: int
    device: int
    #: What must stay alive while the range is registered (None for raw tuples).
    keep: Any


def normalize_kind(kind: Any) -> str:
    """"DRAM", "VRAM" or "FILE" (case-insensitive; "cpu"/"host" and "gpu"/"cuda" accepted):
    the engine's own names, read by the engine (one list of aliases, in Rust)."""
    if not isinstance(kind, str):
        raise InvalidArgumentError(f"a memory kind is a str such as 'DRAM', got {type(kind).__name__} {kind!r:.40}")
    return _native.normalize_kind(kind)


def is_tensor(obj: Any) -> bool:
    """Duck-typed PyTorch tensor check (never imports torch)."""
    return (
        not isinstance(obj, np.ndarray)
        and callable(getattr(obj, "data_ptr", None))
        and callable(getattr(obj, "numel", None))
        and callable(getattr(obj, "element_size", None))
        and hasattr(obj, "device")
    )


def _uint(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0 or value >= 1 << 64:
        raise InvalidArgumentError(f"{what} must be in [0, 2**64), got {value}")
    return value


def _check_kind(obj_kind: str, kind: Optional[str], obj: Any) -> str:
    if kind is not None and kind != obj_kind:
        raise InvalidArgumentError(f"{type(obj).__name__} memory is {obj_kind}, but kind={kind!r} was given")
    return obj_kind


def describe(obj: Any, kind: Optional[str] = None, *, readonly_ok: bool = True) -> Range:
    """Describes ``obj`` as one memory range.

    ``kind`` (already normalised, or None) must agree with the object's memory, except
    for raw tuples where it is the kind (default "DRAM"). Read-only buffers raise
    :class:`InvalidArgumentError` unless ``readonly_ok``.
    """
    if isinstance(obj, tuple):
        if len(obj) != 3:
            raise InvalidArgumentError(f"a memory tuple must be (addr, length, device), got {obj!r}")
        addr, length, dev = (_uint(v, n) for v, n in zip(obj, ("addr", "length", "device")))
        if length == 0:
            raise InvalidArgumentError(f"zero-length memory range at {addr:#x}")
        return Range(kind or "DRAM", addr, length, dev, None)

    if is_tensor(obj):
        device = obj.device
        dtype = getattr(device, "type", str(device))
        if dtype == "cuda":
            index = getattr(device, "index", None)
            if index is None:
                index = obj.get_device() if callable(getattr(obj, "get_device", None)) else 0
            obj_kind, dev = "VRAM", int(index)
        elif dtype == "cpu":
            obj_kind, dev = "DRAM", 0
        else:
            raise InvalidArgumentError(f"tensors on device {device!r} are not supported (cpu or cuda only)")
        _check_kind(obj_kind, kind, obj)
        is_contiguous = getattr(obj, "is_contiguous", None)
        if callable(is_contiguous) and not is_contiguous():
            raise InvalidArgumentError("the tensor is not contiguous (call .contiguous() first)")
        length = int(obj.numel()) * int(obj.element_size())
        if length == 0:
            raise InvalidArgumentError("the tensor is empty")
        return Range(obj_kind, int(obj.data_ptr()), length, dev, obj)

    if isinstance(obj, np.ndarray):
        _check_kind("DRAM", kind, obj)
        if obj.dtype.hasobject:
            # Its bytes are pointers to Python objects: moved elsewhere, they point nowhere.
            raise InvalidArgumentError(f"the array holds Python objects (dtype {obj.dtype}), not raw memory")
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise InvalidArgumentError(
                f"the array (shape {obj.shape}, strides {obj.strides}) is not contiguous; "
                "register its base array, or describe it with strided descriptors"
            )
        if obj.nbytes == 0:
            raise InvalidArgumentError("the array is empty")
        if not readonly_ok and not obj.flags.writeable:
            raise InvalidArgumentError("the array is read-only (pass readonly_ok=True if peers will only read it)")
        return Range("DRAM", int(obj.__array_interface__["data"][0]), int(obj.nbytes), 0, obj)

    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"cannot use a {type(obj).__name__} as memory: expected a numpy array, an object with the "
            "buffer protocol, a tensor, or an (addr, length, device) tuple"
        ) from None
    _check_kind("DRAM", kind, obj)
    if not view.c_contiguous:
        raise InvalidArgumentError(f"the {type(obj).__name__} buffer is not C-contiguous")
    if view.nbytes == 0:
        raise InvalidArgumentError(f"the {type(obj).__name__} buffer is empty")
    if not readonly_ok and view.readonly:
        raise InvalidArgumentError(
            f"the {type(obj).__name__} buffer is read-only (pass readonly_ok=True if peers will only read it)"
        )
    addr = int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
    # Holding the memoryview pins the exporter (a bytearray cannot be resized under it).
    return Range("DRAM", addr, view.nbytes, 0, view)


def is_readonly(obj: Any) -> bool:
    """Whether ``obj`` (anything :func:`describe` takes) is memory Python marks read-only:
    a numpy array that is not writeable, a read-only buffer. Tensors and raw tuples
    carry no such mark."""
    if isinstance(obj, tuple) or is_tensor(obj):
        return False
    if isinstance(obj, np.ndarray):
        return not obj.flags.writeable
    try:
        return memoryview(obj).readonly
    except TypeError:
        return False


def to_bytes(msg: Any, what: str = "message") -> bytes:
    """bytes from bytes-like objects or str (UTF-8)."""
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"{what} must be str or bytes, got {type(msg).__name__} {msg!r:.60}")


_NATIVE_INDEX_TYPES = (np.dtype(np.uint64), np.dtype(np.int64), np.dtype(np.uint32), np.dtype(np.int32))


def _index_array(idx: Any) -> np.ndarray:
    arr = np.asarray(idx)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"indices must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"indices must be integers, got dtype {arr.dtype}")
    return arr


def u64_indices(idx: Any) -> Optional[np.ndarray]:
    """None, or a contiguous 1-D uint64 array from a list / numpy integer array (no
    per-element Python work), for the native calls that read uint64 only."""
    if idx is None:
        return None
    arr = _index_array(idx)
    if arr.dtype.kind == "i" and (arr < 0).any():
        raise InvalidArgumentError(f"indices must be non-negative, got {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def indices(idx: Any) -> Optional[np.ndarray]:
    """None, or a 1-D array of 64- or 32-bit integers from a list / numpy integer array,
    for make_request: Rust reads those four types in place (and refuses negative ones);
    any other becomes uint64."""
    if idx is None:
        return None
    arr = _index_array(idx)
    if arr.dtype in _NATIVE_INDEX_TYPES and arr.dtype.isnative:
        return arr
    return u64_indices(arr)
