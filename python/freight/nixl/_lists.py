"""NIXL's descriptor lists: ``nixlXferDList``, ``nixlRegDList`` and ``nixlRemoteDList``.

These are NIXL 1.5's classes (its ``nixl._bindings`` module) with NIXL's behaviour:
the same constructors, methods, return values, exception types, equality and pickled
state (the state bytes are laid out as NIXL lays them out). The descriptors are kept as
rows of a numpy uint64 array, so lists of many thousand descriptors are built from an
``N x 3`` array with one copy and handed to freight the same way.

Where NIXL's native code reads or writes out of bounds (an index past the end, and so
iteration) or leaves memory uninitialised (``init_size``), these classes raise
``IndexError`` or hold zeros instead.
"""

from __future__ import annotations

import array
import itertools
import logging
import operator
import struct
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ._types import nixl_mem_t, nixlNotFoundError

__all__ = ["nixlXferDList", "nixlRegDList", "nixlRemoteDList"]

_log = logging.getLogger(__name__)

_U64_MAX = (1 << 64) - 1
_UINT_LIMIT = 1 << 32                            # list indices are C unsigned ints in NIXL
_INT_MIN, _INT_LIMIT = -(1 << 31), 1 << 31       # remDesc's index and init_size are C ints
_FIELDS = ("addr", "len", "devID")

# NIXL's serialisation ("nixlSerDes"): a header, then entries ``tag, u64 length, data, '|'``.
_SERDES_HEADER = b"nixlSerDes|"
_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")
_ROW_BYTES = 24
# One serialised registration descriptor with empty metaInfo: (empty tag,) length 24, row, '|'.
_BLOB_RECORD = np.dtype([("len", "<u8"), ("row", "<u8", (3,)), ("bar", "S1")])


def _entry(tag: bytes, data: bytes) -> bytes:
    return tag + _U64.pack(len(data)) + data + b"|"


class _Reader:
    """Reads the entries of a serialised list; ValueError on any mismatch."""

    def __init__(self, data: bytes, cls_name: str) -> None:
        self.data = data
        self.pos = 0
        self.cls_name = cls_name

    def fail(self, why: str) -> None:
        raise ValueError(f"cannot restore a {self.cls_name} from this state: {why}")

    def expect(self, raw: bytes) -> None:
        if self.data[self.pos:self.pos + len(raw)] != raw:
            self.fail(f"expected {raw!r} at byte {self.pos}")
        self.pos += len(raw)

    def take(self, tag: bytes) -> bytes:
        self.expect(tag)
        if len(self.data) < self.pos + 8:
            self.fail(f"truncated entry at byte {self.pos}")
        (length,) = _U64.unpack_from(self.data, self.pos)
        start = self.pos + 8
        end = start + length
        if len(self.data) < end + 1 or self.data[end:end + 1] != b"|":
            self.fail(f"truncated or unterminated entry at byte {self.pos}")
        self.pos = end + 1
        return self.data[start:end]


# ---------------------------------------------------------------------- conversions
# Values are converted as NIXL's argument conversion does: fields through __index__
# (so bool and numpy integers pass, float and str do not), metaInfo / agent names from
# str (UTF-8) or bytes. A value that does not convert raises RuntimeError, as in NIXL.

def _u64(value: Any, what: str, where: str) -> int:
    if type(value) is int and 0 <= value <= _U64_MAX:
        return value
    try:
        v = operator.index(value)
    except TypeError:
        raise RuntimeError(f"{where}: {what} must be an integer, not {type(value).__name__} {value!r}") from None
    if not 0 <= v <= _U64_MAX:
        raise RuntimeError(f"{where}: {what} {v} is outside the unsigned 64-bit range 0 .. 2**64-1")
    return v


def _blob(value: Any, where: str) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RuntimeError(f"{where}: metaInfo {value!r} cannot be encoded as UTF-8 ({e.reason})") from None
    raise RuntimeError(f"{where}: metaInfo must be str or bytes, not {type(value).__name__} {value!r}")


def _agent(value: Any, where: str) -> str:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RuntimeError(f"{where}: agent name {value!r} cannot be encoded as UTF-8 ({e.reason})") from None
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise RuntimeError(f"{where}: agent name {bytes(value)!r} is not valid UTF-8") from None
    raise RuntimeError(f"{where}: agent name must be str or bytes, not {type(value).__name__} {value!r}")


def _raise_bad_value(descs: Sequence[Sequence[Any]], where: str) -> None:
    """Raises the error for the first (addr, len, devID) field of ``descs`` that is not
    an unsigned 64-bit integer."""
    for i, desc in enumerate(descs):
        for value, what in zip(desc, _FIELDS):
            _u64(value, what, f"{where}: descriptor {i}")
    raise AssertionError("no bad value found")  # pragma: no cover


def _mem_type(value: Any, cls_name: str) -> nixl_mem_t:
    if not isinstance(value, nixl_mem_t):
        raise TypeError(
            f"{cls_name}: the memory type must be a nixl_mem_t (DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG "
            f"or FILE_SEG), not {type(value).__name__} {value!r}"
        )
    return value


def _c_int(i: Any, where: str, what: str, lo: int, limit: int, c_type: str) -> int:
    """An integer argument that NIXL takes as a C integer: TypeError when it is no
    integer or does not fit the C type."""
    try:
        v = operator.index(i)
    except TypeError:
        raise TypeError(f"{where}: {what} must be an integer, not {type(i).__name__} {i!r}") from None
    if not lo <= v < limit:
        if lo == 0 and v < 0:
            raise TypeError(f"{where}: indices are unsigned (0 .. descCount()-1), {v} is not accepted")
        raise TypeError(f"{where}: {what} {v} does not fit {c_type}, which NIXL takes")
    return v


def _grown(rows: np.ndarray, n: int, needed: int) -> np.ndarray:
    """``rows[:n]`` in an array with room for ``needed`` rows (capacity doubles)."""
    out = np.empty((max(16, needed, 2 * len(rows)), 3), dtype=np.uint64)
    out[:n] = rows[:n]
    return out


class _DescList:
    """What the three list classes share (not part of NIXL's API).

    The rows are ``_rows[:_n]`` followed by ``_tail``, a list of (addr, len, devID)
    tuples appended since the rows were last needed (appending to a Python list is much
    cheaper than writing a numpy row; ``_sync`` moves them into ``_rows`` in one pass).
    ``_extra`` holds the fourth element of each descriptor (metaInfo bytes or agent
    names), None for nixlXferDList.
    """

    __slots__ = ("_mem", "_rows", "_n", "_tail", "_extra")

    _WIDTH = 3                       # elements of a descriptor tuple
    _SHAPE = "(addr, len, devID)"    # a descriptor as messages show it
    _ARRAYS = True                   # whether N x 3 numpy arrays are accepted
    _EMPTY_EXTRA: Any = None         # the fourth element of a zeroed / numpy-built descriptor
    _SERDES_KIND = b""
    _FAMILY: type = object           # instances compare equal only within this class

    # ------------------------------------------------------------------ construction

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        for k in kwargs:
            if k not in ("type", "init_size", "descs"):
                raise TypeError(f"{name}() got an unexpected keyword argument {k!r}")
        if len(args) > 2:
            raise TypeError(f"{name}() takes a memory type and then init_size or descs, got {len(args)} arguments")
        if "type" in kwargs:
            if args:
                raise TypeError(f"{name}() got the memory type twice (positionally and as type=)")
            mem = kwargs["type"]
        elif args:
            mem = args[0]
        else:
            raise TypeError(f"{name}() needs a memory type (a nixl_mem_t such as DRAM_SEG)")
        given = [("", a) for a in args[1:]] + [(k, kwargs[k]) for k in ("init_size", "descs") if k in kwargs]
        if len(given) > 1:
            raise TypeError(f"{name}() takes init_size or descs, not both")
        self._mem = _mem_type(mem, name)
        kw, value = given[0] if given else ("init_size", 0)
        if kw != "init_size" and isinstance(value, np.ndarray):
            if not self._ARRAYS:
                raise TypeError(f"{name}() takes a list of {self._SHAPE} tuples, not a numpy array")
            self._adopt(self._array_rows(value), None)
        elif kw != "init_size" and isinstance(value, list):
            self._adopt(*self._tuple_rows(value))
        elif kw != "descs":
            n = _c_int(value, f"{name}()", "init_size", _INT_MIN, _INT_LIMIT, "a C int")
            if n < 0:
                raise ValueError(f"{name}() init_size must not be negative, got {n}")
            self._adopt(np.zeros((n, 3), dtype=np.uint64), None)
        else:
            forms = f"a list of {self._SHAPE} tuples" + (" or an N x 3 numpy array" if self._ARRAYS else "")
            raise TypeError(f"{name}() descs must be {forms}, not {type(value).__name__}")

    def _adopt(self, rows: np.ndarray, extra: Optional[List[Any]]) -> None:
        """Takes ``rows`` (N x 3 uint64, C-contiguous, owned by this list from now on) and
        the fourth elements (None: all empty) as the whole content."""
        self._rows = rows
        self._n = len(rows)
        self._tail: List[Tuple[int, int, int]] = []
        self._extra: Optional[List[Any]] = None
        if self._WIDTH == 4:
            self._extra = extra if extra is not None else [self._EMPTY_EXTRA] * self._n

    @property
    def _fourths(self) -> List[Any]:
        """The fourth elements, in a list of four-element descriptors (which has them)."""
        assert self._extra is not None, "a list of three-element descriptors has no fourth"
        return self._extra

    @classmethod
    def _over(cls, mem: Any, descs: np.ndarray) -> "Any":
        """A list over an N x 3 array's memory, not a copy of it: only for a caller that is
        done with the list before the array can change (prep_xfer_dlist of an array)."""
        self = cls.__new__(cls)
        self._mem = _mem_type(mem, cls.__name__)
        self._adopt(self._array_rows(descs, copy=False), None)
        return self

    def _array_rows(self, descs: np.ndarray, copy: bool = True) -> np.ndarray:
        name = type(self).__name__
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise ValueError(f"{name}() descs must be an N x 3 numpy array, got shape {descs.shape}")
        if descs.dtype != np.uint64 and descs.dtype != np.int64:
            raise ValueError(f"{name}() descs must be an N x 3 numpy array of uint64 or int64, not {descs.dtype}")
        if not descs.flags.c_contiguous:
            raise ValueError(f"{name}() descs must be a C-contiguous numpy array (see numpy.ascontiguousarray)")
        # int64 rows are taken bit for bit, as NIXL copies the array's memory.
        rows = descs.view(np.uint64)
        return rows.copy() if copy else rows

    def _tuple_rows(self, descs: List[Any]) -> Tuple[np.ndarray, Optional[List[Any]]]:
        where = f"{type(self).__name__}()"
        width = self._WIDTH
        n = len(descs)
        if n == 0:
            return np.zeros((0, 3), dtype=np.uint64), None
        # Whole-list checks in C first; the per-element loops only run to name a culprit.
        if set(map(type, descs)) != {tuple}:
            for i, d in enumerate(descs):
                if not isinstance(d, tuple):
                    raise TypeError(f"{where}: descriptor {i} must be a tuple {self._SHAPE}, not {type(d).__name__}")
        if set(map(len, descs)) != {width}:
            for i, d in enumerate(descs):
                if len(d) != width:
                    raise ValueError(f"{where}: descriptor {i} has {len(d)} elements, not {width}: {self._SHAPE}")
        # array("Q") converts like NIXL (through __index__, 0 .. 2**64-1); it is much faster
        # on a list than on an iterator.
        if width == 3:
            fields = list(itertools.chain.from_iterable(descs))
        else:
            ig = operator.itemgetter
            fields = list(itertools.chain(map(ig(0), descs), map(ig(1), descs), map(ig(2), descs)))
        try:
            flat = array.array("Q", fields)
        except (TypeError, OverflowError):
            _raise_bad_value(descs, where)
        rows = np.frombuffer(flat, dtype=np.uint64)
        if width == 3:
            return rows.reshape(n, 3), None
        rows = np.ascontiguousarray(rows.reshape(3, n).T)
        return rows, self._extras(list(map(operator.itemgetter(3), descs)), where)

    def _extras(self, values: List[Any], where: str) -> List[Any]:
        """The fourth elements of many descriptors, converted."""
        raise NotImplementedError  # pragma: no cover

    def _extra_of(self, value: Any, where: str) -> Any:
        """The fourth element of one descriptor, converted."""
        raise NotImplementedError  # pragma: no cover

    def _one(self, desc: Any, method: str) -> Tuple[Tuple[int, int, int], Any]:
        """One descriptor given to addDesc / append / __setitem__ / index, as
        ((addr, len, devID), fourth element). As in NIXL it must be a tuple, and elements
        past the descriptor's own are ignored."""
        width = self._WIDTH
        if type(desc) is tuple and len(desc) == width:   # the common case, checked cheaply
            a, ln, dev = desc[0], desc[1], desc[2]
            if type(a) is int and type(ln) is int and type(dev) is int and \
                    0 <= a <= _U64_MAX and 0 <= ln <= _U64_MAX and 0 <= dev <= _U64_MAX:
                if width == 3:
                    return desc, None
                try:
                    return (a, ln, dev), self._extra_of(desc[3], method)
                except RuntimeError:
                    pass  # raised again below, with the full location
        where = f"{type(self).__name__}.{method}"
        if not isinstance(desc, tuple):
            raise TypeError(f"{where} takes a tuple {self._SHAPE}, not {type(desc).__name__}")
        if len(desc) < self._WIDTH:
            raise IndexError(f"{where}: a descriptor is {self._SHAPE}, the tuple has only {len(desc)} elements")
        triple = (_u64(desc[0], "addr", where), _u64(desc[1], "len", where), _u64(desc[2], "devID", where))
        return triple, (self._extra_of(desc[3], where) if self._WIDTH == 4 else None)

    def _sync(self) -> None:
        """Moves the pending appended rows into ``_rows``."""
        tail = self._tail
        if not tail:
            return
        n, k = self._n, len(tail)
        if n + k > len(self._rows):
            self._rows = _grown(self._rows, n, n + k)
        if k == 1:
            self._rows[n] = tail[0]
        else:
            flat = array.array("Q", itertools.chain.from_iterable(tail))
            self._rows[n:n + k] = np.frombuffer(flat, dtype=np.uint64).reshape(k, 3)
        self._n = n + k
        self._tail = []

    def _position(self, i: Any, method: str) -> int:
        count = self._n + len(self._tail)
        v = _c_int(i, f"{type(self).__name__}.{method}", "index", 0, _UINT_LIMIT, "a C unsigned int")
        if v >= count:
            raise IndexError(f"{type(self).__name__} index {v} is out of range: the list has {count} descriptors")
        return v

    # ------------------------------------------------------------------ NIXL's methods

    def getType(self) -> nixl_mem_t:
        """The memory type of the descriptors."""
        return self._mem

    def descCount(self) -> int:
        """The number of descriptors."""
        return self._n + len(self._tail)

    def isEmpty(self) -> bool:
        """Whether the list holds no descriptor."""
        return self._n == 0 and not self._tail

    def __getitem__(self, i: Any) -> tuple:
        if type(i) is int and 0 <= i < self._n:   # the common case, checked cheaply
            row = tuple(self._rows[i].tolist())
            return row if self._extra is None else row + (self._extra[i],)
        v = self._position(i, "__getitem__")
        if v < self._n:
            row = tuple(self._rows[v].tolist())
        else:
            row = tuple(self._tail[v - self._n])
        return row if self._extra is None else row + (self._extra[v],)

    def __setitem__(self, i: Any, desc: Any) -> None:
        if not isinstance(desc, tuple):
            raise TypeError(f"{type(self).__name__}.__setitem__ takes a tuple {self._SHAPE}, not {type(desc).__name__}")
        v = self._position(i, "__setitem__")
        triple, extra = self._one(desc, "__setitem__")
        self._sync()
        self._rows[v] = triple
        if self._extra is not None:
            self._extra[v] = extra

    def addDesc(self, desc: Any, /) -> None:
        """Appends one descriptor tuple."""
        triple, extra = self._one(desc, "addDesc")
        self._tail.append(triple)
        if self._extra is not None:
            self._extra.append(extra)

    def append(self, desc: Any, /) -> None:
        """Appends one descriptor tuple (the same as addDesc)."""
        triple, extra = self._one(desc, "append")
        self._tail.append(triple)
        if self._extra is not None:
            self._extra.append(extra)

    def remDesc(self, i: Any, /) -> None:
        """Removes the descriptor at index ``i``; those after it move down one place."""
        where = f"{type(self).__name__}.remDesc"
        v = _c_int(i, where, "index", _INT_MIN, _INT_LIMIT, "a C int")
        self._sync()
        n = self._n
        if not 0 <= v < n:
            raise IndexError(f"{where}: index {v} is out of range: the list has {n} descriptors")
        self._rows[v:n - 1] = self._rows[v + 1:n].copy()
        self._n = n - 1
        if self._extra is not None:
            del self._extra[v]

    def clear(self) -> None:
        """Removes every descriptor (the memory type stays)."""
        self._adopt(np.zeros((0, 3), dtype=np.uint64), None)

    def print(self) -> None:
        """Writes ``DescList of mem type N`` to stdout, as NIXL does; the descriptors go to
        this module's logger at INFO level (NIXL logs them at INFO too)."""
        print(f"DescList of mem type {int(self._mem)}", flush=True)
        if _log.isEnabledFor(logging.INFO):
            for i, (a, ln, dev) in enumerate(self._triples().tolist()):
                _log.info("Desc (%d, %d) from devID %d%s", a, ln, dev, self._describe_extra(i))

    def _describe_extra(self, i: int) -> str:
        return ""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self._FAMILY):
            return NotImplemented
        assert isinstance(other, _DescList)
        return (
            self._mem == other._mem
            and self.descCount() == other.descCount()
            and bool(np.array_equal(self._triples(), other._triples()))
            and self._extra == other._extra
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, so unhashable (as in NIXL)

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> bytes:
        n = self.descCount()
        parts = [
            _SERDES_HEADER,
            _entry(b"nixlDList", self._SERDES_KIND),
            _entry(b"t", _I32.pack(int(self._mem))),
            _entry(b"n", _U64.pack(n)),
        ]
        if n:
            parts.append(self._serialize_rows())
        return b"".join(parts)

    def _serialize_rows(self) -> bytes:
        raise NotImplementedError  # pragma: no cover

    def __setstate__(self, state: Any) -> None:
        name = type(self).__name__
        if not isinstance(state, (bytes, bytearray, memoryview)):
            raise TypeError(f"{name}.__setstate__ takes the bytes __getstate__ returns, not {type(state).__name__}")
        r = _Reader(bytes(state), name)
        r.expect(_SERDES_HEADER)
        kind = r.take(b"nixlDList")
        if kind != self._SERDES_KIND:
            r.fail(f"it holds a {kind.decode('latin-1')!r} list, not a {self._SERDES_KIND.decode()!r} one")
        raw_type = r.take(b"t")
        if len(raw_type) != 4:
            r.fail("the memory type entry is not 4 bytes long")
        (type_value,) = _I32.unpack(raw_type)
        if type_value not in nixl_mem_t._value2member_map_:
            r.fail(f"unknown memory type {type_value}")
        raw_n = r.take(b"n")
        if len(raw_n) != 8:
            r.fail("the count entry is not 8 bytes long")
        (n,) = _U64.unpack(raw_n)
        rows, extra = self._deserialize_rows(r, n) if n else (np.zeros((0, 3), dtype=np.uint64), None)
        if r.pos != len(r.data):
            r.fail(f"{len(r.data) - r.pos} unexpected bytes after the descriptors")
        self._mem = nixl_mem_t(type_value)
        self._adopt(rows, extra)

    def _deserialize_rows(self, r: _Reader, n: int) -> Tuple[np.ndarray, Optional[List[Any]]]:
        raise NotImplementedError  # pragma: no cover

    # ------------------------------------------------------------------ for the NIXL face

    def _triples(self) -> np.ndarray:
        """The (addr, len, devID) rows as a read-only N x 3 uint64 C-contiguous view,
        valid until the list next changes."""
        self._sync()
        view = self._rows[:self._n]
        view.flags.writeable = False
        return view


class _Indexed:
    """``index``, which nixlXferDList and nixlRegDList have and nixlRemoteDList lacks."""

    __slots__ = ()

    def index(self, desc: Any, /) -> int:
        """The index of the first descriptor equal to ``desc`` in (addr, len, devID) (a
        nixlRegDList's metaInfo is not compared); nixlNotFoundError if there is none."""
        assert isinstance(self, _DescList)
        (a, ln, dev), _ = self._one(desc, "index")
        rows = self._triples()
        hits = np.flatnonzero((rows[:, 0] == a) & (rows[:, 1] == ln) & (rows[:, 2] == dev))
        if not len(hits):
            raise nixlNotFoundError(f"descriptor {(a, ln, dev)} is not in this {type(self).__name__}")
        return int(hits[0])


class nixlXferDList(_Indexed, _DescList):
    """NIXL's transfer descriptor list: (addr, len, devID) descriptors of one memory type.

    ``nixlXferDList(type, init_size=0)`` (zeroed descriptors) or ``nixlXferDList(type,
    descs)`` with descs a list of 3-tuples or a C-contiguous N x 3 uint64 / int64 array.
    """

    __slots__ = ()
    _SERDES_KIND = b"nixlBDList"

    def _serialize_rows(self) -> bytes:
        return _entry(b"", self._triples().astype("<u8", copy=False).tobytes())

    def _deserialize_rows(self, r: _Reader, n: int) -> Tuple[np.ndarray, Optional[List[Any]]]:
        data = r.take(b"")
        if len(data) != n * _ROW_BYTES:
            r.fail(f"{len(data)} bytes of descriptors for a count of {n}")
        return np.frombuffer(data, dtype="<u8").astype(np.uint64).reshape(n, 3), None


class nixlRegDList(_Indexed, _DescList):
    """NIXL's registration descriptor list: (addr, len, devID, metaInfo) descriptors of
    one memory type; metaInfo is given as str or bytes and read back as bytes.

    ``nixlRegDList(type, init_size=0)`` or ``nixlRegDList(type, descs)`` with descs a
    list of 4-tuples or a C-contiguous N x 3 uint64 / int64 array (empty metaInfo).
    """

    __slots__ = ()
    _WIDTH = 4
    _SHAPE = "(addr, len, devID, metaInfo)"
    _SERDES_KIND = b"nixlSDList"
    _EMPTY_EXTRA = b""

    def _extras(self, values: List[Any], where: str) -> List[Any]:
        kinds = set(map(type, values))
        if kinds <= {bytes}:
            return values
        if kinds == {str}:
            try:
                return list(map(str.encode, values))
            except UnicodeEncodeError:
                pass
        return [_blob(v, f"{where}: descriptor {i}") for i, v in enumerate(values)]

    def _extra_of(self, value: Any, where: str) -> Any:
        return _blob(value, where)

    def _describe_extra(self, i: int) -> str:
        return ", Metadata: " + self._fourths[i].decode("utf-8", "backslashreplace")

    def trim(self) -> nixlXferDList:
        """A nixlXferDList of the same descriptors, without their metaInfo."""
        out = nixlXferDList.__new__(nixlXferDList)
        out._mem = self._mem
        out._adopt(self._triples().copy(), None)
        return out

    def _serialize_rows(self) -> bytes:
        rows = self._triples()
        metas = self._fourths
        if not any(metas):
            records = np.empty(len(rows), dtype=_BLOB_RECORD)
            records["len"] = _ROW_BYTES
            records["row"] = rows
            records["bar"] = b"|"
            return records.tobytes()
        raw = rows.astype("<u8", copy=False).tobytes()
        return b"".join(
            _U64.pack(_ROW_BYTES + len(m)) + raw[i * _ROW_BYTES:(i + 1) * _ROW_BYTES] + m + b"|"
            for i, m in enumerate(metas)
        )

    def _deserialize_rows(self, r: _Reader, n: int) -> Tuple[np.ndarray, Optional[List[Any]]]:
        rest = r.data[r.pos:]
        if len(rest) == n * _BLOB_RECORD.itemsize:   # maybe all metaInfo empty: one pass
            records = np.frombuffer(rest, dtype=_BLOB_RECORD)
            if (records["len"] == _ROW_BYTES).all() and (records["bar"] == b"|").all():
                r.pos = len(r.data)
                return np.ascontiguousarray(records["row"], dtype=np.uint64), None
        rows = np.empty((n, 3), dtype=np.uint64)
        metas = []
        for i in range(n):
            data = r.take(b"")
            if len(data) < _ROW_BYTES:
                r.fail(f"descriptor {i} is {len(data)} bytes long, less than {_ROW_BYTES}")
            rows[i] = np.frombuffer(data, dtype="<u8", count=3)
            metas.append(data[_ROW_BYTES:])
        return rows, metas

    def _metas(self) -> List[bytes]:
        """The metaInfo of every descriptor, in order."""
        return list(self._fourths)


class nixlRemoteDList(_DescList):
    """NIXL's remote descriptor list: (addr, len, devID, agent_name) descriptors of one
    memory type, each naming the remote agent it lies in (read back as str).

    ``nixlRemoteDList(type, init_size=0)`` or ``nixlRemoteDList(type, descs)`` with
    descs a list of 4-tuples. As in NIXL it has no ``index`` and cannot be pickled.
    """

    __slots__ = ()
    _WIDTH = 4
    _SHAPE = "(addr, len, devID, agent_name)"
    _ARRAYS = False
    _EMPTY_EXTRA = ""

    def _extras(self, values: List[Any], where: str) -> List[Any]:
        if set(map(type, values)) == {str}:
            try:
                for v in set(values):
                    v.encode("utf-8")
                return values
            except UnicodeEncodeError:
                pass
        return [_agent(v, f"{where}: descriptor {i}") for i, v in enumerate(values)]

    def _extra_of(self, value: Any, where: str) -> Any:
        return _agent(value, where)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"cannot pickle {type(self).__name__!r} object (NIXL's remote lists are not picklable)")

    def __getstate__(self) -> bytes:
        raise TypeError(f"cannot pickle {type(self).__name__!r} object (NIXL's remote lists are not picklable)")

    def __setstate__(self, state: Any) -> None:
        raise TypeError(f"{type(self).__name__} cannot be unpickled (NIXL's remote lists are not picklable)")

    def _agents(self) -> List[str]:
        """The remote agent name of every descriptor, in order."""
        return list(self._fourths)


nixlXferDList._FAMILY = nixlXferDList
nixlRegDList._FAMILY = nixlRegDList
nixlRemoteDList._FAMILY = nixlRemoteDList
