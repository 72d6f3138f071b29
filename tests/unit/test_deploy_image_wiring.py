"""Where the deployment files meet the images of deploy/docker. docker-compose.yml and deploy/k8s
(parsed with yaml.safe_load) must run these images with their entrypoint, the same user id,
probes on the ports their own arguments open, and the token from an env file or a mounted secret,
never on a command line. The Slurm script passes `bash -n` and opens the ports the images
expose."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.unit.deploy_images_support import (
    GID,
    IMAGES,
    PORT_FLAGS,
    PROBE,
    ROOT,
    UID,
    final,
    flag_values,
    healthcheck,
)

# ---- where docker-compose.yml and deploy/k8s run them -----------------------------------------

COMPOSE_IMAGES = {
    "quorum-a": "quorum",
    "quorum-b": "quorum",
    "checkpoint": "checkpoint",
    "health": "health",
    "health-agent": "health",
    "replica-0": "worker",
    "replica-1": "worker",
    "replica-2": "worker",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_compose_runs_the_images_built_here(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *COMPOSE_IMAGES}
    assert services["redis"]["image"] == "redis:7.4.6-alpine" and "build" not in services["redis"]
    for name, image in COMPOSE_IMAGES.items():
        service = services[name]
        assert service["image"] == f"fthsdp-{image}:dev", name
        assert service["build"] == {
            "context": ".",
            "dockerfile": f"deploy/docker/{image}.Dockerfile",
        }
        assert "entrypoint" not in service, f"{name}: keep the image's exec-form ENTRYPOINT"
        assert "user" not in service, f"{name}: the image's numeric user"


def _compose_commands(compose: dict[str, Any]) -> Iterator[tuple[str, list[str]]]:
    for name in COMPOSE_IMAGES:
        command = compose["services"][name]["command"]
        assert isinstance(command, list), f"{name}: exec form, no shell"
        yield name, command


def test_compose_health_checks_probe_the_port_each_command_opens(compose: dict[str, Any]) -> None:
    for name, command in _compose_commands(compose):
        image = IMAGES[COMPOSE_IMAGES[name]]
        check = compose["services"][name]["healthcheck"]
        _, image_argv, _ = healthcheck(final(COMPOSE_IMAGES[name]))
        if image.probe_port_flag is None:
            kind, shell = check["test"]
            assert kind == "CMD-SHELL"
            # $$ is compose's escape for a literal $: the container's shell expands it.
            argv = shlex.split(shell.replace("$$", "$"))
            assert argv == [
                *image_argv[:4],
                "/data/run/replicas/${FTHSDP_REPLICA_ID}.jsonl",
                *image_argv[5:],
            ]
            assert compose["services"][name]["environment"] == {"FTHSDP_REPLICA_ID": f"r{name[-1]}"}
            assert check["start_period"] == healthcheck(final("worker"))[0]["start-period"]
            continue
        kind, *argv = check["test"]
        assert kind == "CMD" and argv[:3] == PROBE and len(argv) == 4, name
        url = urlsplit(argv[3])
        assert url.hostname == "127.0.0.1", name
        assert str(url.port) == flag_values(command)[image.probe_port_flag], name
        assert url.path == image.probe_path, name


def test_compose_publishes_only_ports_the_commands_open(compose: dict[str, Any]) -> None:
    for name, command in _compose_commands(compose):
        opened = {v for k, v in flag_values(command).items() if k in PORT_FLAGS}
        for mapping in compose["services"][name].get("ports", []):
            address, _, container = mapping.rpartition(":")
            assert address.startswith("127.0.0.1:"), f"{name}: {mapping} beyond loopback"
            assert container in opened, f"{name}: {mapping}"


def test_compose_volumes_land_in_directories_the_images_own(compose: dict[str, Any]) -> None:
    for name in COMPOSE_IMAGES:
        owned = IMAGES[COMPOSE_IMAGES[name]].data_dirs
        for volume in compose["services"][name].get("volumes", []):
            _, target = volume.split(":")
            assert target in owned, f"{name}: {volume} is not owned by uid {UID}"
    options = compose["volumes"]["snapshots"]["driver_opts"]
    tmpfs = dict(o.split("=") for o in options["o"].split(","))
    assert (tmpfs["uid"], tmpfs["gid"]) == (UID, GID)  # the images' user writes snapshots


def _no_secret_on_the_command_line(argv: list[str], where: str) -> None:
    assert "--token" not in argv, where
    for key, value in flag_values(argv).items():
        if key == "--redis-url":
            url = urlsplit(value)
            assert url.password is None and url.username is None, f"{where}: credentials"


def test_compose_takes_the_token_from_the_env_file(compose: dict[str, Any]) -> None:
    for name, command in _compose_commands(compose):
        assert compose["services"][name]["env_file"] == ["deploy/compose.env"], name
        assert "FTHSDP_TOKEN" not in compose["services"][name].get("environment", {}), name
        _no_secret_on_the_command_line(command, name)


def _k8s_containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, container, pod spec) of every fthsdp container in deploy/k8s."""
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            pod = doc["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                if container["image"].startswith("fthsdp/"):
                    yield f"{doc['metadata']['name']}/{container['name']}", container, pod


def test_k8s_runs_the_images_built_here_with_their_user_and_tag() -> None:
    kustomization = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    tags = {i["name"]: i["newTag"] for i in kustomization["images"]}
    assert tags == {f"fthsdp/{name}": "0.1.0" for name in IMAGES}
    seen = {}
    for where, container, pod in _k8s_containers():
        repository, _, tag = container["image"].partition(":")
        assert tag == tags[repository], where
        seen[where] = repository.removeprefix("fthsdp/")
        assert "command" not in container, f"{where}: keep the image's ENTRYPOINT"
        context = pod["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (UID, GID), where
        assert context["runAsNonRoot"] is True
    assert seen == {
        "fthsdp-health/health": "health",
        "fthsdp-quorum-a/quorum": "quorum",
        "fthsdp-quorum-b/quorum": "quorum",
        "fthsdp-demo/checkpoint": "checkpoint",
        "fthsdp-demo/health-agent": "health",
        "fthsdp-demo/trainer": "worker",
    }


def test_k8s_http_probes_hit_livez_and_readyz_on_ports_the_args_open() -> None:
    paths = {}
    for where, container, _ in _k8s_containers():
        ports = {p["name"]: str(p["containerPort"]) for p in container.get("ports", [])}
        opened = {v for k, v in flag_values(container["args"]).items() if k in PORT_FLAGS}
        assert set(ports.values()) == opened, where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "httpGet" in container.get(probe, {}):
                http = container[probe]["httpGet"]
                assert ports[http["port"]] in opened, f"{where} {probe}"
                paths[where, probe] = http["path"]
            elif "grpc" in container.get(probe, {}):
                assert str(container[probe]["grpc"]["port"]) in opened, f"{where} {probe}"
                paths[where, probe] = "grpc"
    assert paths == {
        ("fthsdp-health/health", "startupProbe"): "/livez",
        ("fthsdp-health/health", "readinessProbe"): "/readyz",
        ("fthsdp-health/health", "livenessProbe"): "grpc",
        ("fthsdp-quorum-a/quorum", "startupProbe"): "/livez",
        ("fthsdp-quorum-a/quorum", "readinessProbe"): "grpc",
        ("fthsdp-quorum-a/quorum", "livenessProbe"): "/livez",
        ("fthsdp-quorum-b/quorum", "startupProbe"): "/livez",
        ("fthsdp-quorum-b/quorum", "readinessProbe"): "grpc",
        ("fthsdp-quorum-b/quorum", "livenessProbe"): "/livez",
        ("fthsdp-demo/checkpoint", "startupProbe"): "/livez",
        ("fthsdp-demo/checkpoint", "readinessProbe"): "/readyz",
        ("fthsdp-demo/checkpoint", "livenessProbe"): "/livez",
        ("fthsdp-demo/health-agent", "startupProbe"): "/livez",
        ("fthsdp-demo/health-agent", "readinessProbe"): "/readyz",
        ("fthsdp-demo/health-agent", "livenessProbe"): "grpc",
    }


def test_k8s_trainer_liveness_is_the_images_freshness_probe() -> None:
    (trainer,) = [c for w, c, _ in _k8s_containers() if w == "fthsdp-demo/trainer"]
    kind, flag, script = trainer["livenessProbe"]["exec"]["command"]
    assert (kind, flag) == ("sh", "-c")
    _, image_argv, _ = healthcheck(final("worker"))
    argv = shlex.split(script)
    assert argv[0] == "exec"  # the probe replaces the shell, so its exit status is the verdict
    assert argv[1:] == [
        *image_argv[:4],
        "/data/run/replicas/${FTHSDP_REPLICA_ID}.jsonl",
        *image_argv[5:],
    ]
    assert trainer["livenessProbe"]["initialDelaySeconds"] == 300  # the image's start period
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["FTHSDP_REPLICA_ID"] == "r$(REPLICA_INDEX)"


def test_k8s_takes_the_token_from_a_mounted_secret() -> None:
    for where, container, pod in _k8s_containers():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert "FTHSDP_TOKEN" not in env, where
        token_file = Path(env["FTHSDP_TOKEN_FILE"])
        (mount,) = [
            m for m in container["volumeMounts"] if token_file.parent == Path(m["mountPath"])
        ]
        assert mount["readOnly"] is True, where
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "fthsdp-token", where
        assert token_file.name == "token"  # the secret's key
        _no_secret_on_the_command_line(container["args"], where)


# ---- Slurm ------------------------------------------------------------------------------------

SLURM = ROOT / "deploy" / "slurm" / "fthsdp.sbatch"


def _slurm_lines() -> list[str]:
    return re.sub(r"\\\n\s*", " ", SLURM.read_text()).splitlines()


def test_slurm_script_is_valid_bash() -> None:
    assert sorted(p.name for p in SLURM.parent.iterdir()) == ["fthsdp.sbatch"]
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run([bash, "-n", str(SLURM)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert _slurm_lines()[0] == "#!/usr/bin/env bash"


def test_slurm_directives() -> None:
    directives = [ln.removeprefix("#SBATCH ") for ln in _slurm_lines() if ln.startswith("#SBATCH ")]
    assert dict(d.partition("=")[::2] for d in directives) == {
        "--job-name": "fthsdp",
        "--nodes": "4",
        "--ntasks-per-node": "1",
        "--exclusive": "",
        "--no-kill": "",  # a dead node must not end the allocation
        "--requeue": "",
        "--time": "24:00:00",
        "--output": "fthsdp-%j.out",
    }


def _after(words: list[str], program: list[str]) -> list[str]:
    for at in range(len(words)):
        if words[at : at + len(program)] == program:
            return words[at + len(program) :]
    raise AssertionError(f"{program} not found")


def test_slurm_opens_the_ports_the_images_expose_and_passes_a_token_file() -> None:
    lines = _slurm_lines()
    assignments = dict(ln.split("=", 1) for ln in lines if re.match(r"^[A-Z_]+=\S+$", ln))
    assert assignments["CHECKPOINT_PORT"] == flag_values(IMAGES["checkpoint"].cmd)["--port"]
    (up,) = [shlex.split(ln) for ln in lines if ln.startswith("srun ") and "fthsdp up " in ln]
    up_flags = flag_values(_after(up, ["fthsdp", "up"]))
    quorum, health = flag_values(IMAGES["quorum"].cmd), flag_values(IMAGES["health"].cmd)
    assert (up_flags["--quorum-port"], up_flags["--quorum-admin-port"]) == (
        quorum["--port"],
        quorum["--admin-port"],
    )
    assert (up_flags["--health-port"], up_flags["--health-http-port"]) == (
        health["--port"],
        health["--http-port"],
    )
    assert up_flags["--token-file"] == "$TOKEN_FILE" and "--token" not in up
    # The replica's job step: the single-quoted STEP script, run by `bash -c` on its node.
    step = lines[lines.index("STEP='") + 1 : lines.index("'")]
    (torchrun,) = [shlex.split(ln) for ln in step if ln.startswith("torchrun ")]
    assert _after(torchrun, ["-m"])[0] == "fthsdp.deploy.demo.train"
    assert flag_values(torchrun)["--nproc-per-node"] == "$RANKS"
