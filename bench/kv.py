#!/usr/bin/env python3
"""The KV server beside Redis, in one run on one machine, over loopback.

For each value size, Redis 7 (Debian's redis-server, measured by its own
redis-benchmark: SET, then GET of keys that all exist, 4 clients) and freight (`freight serve`, measured by
`freight kv-bench`: 4 reader threads, each a client of its own, over shared memory and
over tcp, where clients take the server's direct connection; and over tcp through the
engine, as before direct connections) serve the same number of keys of that size. Each
is measured three times against one server, and the median run counts. Beside them,
plain TCP sockets (four pairs of processes sending values and reading them, no protocol)
show what the machine's loopback allows. Writes one JSON document and prints a table
last, with the targets (GET ops/s as a multiple of Redis's):

  4 KiB    shared memory >= 1.5x; tcp >= 1x, and p50 under load <= Redis's p50
  64 KiB   shared memory >= 2x; tcp >= 1.5x
  1 MiB    shared memory >= 3x; tcp >= 2x

    python3 bench/kv.py --machine "2-vCPU VM" --out bench/results/kv-dev-vm-2cpu.json

Redis comes from Debian's packages (redis-server, redis-tools): the script installs them
with apt-get when it runs as root and they are missing. Only the standard library is
used.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reporting import PERCENTILE, free_port, host_machine, median, run_json  # noqa: E402

SIZES = {"4KiB": 4096, "64KiB": 65536, "1MiB": 1 << 20}
# Keys per size (freight's kv-bench reads each once, across its threads; Redis's
# benchmark makes as many GETs over as many keys): enough for about a second of reads
# on a small machine, within its memory.
KEYS = {"4KiB": 50_000, "64KiB": 10_000, "1MiB": 1_000}
CLIENTS = 4


def ensure_redis() -> None:
    if shutil.which("redis-server") and shutil.which("redis-benchmark"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("Redis is missing: apt-get install redis-server redis-tools (Debian packages)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "-q", "redis-server", "redis-tools"], check=True, env=env)


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on port {port} within {timeout:.0f} s")


# Each side is measured this many times against one server; the median run counts (a
# small virtual machine's first run is often far off).
REPEATS = 3


def median_run(runs: list[dict]) -> dict:
    """The run whose GET ops/s is the median (reporting.median), with every run's."""
    rates = [r["ops_per_sec"] for r in runs]
    middle = median(rates)
    return {**next(r for r in runs if r["ops_per_sec"] == middle), "runs_ops_per_sec": rates}


def measure(server_cmd: list[str], port: int, what: str, run_once) -> dict:
    """Starts a server, calls `run_once()` REPEATS times against it, stops it; the
    median run."""
    server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, server, what)
        runs = [run_once() for _ in range(REPEATS)]
    finally:
        server.terminate()
        server.wait(timeout=20)
    return median_run(runs)


def redis_fill(port: int, size: int, keys: int) -> None:
    """Stores every key the benchmark's GETs can name (redis-benchmark's `-r` keys are
    `key:` and twelve digits), so that Redis, like freight, answers every GET with a
    value: its own SET phase picks keys at random and leaves about a third unset."""
    value = b"x" * size
    fill = subprocess.Popen(["redis-cli", "-p", str(port), "--pipe"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)
    for i in range(keys):
        key = b"key:%012d" % i
        fill.stdin.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size) + value + b"\r\n")
    fill.stdin.close()
    if fill.wait(timeout=600) != 0:
        sys.exit("redis-cli --pipe failed to store the keys")


def redis_stats(port: int) -> dict:
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "stats"], check=True, capture_output=True,
                         text=True).stdout
    return {k: int(v) for k, v in (line.split(":", 1) for line in out.split() if ":" in line) if v.isdigit()}


def redis_run(size: int, keys: int) -> dict:
    port = free_port()

    def benchmark(test: str) -> dict:
        out = subprocess.run(
            ["redis-benchmark", "-p", str(port), "-t", test, "-d", str(size), "-c", str(CLIENTS),
             "-n", str(keys), "-r", str(keys), "--csv"],
            check=True, capture_output=True, text=True, timeout=600,
        ).stdout
        return next(r for r in csv.DictReader(io.StringIO(out)) if r["test"] == test.upper())

    def once() -> dict:
        put = benchmark("set")
        redis_fill(port, size, keys)
        before = redis_stats(port)
        get = benchmark("get")
        after = redis_stats(port)
        hits = after["keyspace_hits"] - before["keyspace_hits"]
        misses = after["keyspace_misses"] - before["keyspace_misses"]
        if misses:
            sys.exit(f"Redis missed {misses} of {hits + misses} GETs: the fill did not store every key")
        return {
            "ops_per_sec": float(get["rps"]),
            "p50_us": float(get["p50_latency_ms"]) * 1000,
            "p99_us": float(get["p99_latency_ms"]) * 1000,
            "set_ops_per_sec": float(put["rps"]),
            "get_hits": hits,
        }

    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return measure(cmd, port, "redis-server", once)


def socket_pair(size: int, keys: int, seconds: float, start, results) -> None:
    """One server process and one client process over a plain loopback tcp socket: the
    client asks for value i (8 bytes), the server sends its `size` bytes from a store of
    `keys` values, the client reads them into one buffer. No protocol, no checks: what
    the kernel's loopback path allows, the ceiling of any server over tcp."""
    import mmap
    import multiprocessing as mp

    def serve(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        store = mmap.mmap(-1, size * keys)
        view = memoryview(store)
        for off in range(0, size * keys, 4096):
            view[off] = 1
        while (req := conn.recv(8)) and len(req) == 8:
            i = int.from_bytes(req, "little") % keys
            conn.sendall(view[i * size:(i + 1) * size])

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    server = mp.get_context("fork").Process(target=serve, args=(listener,), daemon=True)
    server.start()
    with socket.create_connection(listener.getsockname()) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = memoryview(bytearray(size))
        start.wait()  # every pair starts at once
        done, i, deadline = 0, os.getpid(), time.monotonic() + seconds
        while time.monotonic() < deadline:
            i = (i * 7919 + 1) % keys
            c.sendall(i.to_bytes(8, "little"))
            got = 0
            while got < size:
                got += c.recv_into(out[got:])
            done += 1
    server.kill()
    results.put(done / seconds)


def socket_ceiling(size: int, keys: int, seconds: float = 3.0) -> dict:
    """CLIENTS plain-socket pairs at once (separate processes): GETs per second."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start, results = ctx.Barrier(CLIENTS), ctx.Queue()
    keys = max(1, min(keys, (1 << 30) // size // CLIENTS))  # at most 1 GiB of values per pair
    pairs = [ctx.Process(target=socket_pair, args=(size, keys, seconds, start, results)) for _ in range(CLIENTS)]
    for p in pairs:
        p.start()
    total = sum(results.get(timeout=seconds + 120) for _ in pairs)
    for p in pairs:
        p.join()
    return {"ops_per_sec": total, "pairs": CLIENTS, "seconds": seconds}


def freight_run(freight: list[str], size: int, keys: int, transport: str, direct: bool = True) -> dict:
    port = free_port()
    memory_mb = max(64, keys * size * 5 // 4 // (1 << 20) + 16)

    def once() -> dict:
        d = run_json([*freight, "kv-bench", "--server-addr", f"http://127.0.0.1:{port}", "--num-keys", str(keys),
                      "--value-size", str(size), "--num-threads", str(CLIENTS), "--buffer-mb",
                      str(max(8, 2 * size >> 20)), "--transport", transport, "--verify", "sample", "--warmup", "100",
                      "--json", *([] if direct else ["--no-direct"])], check=True)
        return {
            "direct": d["direct"],
            "ops_per_sec": d["read"]["ops_per_sec"],
            "p50_us": d["read_latency_us"]["median"],
            "p99_us": d["read_latency_us"]["p99"],
            "set_ops_per_sec": d["write"]["ops_per_sec"],
            "single_get_p50_us": d["latency_us"]["median"],
        }

    cmd = [*freight, "serve", "--listen", f"127.0.0.1:{port}", "--memory-mb", str(memory_mb), "--transport", transport]
    return measure(cmd, port, "freight serve", once)


TARGETS = {  # size -> (transport -> minimum ratio of GET ops/s to Redis's)
    "4KiB": {"shm": 1.5, "tcp": 1.0},
    "64KiB": {"shm": 2.0, "tcp": 1.5},
    "1MiB": {"shm": 3.0, "tcp": 2.0},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", required=True, help="the machine, in words")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--freight", default=str(ROOT / "target/release/freight"),
                    help="the freight command (default: the release build); e.g. 'python3 -m freight'")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the number of keys of every size")
    ap.add_argument("--sizes", default=",".join(SIZES), help="value sizes to run (default: all)")
    args = ap.parse_args()
    ensure_redis()
    freight = args.freight.split()
    results = []
    for name in args.sizes.split(","):
        size = SIZES[name]
        keys = max(100, int(KEYS[name] * args.scale))
        row = {"size": name, "bytes": size, "keys": keys, "redis": redis_run(size, keys),
               "plain_tcp": socket_ceiling(size, keys)}
        # tcp through the engine, as clients moved values over tcp before direct connections.
        row["freight_tcp_engine"] = freight_run(freight, size, keys, "tcp", direct=False)
        for transport in ("shm", "tcp"):
            row[f"freight_{transport}"] = freight_run(freight, size, keys, transport)
            ratio = row[f"freight_{transport}"]["ops_per_sec"] / row["redis"]["ops_per_sec"]
            target = TARGETS[name][transport]
            row[f"{transport}_ratio"] = ratio
            row[f"{transport}_target"] = target
            row[f"{transport}_met"] = None if target is None else ratio >= target
        if name == "4KiB":
            row["p50_met"] = row["freight_shm"]["p50_us"] <= row["redis"]["p50_us"]
            row["tcp_p50_met"] = row["freight_tcp"]["p50_us"] <= row["redis"]["p50_us"]
        results.append(row)
        print(f"[kv] {name}: redis {row['redis']['ops_per_sec']:.0f} ops/s, freight shm "
              f"{row['freight_shm']['ops_per_sec']:.0f}, tcp {row['freight_tcp']['ops_per_sec']:.0f}", flush=True)
    doc = {
        "benchmark": "bench/kv.py",
        "machine": args.machine,
        "host": host_machine(),
        # freight's percentiles are the CLI's (the same definition); Redis's are redis-benchmark's own,
        # which prints only its summary.
        "percentile": PERCENTILE,
        "redis_percentile": "redis-benchmark's own (its --csv summary), not taken from samples here",
        "clients": CLIENTS,
        "redis": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n| value | Redis GET ops/s (p50 us) | freight shm ops/s (p50 us) | ratio | freight tcp ops/s (p50 us) "
          "| ratio | tcp through the engine ops/s | plain tcp sockets ops/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        def cell(t: str) -> str:
            met = r[f"{t}_met"]
            mark = "" if met is None else (" ok" if met else f" MISSED (target {r[f'{t}_target']}x)")
            return f"{r[f'{t}_ratio']:.2f}x{mark}"
        print(f"| {r['size']} | {r['redis']['ops_per_sec']:.0f} ({r['redis']['p50_us']:.0f}) | "
              f"{r['freight_shm']['ops_per_sec']:.0f} ({r['freight_shm']['p50_us']:.0f}) | {cell('shm')} | "
              f"{r['freight_tcp']['ops_per_sec']:.0f} ({r['freight_tcp']['p50_us']:.0f}) | {cell('tcp')} | "
              f"{r['freight_tcp_engine']['ops_per_sec']:.0f} | {r['plain_tcp']['ops_per_sec']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
