"""A local stack whose start fails part way leaves nothing running: real service processes."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from fthsdp.deploy.stack import LocalStack


def test_a_failed_start_stops_what_had_started(tmp_path: Path) -> None:
    """The health processes refuse their flags (a log format that does not exist) after the
    quorum service is up: entering the stack raises, and neither the quorum service nor any
    health process is left behind (they would outlive the launcher, holding their ports)."""
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(24))
    stack = LocalStack(
        run_dir=tmp_path,
        token_file=token_file,
        hosts=["h0", "h1"],
        checkpoint_dir=tmp_path / "checkpoints",
        shm_root=tmp_path / "shm",
        log_flags=("--log-format", "no-such-format"),
    )
    with pytest.raises(RuntimeError, match="exited"), stack:
        pytest.fail("the stack started with a refused flag")
    assert stack.quorum_address  # the quorum service had started, before health failed
    assert stack._embedded is None
    assert stack._health_processes
    assert not any(p.running() for p in stack._health_processes)
    assert all(
        p.proc is not None and p.proc.returncode is not None for p in stack._health_processes
    )
