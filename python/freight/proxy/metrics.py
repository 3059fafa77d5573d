"""The proxy's Prometheus metrics, in a registry of their own (one per proxy, so that
several can live in one process, as in tests).

``freight_proxy_requests_total{route,code}``
    client requests, by the status the client got;
``freight_proxy_upstream_total{role,instance,outcome}``
    requests sent to instances: ``ok``, ``http_error`` (answered with an error status),
    ``connection_error`` (refused, reset), ``timeout``, ``bad_answer``;
``freight_proxy_errors_total{role,reason}``
    requests the proxy failed for a role: ``no_instance`` (503), ``connection``,
    ``bad_answer`` (502), ``timeout`` (504), ``http_status`` (the instance's own error
    passed on); role ``client``, reason ``gone``: the client left mid-answer;
``freight_proxy_last_resort_total{role,instance}``
    requests sent to a down instance because none of its role was alive and its health
    checks had gone unanswered (busy, perhaps, not dead);
``freight_proxy_ttft_seconds{role}`` / ``freight_proxy_latency_seconds{role}``
    time from sending a request to an instance to its first / last byte of answer
    (role ``client``: from the client's request to its first / last byte);
``freight_proxy_in_flight{role,instance}``, ``freight_proxy_instance_up{role,instance}``
    requests in flight, and whether the instance is in use (1) or down (0).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds, 1 ms to 10 min: a decode of many tokens on a slow host lasts minutes.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 600.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("freight_proxy_requests", "Client requests by route and status",
                                ["route", "code"], registry=r)
        self.upstream = Counter("freight_proxy_upstream", "Requests sent to instances, by outcome",
                                ["role", "instance", "outcome"], registry=r)
        self.errors = Counter("freight_proxy_errors", "Requests failed for a role, by reason",
                              ["role", "reason"], registry=r)
        self.last_resort = Counter("freight_proxy_last_resort", "Requests sent to an instance whose health "
                                   "checks go unanswered, none of its role being alive",
                                   ["role", "instance"], registry=r)
        self.ttft = Histogram("freight_proxy_ttft_seconds", "Time to the first byte of an answer",
                              ["role"], buckets=BUCKETS, registry=r)
        self.latency = Histogram("freight_proxy_latency_seconds", "Time to the last byte of an answer",
                                 ["role"], buckets=BUCKETS, registry=r)
        self.in_flight = Gauge("freight_proxy_in_flight", "Requests in flight to an instance",
                               ["role", "instance"], registry=r)
        self.up = Gauge("freight_proxy_instance_up", "1 while an instance is in use, 0 while it is down",
                        ["role", "instance"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
