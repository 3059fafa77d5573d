#!/usr/bin/env python3
"""Disaggregated serving under load: prefill and decode ``vllm serve`` instances behind
``freight proxy``, driven by ``vllm bench serve`` at several concurrencies, for each
transfer backend in one run: freight over shm, tcp and fabric (libfabric's tcp
provider), switched by environment only (``FREIGHT_TRANSPORT``,
``FREIGHT_FABRIC_PROVIDER``), beside NixlConnector over UCX (and NIXL's LIBFABRIC
backend, ``kv_connector_extra_config.backends``).

Per configuration and concurrency (``vllm bench serve``'s own numbers, from its saved
result): average and P99 end-to-end latency, TTFT (average, P50, P99), inter-token
latency (average, P99), output tokens/s, requests/s, failed requests. Per
configuration: the connector's handshakes on the decode instance and their total time
(freight: its ``vllm:freight_handshake_seconds`` metric; NIXL: the two timed steps of
its handshake that vLLM logs at debug level: every instance here runs with a logging
configuration, ``VLLM_LOGGING_CONFIG_PATH``, that shows debug lines of NixlConnector's
worker module only). The model is bench/vllm_pd.py's (KV large next to
its compute: 64 KiB a token in float32), made here with random weights.

    V=$(bash scripts/vllm-env.sh)
    PYTHONPATH=python $V/bin/python bench/serve.py --machine "dev VM, 2 CPUs" \\
        --json bench/results/serve-dev-vm-2cpu.json --plot docs/serving.png

Across hosts: the two namespaces of scripts/netns.sh stand for two hosts joined by a
veth pair. Run this in side b (decode instance, proxy and client there) with
``--prefill-netns a``: the prefill instance starts in side a, at 10.77.0.1, and the KV
crosses the pair (freight over tcp and fabric, NIXL over UCX's tcp transport:
``UCX_TLS=tcp,self``, since UCX would otherwise find the one machine's shared memory).

    bash scripts/netns.sh up 1
    bash scripts/netns.sh exec b env PYTHONPATH=python $V/bin/python bench/serve.py \
        --prefill-netns a --configs freight-tcp,freight-fabric,nixl-ucx \
        --machine "dev VM, 2 CPUs, two network namespaces" --json bench/results/serve-netns-dev-vm-2cpu.json
    bash scripts/netns.sh down

``--plot`` draws each metric against concurrency, a line per configuration. Prints a
progress bar per run (``vllm bench serve``'s), the seed's table (metric,
NixlConnector, freight, gain) per concurrency for the two configurations of
``--compare``, and a table of every configuration last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from typing import Any, Dict, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("FREIGHT_VLLM_VENV", sys.prefix)

import vllm_serving as vs  # noqa: E402
from reporting import PERCENTILE, logger  # noqa: E402
from vllm_pd import MODEL  # noqa: E402

log = logger("serve")

# name: (connector, environment of both instances, kv_connector_extra_config)
CONFIGS: Dict[str, Tuple[str, Dict[str, str], Optional[Dict[str, Any]]]] = {
    "freight-shm": ("freight", {"FREIGHT_TRANSPORT": "shm"}, None),
    "freight-tcp": ("freight", {"FREIGHT_TRANSPORT": "tcp"}, None),
    "freight-fabric": ("freight", {"FREIGHT_TRANSPORT": "fabric", "FREIGHT_FABRIC_PROVIDER": "tcp"}, None),
    "nixl-ucx": ("nixl", {}, {"backends": ["UCX"]}),
    # vLLM gives NIXL's UCX backend 4 threads by default; NIXL's own default is none,
    # kinder to a host of few cores.
    "nixl-ucx-0t": ("nixl", {}, {"backends": ["UCX"], "num_threads": 0}),
    "nixl-libfabric": ("nixl", {}, {"backends": ["LIBFABRIC"]}),
}
# NIXL's LIBFABRIC plugin in its PyPI wheel links the CUDA driver and runtime: on a
# host without them it does not load (docs/serving.md), so it is not run by default.
DEFAULT_CONFIGS = ["freight-shm", "freight-tcp", "freight-fabric", "nixl-ucx"]
# vLLM's logging at INFO, but for the module that times NIXL's handshake.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
                                       "[%(name)s] %(message)s", "datefmt": "%m-%d %H:%M:%S"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain", "level": "DEBUG",
                         "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker": {"level": "DEBUG"}},
}
# (key in the report, key in vllm bench serve's result, label)
METRICS = [
    ("latency_avg_ms", "mean_e2el_ms", "latency avg (ms)"),
    ("latency_p99_ms", "p99_e2el_ms", "latency P99 (ms)"),
    ("ttft_avg_ms", "mean_ttft_ms", "TTFT avg (ms)"),
    ("ttft_p50_ms", "median_ttft_ms", "TTFT P50 (ms)"),
    ("ttft_p99_ms", "p99_ttft_ms", "TTFT P99 (ms)"),
    ("itl_avg_ms", "mean_itl_ms", "inter-token latency avg (ms)"),
    ("itl_p99_ms", "p99_itl_ms", "inter-token latency P99 (ms)"),
    ("output_tokens_per_s", "output_throughput", "output tokens/s"),
    ("requests_per_s", "request_throughput", "requests/s"),
]
# Each side's end of scripts/netns.sh's first veth pair.
NETNS_ADDRESS = {"a": "10.77.0.1", "b": "10.77.0.2"}
HIGHER_IS_BETTER = {"output_tokens_per_s", "requests_per_s"}
# vllm bench serve takes the percentiles itself, and its saved result holds them, not the
# samples: the report says whose they are.
SERVE_PERCENTILE = (f"vllm bench serve's own, the same for every configuration: numpy's median and percentile, "
                    f"which interpolate between two samples (not bench/reporting.py's {PERCENTILE})")
NIXL_HANDSHAKE = re.compile(r"NIXL handshake: (?:get metadata|add agent) took: ([0-9.eE+-]+)")


def parse_list(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers of at least 1")
    return out


def parse_configs(text: str) -> List[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration {', '.join(unknown) or text!r}: "
                                         f"choose from {', '.join(CONFIGS)}")
    return names


def warm_up(url: str, decode: vs.Instance, attempts: int = 3) -> None:
    """Requests until one passes: the first connects the instances (and NIXL's first
    handshake on two busy cores can time out, see tests/test_vllm.py)."""
    for attempt in range(1, attempts + 1):
        try:
            vs.complete(url, vs.prompts(1, 40, seed=100 + attempt)[0], 2)
            return
        except urllib.error.HTTPError as e:
            log(f"warm-up request {attempt} failed ({e.code}); trying again")
            time.sleep(2)
    raise RuntimeError(f"no request passed in {attempts} attempts:\n{decode.tail(60)}")


def handshakes(connector: str, decode: vs.Instance) -> Dict[str, Any]:
    """How many connections the decode instance's connector made, and their set-up time."""
    if connector == "freight":
        m = decode.metrics()
        count = sum(v for k, v in m.items() if k.startswith("vllm:freight_handshake_seconds_count"))
        total = sum(v for k, v in m.items() if k.startswith("vllm:freight_handshake_seconds_sum"))
        return {"count": int(count), "total_ms": total * 1e3, "source": "vllm:freight_handshake_seconds"}
    times = [float(x) for x in NIXL_HANDSHAKE.findall(decode.text())]
    # Two timed steps per handshake: fetching the metadata, adding the remote agent.
    return {"count": len(times) // 2, "total_ms": sum(times) * 1e3,
            "source": "NixlConnector's debug log (get metadata + add agent)"}


def bench_serve(url: str, model: pathlib.Path, concurrency: int, prompts: int, args: argparse.Namespace,
                out_dir: pathlib.Path, stdout_log: pathlib.Path) -> Dict[str, Any]:
    name = f"c{concurrency}.json"
    cmd = [str(pathlib.Path(sys.prefix) / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    with open(stdout_log, "a") as out:
        # Its progress bar (stderr) shows here; its printed summary goes to the log.
        run = subprocess.run(cmd, stdout=out, env=env, timeout=args.timeout)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {run.returncode} (see {stdout_log})")
    raw = json.loads((out_dir / name).read_text())
    row: Dict[str, Any] = {"concurrency": concurrency, "prompts": prompts, "completed": raw.get("completed"),
                           "failed": raw.get("failed", prompts - (raw.get("completed") or 0)),
                           "duration_s": raw.get("duration")}
    for key, source, _ in METRICS:
        row[key] = raw.get(source)
    return row


def first_error(text: str) -> Optional[str]:
    """The line of an instance's log that says why it did not start: the first error of
    a C++ library ("E1204 ..." of glog), else the first Python exception logged at
    ERROR level."""
    lines = text.splitlines()
    for pattern in (r"^E\d{4} ", r" ERROR .*\b\w+(Error|Exception): "):
        for line in lines:
            if re.search(pattern, line):
                return line.strip()[:300]
    return None


def run_config(name: str, model: pathlib.Path, args: argparse.Namespace, work: pathlib.Path) -> Dict[str, Any]:
    connector, env, extra = CONFIGS[name]
    logs = work / name
    logs.mkdir()
    (logs / "logging.json").write_text(json.dumps(LOGGING))
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": args.kv_space, "VLLM_LOGGING_CONFIG_PATH": str(logs / "logging.json")}
    length = args.input_len + args.output_len + 64
    # After the defaults of tests/vllm_serving.py, so they win: the dtype, and room for
    # the sweep's highest concurrency in one batch.
    seqs = str(max(8, max(args.concurrency)))
    common = dict(env=env, max_model_len=length, args=["--dtype", args.dtype, "--max-num-seqs", seqs])
    log(f"{name}: starting a prefill and a decode instance")
    prefill_extra, where = extra, {}
    if args.prefill_netns:
        # The prefill instance in the other namespace: its API, its connector's listener
        # (freight's agent, NIXL's side channel) on the address of its end of the pair.
        host = NETNS_ADDRESS[args.prefill_netns]
        where = {"host": host, "prefix": ["bash", str(ROOT / "scripts" / "netns.sh"), "exec",
                                                        args.prefill_netns]}
        if connector == "freight":
            prefill_extra = {**(extra or {}), "listen": f"{host}:0"}
        else:
            # UCX would find the shared memory of the one machine under the two
            # namespaces (its shm and cma transports): keep it on the network, as
            # between two hosts.
            env["UCX_TLS"] = "tcp,self"
    prefill = vs.Instance(model, logs / "prefill.log", connector, "kv_producer", extra=prefill_extra, **where,
                          **common)
    decode = vs.Instance(model, logs / "decode.log", connector, "kv_consumer", extra=extra, **common)
    proxy = None
    try:
        prefill.wait_ready(600)
        decode.wait_ready(600)
        proxy = vs.ProxyProcess(prefill, decode, logs / "proxy.log")
        warm_up(proxy.url, decode)
        rows = []
        for c in args.concurrency:
            n = args.num_prompts or max(10, 2 * c)
            log(f"{name}: concurrency {c}, {n} requests of {args.input_len} + {args.output_len} tokens")
            rows.append(bench_serve(proxy.url, model, c, n, args, logs, logs / "bench.log"))
        shakes = handshakes(connector, decode)
        transport = None
        if connector == "freight":
            found = re.findall(r"transport (\w+)", decode.text())
            transport = found[-1] if found else None
        errors = sum(v for k, v in proxy.metrics().items() if k.startswith("freight_proxy_errors_total"))
        return {"name": name, "connector": connector, "env": CONFIGS[name][1], "extra_config": extra,
                "transport_seen": transport, "handshakes": shakes, "proxy_errors": errors, "rows": rows}
    except Exception as e:  # one backend that does not run here must not lose the others
        log(f"{name}: failed: {e}")
        return {"name": name, "connector": connector, "env": CONFIGS[name][1], "extra_config": extra,
                "error": first_error(decode.text() + "\n" + prefill.text()) or str(e).splitlines()[0]}
    finally:
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()


def gain(key: str, nixl: Optional[float], freight: Optional[float]) -> Optional[float]:
    """How much better freight is, as a fraction: +0.25 is 25% better (higher
    throughput, or lower latency); negative is worse."""
    if not nixl or freight is None:
        return None
    return (freight - nixl) / nixl if key in HIGHER_IS_BETTER else (nixl - freight) / nixl


def compare(runs: Dict[str, Dict[str, Any]], nixl: str, freight: str) -> List[Dict[str, Any]]:
    a, b = runs.get(nixl, {}), runs.get(freight, {})
    if "rows" not in a or "rows" not in b:
        return []
    out = []
    for ra, rb in zip(a["rows"], b["rows"]):
        for key, _, label in METRICS:
            out.append({"concurrency": ra["concurrency"], "metric": key, "label": label, "nixl": ra[key],
                        "freight": rb[key], "gain": gain(key, ra[key], rb[key])})
    return out


def tables(doc: Dict[str, Any]) -> str:
    lines = []
    nixl, freight = doc["compare"]
    by_c: Dict[int, List[Dict[str, Any]]] = {}
    for r in doc["comparison"]:
        by_c.setdefault(r["concurrency"], []).append(r)
    for c, rows in by_c.items():
        lines += ["", f"concurrency {c}", "", f"| metric | NixlConnector ({nixl}) | freight ({freight}) | gain |",
                  "| --- | --- | --- | --- |"]
        for r in rows:
            g = "n/a" if r["gain"] is None else f"{r['gain'] * 100:+.0f}%"
            digits = 2 if r["metric"] == "requests_per_s" else 1
            lines.append(f"| {r['label']} | {r['nixl']:.{digits}f} | {r['freight']:.{digits}f} | {g} |")
    lines += ["", "| configuration | handshakes | set-up (ms) | " + " | ".join(
        f"c={c} tok/s / TTFT P99 ms / latency P99 ms" for c in doc["concurrency"]) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in doc["concurrency"]) + " |"]
    for name, run in doc["runs"].items():
        if "rows" not in run:
            lines.append(f"| {name} | failed: {run['error'][:160]} | | " +
                         " | ".join("" for _ in doc["concurrency"]) + " |")
            continue
        h = run["handshakes"]
        cells = [f"{r['output_tokens_per_s']:.0f} / {r['ttft_p99_ms']:.0f} / {r['latency_p99_ms']:.0f}"
                 + (f" ({r['failed']} failed)" if r["failed"] else "") for r in run["rows"]]
        lines.append(f"| {name} | {h['count']} | {h['total_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(14, 11))
    for ax, (key, _, label) in zip(axes.flat, METRICS):
        for name, run in doc["runs"].items():
            if "rows" not in run:
                continue
            xs = [r["concurrency"] for r in run["rows"]]
            ax.plot(xs, [r[key] for r in run["rows"]], marker="o", label=name,
                    linestyle="-" if run["connector"] == "freight" else "--")
        ax.set_title(label)
        ax.set_xlabel("concurrency")
        ax.set_xticks(doc["concurrency"])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"P/D serving through freight proxy, vLLM {doc['vllm']} on {doc['machine']}: "
                 f"{doc['input_len']} prompt + {doc['output_len']} output tokens, "
                 f"{doc['model']['kv_bytes_per_token'] // 1024} KiB KV a token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=parse_configs, default=DEFAULT_CONFIGS,
                    help=f"configurations to run, in order, of {', '.join(CONFIGS)} "
                         f"(default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--concurrency", type=parse_list, default=[1, 5, 10, 20],
                    help="concurrencies to sweep (default 1,5,10,20)")
    ap.add_argument("--num-prompts", type=int, default=0,
                    help="requests per concurrency (default twice the concurrency, at least 10)")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens (default 32)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the instances' dtype (default float32: 64 KiB of KV a token)")
    ap.add_argument("--kv-space", default="3", help="VLLM_CPU_KVCACHE_SPACE, GiB per instance (default 3)")
    ap.add_argument("--compare", default="nixl-ucx,freight-shm", metavar="NIXL,FREIGHT",
                    help="the two configurations of the seed's table (default nixl-ucx,freight-shm)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one vllm bench serve may take")
    ap.add_argument("--prefill-netns", choices=sorted(NETNS_ADDRESS),
                    help="start the prefill instance in this side of scripts/netns.sh (run this script in the "
                         "other side): the KV crosses a veth pair, as between two hosts")
    ap.add_argument("--machine", default=platform.node(), help="what the results name as the machine")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--plot", help="write a PNG of each metric against concurrency (needs matplotlib)")
    args = ap.parse_args()
    compared = args.compare.split(",")
    if len(compared) != 2 or any(c not in CONFIGS for c in compared):
        ap.error(f"--compare {args.compare}: give two configurations, NIXL's then freight's, of {', '.join(CONFIGS)}")
    if args.input_len < 16 or args.output_len < 2:
        ap.error("--input-len must be at least 16 and --output-len at least 2")
    if args.num_prompts < 0:
        ap.error("--num-prompts must be at least 1 (or 0 for the default)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib in this interpreter (pip install matplotlib), or leave --plot out")
    if vs.venv() is None:
        sys.exit("run this with the python of the vLLM virtualenv (scripts/vllm-env.sh)")
    # Stopped from outside: stop the instances too (their process groups), not only this.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = pathlib.Path(tempfile.mkdtemp(prefix="freight-serve-"))
    log(f"logs in {work}")
    model = work / "model"
    cmd = [sys.executable, str(ROOT / "tests" / "vllm_model.py"), str(model)]
    for k, v in MODEL.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    subprocess.run(cmd, check=True, capture_output=True)
    meta = json.loads((model / "freight-model.json").read_text())
    runs = {name: run_config(name, model, args, work) for name in args.configs}
    import vllm

    doc = {"benchmark": "serve-pd", "machine": args.machine, "cpus": os.cpu_count(), "vllm": vllm.__version__,
           "percentile": SERVE_PERCENTILE,
           "model": {**MODEL, "dtype": args.dtype,
                     "kv_bytes_per_token": meta["kv_bytes_per_token"] * (2 if args.dtype == "float32" else 1)},
           "prefill_netns": args.prefill_netns,
           "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
           "num_prompts": args.num_prompts or "max(10, 2 x concurrency)", "compare": compared,
           "comparison": compare(runs, *compared), "runs": runs}
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {args.json}")
    print(tables(doc))
    if args.plot:
        plot(doc, args.plot)
    failed = [n for n, r in runs.items() if "rows" not in r]
    return 1 if any(n in compared for n in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
