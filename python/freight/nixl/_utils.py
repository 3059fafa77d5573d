"""NIXL's ``_utils``: raw host memory for examples and tests."""

from __future__ import annotations

import ctypes

_libc = ctypes.CDLL(None)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]

#: Allocations are page aligned, as NIXL's (file transfers need it).
ALIGNMENT = 4096


def malloc_passthru(size: int) -> int:
    """``size`` bytes of page-aligned host memory (C ``aligned_alloc``); the address."""
    addr = _libc.aligned_alloc(ALIGNMENT, int(size))
    if not addr:
        raise MemoryError(f"allocating {size} bytes failed")
    return addr


def free_passthru(addr: int) -> None:
    """Frees what :func:`malloc_passthru` returned."""
    _libc.free(ctypes.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> None:
    """Fills ``size`` bytes at ``addr`` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """AssertionError unless the ``size`` bytes at both addresses are equal."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    if a != b:
        first = next(i for i in range(len(a)) if a[i] != b[i])
        raise AssertionError(f"transfer differs at byte {first} of {size}")
