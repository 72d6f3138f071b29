"""Scoring `bench.predictor`'s recorded telemetry, pure functions: the predictor's error per
replica step (fitted on a warm-up, and online), and fail-slow verdicts replayed through the
health service's own detector with the predictor and without it."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.failslow import Coefficients, FailSlowDetector, fit, predict
from fthsdp.services.health.telemetry import RankId, StepRecord

Sample = tuple[int, int, float]
"""(tokens, Σ l², seconds) of one replica step."""


def replica_steps(
    records: Iterable[Mapping[str, Any]],
) -> dict[str, list[tuple[int, float, Sample]]]:
    """Per replica, its committed steps in order as (step, started_at, (N, Σ l², own seconds)),
    aggregated over its ranks as the fail-slow detector does (own = duration - exchange wait,
    the maximum over ranks; N and Σ l² the maximum)."""
    steps: dict[tuple[str, int], list[Any]] = {}
    for r in records:
        if not r.get("committed", True):
            continue
        key = (r["rank"]["replica_id"], int(r["step"]))
        own = max(0.0, float(r["duration_s"]) - float(r.get("exchange_wait_s", 0.0)))
        entry = steps.setdefault(key, [float(r["started_at"]), 0, 0, 0.0])
        entry[0] = min(entry[0], float(r["started_at"]))
        entry[1] = max(entry[1], int(r["tokens"]))
        entry[2] = max(entry[2], int(r["sum_seq_len_sq"]))
        entry[3] = max(entry[3], own)
    out: dict[str, list[tuple[int, float, Sample]]] = {}
    for (replica, step), (started, tokens, sq, own) in sorted(steps.items()):
        out.setdefault(replica, []).append((step, started, (tokens, sq, own)))
    return out


def ape(coef: Coefficients, samples: Sequence[Sample]) -> list[float]:
    """Absolute percentage error of the predictor on each of `samples`."""
    return [100.0 * abs(t / p - 1.0) for n, sq, t in samples if (p := predict(coef, n, sq)) > 0]


def mape(coef: Coefficients, samples: Sequence[Sample]) -> float:
    """Mean absolute percentage error of the predictor over `samples`."""
    errors = ape(coef, samples)
    return statistics.fmean(errors) if errors else float("nan")


def split_warmup(
    steps: Mapping[str, Sequence[Sample]], warmup: int, skip: int = 0
) -> tuple[dict[str, Coefficients], dict[str, list[Sample]]]:
    """Per replica with more than `skip + warmup` steps: the fit on steps [skip, skip + warmup)
    and the steps after them, to judge it on."""
    fits, held_out = {}, {}
    for replica, samples in steps.items():
        if len(samples) > skip + warmup:
            fits[replica] = fit(list(samples[skip : skip + warmup]))
            held_out[replica] = list(samples[skip + warmup :])
    return fits, held_out


def online_errors(samples: Sequence[Sample], warmup: int, skip: int = 0) -> list[float]:
    """The absolute percentage error of each step after `skip + warmup`, predicted as the
    detector does as it runs: fitted on the warm-up, then refitted every `warmup // 2` steps on
    every earlier step (at most the detector's 512), each step predicted before it is learned.
    (The detector learns only steps it judged healthy; here every step is healthy.)"""
    errors = []
    coef: Coefficients | None = None
    refit_every = max(1, warmup // 2)
    for i in range(skip + warmup, len(samples)):
        if coef is None or (i - skip - warmup) % refit_every == 0:
            coef = fit(list(samples[max(skip, i - 512) : i]))
        errors.extend(ape(coef, [samples[i]]))
    return errors


def replay_verdicts(
    records: Iterable[Mapping[str, Any]], *, use_predictor: bool
) -> list[dict[str, Any]]:
    """The fail-slow incidents the health service's detector raises on these step records (JSON
    as `/v1/records/steps` returns them), fed in start order a step at a time: replica, step,
    ratio."""
    detector = FailSlowDetector(DetectorConfig(fail_slow_use_predictor=use_predictor))
    found = []
    for r in sorted(records, key=lambda r: (float(r["started_at"]), int(r["step"]))):
        record = StepRecord(
            rank=RankId(replica_id=r["rank"]["replica_id"], rank=int(r["rank"]["rank"])),
            step=int(r["step"]),
            started_at=float(r["started_at"]),
            duration_s=float(r["duration_s"]),
            tokens=int(r["tokens"]),
            sum_seq_len_sq=int(r["sum_seq_len_sq"]),
            committed=bool(r.get("committed", True)),
            exchange_wait_s=float(r.get("exchange_wait_s", 0.0)),
        )
        detector.add([record])
        end = record.started_at + record.duration_s
        for incident in detector.check(end):
            found.append(
                {
                    "replica_id": incident.replica_id,
                    "step": incident.evidence["step"],
                    "t": end,
                    "ratio": round(float(incident.evidence["ratio"]), 3),
                }
            )
    return found


def score(
    records: Sequence[Mapping[str, Any]],
    incidents: Sequence[Mapping[str, Any]],
    *,
    throttle: tuple[float, float] | None,
    slow_replica: str,
    warmup: int,
    skip: int,
) -> dict[str, Any]:
    """Everything the bench reports, from the telemetry, the live incidents and the throttle's
    [start, end) in Unix seconds (None: no throttle ran)."""
    start, end = throttle if throttle is not None else (float("inf"), float("inf"))
    before = [r for r in records if float(r["started_at"]) < start]
    per_replica = {
        replica: [s for _, _, s in steps] for replica, steps in replica_steps(before).items()
    }
    fits, held_out = split_warmup(per_replica, warmup, skip)
    first_fits, first_held = split_warmup(per_replica, warmup)
    rows = {}
    for replica, coef in sorted(fits.items()):
        samples = per_replica[replica]
        judged = held_out[replica]
        mean_only = (0.0, 0.0, statistics.fmean(t for _, _, t in samples[skip : skip + warmup]))
        online = online_errors(samples, warmup, skip)
        rows[replica] = {
            "steps": len(samples),
            "judged": len(judged),
            "mape_online_pct": statistics.fmean(online),
            "median_ape_online_pct": statistics.median(online),
            "alpha": coef[0],
            "beta": coef[1],
            "gamma": coef[2],
            "mape_pct": mape(coef, judged),
            "median_ape_pct": statistics.median(ape(coef, judged)),
            "mape_no_sq_term_pct": mape(mean_only, judged),
            "mape_first_steps_fit_pct": mape(first_fits[replica], first_held[replica]),
            "mape_in_sample_pct": mape(fit(samples[skip:]), samples[skip:]),
            "sum_sq_range": [min(s[1] for s in judged), max(s[1] for s in judged)],
            "own_s_range": [min(s[2] for s in judged), max(s[2] for s in judged)],
        }
    errors = [e for r in held_out for e in ape(fits[r], held_out[r])]
    online = [e for r in fits for e in online_errors(per_replica[r], warmup, skip)]
    overall = {
        "mape_online_pct": statistics.fmean(online) if online else None,
        "median_ape_online_pct": statistics.median(online) if online else None,
        "mape_pct": statistics.fmean(errors) if errors else None,
        "median_ape_pct": statistics.median(errors) if errors else None,
        "steps_judged": len(errors),
    }
    slowed = None
    if throttle is not None and slow_replica in fits:
        # From a second in (the throttle's first steps mix both speeds) to its end.
        during = [
            s
            for _, started, s in replica_steps(records).get(slow_replica, [])
            if start + 1.0 <= started < end
        ]
        ratios = [t / predict(fits[slow_replica], n, sq) for n, sq, t in during]
        peers = [
            t / predict(fits[r], n, sq)
            for r in fits
            if r != slow_replica
            for _, started, (n, sq, t) in replica_steps(records).get(r, [])
            if start + 1.0 <= started < end
        ]
        slowed = {
            "steps": len(ratios),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "peers_median_ratio": statistics.median(peers) if peers else None,
        }
    live = [i for i in incidents if i.get("kind") == "fail_slow"]
    verdicts = {
        "live_false_alarms": [_brief(i) for i in live if not _caught(i, slow_replica, start, end)],
        "live_caught": [_brief(i) for i in live if _caught(i, slow_replica, start, end)],
        "replay_predictor_before": replay_verdicts(before, use_predictor=True),
        "replay_plain_before": replay_verdicts(before, use_predictor=False),
        "replay_predictor_all": replay_verdicts(records, use_predictor=True),
    }
    return {"replicas": rows, "overall": overall, "throttled": slowed, "verdicts": verdicts}


def _caught(incident: Mapping[str, Any], replica: str, start: float, end: float) -> bool:
    """A fail-slow incident naming the throttled replica during the throttle (or within the
    detector's few seconds of persistence after it)."""
    at = float(incident["detected_at"])
    return incident["replica_id"] == replica and start <= at <= end + 3.0


def _brief(incident: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "replica_id": incident["replica_id"],
        "detected_at": incident["detected_at"],
        "summary": incident.get("summary"),
    }
