"""Prometheus metrics of the proxy, on a registry of its own (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aitlrt_requests", "Proxied model calls", ["endpoint", "status"], registry=self.registry
        )
        self.errors = Counter("aitlrt_errors", "Calls answered with an error", ["reason"], registry=self.registry)
        self.prompt_tokens = Counter("aitlrt_prompt_tokens", "Prompt tokens of recorded calls", registry=self.registry)
        self.completion_tokens = Counter(
            "aitlrt_completion_tokens", "Sampled tokens of recorded calls", registry=self.registry
        )
        self.continuity = Counter(
            "aitlrt_continuity",
            "Chat calls by how they went: 'continued' (the previous call's tokens extended: the same training row), "
            "else why not (a new row)",
            ["outcome"],
            registry=self.registry,
        )
        self.inflight = Gauge("aitlrt_inflight", "Calls in flight", registry=self.registry)
        self.latency = Histogram(
            "aitlrt_request_latency_seconds",
            "Wall time of a proxied call",
            ["endpoint"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.weight_version = Gauge("aitlrt_weight_version", "Current policy weight version", registry=self.registry)
