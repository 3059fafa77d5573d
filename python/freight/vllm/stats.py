"""FreightConnector's numbers (:mod:`freight.vllm.numbers`) in vLLM's KV connector
stats (the periodic "KV Transfer metrics" log line) and its Prometheus metrics
(``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from .numbers import Numbers, empty


@dataclass
class FreightStats(KVConnectorStats):
    """A worker's :class:`Numbers` as vLLM carries them from the workers to its
    loggers (``data`` is what crosses processes)."""

    data: Dict[str, Any] = field(default_factory=empty)

    def __post_init__(self) -> None:
        Numbers(self.data)  # fills in what is missing

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> "FreightStats":
        if not other.is_empty():
            Numbers(self.data).merge(other.data)
        return self

    def is_empty(self) -> bool:
        return Numbers(self.data).is_empty()

    def reduce(self) -> Dict[str, float]:
        return Numbers(self.data).summary()


class FreightPromMetrics(KVConnectorPromMetrics):
    """``vllm:freight_xfer_time_seconds``, ``vllm:freight_bytes_transferred`` (one
    observation a loaded request), ``vllm:freight_handshake_seconds`` (one a prefill
    worker connected to), ``vllm:freight_failed_transfers`` (a counter)."""

    def __init__(self, vllm_config: Any, metric_types: Dict[Any, Any], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        per_engine = self.per_engine_labelvalues

        def histogram(name: str, doc: str, buckets: List[float]) -> Dict[int, Any]:
            metric = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine)

        self.xfer_time = histogram("vllm:freight_xfer_time_seconds",
                                   "Time a request's KV read took, from posting it to its completion.", seconds)
        self.xfer_bytes = histogram("vllm:freight_bytes_transferred", "Bytes of KV read for a request.",
                                    [float(1 << (10 + 2 * i)) for i in range(12)])
        self.handshake = histogram("vllm:freight_handshake_seconds",
                                   "Time to connect to a prefill worker (metadata and connections).", seconds)
        failed = self._counter_cls(name="vllm:freight_failed_transfers",
                                   documentation="KV reads that failed (their blocks are reported as load errors).",
                                   labelnames=labelnames)
        self.failed = create_metric_per_engine(failed, per_engine)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for v in transfer_stats_data.get("transfer_seconds", []):
            self.xfer_time[engine_idx].observe(v)
        for v in transfer_stats_data.get("transfer_bytes", []):
            self.xfer_bytes[engine_idx].observe(v)
        for v in transfer_stats_data.get("handshake_seconds", []):
            self.handshake[engine_idx].observe(v)
        failures = transfer_stats_data.get("failed_transfers", 0)
        if failures:
            self.failed[engine_idx].inc(failures)
