#!/usr/bin/env python3
"""The expert-parallel data-plane benchmark, beside NCCL:

    python3 bench/ep_bench.py --num-processes 4 --tokens 128 --hidden 7168 --topk 8 --mode e2e

A script of the source tree, not a command of the freight package: it needs PyTorch and
NCCL, which the wheel does not ship (and freight's Python package, installed).

Starts ``--num-processes`` ranks (one process each, running this script, GPU
``rank % GPUs``) that find each other through a rank server run by this process, then
measures dispatch, combine, or both (``--mode``) with random top-k routing, and checks
every rank's result against a reference (identity experts: combine(dispatch(x)) must equal x times the sum of its
top-k weights). In the same run, the same inputs go through a baseline built from
``torch.distributed.all_to_all_single`` over NCCL (counts exchange, one row per (token,
expert) pair out, the rows back, weighted sum), checked against the same reference.

Bytes counted: each rank's algorithmic bytes, as DeepEP counts them: a token crosses to
each rank that owns one of its experts once (``hidden x 2`` bytes each, the sender's
own rank included; with ``--fp8``, ``hidden + hidden / 32`` bytes on the way out);
combine moves the same rows back in bf16; e2e counts both directions. The NCCL
baseline moves the same rows: with ``--fp8`` it quantizes them the same way (a scale
per 128 channels, inside the timed dispatch) and sends values and scales packed in one
byte row, so it is given the same byte count and the bandwidths compare as the
latencies do.
Bandwidth = those bytes / latency, per rank; the report gives avg/min/max across ranks.
Latency is the mean of the timed steps; each rank's p50 is bench/reporting.py's
percentile, which the JSON report states.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import PERCENTILE, free_port, percentile  # noqa: E402

SCRIPT = Path(__file__).resolve()  # what the ranks run
PROG = "bench/ep_bench.py"

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Expert-parallel dispatch/combine across GPU ranks, beside an NCCL all_to_all baseline.",
        epilog="Needs freight's Python package, PyTorch and a GPU it can use.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-processes", type=int, default=8, help="ranks, one process each (GPU rank %% GPUs)")
    p.add_argument("--mode", choices=["dispatch", "combine", "e2e"], default="e2e",
                   help="dispatch only; combine only (one dispatch, many combines); or both")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (bf16 elements per token)")
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--nvlink-backend", choices=["ipc", "freight", "none"], default="ipc",
                   help="ipc: kernels write into peers' GPU memory over NVLink; freight: the engine's transports "
                        "(its choice: cuda on one host); none: the engine's network transports only (tcp)")
    p.add_argument("--low-latency", action="store_true",
                   help="low-latency mode: outputs sized for the most a dispatch delivers, no host synchronisation")
    p.add_argument("--fp8", action="store_true",
                   help="dispatch fp8 tokens with a scale per 128 channels (combine stays bf16)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the measured step in a CUDA graph and replay it (needs --low-latency)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--baseline", choices=["nccl", "none"], default="nccl",
                   help="run the NCCL all_to_all baseline in the same run (needs one GPU per rank)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for the others")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--log-level", metavar="LEVEL",
                   help="the engine's log filter in every rank, as freight's --log-level (default: $FREIGHT_LOG)")
    # Set by the runner for its ranks.
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--nccl-port", type=int, help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------------- one rank


def _routing(args, rank: int, device):
    import torch

    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    experts = args.num_processes * args.experts_per_rank
    scores = torch.rand((args.tokens, experts), generator=g)
    idx = scores.topk(args.topk, dim=1).indices.to(torch.int64)
    weights = torch.rand((args.tokens, args.topk), generator=g)
    x = torch.randn((args.tokens, args.hidden), generator=g).to(torch.bfloat16)
    return x.to(device), idx.to(device), weights.to(device)


def _time(fn, args, barrier) -> List[float]:
    import torch

    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


class NcclBaseline:
    """dispatch and combine from all_to_all_single: one row per (token, expert) pair."""

    def __init__(self, args, x, idx, weights):
        import torch

        self.torch = torch
        self.args = args
        valid = idx >= 0
        pair_token = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1).expand_as(idx)[valid]
        pair_expert = idx[valid]
        order = torch.argsort(pair_expert // args.experts_per_rank, stable=True)
        self.token = pair_token[order]
        self.expert = pair_expert[order]
        self.weight = weights[valid][order]
        self.send_counts = torch.bincount(self.expert // args.experts_per_rank, minlength=args.num_processes)
        self.x = x

    def dispatch(self):
        import torch.distributed as dist

        torch = self.torch
        recv_counts = torch.empty_like(self.send_counts)
        dist.all_to_all_single(recv_counts, self.send_counts)
        self.out_splits = recv_counts.tolist()
        self.in_splits = self.send_counts.tolist()
        rows = self.x.index_select(0, self.token)
        if self.args.fp8:
            rows = quantize_rows(rows)
        recv = rows.new_empty((sum(self.out_splits), rows.shape[1]))
        dist.all_to_all_single(recv, rows, self.out_splits, self.in_splits)
        self.recv = recv
        return recv

    def expert_rows(self, recv):
        """What identity experts give back: the received rows, dequantized where they
        came as fp8 (done once, outside the timed steps, as for freight)."""
        return dequantize_rows(recv, self.x.shape[1]) if self.args.fp8 else recv

    def combine(self, expert_out):
        import torch.distributed as dist

        back = expert_out.new_empty((len(self.token), expert_out.shape[1]))
        dist.all_to_all_single(back, expert_out, self.in_splits, self.out_splits)
        out = self.torch.zeros(self.x.shape, dtype=self.torch.float32, device=self.x.device)
        out.index_add_(0, self.token, back.float() * self.weight.unsqueeze(1))
        return out.to(self.torch.bfloat16)


FP8_GROUP = 128
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_rows(rows):
    """bf16 rows -> one byte row each: fp8 (e4m3) values, then a float32 scale per 128
    channels (amax / 448), as freight's fp8 dispatch sends them."""
    import torch

    groups = rows.float().unflatten(-1, (-1, FP8_GROUP))
    scales = (groups.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    values = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def dequantize(values, scales):
    """fp8 values [rows, hidden] and their scales [rows, hidden / 128] -> bf16 rows."""
    import torch

    groups = values.float().unflatten(-1, (-1, FP8_GROUP))
    return (groups * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def dequantize_rows(packed, hidden: int):
    """The inverse of quantize_rows."""
    import torch

    values = packed[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    return dequantize(values, packed[:, hidden:].contiguous().view(torch.float32))


def _worker(args) -> dict:
    import torch

    from freight import ep

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit(f"{PROG} needs GPUs (none visible)")
    device = torch.device("cuda", args.rank % gpus)
    torch.cuda.set_device(device)
    group = ep.Group.join(args.rank, args.num_processes, args.server, timeout=args.timeout)
    buffer = ep.Buffer(group, args.hidden, args.tokens, args.experts_per_rank, args.topk, device, args.timeout,
                       backend=args.nvlink_backend)
    x, idx, weights = _routing(args, args.rank, device)
    reference = (x.float() * weights.sum(1, keepdim=True)).to(torch.bfloat16).float()

    tolerance = (0.1, 0.15) if args.fp8 else (2e-2, 2e-2)

    def check(out) -> bool:
        return bool(torch.allclose(out.float(), reference, rtol=tolerance[0], atol=tolerance[1]))

    def expert_rows(recv):
        """What identity experts give back for the received rows: the rows themselves,
        dequantized where they came as fp8 (done once, outside the timed steps)."""
        if not args.fp8:
            return recv
        return dequantize(*recv)

    layout = buffer.get_layout(idx)
    sent_rows = int(layout.num_tokens_per_rank.sum())
    dispatch_row = args.hidden + args.hidden // 128 * 4 if args.fp8 else args.hidden * 2
    counted = sent_rows * {"dispatch": dispatch_row, "combine": args.hidden * 2,
                           "e2e": dispatch_row + args.hidden * 2}[args.mode]
    barrier = lambda: group.barrier(args.timeout)  # noqa: E731

    result = {"rank": args.rank, "gpu": device.index, "rows_sent": sent_rows}
    state = {}

    def rows():
        """The experts' outputs, made once from the first dispatch (the routing, and so
        the shapes, are the same every step; the last dispatch's are checked at the end)."""
        if "rows" not in state:
            state["rows"] = expert_rows(state["d"][0])
        return state["rows"]

    if args.low_latency:
        def f_dispatch():
            state["d"] = buffer.low_latency_dispatch(x, idx, weights, fp8=args.fp8)

        def f_combine():
            state["out"] = buffer.low_latency_combine(rows(), state["d"][3])
    else:
        def f_dispatch():
            state["d"] = buffer.dispatch(x, idx, weights, fp8=args.fp8)

        def f_combine():
            state["out"] = buffer.combine(rows(), state["d"][4])

    def f_e2e():
        f_dispatch()
        f_combine()

    f_dispatch()
    f_combine()
    buffer.synchronize()
    result["passed"] = check(state["out"])
    fn = {"dispatch": f_dispatch, "combine": f_combine, "e2e": f_e2e}[args.mode]
    if args.cuda_graph:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        barrier()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        fn = graph.replay
    times = _time(fn, args, barrier)
    buffer.synchronize()
    result["freight"] = _summary(times, counted)
    if args.mode != "dispatch":
        result["passed"] = result["passed"] and check(state["out"])
    # The timed steps combined the first dispatch's rows: the last dispatch's own (a graph's
    # replay among them) go through one more combine, outside the timing.
    state["rows"] = expert_rows(state["d"][0])
    f_combine()
    buffer.synchronize()
    result["passed"] = result["passed"] and check(state["out"])

    if args.baseline == "nccl":
        if gpus < args.num_processes:
            result["nccl_skipped"] = f"NCCL needs one GPU per rank ({gpus} GPUs for {args.num_processes} ranks)"
        else:
            result.update(_nccl(args, device, x, idx, weights, check, counted))
    group.barrier(args.timeout)
    group.leave()
    return result


def _nccl(args, device, x, idx, weights, check, counted_bytes) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.nccl_port)
    dist.init_process_group("nccl", rank=args.rank, world_size=args.num_processes, device_id=device)
    base = NcclBaseline(args, x, idx, weights)
    state = {}

    def f_dispatch():
        state["recv"] = base.dispatch()

    def f_combine():
        if "rows" not in state:
            state["rows"] = base.expert_rows(state["recv"])
        state["out"] = base.combine(state["rows"])

    def f_e2e():
        f_dispatch()
        f_combine()

    f_e2e()
    torch.cuda.synchronize()
    passed = check(state["out"])
    fn = {"dispatch": f_dispatch, "combine": f_combine, "e2e": f_e2e}[args.mode]
    times = _time(fn, args, dist.barrier)
    if args.mode != "dispatch":
        passed = passed and check(state["out"])
    dist.barrier()
    dist.destroy_process_group()
    return {"nccl": _summary(times, counted_bytes), "nccl_passed": passed}


def _summary(times: Sequence[float], nbytes: int) -> dict:
    mean = sum(times) / len(times)
    return {
        "latency_us": mean * 1e6,
        "p50_us": percentile(times, 50) * 1e6,
        "gbps": nbytes / mean / 1e9,
        "bytes": nbytes,
    }


# ----------------------------------------------------------------------------- runner


def _spread(values: Sequence[float]) -> dict:
    return {"avg": sum(values) / len(values), "min": min(values), "max": max(values)}


def _missing_requirement() -> Optional[str]:
    """What every rank needs and this machine lacks (PyTorch, a GPU it sees), said once
    here rather than as one traceback per rank."""
    try:
        import torch
    except ImportError as e:
        return (f"needs PyTorch, which cannot be imported here ({e}); install it (pip install torch) "
                f"into the environment of {sys.executable}")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        why = "it was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        return f"needs a GPU that PyTorch can use, and {why} (torch {torch.__version__})"
    return None


def run(args) -> int:
    if args.cuda_graph and not args.low_latency:
        print(f"{PROG}: --cuda-graph needs --low-latency (normal dispatch waits for the GPU)", file=sys.stderr)
        return 2
    if args.fp8 and args.hidden % 512:
        print(f"{PROG}: --fp8 needs a hidden size that is a multiple of 512", file=sys.stderr)
        return 2
    if args.low_latency and args.nvlink_backend != "ipc":
        print(f"{PROG}: --low-latency needs --nvlink-backend ipc (the engine backends ship from the host)",
              file=sys.stderr)
        return 2
    for name in ("num_processes", "tokens", "hidden", "experts_per_rank", "topk", "iters"):
        if getattr(args, name) <= 0:
            print(f"{PROG}: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if args.topk > args.num_processes * args.experts_per_rank:
        print(f"{PROG}: --topk is larger than the number of experts", file=sys.stderr)
        return 2
    missing = _missing_requirement()
    if missing:
        print(f"{PROG}: {missing}", file=sys.stderr)
        return 2
    if args.log_level is not None:
        # freight reads it when its first agent is made, here and in the ranks (which inherit it).
        os.environ["FREIGHT_LOG"] = args.log_level
    from freight import ep

    # Only the ranks started here may join: they get the token through their environment.
    token = secrets.token_hex(16)
    server = ep.RankServer("127.0.0.1:0", args.num_processes, token)
    nccl_port = free_port()
    procs = []
    for rank in range(args.num_processes):
        cmd = [sys.executable, str(SCRIPT), f"--rank={rank}", f"--server={server.address}",
               f"--nccl-port={nccl_port}"] + _forward(args)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, ep.TOKEN_ENV: token}))
    results, failures = [], []
    for rank, p in enumerate(procs):
        out, _ = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            failures.append(f"rank {rank} exited with {p.returncode}")
            continue
        results.append(json.loads(lines[-1]))
    server.close()
    report = _report(args, results, failures)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(args, report)
    return 0 if report["ranks_passed"] == args.num_processes else 1


def _forward(args) -> List[str]:
    keys = ("num_processes", "mode", "tokens", "hidden", "experts_per_rank", "topk", "nvlink_backend", "warmup",
            "iters", "baseline", "timeout", "seed")
    flags = [f"--{k.replace('_', '-')}" for k in ("low_latency", "cuda_graph", "fp8") if getattr(args, k)]
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys] + flags


def _report(args, results: List[dict], failures: List[str]) -> dict:
    report = {
        "percentile": PERCENTILE,
        "config": {k: getattr(args, k) for k in ("num_processes", "mode", "tokens", "hidden", "experts_per_rank",
                                                 "topk", "nvlink_backend", "low_latency", "cuda_graph", "fp8",
                                                 "warmup", "iters")},
        "ranks_passed": sum(1 for r in results if r.get("passed")),
        "failures": failures,
        "per_rank": results,
    }
    for system in ("freight", "nccl"):
        rows = [r[system] for r in results if system in r]
        if len(rows) == args.num_processes:
            report[system] = {
                "bandwidth_gbps": _spread([r["gbps"] for r in rows]),
                "latency_us": _spread([r["latency_us"] for r in rows]),
            }
    if "freight" in report and "nccl" in report:
        report["speedup_vs_nccl"] = report["nccl"]["latency_us"]["avg"] / report["freight"]["latency_us"]["avg"]
        report["nccl_ranks_passed"] = sum(1 for r in results if r.get("nccl_passed"))
    skipped = {r.get("nccl_skipped") for r in results} - {None}
    if skipped:
        report["nccl_skipped"] = skipped.pop()
    return report


def _print(args, report: dict) -> None:
    bar = "=" * 70
    c = report["config"]
    print(bar)
    print("freight EP data plane")
    print(bar)
    print(f"Mode: {c['mode']}")
    print(f"Ranks: {c['num_processes']}, Tokens: {c['tokens']}, Hidden: {c['hidden']}")
    print(f"Experts: {c['experts_per_rank']}/rank ({c['experts_per_rank'] * c['num_processes']} total), TopK: {c['topk']}")
    print(f"Backend: {c['nvlink_backend']}" + (", low-latency" if c["low_latency"] else "")
          + (", CUDA graph" if c["cuda_graph"] else "") + (", fp8 dispatch" if c["fp8"] else ""))
    print(f"Warmup: {c['warmup']}, Measure: {c['iters']} iterations")
    print(bar)
    print()
    print(bar)
    print(f"Data Plane ({c['mode']}): {report['ranks_passed']}/{c['num_processes']} ranks passed")
    print(bar)
    for f in report["failures"]:
        print(f"  {f}")
    for system, label in (("freight", "freight"), ("nccl", "NCCL all_to_all")):
        if system not in report:
            continue
        bw, lat = report[system]["bandwidth_gbps"], report[system]["latency_us"]
        print(f"{label}:")
        print(f"  Bandwidth (GB/s): avg={bw['avg']:.2f}, min={bw['min']:.2f}, max={bw['max']:.2f}")
        print(f"  Latency (\u03bcs):     avg={lat['avg']:.1f}, min={lat['min']:.1f}, max={lat['max']:.1f}")
    if "speedup_vs_nccl" in report:
        print(f"freight vs NCCL: {report['speedup_vs_nccl']:.2f}x faster "
              f"(NCCL baseline: {report['nccl_ranks_passed']}/{c['num_processes']} ranks passed)")
    if "nccl_skipped" in report:
        print(f"NCCL baseline skipped: {report['nccl_skipped']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.rank is None:
        return run(args)
    print(json.dumps(_worker(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
