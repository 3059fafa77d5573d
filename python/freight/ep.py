"""Expert parallelism: dispatch MoE tokens to the GPU ranks that own their experts, and
combine the experts' outputs back.

Each rank (one process per GPU) holds ``x`` (bf16 ``[tokens, hidden]``) and, for each
token, its top-k experts (``topk_idx``, ``[tokens, topk]``, -1 for none) with their
weights. Experts are numbered across ranks: rank ``r`` owns experts ``r * E`` to
``(r + 1) * E - 1`` for ``E`` experts per rank.

* :meth:`Buffer.dispatch` sends every token once to each rank that owns one of its
  experts (a token with three experts on one rank crosses NVLink once) and returns, on
  every rank, the ``(token, expert)`` pairs for its local experts, **grouped by local
  expert** (expert 0's rows first; within an expert, by source rank then source token),
  ready for a grouped GEMM.
* :meth:`Buffer.combine` takes the experts' outputs for those rows, sums each token's
  rows on the expert's rank weighted by the top-k weights, sends one row per token back,
  and sums the rows from the token's ranks (in rank order, so results are the same run
  to run): ``out[t] = sum_k w[t, k] * expert_{topk_idx[t, k]}(x[t])``.

Ranks on one host write straight into each other's GPU memory through CUDA IPC
mappings; signalling between ranks happens on the GPU. Ranks find each other through a
:class:`Group`: a small rank server (:class:`RankServer`, :meth:`Group.join`), etcd
(:meth:`Group.join_etcd`) or an existing ``torch.distributed`` process group
(:meth:`Group.from_process_group`). A rank that dies makes the others raise
:class:`freight.errors.PeerDisconnectedError` (or :class:`freight.errors.TimeoutError`
after ``timeout``) instead of hanging.

Needs PyTorch and a GPU; importing this module needs neither.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from typing import Any, List, Optional, Sequence, Tuple

from . import _native
from .errors import InvalidArgumentError, InvalidStateError

DEFAULT_TIMEOUT_S = 60.0
#: Where ranks find the rank server's token when none is passed to :meth:`Group.join`.
TOKEN_ENV = "FREIGHT_EP_TOKEN"

RankServer = _native.EpRankServer


class Group:
    """The ranks of one expert-parallel job, joined through a rendezvous."""

    def __init__(self, native: Any):
        self._native = native
        # The rank server rank 0 started for the group (from_process_group), kept for
        # as long as the group lives.
        self._server: Optional[RankServer] = None

    @classmethod
    def join(cls, rank: int, world: int, server: str, timeout: float = DEFAULT_TIMEOUT_S,
             token: Optional[str] = None) -> "Group":
        """Joins through the rank server at ``server`` (``"host:port"``), presenting the
        server's ``token`` where it has one (by default ``FREIGHT_EP_TOKEN`` from the
        environment); ranks may start before the server and in any order (each retries
        until ``timeout``)."""
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        return cls(_native.EpGroup.join_server(server, rank, world, timeout, token))

    @classmethod
    def join_etcd(
        cls, rank: int, world: int, endpoints: Sequence[str], group: str, timeout: float = DEFAULT_TIMEOUT_S
    ) -> "Group":
        """Joins through etcd under the name ``group`` (one name per run)."""
        return cls(_native.EpGroup.join_etcd(list(endpoints), group, rank, world, timeout))

    @classmethod
    def from_process_group(cls, group: Any = None, timeout: float = DEFAULT_TIMEOUT_S) -> "Group":
        """Joins the ranks of a ``torch.distributed`` process group: its rank 0 starts a
        rank server and tells the others where (rank 0's host must be reachable from
        every rank)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        server = None
        # The server listens on every interface: a token, which only the group's ranks
        # learn (through the process group), keeps strangers from joining.
        box: List[Optional[str]] = [None, None]
        if rank == 0:
            token = secrets.token_hex(16)
            server = RankServer("0.0.0.0:0", world, token)
            port = server.address.rsplit(":", 1)[1]
            box[:] = [f"{_reachable_address()}:{port}", token]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        address, shared = box
        assert address is not None, "rank 0 broadcast the rank server's address"
        joined = cls.join(rank, world, address, timeout, token=shared)
        joined._server = server
        return joined

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world(self) -> int:
        return self._native.world

    def all_gather(self, blob: bytes, timeout: float = DEFAULT_TIMEOUT_S) -> List[bytes]:
        """Every rank's ``blob``, in rank order (a collective)."""
        return self._native.all_gather(blob, timeout)

    def barrier(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._native.barrier(timeout)

    def dead(self) -> Optional[Tuple[int, str]]:
        """``(rank, reason)`` of the first rank known dead, or ``None``."""
        return self._native.dead()

    def leave(self) -> None:
        """Leaves cleanly: the others do not take this rank for dead."""
        self._native.leave()


def _reachable_address() -> str:
    """This host's address as other hosts would reach it (loopback when alone)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclasses.dataclass
class Layout:
    """Where tokens go, from :meth:`Buffer.get_layout`."""

    num_tokens_per_rank: Any  # int32 [ranks]: tokens sent to each rank (once each)
    num_tokens_per_expert: Any  # int32 [experts]: tokens that chose each expert
    is_token_in_rank: Any  # bool [tokens, ranks]


@dataclasses.dataclass
class Handle:
    """What :meth:`Buffer.combine` needs from the dispatch it undoes."""

    slot: Any  # int32 [tokens, ranks]: each token's row among those sent to a rank, or -1
    row_pairs: Any  # int32 [received tokens, topk]: the output row of each local choice, or -1
    row_source: Any  # int32 [received tokens, 2]: source rank, token index there
    received: Any  # int32 [1]: tokens received (written on the GPU)
    recv_topk_weights: Any  # float32, one per output row
    tokens: int
    expert_out_shape: Tuple[int, ...]  # what combine's expert_out must look like
    owner: int  # id() of the buffer that dispatched
    low_latency: bool


class Buffer:
    """One rank's expert-parallel buffer (a collective to create: every rank of
    ``group`` must create one with the same sizes).

    ``max_tokens`` bounds the tokens one rank passes to one dispatch; the buffer holds
    ``ranks * max_tokens`` rows of ``hidden`` bf16 for each direction.

    ``backend`` says how ranks reach each other, as the seed's ``--nvlink-backend``:
    ``"ipc"`` (kernels write into peers' GPU memory through CUDA IPC; one host),
    ``"freight"`` (the engine's transports, its choice: cuda on one host, the network
    across hosts) or ``"none"`` (the engine's network transports only). With the engine
    backends the host ships each step's rows, so low-latency mode is not available;
    ``listen`` is where this rank's engine listens (``"0.0.0.0:0"`` across hosts).
    """

    def __init__(
        self,
        group: Group,
        hidden: int,
        max_tokens: int,
        experts_per_rank: int,
        topk: int,
        device: Any = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        backend: str = "ipc",
        listen: str = "127.0.0.1:0",
    ):
        import torch

        if device is None:
            device = "cuda"
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise InvalidArgumentError(f"an expert-parallel buffer lives on a GPU, not on {self.device}")
        if self.device.index is None:  # "cuda": the current GPU, named so tensors compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.hidden, self.max_tokens, self.topk = hidden, max_tokens, topk
        self.experts_per_rank = experts_per_rank
        self.num_experts = experts_per_rank * group.world
        self.backend = backend
        self._native = _native.EpBuffer(
            group._native, self.device.index, max_tokens, hidden, topk, experts_per_rank, timeout, backend, listen
        )

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world

    def _stream(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device).cuda_stream

    def _check(self, name: str, t: Any, dtype: Any, shape: Tuple[int, ...]) -> None:
        if t.device != self.device:
            raise InvalidArgumentError(f"{name} is on {t.device}; this buffer is on {self.device}")
        if t.dtype != dtype:
            raise InvalidArgumentError(f"{name} must be {dtype}, not {t.dtype}")
        if tuple(t.shape) != shape:
            raise InvalidArgumentError(f"{name} must have shape {list(shape)}, not {list(t.shape)}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            raise InvalidArgumentError(f"{name} must start on a 16-byte boundary (rows move in 16-byte vectors)")

    def _routing(self, topk_idx: Any) -> Any:
        import torch

        if topk_idx.dim() != 2 or topk_idx.shape[1] != self.topk:
            raise InvalidArgumentError(f"topk_idx must have shape [tokens, {self.topk}], not {list(topk_idx.shape)}")
        if topk_idx.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"topk_idx must hold integers, not {topk_idx.dtype}")
        if topk_idx.shape[0] > self.max_tokens:
            raise InvalidArgumentError(f"{topk_idx.shape[0]} tokens, but this buffer takes at most {self.max_tokens}")
        topk_idx = topk_idx.to(torch.int64).contiguous()
        self._check("topk_idx", topk_idx, torch.int64, tuple(topk_idx.shape))
        return topk_idx

    def get_layout(self, topk_idx: Any, num_experts: Optional[int] = None) -> Layout:
        """How many tokens go to each rank and each expert, and which tokens go where.
        Waits for the GPU, so bad expert indices raise here."""
        import torch

        if num_experts is not None and num_experts != self.num_experts:
            raise InvalidArgumentError(f"this buffer's ranks own {self.num_experts} experts, not {num_experts}")
        topk_idx = self._routing(topk_idx)
        tokens = topk_idx.shape[0]
        slot = torch.empty((tokens, self.world), dtype=torch.int32, device=self.device)
        per_rank = torch.empty(self.world, dtype=torch.int32, device=self.device)
        per_expert = torch.empty(self.num_experts, dtype=torch.int32, device=self.device)
        self._native.layout(
            self._stream(), topk_idx.data_ptr(), tokens, slot.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr()
        )
        return Layout(per_rank, per_expert, slot >= 0)

    def _inputs(self, x: Any, topk_idx: Any, topk_weights: Any, fp8: bool):
        """Checks a dispatch's inputs; returns ``(native inputs, topk_idx, slot)``."""
        import torch

        topk_idx = self._routing(topk_idx)
        tokens = topk_idx.shape[0]
        self._check("x", x, torch.bfloat16, (tokens, self.hidden))
        self._check("topk_weights", topk_weights, torch.float32, (tokens, self.topk))
        if fp8 and not self._native.fp8_available:
            raise InvalidArgumentError(f"fp8 dispatch needs a hidden size that is a multiple of 512, not {self.hidden}")
        slot = torch.empty((tokens, self.world), dtype=torch.int32, device=self.device)
        native = (x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), tokens, slot.data_ptr(), bool(fp8))
        return native, topk_idx, slot

    def _received_rows(self, shape: Tuple[int, ...], fp8: bool):
        """Tensors for received rows of ``shape`` (rows x hidden): bf16, or fp8 values
        and their float32 scales (one per 128 channels)."""
        import torch

        if not fp8:
            return torch.empty(shape, dtype=torch.bfloat16, device=self.device), None
        values = torch.empty(shape, dtype=torch.float8_e4m3fn, device=self.device)
        scales = torch.empty((*shape[:-1], self.hidden // 128), dtype=torch.float32, device=self.device)
        return values, scales

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, fp8: bool = False):
        """Sends each token to the ranks of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert,
        handle)``: ``recv_x`` is bf16 ``[pairs, hidden]``, one row per ``(token, local
        expert)`` pair grouped by local expert; ``recv_topk_idx`` (int32 ``[pairs]``) is
        each row's local expert and ``recv_topk_weights`` (float32 ``[pairs]``) its
        weight; ``num_recv_tokens_per_expert`` is a list of rows per local expert. With
        ``fp8=True`` tokens travel as fp8 (e4m3) with a float32 scale per 128 channels,
        and ``recv_x`` is ``(values [pairs, hidden], scales [pairs, hidden / 128])``
        (value = fp8 x scale). Waits for the GPU once (to learn the sizes).

        Routing that names an expert out of range, or one expert twice for a token,
        raises :class:`InvalidArgumentError` once the dispatch is complete (those choices
        dropped, every rank's tokens delivered). The other ranks then expect the
        combine: the error's ``result`` attribute holds what this call would have
        returned, for that combine.
        """
        import torch

        native, topk_idx, slot = self._inputs(x, topk_idx, topk_weights, fp8)
        stream = self._stream()
        try:
            per_source, per_expert = self._native.dispatch_begin(stream, native)
            received, pairs = sum(per_source), sum(per_expert)
            recv_x, recv_scales = self._received_rows((pairs, self.hidden), fp8)
            recv_expert = torch.empty(pairs, dtype=torch.int32, device=self.device)
            recv_weight = torch.empty(pairs, dtype=torch.float32, device=self.device)
            row_pairs, row_source, received_word = self._row_tables(received)
            outputs = (recv_x.data_ptr(), recv_scales.data_ptr() if fp8 else 0, recv_expert.data_ptr(),
                       recv_weight.data_ptr(), row_pairs.data_ptr(), row_source.data_ptr(), received_word.data_ptr())
            bad_routing = self._native.dispatch_finish(stream, outputs, bool(fp8))
        except BaseException:
            # Between the halves (out of memory for the outputs, an interrupt), the rows
            # that arrived are never released and the ranks' steps part: the buffer is
            # marked unusable, so later calls say why instead of waiting on the peers.
            # A no-op where no dispatch is half done.
            self._native.abandon()
            raise
        handle = Handle(slot, row_pairs, row_source, received_word, recv_weight, native[3], tuple(recv_x.shape), id(self), False)
        recv = (recv_x, recv_scales) if fp8 else recv_x
        result = recv, recv_expert, recv_weight, list(per_expert), handle
        if bad_routing is not None:
            # The dispatch completed without the bad choices, and the peers go on to the
            # combine that undoes it: the outputs travel with the error, so that this
            # rank can take part.
            setattr(bad_routing, "result", result)
            raise bad_routing
        return result

    def _row_tables(self, rows: int):
        import torch

        return (
            torch.empty((rows, self.topk), dtype=torch.int32, device=self.device),
            torch.empty((rows, 2), dtype=torch.int32, device=self.device),
            torch.empty(1, dtype=torch.int32, device=self.device),
        )

    def low_latency_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, fp8: bool = False):
        """Dispatch for small batches without any host synchronisation (a CUDA graph can
        capture it): outputs are sized for the most a dispatch can deliver.

        Returns ``(recv_x, recv_count, recv_topk_weights, handle)``: ``recv_x`` is bf16
        ``[experts_per_rank, ranks * max_tokens, hidden]``, local expert ``e``'s rows
        first in ``recv_x[e, :recv_count[e]]`` (by source rank, then source token);
        ``recv_count`` is an int32 tensor on the GPU; ``recv_topk_weights`` is float32
        ``[experts_per_rank, ranks * max_tokens]``. ``fp8`` as for :meth:`dispatch`. Bad
        routing (its choices dropped, as in :meth:`dispatch`) is reported by the next
        :meth:`synchronize`, :meth:`check` or :meth:`dispatch`.
        """
        import torch

        if topk_idx.dtype != torch.int64:
            raise InvalidArgumentError("low-latency dispatch takes int64 topk_idx (no conversion on the way)")
        native, topk_idx, slot = self._inputs(x, topk_idx, topk_weights, fp8)
        most = self._native.most_received
        recv_x, recv_scales = self._received_rows((self.experts_per_rank, most, self.hidden), fp8)
        recv_weight = torch.empty((self.experts_per_rank, most), dtype=torch.float32, device=self.device)
        counts = torch.empty(self.experts_per_rank, dtype=torch.int32, device=self.device)
        row_pairs, row_source, received_word = self._row_tables(most)
        outputs = (recv_x.data_ptr(), recv_scales.data_ptr() if fp8 else 0, 0, recv_weight.data_ptr(),
                   row_pairs.data_ptr(), row_source.data_ptr(), received_word.data_ptr())
        self._native.dispatch_low_latency(self._stream(), native, outputs, counts.data_ptr())
        handle = Handle(slot, row_pairs, row_source, received_word, recv_weight, native[3], tuple(recv_x.shape), id(self), True)
        recv = (recv_x, recv_scales) if fp8 else recv_x
        return recv, counts, recv_weight, handle

    def low_latency_combine(self, expert_out: Any, handle: Handle, topk_weights: Any = None) -> Any:
        """Combine for :meth:`low_latency_dispatch`: ``expert_out`` is bf16
        ``[experts_per_rank, ranks * max_tokens, hidden]`` (rows beyond each expert's
        count are ignored). No host synchronisation."""
        if not handle.low_latency:
            raise InvalidArgumentError("this handle comes from dispatch(); use combine()")
        return self._combine(expert_out, handle, topk_weights)

    def combine(self, expert_out: Any, handle: Handle, topk_weights: Any = None) -> Any:
        """Brings the experts' outputs back: ``expert_out`` (bf16 ``[pairs, hidden]``,
        rows as :meth:`dispatch` returned them) weighted by ``topk_weights`` (float32
        ``[pairs]``; default: the weights that came with the dispatch), summed per token.
        Returns bf16 ``[tokens, hidden]``. Does not wait for the GPU."""
        if isinstance(handle, Handle) and handle.low_latency:
            raise InvalidArgumentError("this handle comes from low_latency_dispatch(); use low_latency_combine()")
        return self._combine(expert_out, handle, topk_weights)

    def _combine(self, expert_out: Any, handle: Handle, topk_weights: Any) -> Any:
        import torch

        if not isinstance(handle, Handle):
            raise InvalidArgumentError("handle must be the one dispatch returned")
        if handle.owner != id(self):
            raise InvalidStateError("this handle comes from another buffer's dispatch")
        weights = handle.recv_topk_weights if topk_weights is None else topk_weights
        self._check("expert_out", expert_out, torch.bfloat16, handle.expert_out_shape)
        self._check("topk_weights", weights, torch.float32, tuple(handle.recv_topk_weights.shape))
        out = torch.empty((handle.tokens, self.hidden), dtype=torch.bfloat16, device=self.device)
        self._native.combine(
            self._stream(),
            expert_out.data_ptr(),
            weights.data_ptr(),
            handle.row_pairs.data_ptr(),
            handle.row_source.data_ptr(),
            handle.received.data_ptr(),
            handle.row_pairs.shape[0],
            handle.slot.data_ptr(),
            handle.tokens,
            out.data_ptr(),
        )
        return out

    def synchronize(self) -> None:
        """Waits for this buffer's work on the current stream; raises what the GPU met,
        bad routing of a low-latency dispatch included."""
        self._native.synchronize(self._stream())

    def check(self) -> None:
        """Raises the error a kernel recorded, if any, or bad routing a low-latency
        dispatch met (does not wait: what is still running reports later)."""
        self._native.check()


def compile_kernels(arch: str = "sm_90") -> int:
    """Compiles the expert-parallel kernels for ``arch`` with NVRTC (no GPU needed) and
    returns the size of the result."""
    return _native.compile_ep_kernels(arch)


__all__ = ["Buffer", "Group", "Handle", "Layout", "RankServer", "compile_kernels"]
