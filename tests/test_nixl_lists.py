"""freight.nixl's descriptor lists (nixlXferDList, nixlRegDList, nixlRemoteDList).

The expected values and exception types below are NIXL 1.5.1's observed behaviour
(``nixl._bindings``, probed on CPU), written in so that no NIXL install is needed here.
Where NIXL reads or writes out of bounds or leaves memory uninitialised, the tests
assert freight's documented choice instead (IndexError, zeros); those tests say so.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections import namedtuple

import numpy as np
import pytest

from freight.nixl._lists import nixlRegDList, nixlRemoteDList, nixlXferDList
from freight.nixl._types import nixl_mem_t, nixlNotFoundError

DRAM, VRAM, BLK, OBJ, FILE = (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG, nixl_mem_t.BLK_SEG,
                              nixl_mem_t.OBJ_SEG, nixl_mem_t.FILE_SEG)
U64_MAX = 2**64 - 1
Desc3 = namedtuple("Desc3", "addr len dev")


def items(dl):
    return [dl[i] for i in range(dl.descCount())]


def xfer():
    return nixlXferDList(DRAM, [(1, 2, 3), (4, 5, 6)])


def reg():
    return nixlRegDList(DRAM, [(1, 2, 3, "a"), (4, 5, 6, b"b\x00c")])


def remote():
    return nixlRemoteDList(DRAM, [(1, 2, 3, "agentA"), (4, 5, 6, "agentB")])


# NIXL 1.5.1's __getstate__ for xfer(), reg() and nixlXferDList(FILE_SEG), byte for byte.
def _u64(v):
    return v.to_bytes(8, "little")


def _head(kind, mem, n):
    return (b"nixlSerDes|nixlDList" + _u64(10) + kind + b"|t" + _u64(4) + mem.to_bytes(4, "little")
            + b"|n" + _u64(8) + _u64(n) + b"|")


XFER_STATE = _head(b"nixlBDList", 0, 2) + _u64(48) + b"".join(map(_u64, (1, 2, 3, 4, 5, 6))) + b"|"
REG_STATE = (_head(b"nixlSDList", 0, 2)
             + _u64(25) + b"".join(map(_u64, (1, 2, 3))) + b"a|"
             + _u64(27) + b"".join(map(_u64, (4, 5, 6))) + b"b\x00c|")
EMPTY_FILE_STATE = _head(b"nixlBDList", 4, 0)


def test_the_expected_states_are_nixls_literal_bytes():
    """A spot check of the helper above against a prefix NIXL printed."""
    assert XFER_STATE.startswith(
        b"nixlSerDes|nixlDList\n\x00\x00\x00\x00\x00\x00\x00nixlBDList|t\x04\x00\x00\x00\x00\x00\x00\x00"
        b"\x00\x00\x00\x00|n\x08\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00|0\x00")


# --------------------------------------------------------------------------- construction


def test_construct_from_tuples_and_read_back():
    d = xfer()
    assert d.descCount() == 2
    assert d[0] == (1, 2, 3) and d[1] == (4, 5, 6)
    assert type(d[0]) is tuple and all(type(v) is int for v in d[1])
    assert d.getType() is DRAM and isinstance(d.getType(), nixl_mem_t)
    assert not d.isEmpty()


def test_constructor_forms_and_keywords():
    assert nixlXferDList(DRAM).isEmpty()
    assert nixlXferDList(type=FILE).getType() is FILE
    assert nixlXferDList(DRAM, init_size=0).descCount() == 0
    assert items(nixlXferDList(type=VRAM, descs=[(7, 8, 9)])) == [(7, 8, 9)]
    assert items(nixlXferDList(DRAM, descs=np.array([[7, 8, 9]], dtype=np.uint64))) == [(7, 8, 9)]
    assert items(nixlRegDList(DRAM, descs=[(7, 8, 9, "m")])) == [(7, 8, 9, b"m")]
    assert items(nixlRemoteDList(type=OBJ, descs=[(7, 8, 9, "a")])) == [(7, 8, 9, "a")]
    assert nixlXferDList(DRAM, np.int64(2)).descCount() == 2     # init_size through __index__


def test_init_size_gives_zeroed_descriptors():
    """NIXL leaves these uninitialised (garbage addresses); freight zeroes them. NIXL's
    registration and remote lists are zeroed too: (0, 0, 0, b'') and (0, 0, 0, '')."""
    assert items(nixlXferDList(DRAM, 3)) == [(0, 0, 0)] * 3
    assert items(nixlRegDList(DRAM, 2)) == [(0, 0, 0, b"")] * 2
    assert items(nixlRemoteDList(DRAM, init_size=1)) == [(0, 0, 0, "")]


@pytest.mark.parametrize("mem", [0, 1, True, None, "DRAM", 1.0])
def test_memory_type_must_be_nixl_mem_t(mem):
    """NIXL rejects plain ints (and anything but nixl_mem_t) with TypeError."""
    for cls in (nixlXferDList, nixlRegDList, nixlRemoteDList):
        with pytest.raises(TypeError, match="nixl_mem_t"):
            cls(mem)
        with pytest.raises(TypeError, match="nixl_mem_t"):
            cls(mem, [])


@pytest.mark.parametrize("args,kwargs", [
    ((), {}),
    ((DRAM, ()), {}),                                # a tuple of tuples is not a list
    ((DRAM, ((1, 2, 3),)), {}),
    ((DRAM, ((1, 2, 3) for _ in range(1))), {}),     # nor a generator
    ((DRAM, nixlXferDList(DRAM, [(1, 2, 3)])), {}),  # nor another list
    ((DRAM, [(1, 2, 3)]), {"sorted": True}),
    ((DRAM, [(1, 2, 3)], False), {}),
    ((DRAM, [(1, 2, 3)]), {"descs": [(1, 2, 3)]}),
    ((DRAM,), {"init_size": [(1, 2, 3)]}),
    ((DRAM, 3.0), {}),
    ((DRAM, 2**31), {}),                             # init_size is a C int
    ((DRAM,), {"type": DRAM}),
])
def test_constructor_signature_errors(args, kwargs):
    with pytest.raises(TypeError):
        nixlXferDList(*args, **kwargs)


def test_negative_init_size():
    with pytest.raises(ValueError, match="-1"):
        nixlXferDList(DRAM, -1)


def test_list_elements_must_be_tuples_of_the_right_length():
    with pytest.raises(TypeError, match="descriptor 1 must be a tuple"):
        nixlXferDList(DRAM, [(1, 2, 3), [4, 5, 6]])
    with pytest.raises(TypeError, match="descriptor 0"):
        nixlXferDList(DRAM, [5])
    for bad in [(1, 2), (1, 2, 3, 4)]:
        with pytest.raises(ValueError, match="descriptor 1 has"):
            nixlXferDList(DRAM, [(1, 2, 3), bad])
    for bad in [(1, 2, 3), (1, 2, 3, "", 5)]:
        with pytest.raises(ValueError):
            nixlRegDList(DRAM, [bad])
        with pytest.raises(ValueError):
            nixlRemoteDList(DRAM, [bad])
    with pytest.raises(TypeError):
        nixlRegDList(DRAM, [[1, 2, 3, ""]])
    with pytest.raises(TypeError):
        nixlRemoteDList(DRAM, [[1, 2, 3, "a"]])


@pytest.mark.parametrize("value,shown", [
    (-1, "-1"), (2**64, str(2**64)), (1.5, "1.5"), (2.0, "2.0"), ("1", "'1'"), (None, "None"),
    (np.int64(-3), "-3"), (b"1", "b'1'"),
])
@pytest.mark.parametrize("field", [0, 1, 2])
def test_bad_field_values_raise_runtime_error_naming_them(value, shown, field):
    """NIXL's argument conversion fails with RuntimeError for negative, too large or
    non-integer fields."""
    desc = [5, 6, 7]
    desc[field] = value
    with pytest.raises(RuntimeError, match=("addr", "len", "devID")[field]) as e:
        nixlXferDList(DRAM, [(1, 2, 3), tuple(desc)])
    assert shown in str(e.value) and "descriptor 1" in str(e.value)
    with pytest.raises(RuntimeError, match="descriptor 0"):
        nixlRegDList(DRAM, [tuple(desc) + ("m",)])
    with pytest.raises(RuntimeError):
        nixlRemoteDList(DRAM, [tuple(desc) + ("a",)])
    with pytest.raises(RuntimeError, match=shown.replace("(", r"\(")):
        xfer().addDesc(tuple(desc))


def test_integer_like_fields_are_accepted():
    d = nixlXferDList(DRAM, [(np.int64(1), np.uint64(U64_MAX), np.int32(3)), (True, False, 1), Desc3(7, 8, 9)])
    assert items(d) == [(1, U64_MAX, 3), (1, 0, 1), (7, 8, 9)]
    assert items(nixlXferDList(DRAM, [(U64_MAX, U64_MAX, U64_MAX)])) == [(U64_MAX,) * 3]
    ListSub = type("ListSub", (list,), {})
    assert items(nixlXferDList(DRAM, ListSub([(1, 2, 3)]))) == [(1, 2, 3)]


def test_construct_from_numpy():
    a = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)
    d = nixlXferDList(VRAM, a)
    assert d == nixlXferDList(VRAM, [(1, 2, 3), (4, 5, 6)])
    a[0, 0] = 99                                     # the list holds a copy
    assert d[0] == (1, 2, 3)
    # int64 rows are taken bit for bit (NIXL copies the memory): -3 reads as 2**64 - 3.
    assert nixlXferDList(DRAM, np.array([[1, 2, -3]], dtype=np.int64))[0] == (1, 2, 2**64 - 3)
    assert nixlXferDList(DRAM, np.zeros((0, 3), dtype=np.uint64)).isEmpty()
    assert items(nixlRegDList(DRAM, a)) == [(99, 2, 3, b""), (4, 5, 6, b"")]


@pytest.mark.parametrize("arr,match", [
    (np.zeros((2, 5), np.uint64), "N x 3"),
    (np.zeros(6, np.uint64), "N x 3"),
    (np.zeros((2, 3, 1), np.uint64), "N x 3"),
    (np.zeros((2, 3), np.int32), "uint64 or int64"),
    (np.zeros((2, 3), np.uint32), "uint64 or int64"),
    (np.zeros((2, 3), np.float64), "uint64 or int64"),
    (np.zeros((2, 3), object), "uint64 or int64"),
    (np.zeros((2, 3), ">u8"), "uint64 or int64"),
    (np.asfortranarray(np.arange(6, dtype=np.uint64).reshape(2, 3)), "C-contiguous"),
    (np.arange(12, dtype=np.uint64).reshape(2, 6)[:, ::2], "C-contiguous"),
    (np.arange(9, dtype=np.uint64).reshape(3, 3).T, "C-contiguous"),
])
def test_bad_numpy_arrays_raise_value_error(arr, match):
    """NIXL takes only C-contiguous N x 3 uint64 / int64 arrays, with ValueError otherwise."""
    with pytest.raises(ValueError, match=match):
        nixlXferDList(DRAM, arr)
    with pytest.raises(ValueError, match=match):
        nixlRegDList(DRAM, arr)


def test_remote_lists_take_no_numpy_array():
    with pytest.raises(TypeError, match="numpy"):
        nixlRemoteDList(DRAM, np.zeros((1, 3), np.uint64))


def test_registration_lists_take_no_transfer_list():
    with pytest.raises(TypeError):
        nixlRegDList(DRAM, xfer())


# --------------------------------------------------------------------------- indexing


def test_getitem_index_types():
    d = xfer()
    assert d[np.int64(1)] == (4, 5, 6)
    assert d[True] == (4, 5, 6)
    for bad in (-1, 1.0, slice(0, 1), "a", 2**32):     # NIXL: TypeError (unsigned int index)
        with pytest.raises(TypeError):
            d[bad]
    with pytest.raises(TypeError):
        reg()[-1]


def test_getitem_past_the_end_raises_index_error():
    """NIXL reads past its vector here (garbage or a crash); freight raises IndexError."""
    for d in (xfer(), reg(), remote()):
        with pytest.raises(IndexError, match="out of range"):
            d[2]
    with pytest.raises(IndexError):
        nixlXferDList(DRAM)[0]


def test_iteration_and_membership():
    """Iteration runs through __getitem__ until IndexError (NIXL crashes instead)."""
    assert list(xfer()) == [(1, 2, 3), (4, 5, 6)]
    assert list(reg()) == [(1, 2, 3, b"a"), (4, 5, 6, b"b\x00c")]
    assert list(remote()) == [(1, 2, 3, "agentA"), (4, 5, 6, "agentB")]
    assert (4, 5, 6) in xfer() and (4, 5, 7) not in xfer()
    assert list(nixlXferDList(DRAM)) == []


def test_no_len_and_always_true():
    """NIXL's lists have no __len__ (so they are always true); descCount() counts."""
    with pytest.raises(TypeError):
        len(xfer())
    assert bool(nixlXferDList(DRAM)) is True


def test_setitem():
    d = xfer()
    d[1] = (7, 8, 9)
    assert items(d) == [(1, 2, 3), (7, 8, 9)]
    d[0] = (10, 11, 12, 13)                          # extra elements are ignored, as in NIXL
    assert d[0] == (10, 11, 12)
    r = reg()
    r[0] = (7, 8, 9, "z")
    assert items(r) == [(7, 8, 9, b"z"), (4, 5, 6, b"b\x00c")]
    m = remote()
    m[1] = (5, 6, 7, b"c")
    assert m[1] == (5, 6, 7, "c")


def test_setitem_errors():
    d = xfer()
    with pytest.raises(TypeError):
        d[-1] = (7, 8, 9)
    with pytest.raises(TypeError):
        d[0] = [7, 8, 9]
    with pytest.raises(IndexError):
        d[0] = (7, 8)
    with pytest.raises(RuntimeError, match="devID"):
        d[0] = (7, 8, -9)
    with pytest.raises(IndexError):                  # NIXL writes out of bounds here
        d[2] = (7, 8, 9)
    with pytest.raises(AttributeError):
        del d[0]
    assert items(d) == [(1, 2, 3), (4, 5, 6)]


# --------------------------------------------------------------------------- methods


def test_add_desc_and_append():
    d = xfer()
    assert d.addDesc((7, 8, 9)) is None
    assert d.append((1, 2, 3)) is None               # duplicates are kept
    d.addDesc(Desc3(10, 11, 12))
    d.addDesc((np.uint64(U64_MAX), 0, 0))
    d.addDesc((13, 14, 15, "ignored"))
    assert items(d) == [(1, 2, 3), (4, 5, 6), (7, 8, 9), (1, 2, 3), (10, 11, 12), (U64_MAX, 0, 0), (13, 14, 15)]
    assert d.descCount() == 7


def test_add_desc_errors():
    d = xfer()
    with pytest.raises(TypeError, match="tuple"):
        d.addDesc([7, 8, 9])
    with pytest.raises(IndexError):
        d.addDesc((7, 8))
    with pytest.raises(RuntimeError, match="len"):
        d.addDesc((7, 8.0, 9))
    with pytest.raises(TypeError):
        d.addDesc(desc=(7, 8, 9))
    with pytest.raises(TypeError):
        d.addDesc()
    with pytest.raises(IndexError):
        reg().addDesc((7, 8, 9))
    with pytest.raises(RuntimeError, match="metaInfo"):
        reg().append((7, 8, 9, None))
    with pytest.raises(RuntimeError, match="agent name"):
        remote().addDesc((7, 8, 9, 5))
    assert items(d) == [(1, 2, 3), (4, 5, 6)]


def test_rem_desc():
    d = nixlXferDList(DRAM, [(i, i, i) for i in range(5)])
    assert d.remDesc(1) is None
    d.remDesc(np.int64(3))
    assert items(d) == [(0, 0, 0), (2, 2, 2), (3, 3, 3)]
    r = reg()
    r.remDesc(0)
    assert items(r) == [(4, 5, 6, b"b\x00c")]
    m = remote()
    m.remDesc(1)
    assert items(m) == [(1, 2, 3, "agentA")]


def test_rem_desc_errors():
    d = xfer()
    for i in (2, -1):
        with pytest.raises(IndexError, match="out of range"):
            d.remDesc(i)
    for bad in (2**40, 1.0, None):
        with pytest.raises(TypeError):
            d.remDesc(bad)
    with pytest.raises(TypeError):
        d.remDesc()
    assert items(d) == [(1, 2, 3), (4, 5, 6)]


def test_clear_and_is_empty():
    for d in (xfer(), reg(), remote()):
        assert d.clear() is None
        assert d.isEmpty() and d.descCount() == 0 and d.getType() is DRAM
        assert d == type(d)(DRAM)
    d = xfer()
    d.clear()
    d.addDesc((9, 9, 9))
    assert items(d) == [(9, 9, 9)]


def test_index():
    d = nixlXferDList(DRAM, [(1, 2, 3), (4, 5, 6), (1, 2, 3)])
    assert d.index((1, 2, 3)) == 0                   # the first match
    assert d.index((4, 5, 6)) == 1
    assert d.index(Desc3(4, 5, 6)) == 1
    assert d.index((np.uint64(4), 5, 6, "extra")) == 1
    with pytest.raises(nixlNotFoundError, match=r"\(4, 5, 7\)"):
        d.index((4, 5, 7))
    with pytest.raises(TypeError):
        d.index([4, 5, 6])
    with pytest.raises(IndexError):
        d.index((4, 5))
    with pytest.raises(RuntimeError):
        d.index((-4, 5, 6))


def test_registration_index_ignores_meta_info():
    """NIXL compares only (addr, len, devID), but the metaInfo must still be str/bytes."""
    r = reg()
    assert r.index((4, 5, 6, b"b\x00c")) == 1
    assert r.index((4, 5, 6, "anything")) == 1
    with pytest.raises(IndexError):
        r.index((4, 5, 6))
    with pytest.raises(RuntimeError):
        r.index((4, 5, 6, None))
    with pytest.raises(nixlNotFoundError):
        r.index((4, 5, 7, ""))


def test_remote_lists_have_no_index_nor_trim():
    assert not hasattr(remote(), "index")
    assert not hasattr(remote(), "trim")
    assert not hasattr(xfer(), "trim")


def test_trim():
    r = nixlRegDList(VRAM, [(1, 2, 3, "x"), (4, 5, 6, b"")])
    t = r.trim()
    assert type(t) is nixlXferDList
    assert t.getType() is VRAM
    assert items(t) == [(1, 2, 3), (4, 5, 6)]
    r[0] = (9, 9, 9, "y")                            # the trimmed list is a copy
    assert t[0] == (1, 2, 3)
    assert nixlRegDList(FILE).trim() == nixlXferDList(FILE)


def test_meta_info_conversions():
    r = nixlRegDList(DRAM, [(1, 2, 3, "é"), (1, 2, 3, bytearray(b"x")), (1, 2, 3, b"\xff")])
    assert [m for *_, m in items(r)] == [b"\xc3\xa9", b"x", b"\xff"]
    assert all(type(m) is bytes for m in r._metas())
    for bad in ("\udcff", None, 5):
        with pytest.raises(RuntimeError, match="metaInfo"):
            nixlRegDList(DRAM, [(1, 2, 3, "ok"), (1, 2, 3, bad)])


def test_agent_names():
    m = nixlRemoteDList(DRAM, [(1, 2, 3, b"bytes-name"), (4, 5, 6, "str-name")])
    assert items(m) == [(1, 2, 3, "bytes-name"), (4, 5, 6, "str-name")]
    assert m._agents() == ["bytes-name", "str-name"]
    for bad in (7, None, b"\xff"):
        with pytest.raises(RuntimeError, match="agent name"):
            nixlRemoteDList(DRAM, [(1, 2, 3, bad)])


# --------------------------------------------------------------------------- equality


def test_equality():
    assert xfer() == xfer() and not (xfer() != xfer())
    assert xfer() != nixlXferDList(VRAM, [(1, 2, 3), (4, 5, 6)])       # memory type counts
    assert xfer() != nixlXferDList(DRAM, [(4, 5, 6), (1, 2, 3)])       # so does order
    assert xfer() != nixlXferDList(DRAM, [(1, 2, 3)])
    assert xfer() != 5 and xfer() != [(1, 2, 3), (4, 5, 6)]
    assert xfer() != nixlRegDList(DRAM, [(1, 2, 3, ""), (4, 5, 6, "")])  # other class
    assert reg() == reg()
    assert reg() != nixlRegDList(DRAM, [(1, 2, 3, "a"), (4, 5, 6, b"b")])  # metaInfo counts
    assert remote() == remote()
    assert remote() != nixlRemoteDList(DRAM, [(1, 2, 3, "agentA"), (4, 5, 6, "agentC")])
    assert nixlRemoteDList(DRAM) != nixlXferDList(DRAM)
    with pytest.raises(TypeError):
        xfer() < xfer()


def test_unhashable_and_slotted():
    for d in (xfer(), reg(), remote()):
        with pytest.raises(TypeError):
            hash(d)
        with pytest.raises(AttributeError):
            d.foo = 1


def test_numpy_and_tuple_construction_agree_after_appends():
    a = nixlXferDList(DRAM, np.array([[1, 2, 3]], dtype=np.uint64))
    a.addDesc((4, 5, 6))
    b = nixlXferDList(DRAM)
    b.append((1, 2, 3))
    b.append((4, 5, 6))
    assert a == b == xfer()


def test_subclasses():
    Sub = type("Sub", (nixlXferDList,), {})
    s = Sub(DRAM, [(1, 2, 3), (4, 5, 6)])
    assert s == xfer() and isinstance(s, nixlXferDList)
    assert not isinstance(reg(), nixlXferDList) and not isinstance(xfer(), nixlRegDList)


# --------------------------------------------------------------------------- pickling


def test_getstate_is_nixls_serialisation():
    assert xfer().__getstate__() == XFER_STATE
    assert reg().__getstate__() == REG_STATE
    assert nixlXferDList(FILE).__getstate__() == EMPTY_FILE_STATE
    # Registration descriptors from numpy (empty metaInfo) take the vectorised path.
    empty_meta = nixlRegDList(OBJ, np.array([[7, 8, 9]], dtype=np.uint64)).__getstate__()
    assert empty_meta == _head(b"nixlSDList", 3, 1) + _u64(24) + b"".join(map(_u64, (7, 8, 9))) + b"|"


def test_setstate_reads_nixls_serialisation():
    d = nixlXferDList.__new__(nixlXferDList)
    d.__setstate__(XFER_STATE)
    assert d == xfer()
    r = nixlRegDList.__new__(nixlRegDList)
    r.__setstate__(REG_STATE)
    assert r == reg()
    e = nixlXferDList.__new__(nixlXferDList)
    e.__setstate__(EMPTY_FILE_STATE)
    assert e.getType() is FILE and e.isEmpty()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(protocol):
    """NIXL pickles with protocols 2 and up (0 and 1 abort its process); all work here."""
    for d in (xfer(), reg(), nixlXferDList(OBJ), nixlRegDList(BLK, 2)):
        back = pickle.loads(pickle.dumps(d, protocol))
        assert type(back) is type(d) and back == d and back.getType() is d.getType()
    assert copy.copy(xfer()) == xfer()
    assert copy.deepcopy(reg()) == reg()


def test_bad_states_raise_value_error():
    """NIXL logs and yields an empty list for these; freight refuses them."""
    for state in (b"", b"garbage", XFER_STATE[:-5], XFER_STATE + b"x", REG_STATE):
        with pytest.raises(ValueError):
            nixlXferDList.__new__(nixlXferDList).__setstate__(state)
    with pytest.raises(ValueError, match="nixlBDList"):
        nixlRegDList.__new__(nixlRegDList).__setstate__(XFER_STATE)
    bad_type = XFER_STATE.replace(b"t\x04" + bytes(7) + b"\x00", b"t\x04" + bytes(7) + b"\x09", 1)
    with pytest.raises(ValueError, match="memory type 9"):
        nixlXferDList.__new__(nixlXferDList).__setstate__(bad_type)
    with pytest.raises(TypeError):
        nixlXferDList.__new__(nixlXferDList).__setstate__("text")


def test_remote_lists_cannot_be_pickled():
    for f in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="pickle"):
            f(remote())


# --------------------------------------------------------------------------- printing


def test_print(capsys, caplog):
    """NIXL prints the header to stdout and logs each descriptor at INFO."""
    caplog.set_level(logging.INFO, logger="freight.nixl._lists")
    assert nixlRegDList(DRAM, [(1, 2, 3, "a"), (4, 5, 6, b"b\xffc")]).print() is None
    nixlXferDList(VRAM, [(1, 2, 3)]).print()
    nixlRemoteDList(FILE).print()
    assert capsys.readouterr().out == "DescList of mem type 0\nDescList of mem type 1\nDescList of mem type 4\n"
    assert [r.getMessage() for r in caplog.records] == [
        "Desc (1, 2) from devID 3, Metadata: a",
        "Desc (4, 5) from devID 6, Metadata: b\\xffc",   # bytes that are not UTF-8 escaped
        "Desc (1, 2) from devID 3",
    ]


def test_repr_is_the_default_object_repr():
    assert repr(xfer()).startswith("<freight.nixl._lists.nixlXferDList object at 0x")
    assert str(remote()).startswith("<freight.nixl._lists.nixlRemoteDList object at 0x")


# --------------------------------------------------------------------------- large lists and helpers


N = 65536


def big_rows(n=N):
    rng = np.random.default_rng(1)
    return rng.integers(0, U64_MAX, size=(n, 3), dtype=np.uint64, endpoint=True)


def test_large_lists_from_numpy_and_tuples_agree():
    arr = big_rows()
    tuples = [tuple(r) for r in arr.tolist()]
    a = nixlXferDList(VRAM, arr)
    b = nixlXferDList(VRAM, tuples)
    assert a == b and a.descCount() == N
    assert a.__getstate__() == b.__getstate__()
    assert a[N - 1] == tuples[-1] and b[12345] == tuples[12345]
    r = nixlRegDList(VRAM, [t + (b"",) for t in tuples])
    assert r == nixlRegDList(VRAM, arr) and r.trim() == a
    assert a.index(tuples[40000]) == 40000


def test_triples_view():
    arr = big_rows(1000)
    d = nixlXferDList(DRAM, arr)
    t = d._triples()
    assert t.dtype == np.uint64 and t.shape == (1000, 3) and t.flags.c_contiguous
    assert np.array_equal(t, arr)
    with pytest.raises(ValueError):
        t[0, 0] = 1                                  # read-only
    d.addDesc((1, 2, 3))                             # appends show in the next view
    assert d._triples().shape == (1001, 3) and tuple(d._triples()[-1]) == (1, 2, 3)
    d.remDesc(0)
    assert np.array_equal(d._triples()[:999], arr[1:])
    assert nixlXferDList(DRAM)._triples().shape == (0, 3)
    assert np.array_equal(remote()._triples(), [[1, 2, 3], [4, 5, 6]])


def test_many_appends_grow_and_stay_in_order():
    arr = big_rows(70000)
    d = nixlXferDList(DRAM, arr[:10])
    r = nixlRegDList(DRAM)
    for i, row in enumerate(arr[10:].tolist()):
        d.append(tuple(row))
        if i % 7 == 0:
            r.addDesc(tuple(row) + (str(i),))
        if i == 30000:                               # reads in between appends
            assert d[i + 10] == tuple(row) and d.descCount() == i + 11
            d[5] = (5, 5, 5)
    expected = arr.copy()
    expected[5] = (5, 5, 5)
    assert np.array_equal(d._triples(), expected)
    assert d == nixlXferDList(DRAM, expected)
    assert r.descCount() == len(range(0, 69990, 7))
    assert r._metas()[:3] == [b"0", b"7", b"14"]
    back = pickle.loads(pickle.dumps(r))
    assert back == r and back._metas() == r._metas()


def test_metas_is_a_copy():
    r = reg()
    metas = r._metas()
    assert metas == [b"a", b"b\x00c"]
    metas.append(b"x")
    assert r._metas() == [b"a", b"b\x00c"]
    assert nixlRegDList(DRAM, np.zeros((3, 3), np.uint64))._metas() == [b""] * 3
