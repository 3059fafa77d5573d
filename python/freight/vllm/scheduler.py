"""FreightConnector in vLLM's scheduler process: which requests load their prompt's KV
from a prefill instance, which hand theirs on, and what the workers are told each step.

The scheduler side moves no byte. On a decode instance it claims the prompt tokens a
request's params say the prefill instance computed (beyond those this instance has in
its own prefix cache), and tells the workers which of its new blocks to fill from
which of the prefill instance's. On a prefill instance it answers a finished request
with where its blocks are (the request's ``kv_transfer_params``) and keeps them from
being freed until a worker reports that the decode instance has them, or that nobody
asked within the lease.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from .config import Settings
from .params import Handoff, Load, Place, wants_remote_decode, wants_remote_prefill
from .layout import Geometry

# A child of vLLM's logger: its messages come out with vLLM's, in its format.
log = logging.getLogger("vllm.freight")


@dataclass
class FreightMetadata(KVConnectorMetadata):
    """What the workers are told at one step (pickled to every worker)."""

    loads: Dict[str, Load] = field(default_factory=dict)
    # Prefill instance: finished requests whose blocks wait for a decode instance, and
    # how long they may wait.
    sends: Dict[str, float] = field(default_factory=dict)


@dataclass
class WorkerHandshake(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler once, at start: where its blocks are
    (:meth:`freight.vllm.worker.WorkerSide.handshake`)."""

    place: Dict[str, Any]
    geometry: Dict[str, Any]


class SchedulerSide:
    def __init__(self, vllm_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tensor_parallel = int(vllm_config.parallel_config.tensor_parallel_size)
        self.loads: Dict[str, Load] = {}
        self.sends: Dict[str, float] = {}
        self.ranks: Optional[List[Place]] = None
        self.geometry: Optional[Geometry] = None

    def set_worker_handshakes(self, metadata: Dict[Any, Any]) -> None:
        """Every worker's :class:`WorkerHandshake`, keyed by its tensor-parallel rank
        (or ``(pipeline rank, tensor rank)``)."""
        def tp_rank(key: Any) -> int:
            return int(key[-1]) if isinstance(key, tuple) else int(key)

        ordered = sorted(metadata.items(), key=lambda kv: tp_rank(kv[0]))
        self.ranks = [Place.from_dict(h.place) for _, h in ordered]
        self.geometry = Geometry.from_dict(ordered[0][1].geometry)
        log.info("freight connector: %d worker(s), KV geometry %s", len(self.ranks), self.geometry)

    # --------------------------------------------------------------- decode side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.settings.consumes and wants_remote_prefill(params)):
            return 0, False
        # The prompt's KV beyond what this instance has cached; vLLM computes the last
        # prompt token again itself, for its logits.
        count = len(request.prompt_token_ids) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not (self.settings.consumes and wants_remote_prefill(params)):
            return
        # Blocks this instance had in its prefix cache are not moved: only the new ones,
        # which are the last ones of the prompt.
        local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        self.loads[request.request_id] = Load(local_blocks=local, params=dict(params))
        # Once: a second allocation for the same request must not load again.
        params["do_remote_prefill"] = False

    # -------------------------------------------------------------- prefill side

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        params = request.kv_transfer_params
        if self.settings.consumes and wants_remote_prefill(params):
            # Never scheduled here (aborted while waiting): the prefill instance still
            # holds its blocks for us; a load of nothing tells it to let them go.
            self.loads[request.request_id] = Load(local_blocks=[], params=dict(params))
            return False, None
        if not (self.settings.produces and wants_remote_decode(params)):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # Aborted or stopped early: no decode instance will ask for these blocks.
            return False, None
        if self.ranks is None or self.geometry is None:
            log.error("freight connector: request %s finished before the workers' handshake", request.request_id)
            return False, None
        handoff = Handoff(request_id=request.request_id, engine_id=self.engine_id, block_ids=list(block_ids),
                          ranks=self.ranks, geometry=self.geometry)
        keep = len(block_ids) > 0
        if keep:
            self.sends[request.request_id] = self.settings.lease_seconds
        return keep, handoff.to_params()

    # ---------------------------------------------------------------- each step

    def build_connector_meta(self, scheduler_output: Any) -> FreightMetadata:
        meta = FreightMetadata(loads=self.loads, sends=self.sends)
        self.loads, self.sends = {}, {}
        return meta
