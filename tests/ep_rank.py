#!/usr/bin/env python3
"""One expert-parallel rank for tests/test_ep.py: joins the rank server, makes a buffer,
runs a scenario and prints one JSON line with what it found.

Every rank draws its inputs from seeds that name the rank, so each rank can rebuild every
other rank's tokens and check what it received row by row. Ranks use GPU
``rank % visible GPUs`` (several ranks may share one GPU).

Scenarios:
  correctness   dispatch exactly as expected, combine against references, edge cases,
                determinism, bad input
  die           rank 1 exits without a word after the buffer is made; the others
                dispatch and report the error they get and how long it took
  fp8_mismatch  rank 0 dispatches fp8 tokens, the others bf16: every rank must refuse
                the dispatch, and the next one, saying why
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import torch

import freight
from freight import ep


def routing(case: str, rank: int, world: int, tokens: int, experts_per_rank: int, topk: int, seed: int):
    """``(x-seed, topk_idx, topk_weights)`` of ``rank`` for a case (CPU tensors)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    experts = world * experts_per_rank
    if case == "skewed":  # every token to expert 0 only: ranks other than 0 receive nothing
        idx = torch.full((tokens, topk), -1, dtype=torch.int64)
        idx[:, 0] = 0
    elif case == "one_rank":  # all of a token's experts on one rank (several experts there)
        idx = torch.stack([torch.randperm(experts_per_rank, generator=g)[:topk] for _ in range(tokens)]) if tokens else torch.empty((0, topk), dtype=torch.int64)
        owner = torch.randint(0, world, (tokens, 1), generator=g)
        idx = idx + owner * experts_per_rank
    else:  # random distinct experts, some choices left out (-1)
        idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else torch.empty((0, topk), dtype=torch.int64)
        idx[torch.rand((tokens, topk), generator=g) < 0.1] = -1
    weights = torch.rand((tokens, topk), generator=g, dtype=torch.float32)
    return idx, weights


def tokens_of(rank: int, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank + 500)
    return torch.randn((tokens, hidden), generator=g).to(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def expert_matrix(expert: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + expert)
    return torch.randn((hidden, hidden), generator=g) / hidden**0.5


class Rank:
    def __init__(self, args):
        self.args = args
        self.rank, self.world = args.rank, args.world
        self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)
        self.group = ep.Group.join(self.rank, self.world, args.server, timeout=args.timeout)
        self.buffer = ep.Buffer(
            self.group, args.hidden, args.max_tokens, args.experts_per_rank, args.topk, self.device, args.timeout,
            backend=args.backend,
        )
        self.passed, self.failed = [], []

    def check(self, name: str, fn) -> None:
        try:
            fn()
            self.passed.append(name)
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            self.failed.append(f"{name}: {traceback.format_exc(limit=4)}")

    def inputs(self, case: str, rank: int, tokens: int, seed: int):
        a = self.args
        idx, w = routing(case, rank, self.world, tokens, a.experts_per_rank, a.topk, seed)
        return tokens_of(rank, tokens, a.hidden, seed), idx, w

    def expected_receive(self, case: str, tokens: int, seed: int):
        """Rows, experts and weights this rank should receive: by local expert, then
        source rank, then source token."""
        a = self.args
        rows, experts, weights = [], [], []
        per_rank = [self.inputs(case, r, tokens, seed) for r in range(self.world)]
        for e in range(a.experts_per_rank):
            g = self.rank * a.experts_per_rank + e
            for x, idx, w in per_rank:
                for t in range(tokens):
                    hits = (idx[t] == g).nonzero()
                    if len(hits):
                        rows.append(x[t])
                        experts.append(e)
                        weights.append(w[t, hits[0, 0]].item())
        hidden = a.hidden
        x = torch.stack(rows) if rows else torch.empty((0, hidden), dtype=torch.bfloat16)
        return x, torch.tensor(experts, dtype=torch.int32), torch.tensor(weights, dtype=torch.float32)

    def run_case(self, case: str, tokens: int, seed: int) -> None:
        a = self.args
        x, idx, w = self.inputs(case, self.rank, tokens, seed)
        dx, didx, dw = x.to(self.device), idx.to(self.device), w.to(self.device)
        recv_x, recv_expert, recv_weight, per_expert, handle = self.buffer.dispatch(dx, didx, dw)
        want_x, want_expert, want_weight = self.expected_receive(case, tokens, seed)

        def dispatched_exactly():
            assert recv_x.shape == want_x.shape, (recv_x.shape, want_x.shape)
            assert torch.equal(recv_x.cpu(), want_x), "received rows differ"
            assert torch.equal(recv_expert.cpu(), want_expert)
            assert torch.equal(recv_weight.cpu(), want_weight)
            assert per_expert == torch.bincount(want_expert.long(), minlength=a.experts_per_rank).tolist()

        self.check(f"{case}/{tokens}: dispatch delivers every row in order", dispatched_exactly)

        valid = (idx >= 0).float()
        identity_ref = x.float() * (w * valid).sum(1, keepdim=True)
        out = self.buffer.combine(recv_x, handle)

        def identity():
            torch.testing.assert_close(out.float().cpu(), identity_ref, rtol=2e-2, atol=2e-2)

        self.check(f"{case}/{tokens}: combine of identity experts is x times the sum of weights", identity)

        if not a.linear:
            return
        # Random linear experts, against a single-GPU reference.
        expert_out = torch.empty_like(recv_x)
        start = 0
        for e, n in enumerate(per_expert):
            m = expert_matrix(self.rank * a.experts_per_rank + e, a.hidden).to(self.device)
            expert_out[start : start + n] = (recv_x[start : start + n].float() @ m).to(torch.bfloat16)
            start += n
        out_linear = self.buffer.combine(expert_out, handle)
        ref = torch.zeros((tokens, a.hidden))
        for t in range(tokens):
            for k in range(a.topk):
                g = int(idx[t, k])
                if g >= 0:
                    y = (x[t].float() @ expert_matrix(g, a.hidden)).to(torch.bfloat16).float()
                    ref[t] += w[t, k] * y

        def linear():
            torch.testing.assert_close(out_linear.float().cpu(), ref, rtol=3e-2, atol=3e-2)

        self.check(f"{case}/{tokens}: combine of linear experts matches the reference", linear)

        again = self.buffer.dispatch(dx, didx, dw)
        out_again = self.buffer.combine(expert_out, again[4])

        def deterministic():
            assert torch.equal(again[0], recv_x)
            assert torch.equal(out_again, out_linear)

        self.check(f"{case}/{tokens}: results are the same run to run", deterministic)

    def low_latency(self, tokens: int, seed: int) -> None:
        """Low-latency dispatch and combine, then the same captured in a CUDA graph and
        replayed with new tokens."""
        a = self.args
        x, idx, w = self.inputs("random", self.rank, tokens, seed)
        dx, didx, dw = x.to(self.device), idx.to(self.device), w.to(self.device)
        want_x, want_expert, want_weight = self.expected_receive("random", tokens, seed)

        def received_per_expert(recv_x, counts, recv_weight):
            counts = counts.cpu().tolist()
            assert counts == torch.bincount(want_expert.long(), minlength=a.experts_per_rank).tolist()
            got_x = torch.cat([recv_x[e, :n] for e, n in enumerate(counts)]).cpu()
            got_w = torch.cat([recv_weight[e, :n] for e, n in enumerate(counts)]).cpu()
            assert torch.equal(got_x, want_x), "received rows differ"
            assert torch.equal(got_w, want_weight)

        recv_x, counts, recv_weight, handle = self.buffer.low_latency_dispatch(dx, didx, dw)
        out = self.buffer.low_latency_combine(recv_x, handle)
        identity_ref = x.float() * (w * (idx >= 0).float()).sum(1, keepdim=True)
        self.check(f"low-latency/{tokens}: rows land per expert in order", lambda: received_per_expert(recv_x, counts, recv_weight))
        self.check(
            f"low-latency/{tokens}: combine of identity experts",
            lambda: torch.testing.assert_close(out.float().cpu(), identity_ref, rtol=2e-2, atol=2e-2),
        )

        static_x, static_idx, static_w = dx.clone(), didx.clone(), dw.clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            g_recv, g_counts, g_weight, g_handle = self.buffer.low_latency_dispatch(static_x, static_idx, static_w)
            g_out = self.buffer.low_latency_combine(g_recv, g_handle)
        for replay in range(3):
            rx, ridx, rw = self.inputs("random", self.rank, tokens, seed + 100 + replay)
            static_x.copy_(rx)
            static_idx.copy_(ridx)
            static_w.copy_(rw)
            self.group.barrier(a.timeout)
            graph.replay()
            torch.cuda.synchronize()
            self.buffer.check()
            ref = rx.float() * (rw * (ridx >= 0).float()).sum(1, keepdim=True)
            self.check(
                f"low-latency/{tokens}: CUDA graph replay {replay}",
                lambda: torch.testing.assert_close(g_out.float().cpu(), ref, rtol=2e-2, atol=2e-2),
            )

    def _refused_low_latency(self, x, idx, w) -> None:
        try:
            self.buffer.low_latency_dispatch(x, idx, w)
        except freight.InvalidArgumentError as e:
            assert "ipc backend" in str(e)
            return
        raise AssertionError("low-latency dispatch through the engine was not refused")

    def fp8(self, tokens: int, seed: int) -> None:
        """fp8 dispatch: values and per-128-channel scales as torch would quantize them,
        and combine of the dequantized rows."""
        a = self.args
        x, idx, w = self.inputs("random", self.rank, tokens, seed)
        (values, scales), recv_expert, recv_weight, per_expert, handle = self.buffer.dispatch(
            x.to(self.device), idx.to(self.device), w.to(self.device), fp8=True
        )
        want_x, want_expert, _ = self.expected_receive("random", tokens, seed)

        def quantized_like_torch():
            groups = want_x.float().view(len(want_x), -1, 128)
            want_scales = (groups.abs().amax(-1) / 448.0).clamp_min(1e-30)
            want_scales = torch.where(groups.abs().amax(-1) > 0, want_scales, torch.ones_like(want_scales))
            torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-6, atol=0)
            want_values = (groups / want_scales.unsqueeze(-1)).to(torch.float8_e4m3fn).float()
            got = values.cpu().float().view_as(want_values)
            mismatch = (got != want_values).float().mean().item()
            assert mismatch < 1e-3, f"{mismatch:.2%} of fp8 values differ from torch's conversion"
            assert torch.equal(recv_expert.cpu(), want_expert)

        self.check(f"fp8/{tokens}: values and scales as torch quantizes", quantized_like_torch)
        dequantized = (values.float().view(len(values), -1, 128) * scales.unsqueeze(-1)).view(len(values), -1)
        out = self.buffer.combine(dequantized.to(torch.bfloat16), handle)
        ref = x.float() * (w * (idx >= 0).float()).sum(1, keepdim=True)
        self.check(
            f"fp8/{tokens}: combine of dequantized identity experts",
            lambda: torch.testing.assert_close(out.float().cpu(), ref, rtol=0.1, atol=0.15),
        )

    def bad_input(self) -> None:
        a = self.args
        x, idx, w = self.inputs("random", self.rank, 8, 99)
        dx, didx, dw = x.to(self.device), idx.to(self.device), w.to(self.device)

        def refused(exc, fn):
            def run():
                try:
                    fn()
                except exc:
                    return
                raise AssertionError(f"expected {exc.__name__}")

            return run

        self.check("wrong dtype refused", refused(freight.InvalidArgumentError, lambda: self.buffer.dispatch(dx.float(), didx, dw)))
        self.check("wrong shape refused", refused(freight.InvalidArgumentError, lambda: self.buffer.dispatch(dx[:, :8], didx, dw)))
        self.check("too many tokens refused", refused(freight.InvalidArgumentError, lambda: self.buffer.dispatch(
            torch.zeros((a.max_tokens + 1, a.hidden), dtype=torch.bfloat16, device=self.device),
            torch.zeros((a.max_tokens + 1, a.topk), dtype=torch.int64, device=self.device),
            torch.zeros((a.max_tokens + 1, a.topk), device=self.device))))
        self.check("host tensors refused", refused(freight.InvalidArgumentError, lambda: self.buffer.dispatch(x, didx, dw)))
        # Rank 0 routes a token to an expert that does not exist: it gets the error once
        # the dispatch is complete, with the outputs; every rank combines, and the sums
        # leave the dropped choice out.
        bad = didx.clone()
        if self.rank == 0:
            bad[3, 0] = self.world * a.experts_per_rank
        self.check("expert out of range refused, then combined", lambda: self.bad_routing_round_trip(dx, bad, dw))
        # Rank 0 repeats an expert in a token's top-k: refused the same way, the repeat
        # dropped.
        twice = didx.clone()
        if self.rank == 0:
            twice[5, 1] = twice[5, 0] = 0
        self.check("an expert chosen twice refused, then combined", lambda: self.bad_routing_round_trip(dx, twice, dw))
        self.check("the buffer still works after bad input", lambda: self.run_case("random", 16, 7))

    def bad_routing_round_trip(self, x, idx, w) -> None:
        """Dispatch (rank 0's routing is bad, the others' fine) and combine with identity
        experts: rank 0 gets InvalidArgumentError carrying the dispatch's outputs, and
        every rank's sums hold the weights of the choices kept (in range, first of a
        repeat)."""
        try:
            recv, _, _, _, handle = self.buffer.dispatch(x, idx, w)
            if self.rank == 0:
                raise AssertionError("rank 0's bad routing was not refused")
        except freight.InvalidArgumentError as e:
            if self.rank != 0:
                raise AssertionError(f"a peer's bad routing failed this rank: {e}") from e
            recv, _, _, _, handle = e.result
        out = self.buffer.combine(recv, handle)
        self.buffer.synchronize()
        experts = self.world * self.args.experts_per_rank
        kept = torch.zeros(idx.shape, dtype=torch.float32)
        for t, choices in enumerate(idx.cpu().tolist()):
            seen = set()
            for k, e in enumerate(choices):
                if 0 <= e < experts and e not in seen:
                    kept[t, k] = 1.0
                seen.add(e)
        ref = x.float().cpu() * (w.cpu() * kept).sum(1, keepdim=True)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)

    def correctness(self) -> None:
        a = self.args
        for case, tokens, seed in [("random", a.max_tokens, 1), ("one_rank", 24, 2), ("skewed", 16, 3), ("random", 0, 4)]:
            self.run_case(case, tokens, seed)
        if a.backend == "ipc":
            self.low_latency(min(a.max_tokens, 32), 6)
        else:
            x, idx, w = (t.to(self.device) for t in self.inputs("random", self.rank, 4, 6))
            self.check("low-latency refused through the engine", lambda: self._refused_low_latency(x, idx, w))
        if a.hidden % 512 == 0:
            self.fp8(min(a.max_tokens, 32), 8)
        self.bad_input()
        self.buffer.synchronize()

    def die(self) -> None:
        if self.rank == 1:
            os._exit(0)
        x, idx, w = self.inputs("random", self.rank, 8, 5)
        t0 = time.monotonic()
        try:
            self.buffer.dispatch(x.to(self.device), idx.to(self.device), w.to(self.device))
            self.failed.append("dispatch succeeded although rank 1 is dead")
        except freight.FreightError as e:
            self.passed.append(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}")


    def fp8_mismatch(self) -> None:
        x, idx, w = (t.to(self.device) for t in self.inputs("random", self.rank, 8, 11))
        for attempt in ("the dispatch", "the next dispatch"):
            try:
                self.buffer.dispatch(x, idx, w, fp8=self.rank == 0)
                self.failed.append(f"{attempt} succeeded although the ranks disagree on fp8")
            except freight.InvalidArgumentError as e:
                if "another format" in str(e):
                    self.passed.append(f"{attempt} refused: {e}")
                else:
                    self.failed.append(f"{attempt} refused for another reason: {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--scenario", choices=["correctness", "die", "fp8_mismatch"], default="correctness")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--backend", choices=["ipc", "freight", "none"], default="ipc")
    p.add_argument("--linear", type=int, default=1, help="also check random linear experts (slow at large hidden)")
    args = p.parse_args()
    rank = Rank(args)
    getattr(rank, args.scenario)()
    if args.scenario != "die":
        # Nobody leaves while a peer may still write into its memory.
        rank.group.barrier(args.timeout)
        rank.group.leave()
    print(json.dumps({"rank": args.rank, "passed": rank.passed, "failed": rank.failed}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the survivors of "die" must not wait on a dead rank in teardown


if __name__ == "__main__":
    main()
