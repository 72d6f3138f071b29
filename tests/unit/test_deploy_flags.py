"""Every flag that a deployment file passes to an fthsdp program exists in that program's `--help`:
docker-compose.yml, the Kubernetes manifests, the Dockerfiles' default commands and the Slurm
script drift silently otherwise (a renamed flag would only fail on a cluster)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

# program -> (module, argv before --help) whose main() prints the help; run in this process (no
# interpreter start per program; torch is imported once).
PROGRAMS = {
    "fthsdp.services.quorum": ("fthsdp.services.quorum.__main__", []),
    "fthsdp.services.checkpoint": ("fthsdp.services.checkpoint.__main__", []),
    "fthsdp.services.health": ("fthsdp.services.health.__main__", []),
    "fthsdp.deploy.demo.train": ("fthsdp.deploy.demo.train", []),
    "torchrun": ("torch.distributed.run", []),
    "fthsdp up": ("fthsdp.deploy.cli", ["up"]),
}
IMAGES = {
    "quorum": "fthsdp.services.quorum",
    "checkpoint": "fthsdp.services.checkpoint",
    "health": "fthsdp.services.health",
    "worker": "torchrun",
}
# Flags the deployment files use ahead of the code, each tracked by the issue that adds it. The
# mark is strict: once the flag lands, the test fails until its line here is removed.
PENDING: dict[tuple[str, str], str] = {}
"""(program, flag) pairs the deployment files use before the program has them (strict xfail)."""


@functools.cache
def help_text(program: str) -> str:
    module, argv = PROGRAMS[program]
    if program == "torchrun":  # its main() is wrapped by an error recorder that eats SystemExit
        parser = importlib.import_module(module).get_args_parser()
        return str(parser.format_help())
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main([*argv, "--help"])
    assert exited.value.code == 0, program
    return out.getvalue()


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and t != "--"]


def _split_worker(program: str, tokens: list[str]) -> Iterator[tuple[str, list[str]]]:
    """A torchrun command line: torchrun's own flags, then the module's after `-m MODULE`."""
    if program != "torchrun" or "-m" not in tokens:
        yield program, tokens
        return
    at = tokens.index("-m")
    yield "torchrun", tokens[:at]
    yield tokens[at + 1], tokens[at + 2 :]


def _compose() -> Iterator[tuple[str, list[str], str]]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        image = service["image"].split(":")[0].removeprefix("fthsdp-")
        if image in IMAGES and "command" in service:
            for program, tokens in _split_worker(IMAGES[image], list(service["command"])):
                yield program, tokens, f"docker-compose.yml:{name}"


def _k8s() -> Iterator[tuple[str, list[str], str]]:
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            spec = doc["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                image = container["image"].split(":")[0].removeprefix("fthsdp/")
                if image in IMAGES and "args" in container:
                    for program, tokens in _split_worker(IMAGES[image], container["args"]):
                        yield program, tokens, f"{path.name}:{container['name']}"


def _dockerfiles() -> Iterator[tuple[str, list[str], str]]:
    for path in sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile")):
        image = path.name.removesuffix(".Dockerfile")
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            if line.startswith("CMD ["):
                yield IMAGES[image], json.loads(line[4:]), path.name


def _slurm() -> Iterator[tuple[str, list[str], str]]:
    for path in sorted((ROOT / "deploy" / "slurm").glob("*")):
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            words = line.split()
            for at, word in enumerate(words):
                if word == "fthsdp" and words[at + 1 : at + 2] == ["up"]:
                    yield "fthsdp up", words[at + 2 :], path.name
                elif word == "fthsdp-checkpoint":
                    yield "fthsdp.services.checkpoint", words[at + 1 :], path.name
                elif word == "fthsdp-health":
                    yield "fthsdp.services.health", words[at + 1 :], path.name
                elif word == "torchrun":
                    for program, tokens in _split_worker("torchrun", words[at + 1 :]):
                        yield program, tokens, path.name


def _usages() -> list[tuple[str, str, str]]:
    seen: dict[tuple[str, str], str] = {}
    for source in (_compose(), _k8s(), _dockerfiles(), _slurm()):
        for program, tokens, where in source:
            assert program in PROGRAMS, f"{where}: unknown program {program}"
            for flag in _flags(tokens):
                seen.setdefault((program, flag), where)
    return sorted((program, flag, where) for (program, flag), where in seen.items())


USAGES = _usages()


def _params() -> list[object]:
    params: list[object] = []
    for program, flag, where in USAGES:
        marks = []
        if (program, flag) in PENDING:
            marks.append(pytest.mark.xfail(strict=True, reason=PENDING[(program, flag)]))
        params.append(pytest.param(program, flag, where, id=f"{program} {flag}", marks=marks))
    return params


def test_the_deployment_files_were_found() -> None:
    programs = {program for program, _, _ in USAGES}
    assert programs == set(PROGRAMS)


@pytest.mark.parametrize(("program", "flag", "where"), _params())
def test_flag_exists(program: str, flag: str, where: str) -> None:
    text = help_text(program)
    assert re.search(rf"(^|[\s\[,]){re.escape(flag)}([\s=,\]]|$)", text, re.MULTILINE), (
        f"{where} passes {flag}, which `{program} --help` does not list"
    )


def test_pending_flags_are_still_used() -> None:
    used = {(program, flag) for program, flag, _ in USAGES}
    assert set(PENDING) <= used, "drop PENDING entries the deployment files no longer use"
