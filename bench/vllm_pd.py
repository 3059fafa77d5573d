#!/usr/bin/env python3
"""Disaggregated prefill/decode in vLLM on this machine's CPUs: FreightConnector beside
NixlConnector and one aggregated instance, the same prompts through each, in one run.

A model whose KV is large next to its compute (tests/vllm_model.py: 4 layers, 16 KV
heads of 128, random weights; in float32 by default, 64 KiB of KV per token) serves
prompts of 1k to 8k tokens, greedy, a few answer tokens each:

- aggregated: one ``vllm serve``, no connector;
- freight: a prefill and a decode instance with FreightConnector, the P/D proxy
  (``freight proxy``) before them;
- nixl: the same with NixlConnector (NIXL's UCX backend, ``kv_buffer_device: cpu``).

Per request: the KV transfer time as the decode instance's connector measures it (the
``xfer_time_seconds`` histogram each connector exports: freight's engine clock, NIXL's
own telemetry), the bytes moved, TTFT at the client (streamed), and the text, which
must equal the aggregated instance's. Requests go one at a time (the first of each
configuration connects the instances and is not measured). Prints a table last;
``--out`` writes the JSON, ``--plot`` a PNG (needs matplotlib).

    V=$(bash scripts/vllm-env.sh)
    PYTHONPATH=python $V/bin/python bench/vllm_pd.py --machine "dev VM, 2 CPUs" \\
        --out bench/results/vllm-pd-dev-vm-2cpu.json --plot docs/vllm-pd.png
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("FREIGHT_VLLM_VENV", sys.prefix)

import vllm_serving as vs  # noqa: E402
from freight.vllm.config import Settings  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from reporting import PERCENTILE, percentile  # noqa: E402

LENGTHS = (1024, 2048, 4096, 8192)
MODEL = {"layers": 4, "hidden": 256, "heads": 16, "kv_heads": 16, "head_dim": 128, "intermediate": 512,
         "context": 8704}
ANSWER = 8
METRIC = {"freight": "vllm:freight_xfer_time_seconds", "nixl": "vllm:nixl_xfer_time_seconds"}
BYTES = {"freight": "vllm:freight_bytes_transferred", "nixl": "vllm:nixl_bytes_transferred"}


def total(metrics: Dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def make_prompts(model: pathlib.Path, lengths, per_length: int, seed: int) -> Dict[int, List[str]]:
    """Prompts of about ``length`` tokens (the model's own tokenizer counts them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    words = ("prefill decode block layer cache memory token value key transfer engine host device request "
             "answer number one two three four five six seven eight nine ten hundred").split()
    out: Dict[int, List[str]] = {}
    for n in lengths:
        prompts = []
        for i in range(per_length):
            text = f"{n} {i} " + " ".join(rng.choice(words) for _ in range(n))
            ids = tok(text)["input_ids"][: n - 8]
            prompts.append(tok.decode(ids))
        out[n] = prompts
    return out


def stream(url: str, prompt: str, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One streamed greedy completion: TTFT, total time, text, prompt tokens."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    text, prompt_tokens = [], None
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    done = time.perf_counter()
    return {"ttft_s": (first or done) - started, "total_s": done - started, "text": "".join(text),
            "prompt_tokens": prompt_tokens}


def wait_count(instance: vs.Instance, name: str, above: float, timeout: float = 30.0) -> Dict[str, float]:
    """The instance's metrics once ``name``'s count rose above ``above``."""
    deadline = time.monotonic() + timeout
    while True:
        m = instance.metrics()
        if total(m, name + "_count") > above or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def run_config(name: str, model: pathlib.Path, prompts: Dict[int, List[str]], logs: pathlib.Path,
               env: Dict[str, str], dtype: str, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    print(f"[vllm_pd] {name}: starting", flush=True)
    length = MODEL["context"]
    args = ["--dtype", dtype]  # after the default, so it wins
    if name == "aggregated":
        single = vs.Instance(model, logs / "aggregated.log", env=env, max_model_len=length, args=args).wait_ready(600)
        instances, url, decode = [single], single.url, None
    else:
        prefill = vs.Instance(model, logs / f"{name}-prefill.log", name, "kv_producer", env=env,
                              max_model_len=length, extra=extra, args=args)
        decode = vs.Instance(model, logs / f"{name}-decode.log", name, "kv_consumer", env=env,
                             max_model_len=length, extra=extra, args=args)
        instances = [prefill, decode]
        prefill.wait_ready(600)
        decode.wait_ready(600)
        proxy = vs.ProxyProcess(prefill, decode, logs / f"{name}-proxy.log")
        url = proxy.url
    rows = []
    try:
        warm = stream(url, "warm up " * 40)  # connects the instances: not measured
        handshake = None
        if decode is not None:
            m = wait_count(decode, METRIC[name], 0)
            if name == "freight":
                handshake = total(m, "vllm:freight_handshake_seconds_sum")
        for n, texts in prompts.items():
            for text in texts:
                before = decode.metrics() if decode is not None else {}
                got = stream(url, text)
                row = {"length": n, **got}
                if decode is not None:
                    count = total(before, METRIC[name] + "_count")
                    after = wait_count(decode, METRIC[name], count)
                    row["transfers"] = total(after, METRIC[name] + "_count") - count
                    row["transfer_s"] = total(after, METRIC[name] + "_sum") - total(before, METRIC[name] + "_sum")
                    row["bytes"] = total(after, BYTES[name] + "_sum") - total(before, BYTES[name] + "_sum")
                rows.append(row)
                print(f"[vllm_pd] {name}: {n} tokens: TTFT {got['ttft_s'] * 1e3:.0f} ms"
                      + (f", transfer {row['transfer_s'] * 1e3:.1f} ms of {row['bytes'] / 2**20:.0f} MiB"
                         if decode is not None else ""), flush=True)
    finally:
        if decode is not None:
            proxy.stop()
        for i in instances:
            i.stop()
    return {"rows": rows, "warm_ttft_s": warm["ttft_s"], "handshake_s": handshake}


def summarize(results: Dict[str, Any], lengths) -> List[Dict[str, Any]]:
    out = []
    for n in lengths:
        row: Dict[str, Any] = {"length": n}
        for name in ("aggregated", "freight", "nixl"):
            mine = [r for r in results[name]["rows"] if r["length"] == n]
            row[f"{name}_ttft_p50_s"] = percentile([r["ttft_s"] for r in mine], 50)
            row[f"{name}_ttft_p99_s"] = percentile([r["ttft_s"] for r in mine], 99)
            if name != "aggregated":
                row[f"{name}_transfer_p50_s"] = percentile([r["transfer_s"] for r in mine], 50)
                row[f"{name}_transfer_p99_s"] = percentile([r["transfer_s"] for r in mine], 99)
                row[f"{name}_mib"] = statistics.mean(r["bytes"] for r in mine) / 2**20
                agg = [r["text"] for r in results["aggregated"]["rows"] if r["length"] == n]
                row[f"{name}_outputs_identical"] = [r["text"] for r in mine] == agg
        row["transfer_ratio_p50"] = row["freight_transfer_p50_s"] / row["nixl_transfer_p50_s"]
        row["transfer_ratio_p99"] = row["freight_transfer_p99_s"] / row["nixl_transfer_p99_s"]
        row["ttft_ratio_p50"] = row["freight_ttft_p50_s"] / row["nixl_ttft_p50_s"]
        out.append(row)
    return out


def plot(summary: List[Dict[str, Any]], path: str, machine: str, freight_extra: Dict[str, Any], dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    xs = [r["length"] for r in summary]
    label = {"aggregated": "aggregated", "nixl": "nixl",
             "freight": "freight" + (" " + json.dumps(freight_extra) if freight_extra else "")}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("freight", "o-"), ("nixl", "s--")):
        a.plot(xs, [r[f"{name}_transfer_p50_s"] * 1e3 for r in summary], style, label=f"{label[name]} p50")
        a.plot(xs, [r[f"{name}_transfer_p99_s"] * 1e3 for r in summary], style, alpha=0.4, label=f"{label[name]} p99")
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="KV transfer per request (ms)",
          title="KV transfer time (decode connector)")
    a.set_xticks(xs, [str(x) for x in xs])
    for name, style in (("aggregated", "^:"), ("freight", "o-"), ("nixl", "s--")):
        b.plot(xs, [r[f"{name}_ttft_p50_s"] for r in summary], style, label=label[name])
    b.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT p50 (s)", title="Time to first token")
    b.set_xticks(xs, [str(x) for x in xs])
    for ax in (a, b):
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    number = 4 if dtype == "float32" else 2
    kib = MODEL["layers"] * 2 * MODEL["kv_heads"] * MODEL["head_dim"] * number // 1024
    fig.suptitle(f"vLLM P/D on CPUs ({machine}): FreightConnector vs NixlConnector, {dtype}, {kib} KiB of KV a token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", default=platform.node(), help="what the results name as the machine")
    ap.add_argument("--out", help="write the results here as JSON")
    ap.add_argument("--plot", help="write a PNG of transfer time and TTFT against prompt length")
    ap.add_argument("--requests", type=int, default=3, help="requests per prompt length (default 3)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in tokens")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the instances' dtype (default float32: 64 KiB of KV a token, and greedy answers that bf16 "
                         "rounding in the decode instance's batch shape does not flip)")
    ap.add_argument("--kv-space", default="3", help="VLLM_CPU_KVCACHE_SPACE, GiB per instance (default 3)")
    ap.add_argument("--freight-extra", type=json.loads, default={}, metavar="JSON",
                    help='FreightConnector\'s kv_connector_extra_config, e.g. \'{"inline_copies": true}\'')
    args = ap.parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib in this interpreter (pip install matplotlib), or leave --plot out")
    if not isinstance(args.freight_extra, dict):
        ap.error("--freight-extra: give a JSON object")
    if vs.venv() is None:
        sys.exit("run this with the python of the vLLM virtualenv (scripts/vllm-env.sh)")
    lengths = [int(x) for x in args.lengths.split(",")]
    work = pathlib.Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    model = work / "model"
    cmd = [sys.executable, str(ROOT / "tests" / "vllm_model.py"), str(model)]
    for k, v in MODEL.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    subprocess.run(cmd, check=True)
    meta = json.loads((model / "freight-model.json").read_text())
    prompts = make_prompts(model, lengths, args.requests, seed=1)
    env = {"VLLM_CPU_KVCACHE_SPACE": args.kv_space}
    results = {name: run_config(name, model, prompts, work, env, args.dtype,
                                args.freight_extra if name == "freight" else None)
               for name in ("aggregated", "freight", "nixl")}
    summary = summarize(results, lengths)
    import vllm

    doc = {"benchmark": "vllm-pd-cpu", "machine": args.machine, "cpus": os.cpu_count(), "vllm": vllm.__version__,
           "percentile": PERCENTILE,
           # The model file's KV is bf16 (2 bytes a number); the instances run it in `dtype`.
           "model": {**MODEL, "dtype": args.dtype,
                     "kv_bytes_per_token": meta["kv_bytes_per_token"] * (2 if args.dtype == "float32" else 1)},
           "answer_tokens": ANSWER,
           "requests_per_length": args.requests, "freight_extra_config": args.freight_extra,
           "freight_inline_copies": Settings.from_extra("kv_consumer", args.freight_extra).copies_inline,
           "summary": summary,
           "runs": results}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print("| prompt tokens | KV MiB | freight transfer p50 / p99 (ms) | NIXL transfer p50 / p99 (ms) | "
          "freight / NIXL (p50) | TTFT p50 (s) aggregated / freight / NIXL | outputs identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in summary:
        same = "yes" if r["freight_outputs_identical"] and r["nixl_outputs_identical"] else (
            f"freight {r['freight_outputs_identical']}, nixl {r['nixl_outputs_identical']}")
        print(f"| {r['length']} | {r['freight_mib']:.0f} | {r['freight_transfer_p50_s'] * 1e3:.1f} / "
              f"{r['freight_transfer_p99_s'] * 1e3:.1f} | {r['nixl_transfer_p50_s'] * 1e3:.1f} / "
              f"{r['nixl_transfer_p99_s'] * 1e3:.1f} | {r['transfer_ratio_p50']:.2f} | "
              f"{r['aggregated_ttft_p50_s']:.2f} / {r['freight_ttft_p50_s']:.2f} / {r['nixl_ttft_p50_s']:.2f} | "
              f"{same} |")
    if args.plot:
        plot(summary, args.plot, args.machine, args.freight_extra, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
