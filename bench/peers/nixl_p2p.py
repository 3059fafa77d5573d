#!/usr/bin/env python3
"""NIXL between two processes on one host, one GPU each: the peer of freight's GPU benchmarks.

Two processes are started (multiprocessing, spawn): the initiator sees only GPU 0 and the
target only GPU 1 (CUDA_VISIBLE_DEVICES is set in each child before torch is imported).
Each creates a NIXL agent with the UCX backend (UCX_TLS=cuda_ipc,cuda_copy,tcp unless
--ucx-tls says otherwise); the initiator adds the target's metadata and measures:

  bw        prepared VRAM->VRAM transfers, WRITE and READ: 128 x 32 MiB, 2048 x 2 MiB,
            16384 x 256 KiB, 65536 x 16 KiB, 65536 x 4 KiB (at most --bytes per request);
            each twice (--order): block i to block i ("sequential", which NIXL may merge
            into fewer, larger copies) and to a random permutation of the remote blocks
            ("random", no two neighbours merge; the ceilings' kernel copies that way); each
            row says its "order"; GB/s = bytes / median post-to-DONE time of the timed
            iterations
  oneshot   128 x 32 MiB WRITE, each time: prep_xfer_dlist (both sides), make_prepped_xfer,
            post, wait (also reported: the same through initialize_xfer, as row
            "oneshot_initialize_xfer"); in each --order, like bw
  lat4k     one 4 KiB VRAM->VRAM WRITE, post to DONE at the initiator: p50 and p99
  notif4k   one 4 KiB WRITE carrying a notification: from the post at the initiator to
            the moment the target's get_new_notifs returns it (CLOCK_MONOTONIC, which both
            processes share)
  h2d       initiator DRAM (pinned) -> target VRAM, WRITE 32 x 32 MiB
  d2h       target VRAM -> initiator DRAM (pinned), READ 32 x 32 MiB

At the end a few MiB are checked byte for byte in both directions (top-level "verify").
Every measurement is one row of the JSON document written to --out:

  {"system": "nixl", "test": ..., "op": "WRITE"|"READ", "block": bytes, "count": n,
   "gbps": float|null, "p50_us": float|null, "p99_us": float|null}

A case that fails gets an "error" instead of figures; the others still run. The whole run
is bounded by --timeout: children still alive then are killed and the rows measured so far
are written.

NIXL itself is not installed: unpack the trimmed wheel (bench/peers/fetch_nixl.sh) into a
folder and pass it as --nixl-dir:

    mkdir -p /tmp/nixl && tar -xJf .carry/nixl_trim.tar.xz -C /tmp/nixl
    python3 bench/peers/nixl_p2p.py --nixl-dir /tmp/nixl --out nixl.json

--no-gpu runs the same plumbing with host memory on both sides (DRAM segments, UCX over
tcp, small sizes) to check the script on a machine without GPUs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reporting import BW_CASES, GIB, HOST_CASE, KIB, MIB, PERCENTILE, finish, host_machine, human, logger, median, percentile  # noqa: E402,F401

ONESHOT = (32 * MIB, 128)
VERIFY = 1 * MIB  # bytes checked per direction
GUARD = 3 * VERIFY  # room past the benchmark area of each buffer, used only by the checks
TRANSFER_TIMEOUT_S = 60.0


log = logger("nixl_p2p")


def pattern(seed: int, n: int):
    """Deterministic bytes, different for each seed."""
    import numpy as np

    i = np.arange(n, dtype=np.uint32) % 251
    return ((i * (2 * seed + 1) + 7 * seed) % 251).astype(np.uint8)


# ---------------------------------------------------------------------------------------
# The plan: which rows the run produces (missing ones are reported as not reached)


TESTS = ("bw", "oneshot", "lat4k", "notif4k", "h2d", "d2h")


def plan(cfg: dict) -> list[dict]:
    """The rows of the tests picked (--only), each yet to be measured."""
    return [r for r in all_rows(cfg) if r["test"].split("_")[0] in cfg["only"]]


def all_rows(cfg: dict) -> list[dict]:
    rows = []
    for order in cfg["orders"]:
        for op in ("WRITE", "READ"):
            for block, count in BW_CASES:
                rows.append(new_row("bw", op, block, min(count, cfg["bytes"] // block), order=order))
    blk, cnt = ONESHOT
    cnt = min(cnt, cfg["bytes"] // blk)
    for order in cfg["orders"]:
        rows.append(new_row("oneshot", "WRITE", blk, cnt, order=order))
        rows.append(new_row("oneshot_initialize_xfer", "WRITE", blk, cnt, order=order))
    rows.append(new_row("lat4k", "WRITE", 4 * KIB, 1))
    rows.append(new_row("notif4k", "WRITE", 4 * KIB, 1))
    blk, cnt = HOST_CASE
    cnt = min(cnt, cfg["host_bytes"] // blk)
    rows.append(new_row("h2d", "WRITE", blk, cnt, order="sequential"))
    rows.append(new_row("d2h", "READ", blk, cnt, order="sequential"))
    return rows


def new_row(test: str, op: str, block: int, count: int, **extra) -> dict:
    return {"system": "nixl", "test": test, "op": op, "block": block, "count": count,
            "gbps": None, "p50_us": None, "p99_us": None, **extra}


def row_key(r: dict) -> tuple:
    return (r["test"], r["op"], r["block"], r["count"], r.get("order"))


# ---------------------------------------------------------------------------------------
# In the children


def child_setup(cfg: dict, gpu: str) -> None:
    """Environment of a child; must run before torch or NIXL is imported."""
    if not cfg["no_gpu"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    os.environ["UCX_TLS"] = cfg["ucx_tls"]
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if cfg["nixl_dir"] not in sys.path:
        sys.path.insert(0, cfg["nixl_dir"])


class Memory:
    """Buffers of one child: torch tensors on its GPU or pinned host memory, or (--no-gpu)
    page-aligned numpy arrays. Each buffer is (object, address, segment)."""

    def __init__(self, no_gpu: bool):
        self.no_gpu = no_gpu
        if not no_gpu:
            import torch

            self.torch = torch
            torch.cuda.set_device(0)

    def alloc(self, nbytes: int, seg: str):
        if self.no_gpu:
            import numpy as np

            raw = np.zeros(nbytes + 4096, dtype=np.uint8)
            skip = (-raw.ctypes.data) % 4096
            buf = raw[skip: skip + nbytes]
            return buf, buf.ctypes.data, "DRAM"
        torch = self.torch
        if seg == "VRAM":
            buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        else:
            buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf, buf.data_ptr(), seg

    def fill(self, buf, offset: int, data) -> None:
        if self.no_gpu:
            buf[offset: offset + len(data)] = data
        else:
            buf[offset: offset + len(data)].copy_(self.torch.from_numpy(data))
            self.torch.cuda.synchronize()

    def fill_pattern(self, buf, nbytes: int, seed: int) -> None:
        """Fill the first nbytes with a pattern, 64 MiB at a time."""
        chunk = pattern(seed, 64 * MIB)
        for off in range(0, nbytes, len(chunk)):
            self.fill(buf, off, chunk[: min(len(chunk), nbytes - off)])

    def read(self, buf, offset: int, n: int):
        if self.no_gpu:
            return buf[offset: offset + n].copy()
        self.torch.cuda.synchronize()
        return buf[offset: offset + n].cpu().numpy()


def descs(addr: int, offsets, block: int):
    """Nx3 (address, length, device) descriptors; the device is 0 in each child."""
    import numpy as np

    n = len(offsets)
    return np.stack([np.uint64(addr) + offsets.astype(np.uint64), np.full(n, block, np.uint64),
                     np.zeros(n, np.uint64)], axis=1)


def register(agent, buf, addr: int, nbytes: int, seg: str) -> None:
    """Torch tensors as themselves (NIXL reads address, length, device and VRAM/DRAM from
    the tensor); numpy buffers as one (address, length, 0) descriptor."""
    import numpy as np

    if isinstance(buf, np.ndarray):
        agent.register_memory(np.array([[addr, nbytes, 0]], dtype=np.uint64), seg)
    else:
        agent.register_memory(buf)


def make_agent(name: str):
    from nixl_cu13 import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL has no UCX backend (plugins found: {agent.plugin_list})")
    return agent


def machine_of_child(no_gpu: bool) -> dict:
    if no_gpu:
        return {"gpu": None}
    import torch

    p = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(p.total_memory / GIB, 1),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda}


def target_main(cfg: dict, q_init, q_main) -> None:
    """The target: registers its buffer, hands its metadata over and records notifications."""
    try:
        child_setup(cfg, cfg["gpus"][1])
        mem = Memory(cfg["no_gpu"])
        size = cfg["bytes"]
        buf, addr, seg = mem.alloc(size + GUARD, "VRAM")
        # [size, +VERIFY): source of the READ check; the two next MiB receive the WRITE checks
        mem.fill(buf, size, pattern(2, VERIFY))
        agent = make_agent("target")
        register(agent, buf, addr, size + GUARD, seg)
        q_main.put(("machine", "target", machine_of_child(cfg["no_gpu"])))
        q_init.put(("meta", agent.get_agent_metadata(), addr))
    except Exception as e:  # noqa: BLE001 - reported, then the run ends
        q_main.put(("fatal", "target", repr(e)))
        q_init.put(("fatal", repr(e)))
        return

    arrivals: dict[bytes, int] = {}
    checks = {b"verify:vram": (size + VERIFY, 1), b"verify:dram": (size + 2 * VERIFY, 3)}
    while True:
        notifs = agent.get_new_notifs()
        now = time.monotonic_ns()
        for msgs in notifs.values():
            for m in msgs:
                if m.startswith(b"n:"):
                    if m == b"n:end":
                        q_main.put(("arrivals", {k.decode(): v for k, v in arrivals.items()}))
                        arrivals = {}
                    else:
                        arrivals[m] = now
                elif m in checks:
                    off, seed = checks[m]
                    got = mem.read(buf, off, VERIFY)
                    ok = bool((got == pattern(seed, VERIFY)).all())
                    q_main.put(("verify", f"{m.decode().split(':')[1]}_write_seen_by_target", ok))
                elif m == b"stop":
                    q_main.put(("done", "target"))
                    return


class Initiator:
    def __init__(self, cfg: dict, q_main):
        self.cfg = cfg
        self.q = q_main
        self.quick = cfg["quick"]
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(12345)

    # -- helpers ------------------------------------------------------------------------

    def wait(self, xh, state: str) -> None:
        """Poll a posted transfer to DONE; raise on ERR or after TRANSFER_TIMEOUT_S."""
        if state == "DONE":
            return
        check = self.agent.check_xfer_state
        deadline = time.perf_counter() + TRANSFER_TIMEOUT_S
        n = 0
        while state == "PROC":
            state = check(xh)
            n += 1
            if n & 1023 == 0 and time.perf_counter() > deadline:
                raise TimeoutError(f"transfer still in progress after {TRANSFER_TIMEOUT_S:.0f} s")
        if state != "DONE":
            raise RuntimeError(f"transfer state {state}")

    def run_once(self, xh, notif: bytes = b"") -> float:
        t0 = time.perf_counter()
        self.wait(xh, self.agent.transfer(xh, notif))
        return time.perf_counter() - t0

    def timed(self, fn, warm: int, iters: int, budget_s: float) -> list[float]:
        """fn() -> seconds; warm-up calls, then up to iters timed calls within budget_s."""
        for _ in range(warm):
            fn()
        out: list[float] = []
        end = time.perf_counter() + budget_s
        while len(out) < iters and (not out or time.perf_counter() < end):
            out.append(fn())
        return out

    def prepared(self, op: str, lbase: int, lseg: str, rbase: int, rseg: str, block: int,
                 count: int, random_order: bool):
        """Prepared dlists over `count` consecutive blocks on each side and one request;
        with random_order the remote blocks are visited in a random permutation."""
        np = self.np
        offs = np.arange(count, dtype=np.uint64) * np.uint64(block)
        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(lbase, offs, block), lseg)
        rh = self.agent.prep_xfer_dlist(self.remote, descs(rbase, offs, block), rseg)
        lidx = np.arange(count, dtype=np.int32)
        ridx = self.rng.permutation(count).astype(np.int32) if random_order else lidx
        xh = self.agent.make_prepped_xfer(op, lh, lidx, rh, ridx)
        return xh, lh, rh

    @staticmethod
    def release(*handles) -> None:
        for h in handles:
            try:
                h.release()
            except Exception:  # noqa: BLE001 - best effort after a failed case
                pass

    def emit(self, row: dict) -> None:
        self.q.put(("row", row))
        shown = {k: row[k] for k in ("gbps", "p50_us", "p99_us", "error") if row.get(k) is not None}
        log(f"{row['test']} {row['op']} {row['count']} x {human(row['block'])}: {shown}")

    def case(self, row: dict, fn) -> None:
        try:
            row.update(fn())
        except Exception as e:  # noqa: BLE001 - one failed case must not end the run
            row["error"] = f"{type(e).__name__}: {e}"
        self.emit(row)

    # -- cases --------------------------------------------------------------------------

    def bandwidth(self, op, lbase, lseg, rbase, rseg, block, count, random_order) -> dict:
        t0 = time.perf_counter()
        xh, lh, rh = self.prepared(op, lbase, lseg, rbase, rseg, block, count, random_order)
        prep_ms = (time.perf_counter() - t0) * 1e3
        try:
            warm, iters = (1, 5) if self.quick else (3, 20)
            ts = self.timed(lambda: self.run_once(xh), warm, iters, 5.0 if self.quick else 15.0)
        finally:
            self.release(xh, lh, rh)
        t = median(ts)
        return {"gbps": round(block * count / t / 1e9, 3), "iters": len(ts),
                "median_ms": round(t * 1e3, 4), "prep_ms": round(prep_ms, 3)}

    def oneshot(self, block: int, count: int, api: str, random_order: bool) -> dict:
        """The request created (both lists prepared) and posted each time; with
        random_order the remote blocks are visited in a random permutation."""
        np, ag = self.np, self.agent
        offs = np.arange(count, dtype=np.uint64) * np.uint64(block)
        idx = np.arange(count, dtype=np.int32)
        ridx = self.rng.permutation(count).astype(np.int32) if random_order else idx
        ld = descs(self.lbase, offs, block)
        # initialize_xfer pairs the lists entry by entry: the remote one is permuted itself.
        rd = descs(self.rbase, offs if api == "prepped" else offs[ridx], block)

        def once() -> float:
            t0 = time.perf_counter()
            if api == "prepped":
                lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", ld, self.vseg)
                rh = ag.prep_xfer_dlist(self.remote, rd, self.vseg)
                xh = ag.make_prepped_xfer("WRITE", lh, idx, rh, ridx)
                handles = (xh, lh, rh)
            else:
                xh = ag.initialize_xfer("WRITE", ag.get_xfer_descs(ld, self.vseg),
                                        ag.get_xfer_descs(rd, self.vseg), self.remote)
                handles = (xh,)
            try:
                self.wait(xh, ag.transfer(xh))
                return time.perf_counter() - t0
            finally:
                self.release(*handles)

        warm, iters = (1, 3) if self.quick else (2, 10)
        ts = self.timed(once, warm, iters, 5.0 if self.quick else 15.0)
        t = median(ts)
        method = ("prep_xfer_dlist x2 + make_prepped_xfer + transfer" if api == "prepped"
                  else "get_xfer_descs x2 + initialize_xfer + transfer")
        return {"gbps": round(block * count / t / 1e9, 3), "iters": len(ts),
                "median_ms": round(t * 1e3, 4), "method": method}

    def latency(self) -> dict:
        xh, lh, rh = self.prepared("WRITE", self.lbase, self.vseg, self.rbase, self.vseg, 4 * KIB, 1, False)
        try:
            warm, iters = (50, 300) if self.quick else (200, 2000)
            ts = self.timed(lambda: self.run_once(xh), warm, iters, 20.0)
        finally:
            self.release(xh, lh, rh)
        p50, p99 = percentiles([t * 1e6 for t in ts])
        return {"p50_us": p50, "p99_us": p99, "iters": len(ts)}

    def notif_posts(self) -> dict:
        """Posts 4 KiB WRITEs with notifications; the target timestamps their arrival. The
        figures are computed by the parent from both sides' CLOCK_MONOTONIC stamps."""
        xh, lh, rh = self.prepared("WRITE", self.lbase, self.vseg, self.rbase, self.vseg, 4 * KIB, 1, False)
        warm, iters = (50, 300) if self.quick else (200, 2000)
        posts = {}
        try:
            for i in range(warm + iters):
                msg = f"n:{i}".encode()
                t0 = time.monotonic_ns()
                self.wait(xh, self.agent.transfer(xh, msg))
                if i >= warm:
                    posts[msg.decode()] = t0
                # leave the target time to see it before the next one goes out
                pause = time.perf_counter() + 300e-6
                while time.perf_counter() < pause:
                    pass
        finally:
            time.sleep(0.01)  # the last notification first
            self.agent.send_notif(self.remote, b"n:end")
            self.release(xh, lh, rh)
        self.q.put(("posts", posts))
        return {"iters": len(posts)}

    def verify(self) -> None:
        """Byte checks in both directions, for the VRAM and the pinned host buffer."""
        mem, size, dsize = self.mem, self.cfg["bytes"], self.cfg["host_bytes"]
        np = self.np
        for name, buf, base, seg, lsize, seed, dst, note in (
                ("vram", self.vbuf, self.lbase, self.vseg, size, 1, size + VERIFY, b"verify:vram"),
                ("dram", self.hbuf, self.hbase, self.hseg, dsize, 3, size + 2 * VERIFY, b"verify:dram")):
            for op in ("READ", "WRITE"):
                try:
                    one = np.zeros(1, dtype=np.uint64)
                    if op == "WRITE":
                        mem.fill(buf, lsize, pattern(seed, VERIFY))
                        loff, roff, msg = lsize, dst, note
                    else:
                        mem.fill(buf, lsize + VERIFY, np.zeros(VERIFY, np.uint8))
                        loff, roff, msg = lsize + VERIFY, size, b""
                    lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(base + loff, one, VERIFY), seg)
                    rh = self.agent.prep_xfer_dlist(self.remote, descs(self.rbase + roff, one, VERIFY), self.vseg)
                    idx = np.zeros(1, dtype=np.int32)
                    xh = self.agent.make_prepped_xfer(op, lh, idx, rh, idx)
                    try:
                        self.wait(xh, self.agent.transfer(xh, msg))
                    finally:
                        self.release(xh, lh, rh)
                    if op == "READ":
                        ok = bool((mem.read(buf, loff, VERIFY) == pattern(2, VERIFY)).all())
                        self.q.put(("verify", f"{name}_read", ok))
                except Exception as e:  # noqa: BLE001
                    self.q.put(("verify", f"{name}_{op.lower()}", f"{type(e).__name__}: {e}"))

    # -- the run ------------------------------------------------------------------------

    def run(self, q_init) -> None:
        cfg = self.cfg
        child_setup(cfg, cfg["gpus"][0])
        self.mem = Memory(cfg["no_gpu"])
        size, dsize = cfg["bytes"], cfg["host_bytes"]
        self.vbuf, self.lbase, self.vseg = self.mem.alloc(size + GUARD, "VRAM")
        self.mem.fill_pattern(self.vbuf, size, 5)
        self.hbuf, self.hbase, self.hseg = self.mem.alloc(dsize + GUARD, "DRAM")
        self.mem.fill_pattern(self.hbuf, dsize, 6)
        self.agent = make_agent("initiator")
        register(self.agent, self.vbuf, self.lbase, size + GUARD, self.vseg)
        register(self.agent, self.hbuf, self.hbase, dsize + GUARD, self.hseg)
        self.q.put(("machine", "initiator", machine_of_child(cfg["no_gpu"])))
        try:
            msg = q_init.get(timeout=180)
        except queue.Empty:
            raise RuntimeError("no metadata from the target within 180 s") from None
        if msg[0] != "meta":
            raise RuntimeError(f"target failed: {msg[1]}")
        _, md, self.rbase = msg
        self.remote = self.agent.add_remote_agent(md)
        try:
            self.agent.make_connection(self.remote)
        except Exception as e:  # noqa: BLE001 - the first transfer connects anyway
            log(f"make_connection: {e}")
        rows = {row_key(r): r for r in plan(cfg)}
        only = cfg["only"]
        for order in cfg["orders"] if "bw" in only else ():
            for op in ("WRITE", "READ"):
                for block, count in BW_CASES:
                    count = min(count, size // block)
                    self.case(rows[("bw", op, block, count, order)],
                              lambda: self.bandwidth(op, self.lbase, self.vseg, self.rbase, self.vseg,
                                                     block, count, order == "random"))
        blk, cnt = ONESHOT
        cnt = min(cnt, size // blk)
        for order in cfg["orders"] if "oneshot" in only else ():
            for test, api in (("oneshot", "prepped"), ("oneshot_initialize_xfer", "initialize_xfer")):
                self.case(rows[(test, "WRITE", blk, cnt, order)],
                          lambda: self.oneshot(blk, cnt, api, order == "random"))
        if "lat4k" in only:
            self.case(rows[("lat4k", "WRITE", 4 * KIB, 1, None)], self.latency)
        if "notif4k" in only:
            # the parent completes this row from both sides' timestamps
            notif = dict(rows[("notif4k", "WRITE", 4 * KIB, 1, None)])
            try:
                notif.update(self.notif_posts())
            except Exception as e:  # noqa: BLE001
                notif["error"] = f"{type(e).__name__}: {e}"
            self.q.put(("row", notif))
        blk, cnt = HOST_CASE
        cnt = min(cnt, dsize // blk)
        for test, op in (("h2d", "WRITE"), ("d2h", "READ")):
            if test not in only:
                continue
            self.case(rows[(test, op, blk, cnt, "sequential")],
                      lambda: self.bandwidth(op, self.hbase, self.hseg, self.rbase, self.vseg,
                                             blk, cnt, False))
        self.verify()
        self.agent.send_notif(self.remote, b"stop")
        self.q.put(("done", "initiator"))


def initiator_main(cfg: dict, q_init, q_main) -> None:
    try:
        Initiator(cfg, q_main).run(q_init)
    except Exception as e:  # noqa: BLE001
        q_main.put(("fatal", "initiator", f"{type(e).__name__}: {e}"))


# ---------------------------------------------------------------------------------------
# In the parent


def nixl_version(nixl_dir: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version("nixl-cu13")
    except md.PackageNotFoundError:
        for d in Path(nixl_dir).glob("nixl*.dist-info"):
            return d.name.split("-")[1]
    return None


def percentiles(values: list[float]) -> tuple[float, float]:
    """p50 and p99 as freight's own figures are taken (reporting.PERCENTILE)."""
    return round(percentile(values, 50), 2), round(percentile(values, 99), 2)


def stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run(cfg: dict, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    q_init, q_main = ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=target_main, args=(cfg, q_init, q_main), name="nixl-target")
    initiator = ctx.Process(target=initiator_main, args=(cfg, q_init, q_main), name="nixl-initiator")
    doc = {"tool": "nixl_p2p", "nixl_version": nixl_version(cfg["nixl_dir"]),
           "machine": host_machine(), "quick": cfg["quick"], "percentile": PERCENTILE,
           "config": {k: cfg[k] for k in ("ucx_tls", "gpus", "bytes", "host_bytes", "orders", "no_gpu")},
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "rows": [], "verify": {}, "errors": []}
    got: dict[tuple, dict] = {}
    posts = arrivals = None
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    initiator_gone_at = initiator_done_at = None
    target.start()
    initiator.start()
    try:
        while time.monotonic() < deadline:
            try:
                msg = q_main.get(timeout=0.5)
            except queue.Empty:
                if not initiator.is_alive() and "initiator" not in done:
                    if initiator_gone_at is None:
                        initiator_gone_at = time.monotonic()
                    elif time.monotonic() - initiator_gone_at > 10:
                        doc["errors"].append(f"initiator exited (code {initiator.exitcode})")
                        break
                if "initiator" in done and "target" not in done:
                    if not target.is_alive() or time.monotonic() - initiator_done_at > 30:
                        doc["errors"].append("the target did not finish after the initiator")
                        break
                continue
            kind = msg[0]
            if kind == "row":
                got[row_key(msg[1])] = msg[1]
            elif kind == "posts":
                posts = msg[1]
            elif kind == "arrivals":
                arrivals = msg[1]
            elif kind == "verify":
                doc["verify"][msg[1]] = msg[2]
            elif kind == "machine":
                doc["machine"][msg[1]] = msg[2]
            elif kind == "fatal":
                doc["errors"].append(f"{msg[1]}: {msg[2]}")
                log(f"{msg[1]} failed: {msg[2]}")
                break
            elif kind == "done":
                done.add(msg[1])
                if msg[1] == "initiator":
                    initiator_done_at = time.monotonic()
                if done == {"initiator", "target"}:
                    break
        else:
            doc["errors"].append(f"timed out after {timeout:.0f} s")
            log(f"timed out after {timeout:.0f} s; stopping the children")
    finally:
        stop([initiator, target])

    for r in plan(cfg):
        k = row_key(r)
        row = got.get(k)
        if row is None:
            row = dict(r, error="not reached (" + ("; ".join(doc["errors"]) or "no result") + ")")
        if r["test"] == "notif4k" and "error" not in row:
            row = complete_notif(row, posts, arrivals)
        doc["rows"].append(row)
    return doc


def complete_notif(row: dict, posts: dict | None, arrivals: dict | None) -> dict:
    row = dict(row)
    if posts is None or arrivals is None:
        row["error"] = "no timestamps from " + ("the initiator" if posts is None else "the target")
        return row
    lat = [(arrivals[m] - t0) / 1e3 for m, t0 in posts.items() if m in arrivals]
    if not lat:
        row["error"] = "the target saw none of the notifications"
        return row
    row["p50_us"], row["p99_us"] = percentiles(lat)
    row["seen"] = len(lat)
    return row


def table(doc: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = [f"{'test':<24} {'op':<5} {'order':<10} {'blocks':>16} {'GB/s':>9} {'p50 us':>9} "
             f"{'p99 us':>9}  note"]
    for r in doc["rows"]:
        lines.append(f"{r['test']:<24} {r['op']:<5} {r.get('order') or '':<10} "
                     f"{str(r['count']) + ' x ' + human(r['block']):>16} "
                     f"{f(r['gbps']):>9} {f(r['p50_us']):>9} {f(r['p99_us']):>9}  {r.get('error', '')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nixl-dir", required=True,
                    help="folder where nixl_trim.tar.xz was unpacked (holds nixl_cu13/); put first on sys.path")
    ap.add_argument("--out", type=Path, help="JSON file to write (default: print the table only)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, not a report)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds for the whole run; children still alive then are killed (default 300)")
    ap.add_argument("--gpus", default="0,1", help="GPU of the initiator and of the target (default 0,1)")
    ap.add_argument("--ucx-tls", help="UCX_TLS of both agents (default cuda_ipc,cuda_copy,tcp; tcp with --no-gpu)")
    ap.add_argument("--order", choices=["both", "random", "sequential"], default="both",
                    help="order of the remote blocks in the bw requests: sequential (block i to "
                         "block i, which NIXL may merge), random (a permutation: nothing to "
                         "merge, like the ceilings' kernel) or both (the default)")
    ap.add_argument("--bytes", type=int, help="at most this many bytes per VRAM request "
                    "(default 4 GiB; 64 MiB with --no-gpu)")
    ap.add_argument("--no-gpu", action="store_true",
                    help="host memory on both sides, to check the script without GPUs")
    ap.add_argument("--only", default=",".join(TESTS),
                    help=f"comma-separated tests to run, of {', '.join(TESTS)} (default: all)")
    args = ap.parse_args()
    only = {t.strip() for t in args.only.split(",") if t.strip()}
    if not only or only - set(TESTS):
        ap.error(f"--only takes tests of {', '.join(TESTS)}, not {args.only!r}")

    nixl_dir = str(Path(args.nixl_dir).resolve())
    if not (Path(nixl_dir) / "nixl_cu13" / "__init__.py").is_file():
        ap.error(f"no nixl_cu13 package in {nixl_dir} (unpack nixl_trim.tar.xz there; see "
                 "bench/peers/fetch_nixl.sh)")
    gpus = args.gpus.split(",")
    if len(gpus) != 2 or not all(g.strip().isdigit() for g in gpus):
        ap.error("--gpus takes two GPU indices, like 0,1")
    size = args.bytes or (64 * MIB if args.no_gpu else 4 * GIB)
    if size < 64 * MIB:
        ap.error("--bytes must be at least 64 MiB (two 32 MiB blocks)")
    cfg = {"nixl_dir": nixl_dir, "quick": args.quick, "no_gpu": args.no_gpu,
           "gpus": [g.strip() for g in gpus], "orders": ["sequential", "random"] if args.order == "both" else [args.order],
           "ucx_tls": args.ucx_tls or ("tcp" if args.no_gpu else "cuda_ipc,cuda_copy,tcp"),
           "bytes": size, "host_bytes": min(1 * GIB, size), "only": sorted(only)}
    sys.path.insert(0, nixl_dir)
    log(f"NIXL {nixl_version(nixl_dir)} from {nixl_dir}; UCX_TLS={cfg['ucx_tls']}; "
        f"{'no GPU' if args.no_gpu else 'GPUs ' + args.gpus}; timeout {args.timeout:.0f} s")
    t0 = time.monotonic()
    doc = run(cfg, args.timeout)
    doc["seconds"] = round(time.monotonic() - t0, 1)
    return finish(doc, args.out, table(doc), log, need_checks=True)


if __name__ == "__main__":
    sys.exit(main())
