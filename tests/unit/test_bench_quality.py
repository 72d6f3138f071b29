"""bench.quality: the outage schedule, and a quick end-to-end run of the emulation."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fthsdp.bench import quality
from fthsdp.bench.quality import Outage, healthy_at, outage_schedule
from fthsdp.bench.quality_render import FAULT_FREE, render


def _covered(schedule: list[Outage]) -> list[int]:
    return [step for o in schedule for step in range(o.start, o.end)]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_outage_schedule_is_spread_disjoint_and_deterministic(seed: int) -> None:
    kwargs = {"replicas": 3, "steps": 200, "outages": 4, "outage_steps": 10}
    schedule = outage_schedule(seed=seed, **kwargs)
    assert schedule == outage_schedule(seed=seed, **kwargs)
    assert len(schedule) == 4 and all(o.length == 10 for o in schedule)
    covered = _covered(schedule)
    assert len(covered) == len(set(covered)) == 40  # never overlapping, right total length
    assert all(0 <= s < 200 for s in covered) and all(0 <= o.replica < 3 for o in schedule)
    # One per quarter of the run: spread out, not bunched.
    assert [o.start // 50 for o in schedule] == [0, 1, 2, 3]
    # Exactly one replica down on a covered step, all of them healthy elsewhere.
    for step in range(200):
        assert len(healthy_at(step, schedule, 3)) == (2 if step in covered else 3)


def test_outage_schedule_depends_on_seed_and_rejects_what_does_not_fit() -> None:
    schedules = {
        tuple(outage_schedule(seed=s, replicas=3, steps=200, outages=4, outage_steps=10))
        for s in range(5)
    }
    assert len(schedules) > 1
    assert outage_schedule(seed=0, replicas=3, steps=200, outages=0, outage_steps=10) == []
    with pytest.raises(ValueError, match="do not fit"):
        outage_schedule(seed=0, replicas=3, steps=30, outages=4, outage_steps=10)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("quality")
    json_path, png = out / "q.json", out / "q.png"
    assert quality.main(["--quick", "--json", str(json_path), "--plot", str(png)]) == 0
    data = json.loads(json_path.read_text())
    return data, png, render(data)


def test_quick_run_covers_every_policy_at_equal_tokens(
    quick: tuple[dict[str, Any], Path, str],
) -> None:
    data, _, _ = quick
    cfg = data["config"]
    (seed,) = data["runs"]
    runs = data["runs"][seed]
    assert set(runs) == {FAULT_FREE, "sqrt", "linear", "none"}
    assert set(data["summary"]["kinds"]) == set(runs)
    budget = cfg["target_tokens"]
    assert budget == cfg["steps"] * cfg["replicas"] * cfg["micro_batch"] * cfg["block_size"]
    assert runs[FAULT_FREE]["tokens"] == budget and runs[FAULT_FREE]["steps"] == cfg["steps"]
    for name, run in runs.items():
        assert run["tokens"] >= budget
        assert run["exactly_once"], name
        # Evaluated at the same token marks, each at or just past its mark.
        assert [e["mark"] for e in run["evals"]] == cfg["eval_marks"]
        assert all(e["tokens"] >= e["mark"] for e in run["evals"])
        # The loss fell from the initial model to the end of training.
        assert run["evals"][-1]["loss"] < run["evals"][0]["loss"] - 0.5


def test_quick_run_really_loses_replicas_and_scales_lr(
    quick: tuple[dict[str, Any], Path, str],
) -> None:
    data, _, _ = quick
    cfg = data["config"]
    replicas = cfg["replicas"]
    (seed,) = data["runs"]
    runs = data["runs"][seed]
    ff = runs[FAULT_FREE]["per_step"]
    assert set(ff["healthy"]) == {replicas} and set(ff["lr_factor"]) == {1.0}
    assert runs[FAULT_FREE]["down_replica_steps"] == 0
    down = cfg["outages"] * cfg["outage_steps"]
    assert math.isclose(down / cfg["steps"], cfg["down_fraction"], abs_tol=0.05)
    expected = {"sqrt": math.sqrt((replicas - 1) / replicas), "linear": (replicas - 1) / replicas}
    for policy in ("sqrt", "linear", "none"):
        run = runs[policy]
        steps = run["per_step"]
        assert run["down_replica_steps"] == down
        assert steps["healthy"].count(replicas - 1) == down and run["steps"] > cfg["steps"]
        shrunk = [
            f for h, f in zip(steps["healthy"], steps["lr_factor"], strict=True) if h < replicas
        ]
        assert shrunk == [pytest.approx(expected.get(policy, 1.0))] * down
        assert all(
            f == 1.0
            for h, f in zip(steps["healthy"], steps["lr_factor"], strict=True)
            if h == replicas
        )
        # The factor scales the scheduler's lr of that step only (both runs share the schedule
        # per step; the faulty run's extra steps at the end have no fault-free twin).
        for f, lr, ff_lr in zip(steps["lr_factor"], steps["lr"], ff["lr"], strict=False):
            assert lr == pytest.approx(ff_lr * f)


def test_quick_run_writes_plot_and_table(quick: tuple[dict[str, Any], Path, str]) -> None:
    _, png, table = quick
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fault-free" in table and "sqrt" in table and "wall time" in table
