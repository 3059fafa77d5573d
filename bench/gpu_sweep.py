#!/usr/bin/env python3
"""freight's batched copy kernel across launch shapes, item sizes and completion modes,
to choose the defaults: two processes on two GPUs of one host, like bench/gpu.py.

The initiator (this process, GPU 0) creates one freight agent per configuration (mode
warp or block, threads per CUDA block, blocks per SM, longest work item) and measures
WRITE and READ over these lists against the target (bench/gpu_peer.py on GPU 1):

  65536 x 4 KiB, 65536 x 16 KiB, 16384 x 256 KiB, 128 x 32 MiB   remote blocks in random order
  65536 x 4 KiB sequential                                      merges into one 256 MiB copy

GB/s = bytes of one request / median time from post() until wait() returns. The item
size is varied only where it can matter (copies longer than the smallest item). Shapes
whose blocks an SM cannot all hold launch as fewer (freight.copy_kernel_occupancy): a
shape that launches like one measured before is skipped. Then the configuration that is
best over all cases runs again with each completion mode ("event", "poll").

The destination bytes are checked for every case and direction, on the first
configuration and under "poll": the source is refilled and the destination poisoned
before the run, and afterwards each side fingerprints its blocks where they are
(bench/gpu_peer.py fingerprint()). Exits non-zero on any error or failed check.

    python3 bench/gpu_sweep.py --out build/gpu-results/sweep.json [--quick]

About 50 seconds on two H200 (most of it 4 GiB requests); --quick: about 20.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from gpu import Target, timed  # noqa: E402
from gpu_peer import fingerprint  # noqa: E402
from reporting import GIB, KIB, MIB, PERCENTILE, finish, host_machine, human, logger, percentile  # noqa: E402

log = logger("sweep")

SIZE = 4 * GIB
OPS = ("WRITE", "READ")


@dataclass(frozen=True)
class Case:
    block: int
    count: int
    order: str  # "random" or "sequential"

    @property
    def name(self) -> str:
        return f"{self.count} x {human(self.block)} {self.order}"

    @property
    def longest_copy(self) -> int:
        """Sequential blocks are neighbours on both sides and merge into one copy."""
        return self.block * self.count if self.order == "sequential" else self.block


CASES = [Case(4 * KIB, 65536, "random"), Case(16 * KIB, 65536, "random"), Case(256 * KIB, 16384, "random"),
         Case(32 * MIB, 128, "random"), Case(4 * KIB, 65536, "sequential")]


@dataclass(frozen=True)
class Config:
    mode: str
    threads: int
    blocks_per_sm: int
    item_bytes: int
    completion: str = "event"

    @property
    def shape(self) -> Tuple[str, int, int]:
        return (self.mode, self.threads, self.blocks_per_sm)

    @property
    def label(self) -> str:
        return (f"{self.mode} {self.threads}x{self.blocks_per_sm} item {human(self.item_bytes)}"
                + ("" if self.completion == "event" else f" {self.completion}"))

    def agent_config(self):
        import freight

        # Every copy in the kernel, however long: the sweep measures the kernel.
        return freight.AgentConfig(cuda_kernel_mode=self.mode, cuda_kernel_threads=self.threads,
                                   cuda_kernel_blocks_per_sm=self.blocks_per_sm,
                                   cuda_kernel_item_bytes=self.item_bytes, cuda_completion=self.completion,
                                   cuda_copy_engine_min_peer=1 << 62)


# Today's defaults first: it is the baseline, and shapes that launch like it are skipped.
DEFAULT = Config("warp", 256, 8, 64 * KIB)
# Blocks of 512 threads: at most 4 per SM (2048 threads); 8 would launch as 4.
SHAPES = [DEFAULT.shape] + [(m, t, b) for m in ("warp", "block") for t in (256, 512) for b in (2, 4, 8)
                            if t * b <= 2048 and (m, t, b) != DEFAULT.shape]
ITEMS = [16 * KIB, 64 * KIB, 256 * KIB]
QUICK_SHAPES = [DEFAULT.shape, ("block", 512, 2), ("block", 256, 4)]
QUICK_ITEMS = [64 * KIB, 256 * KIB]


def grid(shapes, items) -> List[Config]:
    """Every shape with every item size (the default item first)."""
    items = sorted(items, key=lambda i: (i != DEFAULT.item_bytes, i))
    return [Config(m, t, b, i) for (m, t, b) in shapes for i in items]


def cases_for(config: Config, items) -> List[Case]:
    """The cases in which `config`'s item size can change anything: all of them for the
    default item size, else those with copies longer than the smallest item."""
    if config.item_bytes == DEFAULT.item_bytes:
        return CASES
    return [c for c in CASES if c.longest_copy > min(items)]


class Sweep:
    def __init__(self, target: Target, quick: bool):
        import torch
        import freight

        self.torch, self.freight = torch, freight
        self.target = target
        self.warm, self.iters = (1, 3) if quick else (2, 10)
        self.local = torch.empty(SIZE, dtype=torch.uint8, device="cuda:0")
        self.occupancy = freight.copy_kernel_occupancy(0)
        self.lists = {}
        rng = random.Random(1)
        for case in CASES:
            order = list(range(case.count))
            if case.order == "random":
                rng.shuffle(order)
            ldesc = freight.DescList([(self.local.data_ptr() + i * case.block, case.block, 0)
                                      for i in range(case.count)], kind="VRAM")
            rdesc = freight.DescList([(target.base + j * case.block, case.block, 0) for j in order], kind="VRAM")
            self.lists[case] = (ldesc, rdesc, order)
        self.rows: List[dict] = []
        self.verify: Dict[str, bool] = {}
        self.errors: List[str] = []
        self.skipped: List[str] = []
        self.seed = 0

    def launched_blocks_per_sm(self, shape) -> int:
        mode, threads, blocks = shape
        return min(blocks, self.occupancy[(mode, threads)])

    # -- checks ----------------------------------------------------------------------

    def prepare_check(self, case: Case, op: str) -> None:
        """Fresh source bytes, poisoned destination blocks."""
        torch = self.torch
        self.seed += 1
        span = self.local[: case.block * case.count]
        if op == "WRITE":
            g = torch.Generator(device="cuda:0").manual_seed(self.seed)
            span.random_(0, 256, generator=g)
            self.target.call(op="poison")
        else:
            self.target.call(op="scramble", seed=self.seed)
            span.fill_(0xA5)
        torch.cuda.synchronize()

    def check(self, case: Case, op: str, config: Config) -> bool:
        """Block i here and block order[i] there hold the same bytes."""
        import numpy as np

        _, _, order = self.lists[case]
        there = self.target.call(op="fingerprint", block=case.block, indices=order)
        if "fp" not in there:
            raise RuntimeError(f"the target could not fingerprint: {there}")
        here = fingerprint(self.local, case.block, range(case.count))
        ok = here == there["fp"]
        key = f"{case.name} {op} {config.label}"
        self.verify[key] = ok
        if not ok:
            a = np.frombuffer(bytes.fromhex(here), dtype=np.int64)
            b = np.frombuffer(bytes.fromhex(there["fp"]), dtype=np.int64)
            bad = np.nonzero(a != b)[0] if len(a) == len(b) else []
            log(f"CHECK FAILED: {key}: {len(bad)} of {case.count} blocks differ"
                + (f", first: block {bad[0]}" if len(bad) else f" ({len(a)} != {len(b)} fingerprints)"))
        return ok

    # -- measurements ----------------------------------------------------------------

    def run(self, stage: str, config: Config, cases: List[Case], check: set) -> None:
        """Measures `config` on `cases` (both directions) with its own agent; checks the
        bytes of the (case, op) pairs in `check`. Errors are recorded, not raised: the
        other configurations still run, and the exit code says it."""
        name = f"sweep-{stage}-{config.mode}-{config.threads}x{config.blocks_per_sm}-{config.item_bytes // KIB}k-{config.completion}"
        try:
            with self.freight.Agent(name, config.agent_config()) as agent:
                peer = agent.connect(self.target.addr)
                agent.register(self.local)
                for case in cases:
                    ldesc, rdesc, _ = self.lists[case]
                    lp, rp = agent.prepare_local(ldesc), agent.prepare_remote(peer, rdesc)
                    for op in OPS:
                        try:
                            self.measure(stage, config, agent, lp, rp, case, op, (case, op) in check)
                        except Exception as e:  # noqa: BLE001
                            self.error(f"{config.label}, {case.name} {op}", e)
                            self.rows.append({**self.row(stage, config, case, op, None, None), "error": self.errors[-1]})
                agent.remove_peer(peer)
        except Exception as e:  # noqa: BLE001
            self.error(config.label, e)

    def measure(self, stage, config, agent, lp, rp, case: Case, op: str, checking: bool) -> None:
        if checking:
            self.prepare_check(case, op)
        req = agent.make_request(op, lp, None, rp, None)
        timed(req, self.warm)
        times = timed(req, self.iters)
        p50 = percentile(times, 50)
        row = self.row(stage, config, case, op, p50, min(times), copies=req.copies)
        if checking:
            row["verified"] = self.check(case, op, config)
        self.rows.append(row)

    def error(self, where: str, e: Exception) -> None:
        self.errors.append(f"{where}: {type(e).__name__}: {e}")
        log(f"ERROR: {self.errors[-1]}")

    def row(self, stage: str, config: Config, case: Case, op: str, p50: Optional[float], fastest: Optional[float],
            **extra):
        gbps = None if p50 is None else case.block * case.count / p50 / 1e9
        r = {"system": "freight", "test": "sweep", "stage": stage, "case": case.name, "op": op, "block": case.block,
             "count": case.count, "order": case.order, "mode": config.mode, "threads": config.threads,
             "blocks_per_sm": config.blocks_per_sm,
             "launched_blocks_per_sm": self.launched_blocks_per_sm(config.shape),
             "item_bytes": config.item_bytes, "completion": config.completion,
             "gbps": None if gbps is None else round(gbps, 3),
             "p50_us": None if p50 is None else round(p50 * 1e6, 1),
             "min_us": None if fastest is None else round(fastest * 1e6, 1), **extra}
        if gbps is not None:
            log(f"{config.label:<32} {case.name:<26} {op:<5} {gbps:7.1f} GB/s")
        return r


def measured(rows, stage: str = "shapes") -> Dict[Tuple[Config, str, str], float]:
    """GB/s by (configuration, case name, op) of one stage's rows."""
    return {(Config(r["mode"], r["threads"], r["blocks_per_sm"], r["item_bytes"], r["completion"]), r["case"],
             r["op"]): r["gbps"]
            for r in rows if r.get("stage") == stage and r.get("gbps") is not None}


def ranking(rows, items) -> List[Tuple[float, Config]]:
    """Configurations by the geometric mean over every (case, op) of their GB/s over the
    best GB/s there; those missing a figure are left out. A case where the item size
    cannot matter takes the figure of the same shape with the default item size."""
    got = measured(rows)
    best: Dict[Tuple[str, str], float] = {}
    for (_, case, op), g in got.items():
        best[(case, op)] = max(g, best.get((case, op), 0.0))

    def score(c: Config) -> Optional[float]:
        logs = []
        for case in CASES:
            stand_in = c if case in cases_for(c, items) else Config(*c.shape, DEFAULT.item_bytes)
            for op in OPS:
                g = got.get((stand_in, case.name, op))
                if g is None:
                    return None
                logs.append(math.log(g / best[(case.name, op)]))
        return math.exp(sum(logs) / len(logs))

    scored = [(score(c), c) for c in {c for (c, _, _) in got}]
    return sorted(((s, c) for s, c in scored if s is not None), key=lambda sc: -sc[0])


def ceiling_table(path: Optional[Path]) -> Dict[Tuple[str, int], float]:
    """SM ceilings (bench/peers/ceilings.py) by (op, block): the sequential list is held
    to the same ceiling as the random one, as bench/gpu_report.py does."""
    if path is None:
        return {}
    import json

    doc = json.loads(path.read_text())
    return {(r["op"], r["block"]): r["gbps"] for r in doc.get("rows", [])
            if r.get("engine") == "sm" and r.get("gbps") is not None}


def table(rows, ceilings, overall: Optional[Config]) -> str:
    got = measured(rows)
    fmt = lambda g: "-" if g is None else f"{g:.1f}"  # noqa: E731
    lines = ["best configuration per case (completion: event)",
             f"{'case':<26} {'op':<5} {'GB/s':>7} {'x ceil':>6} {'default':>7}  configuration"]
    for case in CASES:
        for op in OPS:
            here = [(g, c) for (c, n, o), g in got.items() if n == case.name and o == op]
            if not here:
                lines.append(f"{case.name:<26} {op:<5} {'-':>7}")
                continue
            g, c = max(here, key=lambda x: x[0])
            ceil = ceilings.get((op, case.block))
            lines.append(f"{case.name:<26} {op:<5} {g:7.1f} {f'{g / ceil:.3f}' if ceil else '-':>6} "
                         f"{fmt(got.get((DEFAULT, case.name, op))):>7}  {c.label}")
    if overall is not None:
        both = measured(rows, "completion")
        lines += ["", f"best over all cases: {overall.label}; GB/s by completion mode",
                  f"{'case':<26} {'op':<5} {'event':>7} {'poll':>7}"]
        for case in CASES:
            for op in OPS:
                ev, po = (both.get((Config(*overall.shape, overall.item_bytes, m), case.name, op))
                          for m in ("event", "poll"))
                lines.append(f"{case.name:<26} {op:<5} {fmt(ev):>7} {fmt(po):>7}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer configurations and iterations (a smoke run)")
    ap.add_argument("--ceilings", type=Path, help="ceilings JSON (bench/peers/ceilings.py) to print ratios against")
    args = ap.parse_args()
    t0 = time.monotonic()
    shapes, items = (QUICK_SHAPES, QUICK_ITEMS) if args.quick else (SHAPES, ITEMS)
    doc = {"tool": "bench/gpu_sweep.py", "machine": host_machine(), "quick": args.quick, "percentile": PERCENTILE,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "rows": [], "overall": [], "skipped": [], "verify": {}, "errors": []}
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    overall = None
    target = None
    try:
        import torch
        import freight

        ok, why = freight.cuda_status()
        if not ok:
            raise RuntimeError(f"no GPU: {why}")
        doc["machine"].update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))
        target = Target(SIZE, "VRAM", "1", name="sweep-target")
        sweep = Sweep(target, args.quick)
        doc["occupancy"] = {f"{m} {t}": b for (m, t), b in sorted(sweep.occupancy.items())}
        log(f"blocks an SM holds: {doc['occupancy']}")
        launched = {}
        checked = set()
        for config in grid(shapes, items):
            key = (config.mode, config.threads, sweep.launched_blocks_per_sm(config.shape), config.item_bytes)
            if key in launched:
                sweep.skipped.append(f"{config.label}: launches as {launched[key].label}")
                continue
            launched[key] = config
            cases = cases_for(config, items)
            todo = {(c, op) for c in cases for op in OPS} - checked
            sweep.run("shapes", config, cases, todo)
            checked |= todo
        log(f"shapes and items done in {time.monotonic() - t0:.0f} s")
        ranked = ranking(sweep.rows, items)
        doc["overall"] = [{"score": round(s, 4), "config": c.label} for s, c in ranked[:5]]
        if ranked:
            overall = ranked[0][1]
            for completion in ("event", "poll"):
                c = Config(*overall.shape, overall.item_bytes, completion)
                sweep.run("completion", c, CASES, {(case, op) for case in CASES for op in OPS}
                          if completion == "poll" else set())
        doc["rows"], doc["verify"], doc["skipped"] = sweep.rows, sweep.verify, sweep.skipped
        doc["errors"] += sweep.errors
    except Exception as e:  # noqa: BLE001 - reported in the JSON and by the exit code
        doc["errors"].append(f"{type(e).__name__}: {e}")
        log(f"ERROR: {doc['errors'][-1]}")
    finally:
        if target is not None:
            target.close()
    doc["seconds"] = round(time.monotonic() - t0, 1)
    log(f"{doc['seconds']} s")
    text = table(doc["rows"], ceiling_table(args.ceilings), overall)
    return finish(doc, args.out, text, log, need_checks=True)


if __name__ == "__main__":
    sys.exit(main())
