"""Descriptor lists as bytes (``get_serialized_descs`` / ``deserialize_descs``): sans-IO.

NIXL pickles them, so a peer's bytes given to ``deserialize_descs`` can run any code in
the receiving process. This format holds descriptor lists and nothing else::

    magic   8 bytes  b"FRTNXDL1"
    class   u8       0 nixlXferDList, 1 nixlRegDList, 2 nixlRemoteDList
    mem     u8       nixl_mem_t
    count   u64 LE
    rows    count x (addr u64, len u64, dev u64), little-endian
    extra   Reg and Remote lists: count x (u32 LE length, bytes): meta info / agent name
"""

from __future__ import annotations

import struct
from typing import Any, List

import numpy as np

from ._lists import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._types import nixl_mem_t, nixlInvalidParamError

MAGIC = b"FRTNXDL1"
_CLASSES = (nixlXferDList, nixlRegDList, nixlRemoteDList)
_HEAD = struct.Struct("<BBQ")


def dumps(descs: Any) -> bytes:
    code = next((c for c, cls in enumerate(_CLASSES) if isinstance(descs, cls)), None)
    if code is None:
        raise TypeError(f"only NIXL descriptor lists serialize, not {type(descs).__name__}")
    n = descs.descCount()
    parts = [MAGIC, _HEAD.pack(code, int(descs.getType()), n)]
    if code == 2:
        rows = np.array([descs[i][:3] for i in range(n)], dtype="<u8").reshape(n, 3)
        extras = [a.encode() for a in descs._agents()]
    else:
        rows = np.ascontiguousarray(descs._triples(), dtype="<u8")
        extras = descs._metas() if code == 1 else []
    parts.append(rows.tobytes())
    for extra in extras:
        parts.append(struct.pack("<I", len(extra)) + extra)
    return b"".join(parts)


def loads(data: bytes) -> Any:
    """The list ``dumps`` made; :class:`nixlInvalidParamError` for any other bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"serialized descriptors are bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEAD.size:
        raise nixlInvalidParamError("not a serialized descriptor list of freight's NIXL face (bad magic)")
    code, mem, n = _HEAD.unpack_from(data, len(MAGIC))
    if code >= len(_CLASSES):
        raise nixlInvalidParamError(f"unknown descriptor list class {code}")
    try:
        mem_t = nixl_mem_t(mem)
    except ValueError:
        raise nixlInvalidParamError(f"unknown memory type {mem}") from None
    off = len(MAGIC) + _HEAD.size
    if n > (len(data) - off) // 24:
        raise nixlInvalidParamError(f"{n} descriptors announced, {len(data) - off} bytes follow")
    rows = np.frombuffer(data, dtype="<u8", count=3 * n, offset=off).reshape(n, 3).astype(np.uint64)
    off += 24 * n
    cls = _CLASSES[code]
    if code == 0:
        if off != len(data):
            raise nixlInvalidParamError("trailing bytes after the descriptors")
        return cls(mem_t, rows)
    extras: List[Any] = []
    for _ in range(n):
        if off + 4 > len(data):
            raise nixlInvalidParamError("serialized descriptor list is truncated")
        (k,) = struct.unpack_from("<I", data, off)
        off += 4
        if off + k > len(data):
            raise nixlInvalidParamError("serialized descriptor list is truncated")
        extras.append(data[off:off + k])
        off += k
    if off != len(data):
        raise nixlInvalidParamError("trailing bytes after the descriptors")
    if code == 2:
        try:
            extras = [e.decode() for e in extras]
        except UnicodeDecodeError:
            raise nixlInvalidParamError("a remote descriptor's agent name is not UTF-8") from None
    items = [(int(a), int(b), int(c), e) for (a, b, c), e in zip(rows.tolist(), extras)]
    return cls(mem_t, items)
