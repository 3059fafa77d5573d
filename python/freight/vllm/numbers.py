"""What a decode worker records about its KV loads, kept apart from vLLM's stats
classes (:mod:`freight.vllm.stats` hands these numbers to vLLM) so that the worker's
data path runs, and is tested, without vLLM.

Per request loaded: the bytes moved and the time the READ took, from posting it to its
completion as the engine clocks it (``Request.duration``); per prefill worker
connected to: the time the connection took; and how many loads failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping

LISTS = ("transfer_seconds", "transfer_bytes", "handshake_seconds")
COUNTS = ("failed_transfers",)


def empty() -> Dict[str, Any]:
    return {**{k: [] for k in LISTS}, **{k: 0 for k in COUNTS}}


@dataclass
class Numbers:
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

    def merge(self, other: Mapping[str, Any]) -> None:
        for k in LISTS:
            self.data[k].extend(other.get(k, []))
        for k in COUNTS:
            self.data[k] += other.get(k, 0)

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in LISTS) and not any(self.data[k] for k in COUNTS)

    def summary(self) -> Dict[str, float]:
        """The figures of vLLM's "KV Transfer metrics" log line."""
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
