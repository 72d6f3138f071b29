"""Prometheus metrics of one health-service process, in its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_DETECTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0)


class HealthMetrics:
    """Counters (`fthsdp_health_*_total`), histograms (`*_seconds`) and gauges."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fthsdp_health_requests_total",
            "gRPC and HTTP requests handled, by method and status.",
            ["method", "code"],
            registry=r,
        )
        self.auth_failures = Counter(
            "fthsdp_health_auth_failures_total",
            "Requests refused for a missing or invalid bearer token.",
            registry=r,
        )
        self.records = Counter(
            "fthsdp_health_records_total",
            "Telemetry records accepted, by kind.",
            ["kind"],
            registry=r,
        )
        self.incidents = Counter(
            "fthsdp_health_incidents_total",
            "Incidents detected or received, by kind.",
            ["kind"],
            registry=r,
        )
        self.teardown_kills = Counter(
            "fthsdp_health_teardown_kills_total",
            "Processes of torn-down replicas this agent signalled.",
            registry=r,
        )
        self.quorum_reports = Counter(
            "fthsdp_health_quorum_reports_total",
            "Failure reports sent to the quorum service, by outcome "
            "(evicted, already_gone, failed).",
            ["outcome"],
            registry=r,
        )
        self.failstops_unreachable = Counter(
            "fthsdp_health_failstops_unreachable_total",
            "Fail-stops the central service found behind a node agent it no longer hears (host "
            "loss or a cut link), left to the quorum service's heartbeats instead of reported.",
            registry=r,
        )
        self.forwards = Counter(
            "fthsdp_health_forwards_total",
            "Agent batches forwarded to the central service, by outcome (ok, failed).",
            ["outcome"],
            registry=r,
        )
        self.dropped = Counter(
            "fthsdp_health_dropped_records_total",
            "Records an agent dropped because its buffer for the central service was full.",
            registry=r,
        )
        self.detection_seconds = Histogram(
            "fthsdp_health_detection_seconds",
            "Agent: from a rank's last heartbeat to its failure report reaching the quorum "
            "service.",
            buckets=_DETECTION_BUCKETS,
            registry=r,
        )
        self.evaluate_seconds = Histogram(
            "fthsdp_health_evaluate_seconds",
            "Central: time of one detector evaluation.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.collective_groups = Gauge(
            "fthsdp_health_collective_groups",
            "Central: collective groups the detectors track (bounded by "
            "collective_groups_per_rank and collective_groups_total).",
            registry=r,
        )
        self.open_collectives = Gauge(
            "fthsdp_health_open_collectives",
            "Central: open collectives the detectors track.",
            registry=r,
        )
        self.groups_dropped = Counter(
            "fthsdp_health_collective_groups_dropped_total",
            "Central: collective groups dropped, by reason: rank_bound (a rank past "
            "collective_groups_per_rank left its least recently recorded group), total_bound "
            "(collective_groups_total reached), idle (no record for collective_retention_s).",
            ["reason"],
            registry=r,
        )
        self.ranks_forgotten = Counter(
            "fthsdp_health_ranks_forgotten_total",
            "Central: gone ranks forgotten after collective_retention_s of silence.",
            registry=r,
        )
        self.ranks = Gauge("fthsdp_health_ranks", "Ranks currently watched.", registry=r)
        self.nodes = Gauge("fthsdp_health_nodes", "Nodes reporting (central).", registry=r)
