"""Prometheus metrics of one quorum service, in its own registry (several servers per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class QuorumMetrics:
    """Counters (`fthsdp_quorum_*_total`), histograms (`*_seconds`) and gauges of the service."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fthsdp_quorum_requests_total",
            "RPCs handled, by method and gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        self.auth_failures = Counter(
            "fthsdp_quorum_auth_failures_total",
            "Requests refused for a missing or invalid bearer token.",
            registry=r,
        )
        self.joins = Counter(
            "fthsdp_quorum_joins_total", "Replica process starts registered by Join.", registry=r
        )
        self.rounds = Counter(
            "fthsdp_quorum_rounds_total",
            "Quorum rounds formed, by decision path (fast, all_asked, join_timeout).",
            ["path"],
            registry=r,
        )
        self.epochs = Counter(
            "fthsdp_quorum_epochs_total", "Rounds that produced a new quorum id.", registry=r
        )
        self.evictions = Counter(
            "fthsdp_quorum_evictions_total",
            "Replicas removed, by cause (heartbeat, report, superseded, left).",
            ["cause"],
            registry=r,
        )
        self.round_seconds = Histogram(
            "fthsdp_quorum_round_seconds",
            "From the last arrival of a round to every participant answered.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.wait_seconds = Histogram(
            "fthsdp_quorum_wait_seconds",
            "How long one Quorum call waited for its round.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.members = Gauge("fthsdp_quorum_members", "Registered replicas.", registry=r)
        self.quorum_id = Gauge("fthsdp_quorum_id", "Latest quorum id formed.", registry=r)
        self.leader = Gauge(
            "fthsdp_quorum_leader", "1 while this instance decides, 0 on a standby.", registry=r
        )
        self.leader_changes = Counter(
            "fthsdp_quorum_leader_changes_total",
            "Times this instance was elected leader.",
            registry=r,
        )
