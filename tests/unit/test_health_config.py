"""HealthConfig validation and the command line's flag > env > default precedence."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fthsdp.services.health.__main__ import build_parser, resolve_config
from fthsdp.services.health.config import HealthConfig


def test_defaults_are_loopback_and_valid() -> None:
    config = HealthConfig()
    assert (config.mode, config.host, config.port, config.http_port) == (
        "central",
        "127.0.0.1",
        7460,
        7461,
    )
    assert config.redis_url is None and config.quorum == ()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"mode": "leader"}, "mode"),
        ({"port": 70000}, "port"),
        ({"http_port": -2}, "http_port"),
        ({"host": ""}, "host"),
        ({"node": "a b"}, "node"),
        ({"central": "nohost"}, "central"),
        ({"quorum": ("h:0",)}, "quorum"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"heartbeat_timeout": timedelta(0)}, "heartbeat_timeout"),
        ({"check_interval": timedelta(seconds=1)}, "check_interval"),
        ({"max_batch_records": 10001}, "max_batch_records"),
        ({"max_buffered_records": 10}, "max_buffered_records"),
        ({"shutdown_grace": timedelta(seconds=-1)}, "shutdown_grace"),
        ({"ingest_forwards_per_s": 0.0}, "ingest_forwards_per_s"),
        ({"ingest_forwards_per_s": float("nan")}, "ingest_forwards_per_s"),
        ({"ingest_forwards_per_s": float("inf")}, "ingest_forwards_per_s"),
    ],
)
def test_bad_settings_are_rejected_by_name(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        HealthConfig(**fields)  # type: ignore[arg-type]


def test_flag_beats_env_beats_default() -> None:
    env = {
        "FTHSDP_HEALTH_MODE": "agent",
        "FTHSDP_HEALTH_PORT": "9001",
        "FTHSDP_HEALTH_HEARTBEAT_TIMEOUT_MS": "700",
        "FTHSDP_HEALTH_QUORUM": "a:1, b:2",
    }
    args = build_parser().parse_args(["--port", "9002", "--central", "c:7460", "--node", "n1"])
    config = resolve_config(args, env)
    assert config.mode == "agent"
    assert config.port == 9002
    assert config.http_port == 7463  # the agent's default, not the central one
    assert config.heartbeat_timeout == timedelta(milliseconds=700)
    assert config.quorum == ("a:1", "b:2")
    assert (config.central, config.node) == ("c:7460", "n1")


def test_http_can_be_turned_off_and_bad_env_names_its_variable() -> None:
    args = build_parser().parse_args(["--http-port", "-1"])
    assert resolve_config(args, {}).http_port is None
    with pytest.raises(ValueError, match="FTHSDP_HEALTH_PORT"):
        resolve_config(build_parser().parse_args([]), {"FTHSDP_HEALTH_PORT": "many"})


def test_the_ingest_capacity_comes_from_the_flag_or_the_env() -> None:
    parsed = build_parser().parse_args(["--ingest-forwards-per-s", "250.5"])
    assert resolve_config(parsed, {}).ingest_forwards_per_s == 250.5
    env = {"FTHSDP_HEALTH_INGEST_FORWARDS_PER_S": "2000"}
    assert resolve_config(build_parser().parse_args([]), env).ingest_forwards_per_s == 2000.0
    assert resolve_config(build_parser().parse_args([]), {}).ingest_forwards_per_s == 500.0
    with pytest.raises(ValueError, match="ingest_forwards_per_s"):
        resolve_config(build_parser().parse_args(["--ingest-forwards-per-s", "-1"]), {})
