"""NIXL's backend (plugin) names, and what each means on freight.

freight has one engine that picks a transport per path (cuda between GPUs of one host,
shm between processes of one host, fabric over libfabric, tcp anywhere); NIXL picks a
plugin. The table below is the mapping docs/nixl.md documents; a plugin whose feature
freight does not have is refused with :class:`nixlNotSupportedError` naming it, never
served by something slower in disguise.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple


class Backend(NamedTuple):
    name: str
    #: freight transports the backend's transfers may take; None: any (freight chooses).
    transports: Optional[Tuple[str, ...]]
    #: NIXL memory types it registers, as NIXL names them ("DRAM_SEG", ...).
    mems: Tuple[str, ...]
    #: Its parameters and their defaults (strings, as NIXL's).
    params: Dict[str, str]
    #: What it is on freight, for logs and docs.
    means: str


BACKENDS: Dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("UCX", None, ("DRAM_SEG", "VRAM_SEG"), {"num_threads": "0"},
                "freight's engine, every transport (cuda, shm, fabric, tcp; the best for each path)"),
        Backend("LIBFABRIC", ("fabric",), ("DRAM_SEG", "VRAM_SEG"), {"num_threads": "0"},
                "freight's fabric transport (libfabric RDMA); a path it cannot serve is an error"),
        Backend("POSIX", (), ("DRAM_SEG", "FILE_SEG"), {},
                "file registration and query_memory (file status); no file transfers"),
    )
}

#: NIXL plugins freight has no counterpart for, and what they are.
UNSUPPORTED: Dict[str, str] = {
    "GDS": "GPUDirect Storage (cuFile) file transfers",
    "GDS_MT": "multi-threaded GPUDirect Storage file transfers",
    "OBJ": "object stores (S3)",
    "AZURE_BLOB": "the Azure Blob object store",
    "HF3FS": "the 3FS distributed file system",
    "GUSLI": "GUSLI block storage",
    "INFINIA": "the DDN Infinia object store",
    "MOONCAKE": "Mooncake's transfer engine as a plugin",
    "UCCL": "the UCCL transport",
    "GPUNETIO": "DOCA GPUNetIO GPU-initiated networking",
    "MOCK_DRAM": "NIXL's mock test plugin",
}


def plugin_names() -> List[str]:
    """What ``getAvailPlugins`` lists: the backends freight serves."""
    return list(BACKENDS)


def lookup(name: str) -> Backend:
    """The backend of a NIXL plugin name; NIXL's errors for the others."""
    from ._types import nixlNotFoundError, nixlNotSupportedError

    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    if name in BACKENDS:
        return BACKENDS[name]
    if name in UNSUPPORTED:
        raise nixlNotSupportedError(
            f"NIXL backend {name!r} ({UNSUPPORTED[name]}) is not supported by freight's NIXL face; "
            f"it serves {', '.join(BACKENDS)} (see docs/nixl.md)")
    raise nixlNotFoundError(f"no NIXL backend named {name!r}; freight's NIXL face serves {', '.join(BACKENDS)}")
