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
from .scheduler import FreightMetadata, SchedulerSide, WorkerHandshake
from .stats import FreightPromMetrics, FreightStats
from .worker import Instance, WorkerSide

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
        self._config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, settings)
        else:
            self._worker = WorkerSide(settings)

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
        self._work().register_kv_caches(kv_caches, self._instance())

    def get_handshake_metadata(self) -> WorkerHandshake:
        place, geometry = self._work().handshake()
        return WorkerHandshake(place=place.to_dict(), geometry=geometry.to_dict())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._step()
        self._work().start_load(meta.loads, meta.sends)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish before the request is scheduled (they are asynchronous).
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # The decode instance reads the blocks; nothing is pushed layer by layer.
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self.has_connector_metadata():
            meta = self._step()
            return self._work().finished(meta.loads, meta.sends)
        return self._work().finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_kv_connector_stats(self) -> Optional[FreightStats]:
        # vLLM asks the scheduler's connector too; it records nothing.
        numbers = self._worker.take_stats() if self._worker is not None else None
        return FreightStats(data=numbers.data) if numbers is not None else None

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

    def _instance(self) -> Instance:
        """This worker's instance, from vLLM's config."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        model, parallel = self._config.model_config, self._config.parallel_config
        return Instance(
            engine_id=str(self._config.kv_transfer_config.engine_id),
            model=str(model.model),
            block_size=int(self._config.cache_config.block_size),
            kv_heads=int(model.get_num_kv_heads(parallel)),
            head_size=int(model.get_head_size()),
            tensor_parallel=int(parallel.tensor_parallel_size),
            rank=int(get_tensor_model_parallel_rank()),
            num_blocks=getattr(self._kv_cache_config, "num_blocks", None),
        )

    def _step(self) -> FreightMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FreightMetadata), type(meta)
        return meta

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("FreightConnector: a scheduler call on the worker's connector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("FreightConnector: a worker call on the scheduler's connector")
        return self._worker
