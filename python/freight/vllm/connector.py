"""FreightConnector: vLLM's disaggregated prefill/decode through freight.

vLLM makes one instance of a KV connector in its scheduler process and one in every
worker process; this class hands each call to the half of its role
(:class:`freight.vllm.scheduler.SchedulerSide`, :class:`freight.vllm.worker.WorkerSide`).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "FreightConnector",
        "kv_connector_module_path": "freight.vllm", "kv_role": "kv_producer"}'

(``kv_consumer`` on the decode instance; ``kv_both`` for an instance that is either).
Settings go in ``kv_connector_extra_config`` (see :class:`freight.vllm.config.Settings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .config import Settings
from .scheduler import SchedulerSide
from .stats import FreightPromMetrics, FreightStats
from .worker import WorkerSide

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class FreightConnector(KVConnectorBase_V1):
    """A vLLM KV connector (``KVConnectorBase_V1``) that moves whole KV blocks between
    instances with freight: the decode instance reads the blocks it lacks, every layer
    in one request, and the prefill instance frees them once it is told."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = Settings.from_vllm(vllm_config)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, settings)
        else:
            self._worker = WorkerSide(vllm_config, settings, kv_cache_config)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]):
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self._sched().set_worker_handshakes(metadata)

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._work().handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish before the request is scheduled (they are asynchronous).
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # The decode instance reads the blocks; nothing is pushed layer by layer.
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._work().finished(finished_req_ids, meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_kv_connector_stats(self) -> Optional[FreightStats]:
        # vLLM asks the scheduler's connector too; it records nothing.
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> FreightStats:
        return FreightStats(data=data) if data is not None else FreightStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list,
                           per_engine_labelvalues: dict) -> FreightPromMetrics:
        return FreightPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ helpers

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("FreightConnector: a scheduler call on the worker's connector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("FreightConnector: a worker call on the scheduler's connector")
        return self._worker
