"""The Dockerfiles under deploy/docker, checked without a Docker engine: what they copy exists and
is not excluded by .dockerignore, what they run is a console script or module the project installs,
they run as a non-root user with an exec-form entrypoint (correct as PID 1), their base images are
pinned, and the service images' requirements follow pyproject.toml. Plus `bash -n` on the Slurm
script."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SERVICE_IMAGES = ("quorum", "checkpoint", "health")
NOT_FOR_SERVICES = {"torch", "rich", "matplotlib"}  # the worker's and the demo's only


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    return instructions[starts[-1] :]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_there_is_an_image_per_service_and_one_for_the_worker() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES} == {
        *SERVICE_IMAGES,
        "worker",
    }


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        p = pattern.strip("/").removeprefix("**/")
        if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, f"{p}/*") or path.startswith(p):
            return True
        if fnmatch.fnmatch(Path(path).name, p):
            return True
    return False


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    ignored = _dockerignore()
    copies = [i for i in parse(dockerfile) if i.keyword in ("COPY", "ADD")]
    assert copies
    for ins in copies:
        words = [w for w in ins.args.split() if not w.startswith("--")]
        if "--from=" in ins.args:
            continue
        assert ins.keyword == "COPY", "ADD fetches and unpacks; use COPY"
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: missing"
            assert not _ignored(source.rstrip("/"), ignored), f"{source} is in .dockerignore"


def _console_scripts() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts: dict[str, str] = dict(project["scripts"])
    return scripts


def _module_in_repo(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None and str(ROOT) in spec.origin


def _check_command(argv: list[str], where: str) -> None:
    """The program a container runs must be something the image installs."""
    if argv[0] == "tini":
        assert argv[1] == "--", where
        argv = argv[2:]
    program = argv[0]
    if program == "python":
        assert argv[1] == "-m" and _module_in_repo(argv[2]), f"{where}: {argv[:3]}"
        return
    installed = {ep.name for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert program in _console_scripts() or program in installed, f"{where}: {program}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_entrypoint_is_exec_form_and_runs_what_the_image_installs(dockerfile: Path) -> None:
    stage = final_stage(parse(dockerfile))
    entrypoints = [exec_form(i.args) for i in stage if i.keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1, "exactly one exec-form ENTRYPOINT (PID 1 gets the signals)"
    _check_command(entrypoints[0], dockerfile.name)
    if entrypoints[0][0] in _console_scripts():
        module = _console_scripts()[entrypoints[0][0]].split(":")[0]
        assert _module_in_repo(module)
    for ins in stage:
        if ins.keyword == "CMD":
            exec_form(ins.args)  # arguments to the entrypoint, never a shell string


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_health_check_runs_an_installed_probe(dockerfile: Path) -> None:
    stage = final_stage(parse(dockerfile))
    checks = [i.args for i in stage if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1, dockerfile.name
    assert "python -m fthsdp.deploy.probe" in checks[0].replace('"', "").replace(",", "")
    assert _module_in_repo("fthsdp.deploy.probe")
    copied = " ".join(i.args for i in parse(dockerfile) if i.keyword == "COPY")
    assert "deploy/probe.py" in copied or "deploy/ " in copied, "the probe must be in the image"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_runs_as_a_non_root_user(dockerfile: Path) -> None:
    stage = final_stage(parse(dockerfile))
    users = [i for i in stage if i.keyword == "USER"]
    assert users, f"{dockerfile.name}: no USER"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), dockerfile.name
    assert user.isdigit(), "a numeric uid lets Kubernetes verify runAsNonRoot"
    after = stage[stage.index(users[-1]) :]
    assert all(i.keyword != "RUN" for i in after), "nothing runs as root after USER"
    assert f"--uid {user}" in " ".join(i.args for i in stage if i.keyword == "RUN")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_base_image_is_pinned(dockerfile: Path) -> None:
    instructions = parse(dockerfile)
    args = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            key, _, value = ins.args.partition("=")
            args.setdefault(key, value)
    stages = set()
    for ins in instructions:
        if ins.keyword != "FROM":
            continue
        words = ins.args.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
        if image in stages:
            continue
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+", image), f"unpinned {image}"
        assert not image.endswith(":latest")


def test_service_requirements_follow_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = sorted(
        d.replace(" ", "")
        for d in project["dependencies"]
        if re.split(r"[<>=!~ \[]", d)[0] not in NOT_FOR_SERVICES
    )
    lines = (DOCKER / "requirements-services.txt").read_text().splitlines()
    listed = sorted(ln.strip() for ln in lines if ln.strip() and not ln.startswith("#"))
    assert listed == wanted


def test_service_images_leave_torch_out_and_the_worker_gets_the_cpu_build() -> None:
    for name in SERVICE_IMAGES:
        text = " ".join(i.args for i in parse(DOCKER / f"{name}.Dockerfile"))
        assert "torch" not in text, name
        assert "--no-deps" in text, f"{name}: the project's own requirements include torch"
    worker = (DOCKER / "worker.Dockerfile").read_text()
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    pin = re.search(r"torch==[\d.]+", bootstrap)
    assert pin is not None
    assert f"pip install {pin.group(0)} --index-url https://download.pytorch.org/whl/cpu" in worker


def test_slurm_script_is_valid_bash() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    scripts = sorted((ROOT / "deploy" / "slurm").glob("*"))
    assert scripts
    for script in scripts:
        result = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash") and "#SBATCH --nodes" in text
        assert "srun" in text and "torchrun" in text
