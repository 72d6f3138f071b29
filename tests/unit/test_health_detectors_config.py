"""DetectorConfig: validation and the JSON round trip."""

from __future__ import annotations

import pytest

from fthsdp.services.health.detectors.config import DetectorConfig


def test_round_trip() -> None:
    config = DetectorConfig(hang_timeout_s=3.0, fail_slow_policy="evict")
    assert DetectorConfig.from_dict(config.to_dict()) == config
    assert DetectorConfig.from_dict({"heartbeat_timeout_s": 2}).heartbeat_timeout_s == 2.0


@pytest.mark.parametrize(
    "data",
    [
        {"nope": 1},
        {"heartbeat_timeout_s": "1"},
        {"heartbeat_timeout_s": True},
        {"slow_rank_window": 2.5},
        {"fail_slow_use_predictor": 1},
        {"fail_slow_policy": "reboot"},
        {"sdc_min_replicas": 2},
        {"hang_timeout_s": -1.0},
        {"collective_retention_s": 5.0},
        {"heartbeat_timeout_s": float("nan")},
        {"collective_groups_per_rank": 1},
        {"collective_groups_per_rank": 1_001},
        {"collective_groups_per_rank": 64.0},
        {"collective_groups_total": 999},
        {"collective_groups_total": 2**63},
    ],
)
def test_bad_settings_are_rejected(data: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        DetectorConfig.from_dict(data)


def test_the_group_bounds_have_defaults_for_large_jobs() -> None:
    config = DetectorConfig()
    assert (config.collective_groups_per_rank, config.collective_groups_total) == (64, 1_000_000)
    changed = DetectorConfig.from_dict({"collective_groups_per_rank": 8})
    assert changed.collective_groups_per_rank == 8
