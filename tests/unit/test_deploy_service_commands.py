"""The one builder of service command lines both launchers use: flags in order, None left out,
the token as a file, the logging pair, and a Redis URL only ever in the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from fthsdp.deploy.service_commands import log_flags, redis_env, service_argv


def test_flags_in_order_none_left_out_then_token_file_and_logging() -> None:
    argv = service_argv(
        "py",
        "quorum",
        token_file=Path("/run/token"),
        log_flags=log_flags("INFO", "json"),
        flags=[("--port", 7450), ("--min-replicas", None), ("--host", "0.0.0.0")],
    )
    assert argv == [
        "py", "-m", "fthsdp.services.quorum",
        "--port", "7450", "--host", "0.0.0.0",
        "--token-file", "/run/token",
        "--log-format", "json", "--log-level", "info",
    ]  # fmt: skip


def test_no_logging_flags_leave_the_environment_in_charge() -> None:
    assert log_flags(None, None) == ()


def test_a_redis_url_goes_in_the_environment_of_its_service() -> None:
    url = "redis://:secret@db:6379/0"
    assert redis_env("checkpoint", url) == {"FTHSDP_CHECKPOINT_REDIS_URL": url}
    assert redis_env("health", None) == {}


def test_an_unknown_service_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown service"):
        service_argv("py", "quorom", token_file=Path("t"))
    with pytest.raises(ValueError, match="unknown service"):
        redis_env("redis", "redis://x")
