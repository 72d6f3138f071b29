"""Parsing the images under deploy/docker without a Docker engine, for the tests that hold them
and the deployment files that run them to exact values: each Dockerfile as stages and
instructions (continuation lines joined, exec forms read as JSON, RUN lines split into commands),
and what each image is expected to be."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SERVICE_IMAGES = ("quorum", "checkpoint", "health")
NOT_FOR_SERVICES = {"torch", "rich", "matplotlib"}  # the worker's and the demo's only
BASE_IMAGE = "python:3.11.14-slim-trixie"
UID = GID = "10001"
PROBE = ["python", "-m", "fthsdp.deploy.probe"]
RUNTIME_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}
SERVICE_SOURCES = [
    ["pyproject.toml", "README.md", "./"],
    ["fthsdp/", "fthsdp/"],
    ["protos/", "protos/"],
    ["services/", "services/"],
    ["deploy/__init__.py", "deploy/probe.py", "deploy/"],
]


@dataclass(frozen=True)
class Expected:
    entrypoint: list[str]
    cmd: list[str]
    workdir: str
    probe_port_flag: str | None
    """The CMD flag whose port the HEALTHCHECK probes (None: the worker's file probe)."""
    probe_path: str | None
    data_dirs: list[str]


IMAGES = {
    "quorum": Expected(
        entrypoint=["fthsdp-quorum"],
        cmd=["--host", "0.0.0.0", "--port", "7450", "--admin-port", "7451"],
        workdir="/tmp",
        # /livez: the standby is alive but never ready until it holds the lease.
        probe_port_flag="--admin-port",
        probe_path="/livez",
        data_dirs=[],
    ),
    "checkpoint": Expected(
        entrypoint=["fthsdp-checkpoint"],
        cmd=[
            "--host",
            "0.0.0.0",
            "--port",
            "7470",
            "--shm-dir",
            "/data/shm",
            "--durable-dir",
            "/data/checkpoints",
        ],
        workdir="/data",
        probe_port_flag="--port",
        probe_path="/readyz",
        data_dirs=["/data/shm", "/data/checkpoints"],
    ),
    "health": Expected(
        entrypoint=["python", "-m", "fthsdp.services.health"],
        cmd=["--mode", "central", "--host", "0.0.0.0", "--port", "7460", "--http-port", "7461"],
        workdir="/tmp",
        probe_port_flag="--http-port",
        probe_path="/readyz",
        data_dirs=[],
    ),
    "worker": Expected(
        entrypoint=["tini", "--", "torchrun"],
        cmd=["--help"],
        workdir="/data",
        probe_port_flag=None,
        probe_path=None,
        data_dirs=["/data/shm", "/data/run"],
    ),
}
PORT_FLAGS = ("--port", "--admin-port", "--http-port")


# ---- parsing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


@dataclass(frozen=True)
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"{keyword}: {len(found)} instructions"
        return found[0]


def parse(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # a comment inside a continuation does not end it
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path.name}: dangling continuation"
    return out


def stages(path: Path) -> list[Stage]:
    """The build stages, base images with the global ARGs substituted."""
    instructions = parse(path)
    first = next(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    args = dict(ins.args.split("=", 1) for ins in instructions[:first])
    assert all(ins.keyword == "ARG" for ins in instructions[:first])
    out: list[Stage] = []
    for ins in instructions[first:]:
        if ins.keyword == "FROM":
            words = ins.args.split()
            assert len(words) in (1, 3) and (len(words) == 1 or words[1].upper() == "AS")
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            out.append(Stage(base, words[2] if len(words) == 3 else None, []))
        else:
            out[-1].instructions.append(ins)
    return out


def final(name: str) -> Stage:
    return stages(DOCKER / f"{name}.Dockerfile")[-1]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def commands(stage: Stage) -> list[list[str]]:
    """Every RUN of a stage as shell commands (argv lists), split on `&&`."""
    out: list[list[str]] = []
    for ins in stage.all("RUN"):
        current: list[str] = []
        for word in shlex.split(ins.args):
            if word == "&&":
                out.append(current)
                current = []
            else:
                current.append(word)
        out.append(current)
    return out


def flag_values(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of an argv (flags without a value are left out)."""
    return {a: b for a, b in itertools.pairwise(argv) if a.startswith("--") and b[:2] != "--"}


def healthcheck(stage: Stage) -> tuple[dict[str, str], list[str], bool]:
    """(options, argv, exec form?) of the stage's only HEALTHCHECK."""
    options_text, sep, command = stage.one("HEALTHCHECK").args.partition("CMD ")
    assert sep, "HEALTHCHECK without CMD"
    options = dict(o.removeprefix("--").split("=", 1) for o in options_text.split())
    command = command.strip()
    if command.startswith("["):
        return options, exec_form(command), True
    return options, shlex.split(command), False


def _ids(paths: list[Path]) -> list[str]:
    return [p.name.removesuffix(".Dockerfile") for p in paths]
