"""The examples as a user runs them: the plain scripts under torchrun, and their fthsdp versions as
one torchrun job per replica against `fthsdp up`. I1: every rank of both replicas ends with one
fingerprint (DDP-style and FSDP2/HSDP alike)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fthsdp.deploy.processes import free_port
from tests.e2e.up_support import ROOT, Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

STEPS = 30
RANKS = 2
FLAGS = ("--steps", str(STEPS), "--workers", "1", "--batch-size", "8")


def _torchrun(script: str, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
        *args, str(ROOT / "examples" / script), *FLAGS,
    ]  # fmt: skip


def _start(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[str]:
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("name", ["ddp_train", "fsdp2_train"])
def test_plain_and_fthsdp_examples_train_under_torchrun(
    name: str, start_up: Callable[..., Up], tmp_path: Path
) -> None:
    [out] = _finish([_start(_torchrun(f"{name}.py", "--standalone"), tmp_path)])
    assert out.count(f"done at step {STEPS}") == RANKS

    env = start_up().env()
    jobs = []
    for index in range(2):
        replica_env = {
            **os.environ,
            **env,
            "FTHSDP_JOB_ID": name.replace("_", "-"),
            "FTHSDP_REPLICA_ID": f"r{index}",
            "FTHSDP_REPLICA_INDEX": str(index),
            "FTHSDP_TOTAL_REPLICAS": "2",
        }
        argv = _torchrun(f"{name}_fthsdp.py", "--master-port", str(free_port()))
        jobs.append(_start(argv, tmp_path, replica_env))
    outputs = _finish(jobs)
    prints = set()
    for out in outputs:
        done = re.findall(rf"done at step {STEPS} fingerprint ([0-9a-f]{{64}})", out)
        assert len(done) == RANKS, out[-4000:]
        prints.update(done)
    assert len(prints) == 1, prints  # I1
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", "".join(outputs))]
    assert losses and losses[-1] < 0.5
