"""The images under deploy/docker, checked without a Docker engine. Each Dockerfile is held to
exact values: the pinned base image, the wheel built from the project alone, the exact install
commands (no torch in a service image, the CPU build in the worker), the exec-form ENTRYPOINT and
default CMD, the exposed ports being the ports that command opens, a HEALTHCHECK that probes that
port's /livez or /readyz, a numeric non-root user, the data directories it owns, an environment
with no secret in it (parsing: tests/unit/deploy_images_support.py)."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.unit.deploy_images_support import (
    BASE_IMAGE,
    DOCKER,
    DOCKERFILES,
    GID,
    IMAGES,
    NOT_FOR_SERVICES,
    PORT_FLAGS,
    PROBE,
    ROOT,
    RUNTIME_ENV,
    SERVICE_IMAGES,
    SERVICE_SOURCES,
    UID,
    Instruction,
    _ids,
    commands,
    exec_form,
    final,
    flag_values,
    healthcheck,
    parse,
    stages,
)

# ---- the Dockerfiles --------------------------------------------------------------------------


def test_there_is_an_image_per_service_and_one_for_the_worker() -> None:
    assert _ids(DOCKERFILES) == sorted(IMAGES)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_two_stages_on_the_pinned_base_image(dockerfile: Path) -> None:
    assert dockerfile.read_text().splitlines()[0] == "# syntax=docker/dockerfile:1"
    assert parse(dockerfile)[0] == Instruction("ARG", f"PYTHON_IMAGE={BASE_IMAGE}")
    assert [(s.base, s.name) for s in stages(dockerfile)] == [
        (BASE_IMAGE, "build"),
        (BASE_IMAGE, None),
    ]


def test_the_base_image_runs_the_python_the_project_targets() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-\w+", BASE_IMAGE)
    assert version is not None, "pin an exact patch release"
    minor = f"{version[1]}.{version[2]}"
    assert minor == pyproject["tool"]["mypy"]["python_version"]
    assert pyproject["project"]["requires-python"] == f">={minor}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_the_build_stage_makes_one_wheel_of_the_project_alone(dockerfile: Path) -> None:
    build, runtime = stages(dockerfile)
    assert build.one("WORKDIR").args == "/src"
    assert commands(build) == [["pip", "wheel", "--no-deps", "--wheel-dir", "/wheels", "."]]
    copies = [ins.args.split() for ins in build.all("COPY")]
    if dockerfile.name == "worker.Dockerfile":
        assert copies == [*SERVICE_SOURCES[:4], ["worker/", "worker/"], ["deploy/", "deploy/"]]
    else:
        assert copies == SERVICE_SOURCES  # no worker/, no demo: a service never imports them
    from_build = [c for c in runtime.all("COPY") if c.args.startswith("--from=")]
    assert [c.args.split() for c in from_build] == [["--from=build", "/wheels", "/tmp/wheels"]]


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
    instructions = parse(dockerfile)
    assert not [i for i in instructions if i.keyword == "ADD"], "ADD fetches and unpacks"
    for ins in instructions:
        if ins.keyword != "COPY" or ins.args.startswith("--from="):
            continue
        *sources, _ = ins.args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: missing"
            assert not _ignored(source.rstrip("/"), ignored), f"{source} is in .dockerignore"


def _torch_pin() -> str:
    pins = re.findall(
        r"pip\" install -q \"(torch==[\d.]+)\"", (ROOT / "scripts/bootstrap.sh").read_text()
    )
    assert len(pins) == 1
    return pins[0]


@pytest.mark.parametrize("image", SERVICE_IMAGES)
def test_service_images_install_the_service_requirements_and_the_wheel_only(image: str) -> None:
    stage = final(image)
    assert next(c.args for c in stage.all("COPY")) == (
        "deploy/docker/requirements-services.txt /tmp/requirements.txt"
    )
    installs = [c for c in commands(stage) if c[:1] == ["pip"]]
    assert installs == [["pip", "install", "-r", "/tmp/requirements.txt", "/tmp/wheels/*.whl"]]
    words = [w for c in commands(stage) for w in c]
    assert not [w for w in words if "torch" in w], "a service image never gets torch"


def test_the_worker_gets_the_cpu_build_of_the_pinned_torch_and_tini() -> None:
    cmds = commands(final("worker"))
    assert [c for c in cmds if c[:1] == ["pip"]] == [
        ["pip", "install", _torch_pin(), "--index-url", "https://download.pytorch.org/whl/cpu"],
        ["pip", "install", "/tmp/wheels/*.whl"],  # after torch: the bare `torch` dep is met
    ]
    assert ["apt-get", "install", "-y", "--no-install-recommends", "tini"] in cmds


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


def _module_in_repo(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None and str(ROOT) in spec.origin


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_and_default_command(image: str) -> None:
    stage, want = final(image), IMAGES[image]
    assert exec_form(stage.one("ENTRYPOINT").args) == want.entrypoint  # exec form: PID 1
    assert exec_form(stage.one("CMD").args) == want.cmd
    assert stage.one("STOPSIGNAL").args == "SIGTERM"
    assert stage.one("WORKDIR").args == want.workdir
    program = want.entrypoint[0]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    if program in scripts:
        module, _, function = scripts[program].partition(":")
        assert (module, function) == (f"fthsdp.services.{image}.__main__", "main")
        assert _module_in_repo(module)
    elif program == "python":
        assert want.entrypoint[1] == "-m" and _module_in_repo(f"{want.entrypoint[2]}.__main__")
    else:
        assert want.entrypoint == ["tini", "--", "torchrun"]  # tini reaps torchrun's ranks


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_exposed_ports_are_the_ports_the_default_command_opens(image: str) -> None:
    stage = final(image)
    exposed = [p for ins in stage.all("EXPOSE") for p in ins.args.split()]
    opened = [v for k, v in flag_values(IMAGES[image].cmd).items() if k in PORT_FLAGS]
    assert exposed == opened


@pytest.mark.parametrize("image", SERVICE_IMAGES)
def test_service_health_check_probes_the_port_its_command_opens(image: str) -> None:
    want = IMAGES[image]
    options, argv, is_exec = healthcheck(final(image))
    assert options == {"interval": "10s", "timeout": "5s", "start-period": "20s", "retries": "3"}
    assert is_exec and argv[:3] == PROBE and len(argv) == 4
    url = urlsplit(argv[3])
    assert want.probe_port_flag is not None
    assert (url.scheme, url.hostname) == ("http", "127.0.0.1")
    assert str(url.port) == flag_values(want.cmd)[want.probe_port_flag]
    assert url.path == want.probe_path


def test_worker_health_check_is_the_freshness_of_its_replica_log() -> None:
    options, argv, is_exec = healthcheck(final("worker"))
    assert options == {"interval": "30s", "timeout": "5s", "start-period": "300s", "retries": "3"}
    # Shell form on purpose: the shell expands the replica id the deployment sets.
    assert not is_exec
    log = "/data/run/replicas/${FTHSDP_REPLICA_ID:-r0}.jsonl"
    assert argv == [*PROBE, "--fresh", log, "--max-age-s", "300"]
    assert argv[4].startswith("/data/run/")  # a directory the image creates for its user


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runs_as_the_numeric_non_root_user_it_creates(image: str) -> None:
    stage = final(image)
    user = stage.one("USER")
    assert user.args == f"{UID}:{GID}"  # numeric: Kubernetes can verify runAsNonRoot
    after = stage.instructions[stage.instructions.index(user) :]
    assert not [i for i in after if i.keyword == "RUN"], "nothing runs as root after USER"
    cmds = commands(stage)
    assert ["groupadd", "--system", "--gid", GID, "fthsdp"] in cmds
    (useradd,) = [c for c in cmds if c[:1] == ["useradd"]]
    flags = flag_values(useradd)
    assert (flags["--uid"], flags["--gid"], flags["--shell"]) == (UID, GID, "/usr/sbin/nologin")
    assert "--system" in useradd and useradd[-1] == "fthsdp"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_data_directories_are_created_and_owned_by_the_user(image: str) -> None:
    cmds = commands(final(image))
    dirs = [c[2:] for c in cmds if c[:2] == ["mkdir", "-p"]]
    chowns = [c for c in cmds if c[:1] == ["chown"]]
    want = IMAGES[image].data_dirs
    if not want:
        assert dirs == [] and chowns == []
        return
    assert dirs == [want]
    assert chowns == [["chown", "-R", f"{UID}:{GID}", "/data"]]
    assert all(d.startswith("/data/") for d in want)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_no_secret_is_baked_into_an_image(dockerfile: Path) -> None:
    build, runtime = stages(dockerfile)
    assert [i.args for i in build.all("ENV")] == [
        "PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1"
    ]
    env = dict(pair.split("=", 1) for ins in runtime.all("ENV") for pair in ins.args.split())
    assert env == RUNTIME_ENV
    assert not [i for s in (build, runtime) for i in s.all("ARG")], "only the global base ARG"
    argv = exec_form(runtime.one("ENTRYPOINT").args) + exec_form(runtime.one("CMD").args)
    assert "--token" not in argv and "--token-file" not in argv  # from the deployment
