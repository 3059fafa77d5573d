"""FreightConnector's numbers in vLLM's KV connector stats (the periodic "KV Transfer
metrics" log line) and its Prometheus metrics (``/metrics``).

Each decode worker records, per request it loaded: the bytes moved and the time from
posting the READ to seeing it done (seen at the next step, so a step's length is the
resolution), and per prefill worker it connected to: the time the connection took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

LISTS = ("transfer_seconds", "transfer_bytes", "handshake_seconds")
COUNTS = ("failed_transfers",)


def empty() -> Dict[str, Any]:
    return {**{k: [] for k in LISTS}, **{k: 0 for k in COUNTS}}


@dataclass
class FreightStats(KVConnectorStats):
    data: Dict[str, Any] = field(default_factory=empty)

    def __post_init__(self) -> None:
        for k, v in empty().items():
            self.data.setdefault(k, v)

    def record_transfer(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_seconds"].append(seconds)
        self.data["transfer_bytes"].append(nbytes)

    def record_failure(self) -> None:
        self.data["failed_transfers"] += 1

    def record_handshake(self, seconds: float) -> None:
        self.data["handshake_seconds"].append(seconds)

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> "FreightStats":
        if not other.is_empty():
            for k in LISTS:
                self.data[k].extend(other.data.get(k, []))
            for k in COUNTS:
                self.data[k] += other.data.get(k, 0)
        return self

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in LISTS) and not any(self.data[k] for k in COUNTS)

    def reduce(self) -> Dict[str, float]:
        times: List[float] = sorted(self.data["transfer_seconds"])
        total_bytes = sum(self.data["transfer_bytes"])
        out: Dict[str, float] = {"Num successful transfers": len(times),
                                 "Num failed transfers": self.data["failed_transfers"]}
        if times:
            out["Avg xfer time (ms)"] = round(sum(times) / len(times) * 1e3, 3)
            out["P99 xfer time (ms)"] = round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3, 3)
            out["Avg MB per transfer"] = round(total_bytes / len(times) / 1e6, 3)
            out["Throughput (MB/s)"] = round(total_bytes / max(sum(times), 1e-9) / 1e6, 1)
        handshakes = self.data["handshake_seconds"]
        out["Num handshakes"] = len(handshakes)
        if handshakes:
            out["Avg handshake (ms)"] = round(sum(handshakes) / len(handshakes) * 1e3, 3)
        return out


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
                                   "Time from posting a request's KV read to seeing it done.", seconds)
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
