"""Fail-slow detection: per-replica step time, filtered by a workload-aware predictor (ResiHP).

Step time changes for benign reasons: attention costs Σl², so a batch of a few long documents
takes longer than the same tokens packed from many short ones. A change point on raw step time
therefore fires on workload changes. The predictor T ≈ αN + βΣl² + γ, fitted by least squares
on the first `warmup` committed steps of each replica, explains those; the detector runs a
one-sided CUSUM on the relative residual (measured / predicted − 1) and, at a change point,
raises an incident only when the median residual of the recent steps (at least `persist_steps`
of them, spanning at least `persist_s`) exceeds the margin above the other replicas' (a
slowdown they all share, such as a loaded machine, is nobody's). An unconfirmed change point is
dropped and the CUSUM restarts (ResiHP removes such points).

Peers are the replicas judged over the same time (their latest step ended inside the window)
and not slow themselves: a replica that is down, or restarting, holds only old residuals. With
none (a single-replica job, every other replica down or still warming up) nothing tells a slow
replica from a slow machine, so the detector stays silent and says so (`judgement`). A
restarted replica warms up again (`forget`): its first steps (catch-up, allocator, caches) are
not its speed.

Nor is anyone's speed while the job recovers: the sources serve a catch-up, rings rebuild, and
where replicas share hosts a restart's imports take their CPU. So nothing is judged while a
replica that (re)joined a running job warms up, nor before `hold`'s time (the core holds for
`fail_slow_settle_s` after a fail-stop, a hang, a restart or a departure, and while a replica
is down); the residual windows start afresh after it.

γ (the intercept) is there because a step has work that no token count explains: the optimizer
step, the fixed-size gradient exchange, the quorum round. Without it, α absorbs them and the fit
is biased whenever N varies. When N is constant (fixed token budget per packed batch) αN and γ
are collinear; the minimum-norm least-squares solution still predicts correctly.

A replica's time is its own: each rank's duration minus the time it waited on the cross-replica
exchange (`exchange_wait_s`), maximum over its ranks (ranks of a replica move in lockstep), with
N and Σl² the maximum over its ranks (with a per-rank token budget, the slowest rank is the one
with the largest Σl²). Without that subtraction a slow replica would stretch every replica.

`use_predictor=False` is the baseline (a plain CUSUM on raw step time against a sliding mean,
every change point an incident, re-baselined after each) used by `bench.rca`."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import fmean, median
from typing import Any, Literal

import numpy as np

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import Incident, IncidentKind, StepRecord

_MAX_FIT_SAMPLES = 512  # the refit window: bounded memory and cost per replica
_MAX_WINDOW = 4096  # residuals kept at most, whatever persist_s asks for (tiny steps)

Judgement = Literal["warming_up", "recovering", "no_peers", "judging", "slow"]
"""What the detector can say of a replica now: still fitting its predictor; the job is
recovering (silent); no peers to tell a slow replica from a slow machine (silent); judging;
confirmed slow."""

Coefficients = tuple[float, float, float]
"""(α per token, β per Σl², γ seconds)."""


def fit(samples: list[tuple[int, int, float]]) -> Coefficients:
    """Least-squares (α, β, γ) for T ≈ αN + βΣl² + γ over (N, Σl², T) samples.

    Columns are scaled to unit magnitude first: Σl² is ~10^7 times N, and an unscaled solve would
    lose β in rounding."""
    data = np.asarray(samples, dtype=np.float64)
    design = np.column_stack([data[:, 0], data[:, 1], np.ones(len(data))])
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    solution = np.linalg.lstsq(design / scale, data[:, 2], rcond=None)[0] / scale
    return float(solution[0]), float(solution[1]), float(solution[2])


def _outside(samples: list[tuple[int, int, float]], sq: int) -> bool:
    """Whether Σl² lies more than 10% outside the range the fit has seen."""
    low = min(sample[1] for sample in samples)
    high = max(sample[1] for sample in samples)
    return sq > high * 1.1 or sq < low / 1.1


def predict(coef: Coefficients, tokens: int, sum_seq_len_sq: int) -> float:
    """The healthy step time for this workload."""
    return coef[0] * tokens + coef[1] * sum_seq_len_sq + coef[2]


def residual_noise(coef: Coefficients, samples: list[tuple[int, int, float]]) -> float:
    """Standard deviation of measured / predicted - 1 over `samples`: how noisy a healthy
    replica's step time is around the fit (a loaded machine's is large)."""
    ratios = [t / p - 1.0 for n, sq, t in samples if (p := predict(coef, n, sq)) > 0]
    return float(np.std(ratios)) if len(ratios) > 1 else 0.0


def _refit(series: _Series) -> None:
    series.coef = fit(series.warm)
    series.noise = residual_noise(series.coef, series.warm)


@dataclass(slots=True)
class _Step:
    own_s: float = 0.0
    by_rank: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Rank -> (its own time, its time waiting on others): which rank set `own_s`."""
    tokens: int = 0
    sq: int = 0
    ranks: int = 0
    started: float = math.inf
    ended: float = -math.inf


@dataclass(slots=True)
class _Series:
    """One replica's step-time series and detector state."""

    ranks: set[int] = field(default_factory=set)
    pending: dict[int, _Step] = field(default_factory=dict)
    newest: int = -1
    done: int = -1
    warm: list[tuple[int, int, float]] = field(default_factory=list)
    coef: Coefficients | None = None
    noise: float = 0.0
    """Standard deviation of the relative residual over the fit's samples."""
    baseline: deque[float] = field(default_factory=deque)
    cusum: float = 0.0
    residuals: deque[float] = field(default_factory=deque)
    starts: deque[float] = field(default_factory=deque)
    """When each step of `residuals` started."""
    last_end: float = -math.inf
    """When the latest judged step ended."""
    no_peers: bool = False
    """The latest change point had no peers to be judged against."""
    late: bool = False
    """Created while another replica's predictor was fitted: it (re)joined a running job, and
    nobody is judged until it has warmed up."""
    slow: bool = False
    alarms: list[dict[str, Any]] = field(default_factory=list)


class FailSlowDetector:
    """Per-replica series; `add` updates them, `check` returns the incidents they raised."""

    __slots__ = ("_config", "_late", "_newest_end", "_quiet_until", "_series")

    def __init__(self, config: DetectorConfig) -> None:
        self._config = config
        self._series: dict[str, _Series] = {}
        self._quiet_until = -math.inf
        """Steps that started before this are not judged (the job was recovering)."""
        self._late = 0
        """Late series still warming up."""
        self._newest_end = -math.inf
        """When the newest step seen ended (the detector's sense of now)."""

    def reconfigure(self, config: DetectorConfig) -> None:
        """New thresholds apply from the next step; fits and windows are kept."""
        self._config = config
        for series in self._series.values():
            series.baseline = deque(series.baseline, maxlen=config.fail_slow_warmup_steps)

    def forget(self, replica_id: str) -> None:
        """Drop a replica's series (it left; a restarted one warms up again)."""
        series = self._series.pop(replica_id, None)
        if series is not None and series.late:
            self._late -= 1

    def hold(self, until: float) -> None:
        """Judge no step that starts before `until` (the job is recovering)."""
        self._quiet_until = max(self._quiet_until, until)

    def suspect(self, replica_id: str) -> bool:
        """Whether the replica is currently confirmed slow."""
        series = self._series.get(replica_id)
        return series is not None and series.slow

    def judgement(self, replica_id: str) -> Judgement:
        """What the detector can say of the replica now (O(1))."""
        series = self._series.get(replica_id)
        if series is None or series.coef is None:
            return "warming_up"
        if series.slow:
            return "slow"
        if self._late or self._newest_end < self._quiet_until:
            return "recovering"
        if series.no_peers or len(self._series) < 2:
            return "no_peers"
        return "judging"

    def coefficients(self, replica_id: str) -> Coefficients | None:
        """The replica's fitted predictor, once warmed up."""
        series = self._series.get(replica_id)
        return None if series is None else series.coef

    def add(self, records: Iterable[StepRecord]) -> None:
        """Step records of any ranks; a replica's step is judged once all its ranks reported
        it, or once a step two later appears (a rank that never reports must not stall it)."""
        touched = set()
        for record in records:
            if not record.committed:
                continue  # a failed exchange is retried; its time is not the replica's speed
            series = self._series.get(record.rank.replica_id)
            if series is None:
                series = self._series[record.rank.replica_id] = self._new_series()
                series.late = any(s.coef is not None for s in self._series.values())
                self._late += series.late
            if record.step <= series.done:
                continue
            series.ranks.add(record.rank.rank)
            series.newest = max(series.newest, record.step)
            step = series.pending.setdefault(record.step, _Step())
            own = max(0.0, record.duration_s - record.exchange_wait_s)
            step.own_s = max(step.own_s, own)
            step.by_rank[record.rank.rank] = (own, record.exchange_wait_s)
            step.tokens = max(step.tokens, record.tokens)
            step.sq = max(step.sq, record.sum_seq_len_sq)
            step.ranks += 1
            step.started = min(step.started, record.started_at)
            step.ended = max(step.ended, record.started_at + record.duration_s)
            self._newest_end = max(self._newest_end, step.ended)
            touched.add(record.rank.replica_id)
        for replica_id in touched:
            self._finalize(self._series[replica_id])

    def check(self, now: float) -> list[Incident]:
        """Incidents raised since the last call."""
        found = []
        for replica_id, series in self._series.items():
            for evidence in series.alarms:
                found.append(_incident(replica_id, evidence, now))
            series.alarms.clear()
        return found

    def _new_series(self) -> _Series:
        cfg = self._config
        return _Series(baseline=deque(maxlen=cfg.fail_slow_warmup_steps))

    def _push(self, series: _Series, step: _Step, residual: float) -> bool:
        """Adds a judged step's residual to the window; whether the window is full: at least
        `persist_steps` steps spanning at least `persist_s`. Older steps leave once the rest
        still fill it."""
        cfg = self._config
        series.residuals.append(residual)
        series.starts.append(step.started)
        series.last_end = max(series.last_end, step.ended)
        while len(series.residuals) > cfg.fail_slow_persist_steps and (
            len(series.residuals) > _MAX_WINDOW
            or series.last_end - series.starts[1] >= cfg.fail_slow_persist_s
        ):
            series.residuals.popleft()
            series.starts.popleft()
        return self._full(series)

    def _full(self, series: _Series) -> bool:
        cfg = self._config
        return (
            len(series.residuals) >= cfg.fail_slow_persist_steps
            and series.last_end - series.starts[0] >= cfg.fail_slow_persist_s
        )

    def _finalize(self, series: _Series) -> None:
        for number in sorted(series.pending):
            step = series.pending[number]
            if step.ranks < len(series.ranks) and number > series.newest - 2:
                break
            del series.pending[number]
            series.done = number
            self._sample(series, number, step)

    def _sample(self, series: _Series, number: int, step: _Step) -> None:
        cfg = self._config
        if series.coef is None:
            series.warm.append((step.tokens, step.sq, step.own_s))
            series.baseline.append(step.own_s)
            if len(series.warm) == cfg.fail_slow_warmup_steps:
                _refit(series)
                if series.late:  # the job is whole again: give it time to settle
                    series.late = False
                    self._late -= 1
                    self.hold(step.ended + cfg.fail_slow_settle_s)
            return
        if self._late or step.started < self._quiet_until:
            series.residuals.clear()  # judged afresh, on steps of the settled job only
            series.starts.clear()
            series.cusum = 0.0
            return
        if cfg.fail_slow_use_predictor:
            if _outside(series.warm, step.sq):
                # A workload the fit never saw (a new data phase): extrapolating β would turn
                # it into a false alarm, so learn it instead of judging it.
                series.warm.append((step.tokens, step.sq, step.own_s))
                _refit(series)
                return
            self._judge_predicted(series, number, step)
            self._learn(series, step)
        else:
            self._judge_raw(series, number, step)

    def _judge_predicted(self, series: _Series, number: int, step: _Step) -> None:
        cfg = self._config
        assert series.coef is not None
        predicted = predict(series.coef, step.tokens, step.sq)
        if predicted <= 0:  # a degenerate fit: fall back to the warm-up mean
            predicted = fmean(series.baseline)
        residual = step.own_s / predicted - 1.0
        full = self._push(series, step, residual)
        level = median(series.residuals)
        if series.slow:
            # Recovered only well inside the margin, on the quantity that raised it (the excess
            # over the peers): one that hovers at the margin is one incident, not one per
            # crossing. A relapse after a recovery is a new incident.
            excess = level - (self._peer_level(series) or 0.0)
            if full and excess < cfg.fail_slow_margin / 2:
                series.slow = False
            return
        # The classic CUSUM settings in units of the healthy noise (slack 0.5 sigma, threshold
        # 5 sigma), never below the configured ones: on a noisy machine a few slow steps are
        # not a change point.
        slack = max(cfg.fail_slow_cusum_slack, 0.5 * series.noise)
        threshold = max(cfg.fail_slow_cusum_threshold, 5.0 * series.noise)
        series.cusum = max(0.0, series.cusum + residual - slack)
        if series.cusum <= threshold:
            return
        series.cusum = 0.0  # confirmed or benign, the next change point starts afresh
        peers = self._peer_level(series)
        series.no_peers = peers is None
        if peers is None:
            return  # nothing to tell this replica's slowdown from the machine's
        # The median of `persist` noisy residuals wanders by about 1.25 sigma / sqrt(persist):
        # two of those on top of the margin keep noise from passing for a slowdown.
        wander = 2.5 * series.noise / len(series.residuals) ** 0.5
        if full and level - peers > cfg.fail_slow_margin + wander:
            series.slow = True
            evidence = self._evidence(series, number, step, predicted, level)
            evidence["peer_median_residual"] = peers
            series.alarms.append(evidence)

    def _peer_level(self, series: _Series) -> float | None:
        """The median residual of the peers (None without any): a slowdown every replica
        shares (the machine, the network, the control plane) is not one replica's fault, so a
        replica is fail-slow only by the margin above its peers. A peer was judged over the
        same time (its latest step ended inside this window), is not slow itself, and has a
        full window."""
        since = series.starts[0]
        levels = [
            median(other.residuals)
            for other in self._series.values()
            if other is not series
            and not other.slow
            and other.last_end >= since
            and self._full(other)
        ]
        return median(levels) if levels else None

    def _learn(self, series: _Series, step: _Step) -> None:
        """Keep refining the fit with steps judged healthy (well inside the margin): warm-up
        may have seen one data phase only, and Σl² of later phases would be extrapolation. A
        slowdown beyond half the margin is never learned, so it cannot hide itself."""
        cfg = self._config
        if series.slow or series.residuals[-1] > cfg.fail_slow_margin / 2:
            return
        series.warm.append((step.tokens, step.sq, step.own_s))
        if len(series.warm) > _MAX_FIT_SAMPLES:
            del series.warm[: len(series.warm) - _MAX_FIT_SAMPLES]
        if len(series.warm) % max(1, cfg.fail_slow_warmup_steps // 2) == 0:
            _refit(series)

    def _judge_raw(self, series: _Series, number: int, step: _Step) -> None:
        cfg = self._config
        if len(series.baseline) < cfg.fail_slow_persist_steps:
            series.baseline.append(step.own_s)  # learning the level after a change point
            return
        base = fmean(series.baseline)
        residual = step.own_s / base - 1.0
        self._push(series, step, residual)
        series.cusum = max(0.0, series.cusum + residual - cfg.fail_slow_cusum_slack)
        if series.cusum <= cfg.fail_slow_cusum_threshold:
            series.baseline.append(step.own_s)
            return
        series.cusum = 0.0
        series.alarms.append(self._evidence(series, number, step, base, median(series.residuals)))
        # The new level is learned afresh from here (the samples before the change would
        # make every following step look like another change).
        series.baseline = deque([step.own_s], maxlen=cfg.fail_slow_warmup_steps)

    def _evidence(
        self, series: _Series, number: int, step: _Step, predicted: float, level: float
    ) -> dict[str, Any]:
        cfg = self._config
        coef = series.coef or (0.0, 0.0, 0.0)
        return {
            "step": number,
            "measured_s": step.own_s,
            # The slowest few ranks by their own time (bounded: a replica may have thousands).
            "slowest_ranks": [
                {"rank": r, "own_s": o, "waiting_s": w}
                for r, (o, w) in sorted(step.by_rank.items(), key=lambda kv: -kv[1][0])[:3]
            ],
            "predicted_s": predicted,
            "ratio": step.own_s / predicted,
            "median_residual": level,
            "residuals": list(series.residuals),
            "tokens": step.tokens,
            "sum_seq_len_sq": step.sq,
            "alpha": coef[0],
            "beta": coef[1],
            "gamma": coef[2],
            "margin": cfg.fail_slow_margin,
            "noise": series.noise,
            "use_predictor": cfg.fail_slow_use_predictor,
            "policy": cfg.fail_slow_policy,
        }


def _incident(replica_id: str, evidence: dict[str, Any], now: float) -> Incident:
    if evidence["use_predictor"]:
        what = f"the {evidence['predicted_s']:.3f} s predicted for its workload"
    else:
        what = f"its recent mean of {evidence['predicted_s']:.3f} s (no workload model)"
    summary = (
        f"replica {replica_id} is fail-slow: step {evidence['step']} took "
        f"{evidence['measured_s']:.3f} s, {evidence['ratio']:.2f}x {what} "
        f"(median excess {evidence['median_residual'] * 100:.0f}% over the last steps)"
    )
    return Incident(
        kind=IncidentKind.FAIL_SLOW,
        replica_id=replica_id,
        detected_at=now,
        summary=summary,
        evidence=evidence,
    )
