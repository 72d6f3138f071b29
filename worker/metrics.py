"""Prometheus metrics of a replica leader (`ManagerConfig.metrics_port`; off by default).

Only rank 0 serves them: the step protocol is per replica, so one scrape target per replica says
what its ranks did. The endpoint is the services' admin server (`/metrics`, `/livez`, `/readyz`),
bound to `metrics_host` (127.0.0.1 unless told otherwise); it serves counters, never state, to
scrapers that present the job's token (as every fthsdp service's /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fthsdp.services.common.admin import AdminServer
from fthsdp.services.common.tokens import Token
from fthsdp.worker.config import ManagerConfig

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerMetrics:
    """The leader's step metrics and the HTTP endpoint that serves them."""

    @classmethod
    def of_rank(cls, config: ManagerConfig, *, is_leader: bool) -> WorkerMetrics | None:
        """The replica leader's metrics when `config.metrics_port` asks for them; None on every
        other rank."""
        if not is_leader or config.metrics_port is None:
            return None
        return cls(
            host=config.metrics_host,
            port=config.metrics_port,
            replica_id=config.replica_id,
            token=config.token,
        )

    def __init__(self, *, host: str, port: int, replica_id: str, token: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"replica": replica_id}

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, ["replica"], registry=self.registry, buckets=_SECONDS
            ).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["replica"], registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["replica"], registry=self.registry).labels(**labels)

        self.step_seconds = histogram(
            "fthsdp_worker_step_seconds", "Wall time of a committed step, start_step to commit."
        )
        self.quorum_wait_seconds = histogram(
            "fthsdp_worker_quorum_wait_seconds",
            "Time a step waited for its quorum (beyond the overlap with the forward pass).",
        )
        self.exchange_seconds = histogram(
            "fthsdp_worker_exchange_seconds", "Cross-replica gradient exchange time per step."
        )
        self.catchup_seconds = histogram(
            "fthsdp_worker_catchup_seconds", "Time a catch-up step waited for the peers' state."
        )
        self.commits = counter("fthsdp_worker_commits_total", "Steps committed.")
        self.failed_attempts = counter(
            "fthsdp_worker_failed_attempts_total",
            "Exchange attempts that did not commit (retried on the next quorum).",
        )
        self.catchups = counter(
            "fthsdp_worker_catchups_total", "Steps that caught up from healthy peers."
        )
        self.exchange_bytes = counter(
            "fthsdp_worker_exchange_bytes_total",
            "Gradient bytes of this rank's share in committed cross-replica exchanges.",
        )
        self.exchange_gbps = gauge(
            "fthsdp_worker_exchange_gigabytes_per_second",
            "Throughput of the last committed exchange (GB/s of this rank's share).",
        )
        self.healthy_replicas = gauge(
            "fthsdp_worker_healthy_replicas",
            "Replicas whose gradients the last committed step averaged.",
        )
        self._server = AdminServer(
            host, port, self.registry, lambda: True, token=Token(token), name="worker-metrics"
        )
        self._server.start()

    @property
    def address(self) -> str:
        """`host:port` the endpoint bound (port 0 picks a free one)."""
        return self._server.address

    def committed(
        self, *, seconds: dict[str, float], healthy: int, recovered: bool, exchange_bytes: int
    ) -> None:
        """One committed step and its phases (`StepOutcome.seconds`)."""
        self.commits.inc()
        self.step_seconds.observe(seconds.get("total", 0.0))
        self.quorum_wait_seconds.observe(seconds.get("quorum", 0.0))
        exchange = seconds.get("exchange", 0.0)
        self.exchange_seconds.observe(exchange)
        self.exchange_bytes.inc(exchange_bytes)
        if exchange > 0:
            self.exchange_gbps.set(exchange_bytes / exchange / 1e9)
        self.healthy_replicas.set(healthy)
        if recovered:
            self.catchups.inc()
            self.catchup_seconds.observe(seconds.get("fetch", 0.0))

    def close(self) -> None:
        """Stops serving. Idempotent."""
        self._server.stop()
