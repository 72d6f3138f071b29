"""`fthsdp demo --log-format/--log-level` reach every process the demo starts: the flags the
demo builds are accepted by the checkpoint sidecar's and the rank's own command lines."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.deploy.demo import train
from fthsdp.deploy.demo.run import DemoConfig
from fthsdp.deploy.stack import Sidecar
from fthsdp.services.checkpoint.__main__ import _parser as checkpoint_parser


def test_only_the_logging_choices_given_are_passed_on() -> None:
    assert DemoConfig().log_flags == ()
    assert DemoConfig(log_format="json").log_flags == ("--log-format", "json")
    assert DemoConfig(log_format="text", log_level="DEBUG").log_flags == (
        "--log-format",
        "text",
        "--log-level",
        "debug",  # the checkpoint sidecar takes lower-case names only
    )


def test_the_sidecar_command_line_carries_them(tmp_path: Path) -> None:
    flags = DemoConfig(log_format="json", log_level="INFO").log_flags
    sidecar = Sidecar(
        name="r0",
        run_dir=tmp_path,
        token_file=tmp_path / "token",
        shm_dir=tmp_path / "shm",
        durable_dir=tmp_path / "durable",
        log_flags=flags,
    )
    argv = list(sidecar.process.spec.argv)
    assert argv[1:3] == ["-m", "fthsdp.services.checkpoint"]
    args = checkpoint_parser().parse_args(argv[3:])
    assert (args.log_format, args.log_level) == ("json", "info")


def test_a_rank_accepts_them() -> None:
    flags = DemoConfig(log_format="json", log_level="INFO").log_flags
    args = train.parse_args(
        ["--run-dir", "x", "--total-replicas", "1", "--quorum", "q:1", "--spare", *flags]
    )
    assert (args.log_format, args.log_level) == ("json", "info")


def test_progress_period_must_be_positive() -> None:
    assert DemoConfig().progress_every <= timedelta(seconds=10)
    with pytest.raises(ValueError, match="progress_every"):
        DemoConfig(progress_every=timedelta(0))


def test_unknown_logging_choices_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="log_format"):
        DemoConfig(log_format="xml")
    with pytest.raises(ValueError, match="log level"):
        DemoConfig(log_level="chatty")
