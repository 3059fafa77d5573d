#!/usr/bin/env python3
"""Engine benchmarks of freight, with their peers, in one run.

Runs `freight bench p2p` and `freight bench descriptors` (and iperf3 for the tcp
reference) on this host, and bench/peers/notif_latency.py for notifications, checks
every figure against its target, writes one JSON document and prints a short table last.

    python3 bench/engine.py --machine "laptop, 8 cores" --out bench/results/engine-laptop.json

Targets (from the engine issue):
  shm   DRAM->DRAM across two processes >= 90% of one-thread memcpy, blocks >= 256 KiB
  shm   4 KiB WRITE, post-to-done p50 <= 8 us
  shm   65536 x 4 KiB in one request >= 50% of the 256 KiB figure
  tcp   one stream over loopback >= 90% of iperf3 with its default settings (same run)
  tcp   several streams >= 3x one stream (on hosts with 16+ cores)
  desc  preparing 65536 descriptors <= 0.5 ms; registering 10,000 regions: reported
  notif 4 KiB shm WRITE with a notification, post to seen by a target polling
        get_notifs, p50 <= 20 us (the GPU hosts' target, for host memory)

Only the standard library is used, so the script runs wherever the binary does; the
notification suite needs freight's Python module (--python, default .venv's) and is
reported as not measured without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reporting import MIB, PERCENTILE, free_port, host_machine, logger, median, run_json  # noqa: E402

log = logger("bench")


def machine_info(label: str) -> dict:
    """What the numbers were measured on, and how busy it was."""
    return {"label": label, **host_machine(), "kernel": platform.release(),
            "load_average_at_start": list(os.getloadavg())}


class Runner:
    def __init__(self, freight: str, quick: bool):
        self.freight = freight
        self.quick = quick

    def freight_json(self, *args: str) -> dict:
        cmd = [self.freight, "bench", *args, "--json"]
        log(" ".join(cmd[1:]))
        return run_json(cmd, timeout=900, check=True)

    def p2p(self, *args: str) -> dict:
        return self.freight_json("p2p", *args)

    def iters(self, full: int, quick: int) -> str:
        return str(quick if self.quick else full)


def iperf3_gbps(iperf3: str, streams: int, seconds: int, length: int | None) -> dict:
    """One iperf3 client run against a fresh one-shot server on loopback."""
    port = free_port()
    server = subprocess.Popen([iperf3, "-s", "-1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cmd = [iperf3, "-c", "127.0.0.1", "-p", str(port), "-P", str(streams),
               "-t", str(seconds), "-J"]
        if length:
            cmd += ["-l", str(length)]
        doc: dict = {}
        for _ in range(50):  # the server needs a moment to listen
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
            try:
                doc = json.loads(out.stdout)
            except json.JSONDecodeError:
                doc = {"error": out.stderr.strip() or out.stdout[-400:]}
            if out.returncode == 0 and "sum_received" in doc.get("end", {}):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"iperf3 failed: {doc.get('error')}")
        bps = doc["end"]["sum_received"]["bits_per_second"]
        return {"streams": streams, "seconds": seconds, "write_length": length,
                "gbps": round(bps / 8e9, 4), "version": doc["start"].get("version", "")}
    finally:
        server.kill()
        server.wait()


def row(doc: dict, block: int, batch: int | None = None) -> dict:
    for r in doc["rows"]:
        if r["block_size"] == block and (batch is None or r["batch_size"] == batch):
            return r
    raise KeyError(f"no row for block {block} batch {batch}")


def check(name: str, value: float, target: str, ok: bool | None, unit: str, note: str = "") -> dict:
    return {"check": name, "value": round(value, 4), "unit": unit, "target": target,
            "met": ok, "note": note}


def shm_suite(r: Runner) -> tuple[dict, list]:
    raw, checks = {}, []
    blocks = "256KiB:64MiB"
    for op in ("WRITE", "READ"):
        doc = r.p2p("--transport", "shm", "--op", op, "--block-sizes", blocks,
                    "--batch-sizes", "1,16", "--max-request-bytes", "256MiB",
                    "--memcpy-baseline", "--iters", r.iters(40, 8), "--warmup", "5")
        raw[f"bandwidth_{op.lower()}"] = doc
        ratios = [x["memcpy_ratio"] for x in doc["rows"]]
        worst = min(doc["rows"], key=lambda x: x["memcpy_ratio"])
        checks.append(check(
            f"shm {op} vs one-thread memcpy, blocks >= 256 KiB (worst row)", min(ratios), ">= 0.90",
            min(ratios) >= 0.90, "x",
            f"worst: {worst['batch_size']} x {worst['block_size'] // 1024} KiB at "
            f"{worst['gbps']} GB/s vs memcpy {worst['memcpy_gbps']} GB/s; "
            f"median ratio {median(ratios)}"))

    doc = r.p2p("--transport", "shm", "--op", "WRITE", "--block-sizes", "4KiB",
                "--batch-sizes", "1", "--iters", r.iters(20000, 2000), "--warmup", "1000")
    raw["latency_4k_write"] = doc
    t = row(doc, 4096)["transfer_us"]
    checks.append(check("shm 4 KiB WRITE post-to-done p50", t["p50"], "<= 8 us", t["p50"] <= 8.0,
                        "us", f"p99 {t['p99']} us over {t['samples']} transfers"))

    # The same 256 MiB request cut into 4 KiB or 256 KiB blocks, shuffled so that the
    # engine cannot merge neighbours: what 65536 separate copies cost.
    doc = r.p2p("--transport", "shm", "--op", "WRITE", "--block-sizes", "4KiB,256KiB",
                "--total-bytes", "256MiB", "--random-order", "--iters", r.iters(20, 4),
                "--warmup", "3")
    raw["many_small_blocks"] = doc
    small, big = row(doc, 4096), row(doc, 256 * 1024)
    ratio = small["gbps"] / big["gbps"]
    checks.append(check("shm 65536 x 4 KiB in one request vs 1024 x 256 KiB", ratio, ">= 0.50",
                        ratio >= 0.50, "x",
                        f"{small['gbps']} GB/s vs {big['gbps']} GB/s ({small['copies']} copies)"))
    return raw, checks


def tcp_suite(r: Runner, iperf3: str | None, many: int) -> tuple[dict, list]:
    raw, checks = {}, []
    seconds = 2 if r.quick else 5
    common = ["--transport", "tcp", "--op", "WRITE", "--block-sizes", "64MiB", "--batch-sizes",
              "1", "--duration", f"{seconds}s", "--warmup", "3"]
    one = r.p2p(*common, "--streams", "1")
    raw["freight_1_stream"] = one
    one_gbps = row(one, 64 * MIB)["gbps"]
    chunk = one["config"]["tcp"]["chunk_size"]
    if iperf3:
        log(f"iperf3 -P 1 -t {seconds} (default and {chunk}-byte writes)")
        ip_default = iperf3_gbps(iperf3, 1, seconds, None)
        ip_chunk = iperf3_gbps(iperf3, 1, seconds, chunk)
        raw["iperf3_1_stream"] = ip_default
        raw["iperf3_1_stream_chunk_writes"] = ip_chunk
        # The target names iperf3 as packaged, i.e. its default settings; the run with
        # writes as large as freight's chunks is reported beside it. (iperf3 sends one
        # cache-resident buffer over and over; freight moves a 64 MiB region.)
        ratio = one_gbps / ip_default["gbps"]
        checks.append(check("tcp 1 stream vs iperf3 -P 1 (default settings)", ratio,
                            ">= 0.90", ratio >= 0.90, "x",
                            f"freight {one_gbps} GB/s; iperf3 {ip_default['gbps']} GB/s "
                            f"(128 KiB writes); iperf3 with {chunk // 1024} KiB writes "
                            f"{ip_chunk['gbps']} GB/s, freight at "
                            f"{one_gbps / ip_chunk['gbps']:.2f}x of that"))
    else:
        checks.append(check("tcp 1 stream vs iperf3", 0.0, ">= 0.90", None, "x",
                            "iperf3 not found: not compared"))
    multi = r.p2p(*common, "--streams", str(many))
    raw[f"freight_{many}_streams"] = multi
    many_gbps = row(multi, 64 * MIB)["gbps"]
    ratio = many_gbps / one_gbps
    cores = os.cpu_count() or 1
    applies = cores >= 16
    checks.append(check(f"tcp {many} streams vs 1 stream", ratio, ">= 3 (16+ cores)",
                        (ratio >= 3.0) if applies else None, "x",
                        f"{many_gbps} GB/s vs {one_gbps} GB/s"
                        + ("" if applies else f"; target applies to 16+ cores, this host has {cores}")))
    if iperf3:
        ip_many = iperf3_gbps(iperf3, many, seconds, chunk)
        raw[f"iperf3_{many}_streams"] = ip_many
        checks[-1]["note"] += f"; iperf3 -P {many}: {ip_many['gbps']} GB/s ({ip_many['version']})"
    return raw, checks


def descriptor_suite(r: Runner) -> tuple[dict, list]:
    doc = r.freight_json("descriptors", "--reps", "5" if r.quick else "20")
    ops = {x["operation"]: x for x in doc["rows"]}
    prep = ops["prepare_local"]["median_us"] / 1e3
    checks = [
        check("prepare 65536 descriptors (prepare_local, median)", prep, "<= 0.5 ms", prep <= 0.5, "ms",
              f"best {ops['prepare_local']['best_us'] / 1e3:.3f} ms; prepare_remote median "
              f"{ops['prepare_remote']['median_us'] / 1e3:.3f} ms"),
        check("register 10,000 regions (median)", ops["register regions"]["median_us"] / 1e3,
              "report", None, "ms",
              f"deregister: {ops['deregister regions']['median_us'] / 1e3:.3f} ms"),
    ]
    return {"descriptors": doc}, checks


def notif_suite(r: Runner, python: str | None) -> tuple[dict, list]:
    name = "shm 4 KiB WRITE's notification, post to seen by a polling target, p50"
    if not python:
        return {}, [check(name, 0.0, "<= 20 us", None, "us",
                          "freight's Python module not found (scripts/setup.sh, or --python): not measured")]
    cmd = [python, str(ROOT / "bench" / "peers" / "notif_latency.py"), "--count", r.iters(5000, 500)]
    log(" ".join(cmd[1:]))
    doc = run_json(cmd, timeout=900, check=True)
    seen = doc["post_to_seen_us"]
    return {"latency_4k_write_notif": doc}, [check(
        name, seen["p50"], "<= 20 us", seen["p50"] <= 20.0, "us",
        f"p99 {seen['p99']} us over {doc['count']} notifications; post to done p50 "
        f"{doc['post_to_done_us']['p50']} us")]


def freight_python(given: str | None) -> str | None:
    """An interpreter that can import freight: `given`, else the repository's .venv, else
    this one."""
    venv = ROOT / ".venv" / "bin" / "python"
    for py in [given] if given else [str(venv), sys.executable]:
        if py and subprocess.run([py, "-c", "import freight"], capture_output=True).returncode == 0:
            return py
    return None


def table(checks: list) -> str:
    verdict = {True: "met", False: "MISSED", None: "-"}
    rows = [("Check", "Value", "Target", "Result")] + [
        (c["check"], f"{c['value']} {c['unit']}", c["target"], verdict[c["met"]]) for c in checks]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="name of this machine for the report")
    ap.add_argument("--out", type=Path, help="JSON file to write (default: print only)")
    ap.add_argument("--freight", default=os.environ.get("FREIGHT_BIN")
                    or str(ROOT / "target" / "release" / "freight"),
                    help="freight binary (default: target/release/freight or $FREIGHT_BIN)")
    ap.add_argument("--iperf3", default=shutil.which("iperf3"), help="iperf3 binary (default: from PATH)")
    ap.add_argument("--streams", type=int, default=8, help="streams of the multi-stream tcp run")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, not a report)")
    ap.add_argument("--python", help="interpreter with freight installed, for the notification suite "
                    "(default: .venv/bin/python, else this one)")
    ap.add_argument("--only", choices=["shm", "tcp", "descriptors", "notif"], action="append",
                    help="run only these suites (repeatable)")
    args = ap.parse_args()

    if not (Path(args.freight).is_file() and os.access(args.freight, os.X_OK)):
        ap.error(f"no freight binary at {args.freight} (build it with cargo build --release -p freight-cli)")
    suites = args.only or ["shm", "tcp", "descriptors", "notif"]
    r = Runner(args.freight, args.quick)
    doc = {"tool": "bench/engine.py", "percentile": PERCENTILE, "machine": machine_info(args.machine),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": args.quick,
           "results": {}, "checks": []}
    t0 = time.monotonic()
    for name in suites:
        if name == "shm":
            raw, checks = shm_suite(r)
        elif name == "tcp":
            raw, checks = tcp_suite(r, args.iperf3, args.streams)
        elif name == "notif":
            raw, checks = notif_suite(r, freight_python(args.python))
        else:
            raw, checks = descriptor_suite(r)
        doc["results"][name] = raw
        doc["checks"] += checks
    doc["seconds"] = round(time.monotonic() - t0, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {args.out}")
    print(f"\nfreight engine benchmarks on {args.machine} "
          f"({doc['machine']['cpus']} CPUs, {doc['machine']['cpu_model']}), {doc['seconds']} s\n")
    print(table(doc["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
