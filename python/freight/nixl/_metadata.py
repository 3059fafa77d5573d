"""The metadata blob of the NIXL face (what ``get_agent_metadata`` returns): sans-IO.

Layout::

    magic    8 bytes   b"FRTNXMD1"
    hlen     u32 LE    length of the header
    header   hlen      JSON object: {"name": str, "visible": null | [[mem, addr, len, dev], ...]}
    freight  rest      the freight agent's own metadata (Agent.metadata())

``visible`` is null for full metadata; partial metadata
(``get_partial_agent_metadata``) lists the registered ranges it shows. The freight
metadata inside always describes the whole agent, and its secret opens every region it
registered: partial metadata narrows what the NIXL face lets a peer address, it is not an
access control (give such peers a token, see docs/nixl.md).
"""

from __future__ import annotations

import json
import struct
from typing import List, NamedTuple, Optional, Tuple

MAGIC = b"FRTNXMD1"
#: Partial metadata lists at most this many ranges; a header at most this many bytes.
MAX_VISIBLE = 1 << 20
MAX_HEADER = 64 << 20

Range = Tuple[int, int, int, int]  # (mem type, addr, len, dev)


class BlobError(ValueError):
    """Bytes that are not metadata of the NIXL face."""


class Blob(NamedTuple):
    name: str
    visible: Optional[List[Range]]
    freight: bytes


def encode(name: str, visible: Optional[List[Range]], freight_md: bytes) -> bytes:
    header = json.dumps({"name": name, "visible": visible}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + freight_md


def decode(data: bytes) -> Blob:
    """Parses a blob; :class:`BlobError` saying what is wrong for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BlobError(f"metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise BlobError("not metadata of a freight NIXL agent (bad magic)")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > len(data):
        raise BlobError(f"metadata header of {hlen} bytes runs past the {len(data)} bytes given")
    try:
        header = json.loads(data[start:start + hlen])
    except (UnicodeDecodeError, ValueError) as e:
        raise BlobError(f"metadata header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("name"), str) or not header["name"]:
        raise BlobError("metadata header names no agent")
    visible = header.get("visible")
    if visible is not None:
        if not isinstance(visible, list) or len(visible) > MAX_VISIBLE:
            raise BlobError("metadata header's visible ranges are not a list of at most 2^20 ranges")
        for r in visible:
            if (not isinstance(r, list) or len(r) != 4
                    or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in r)):
                raise BlobError(f"visible range {r!r} is not [mem, addr, len, dev] of unsigned 64-bit integers")
        visible = [tuple(r) for r in visible]
    freight_md = data[start + hlen:]
    if not freight_md:
        raise BlobError("metadata carries no freight agent metadata")
    return Blob(header["name"], visible, freight_md)


def covered(visible: List[Range], mem: int, addr: int, length: int, dev: int) -> bool:
    """Whether ``[addr, addr+length)`` of ``(mem, dev)`` lies inside one visible range."""
    for vm, va, vl, vd in visible:
        if vm == mem and vd == dev and va <= addr and addr + length <= va + vl:
            return True
    return False
