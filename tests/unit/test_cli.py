"""The `fthsdp` command's first impression: no arguments prints the help (and succeeds),
`--version` names the installed version, an unknown command is a usage error."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io

import pytest

from fthsdp.deploy.cli import main


def test_no_arguments_prints_the_help_with_every_command() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([]) == 0
    text = out.getvalue()
    assert text.startswith("usage: fthsdp")
    for command in ("demo", "up", "status"):
        assert command in text


def test_version_names_the_installed_distribution() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert out.getvalue().strip() == f"fthsdp {importlib.metadata.version('fthsdp')}"


def test_an_unknown_command_is_a_usage_error() -> None:
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exited:
        main(["train"])
    assert exited.value.code == 2
