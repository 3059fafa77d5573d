"""The benchmark scripts' statistics and the helpers they share, for freight and every
peer alike: the one percentile definition (and the median by it), what the machine is,
running a benchmark command for its JSON, a free port, sizes for people, prefixed logs,
and the end of a run (write the JSON, print the table and the byte checks, pick the exit
code)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# The GPU bandwidth cases every side measures: (block size, blocks), 4 GiB per request
# or 65536 blocks, whichever is fewer; and the host<->GPU case.
BW_CASES = [(32 * MIB, 128), (2 * MIB, 2048), (256 * KIB, 16384), (16 * KIB, 65536), (4 * KIB, 65536)]
HOST_CASE = (32 * MIB, 32)


#: How every benchmark's percentiles are taken, freight's and every peer's alike (and
#: freight's CLI, crates/freight-bench/src/stats.rs): the reports say it.
PERCENTILE = "nearest rank: the ceil(p * n)-th smallest of n samples, never an interpolation"


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0 < p <= 100) of ``values`` by nearest rank
    (:data:`PERCENTILE`): p99 of 200 samples is the 198th smallest, p50 of 4 the 2nd."""
    s = sorted(values)
    if not s:
        raise ValueError("no samples")
    if not 0 < p <= 100:
        raise ValueError(f"a percentile is in (0, 100], got {p}")
    return s[min(len(s), max(1, math.ceil(p / 100 * len(s)))) - 1]


def median(values: Iterable[float]) -> float:
    """The median as every benchmark takes it: ``percentile(values, 50)``, one of the
    samples (of an even count, the lower middle one), never the mean of the two middle
    ones that ``statistics.median`` and ``numpy.median`` give."""
    return percentile(values, 50)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago, for a server the script starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def human(n: int) -> str:
    """4096 -> "4 KiB"; sizes that are not whole units stay in bytes."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def run_json(cmd: list, timeout: int = 600, *, check: bool = False) -> dict:
    """Runs a benchmark command that prints a JSON document last; returns the document
    (or {"error": why}) with the command and its wall time added. With `check`, a
    command that fails or prints no document raises RuntimeError instead (for scripts
    that cannot go on without its figures)."""
    import time

    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        doc = {"error": f"timed out after {timeout} s"}
    else:
        start = proc.stdout.find("{")
        try:
            doc = json.loads(proc.stdout[start:]) if start >= 0 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            doc = {"error": f"no JSON report; exit {proc.returncode}: {proc.stderr[-1500:]}"}
        elif check and proc.returncode != 0:
            doc = {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    if check and "error" in doc:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: {doc['error']}")
    doc["command"] = " ".join(map(str, cmd))
    doc["wall_s"] = time.monotonic() - t0
    return doc


def run_child(python: str, code: str, args: list, timeout: int = 1800) -> dict:
    """Runs `code` in the interpreter `python` (another virtualenv: a peer's) with `args`
    and returns the JSON document it prints last; RuntimeError with its stderr if it
    fails."""
    proc = subprocess.run([python, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} {' '.join(map(str, args))} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peer_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark that runs freight beside a peer in another
    interpreter: --python, --nixl-python, --reps, --machine, --out."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the interpreter with freight (default: this one)")
    ap.add_argument("--nixl-python", help="an interpreter with NIXL (nixl._api); without it NIXL is not measured")
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=Path, help="JSON file to write")
    return ap


def save_report(tool: str, args: argparse.Namespace, started: float, log: Callable[[str], None], **fields) -> dict:
    """The report of a run started at `started` (time.time()): the tool, the machine
    (args.machine and this host), the percentile definition and `fields`; written to
    args.out where given."""
    doc = {"tool": tool, "machine": {"label": args.machine, **host_machine()}, "percentile": PERCENTILE,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), **fields}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {args.out}")
    return doc


def logger(prefix: str) -> Callable[[str], None]:
    """A log function writing "[prefix] message" lines to stderr."""

    def log(msg: str) -> None:
        print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)

    return log


def finish(doc: dict, out: Optional[Path], table: str, log: Callable[[str], None], *, need_checks: bool) -> int:
    """Writes `doc` to `out`, prints `table`, the byte checks and the errors; returns 1
    when anything failed (or, with `need_checks`, when nothing was checked)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {out}")
    print(table)
    if doc["verify"]:
        print("verify: " + ", ".join(f"{k}={v}" for k, v in sorted(doc["verify"].items())))
    for e in doc["errors"]:
        print(f"error: {e}")
    bad = doc["errors"] or any(v is not True for v in doc["verify"].values()) or (need_checks and not doc["verify"])
    return 1 if bad else 0


def host_machine() -> dict:
    """What the figures were measured on: the host, its CPUs and memory, its GPUs' names
    and the driver, without touching CUDA in this process."""
    info: dict = {"hostname": os.uname().nodename, "cpus": os.cpu_count(), "cpu_model": "", "memory_gib": None,
                  "platform": platform.platform()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout
            gpus = [line.split(",")[0].strip() for line in out.splitlines() if line.strip()]
            info["gpus"] = gpus
            if out.strip():
                info["driver"] = out.splitlines()[0].split(",")[-1].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    if "driver" not in info:
        try:
            info["driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        except (OSError, IndexError):
            info["driver"] = None
    return info
