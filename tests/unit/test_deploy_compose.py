"""docker-compose.yml, validated offline: against the Compose Specification's JSON schema (the copy
that check-jsonschema vendors, so no network and no Docker engine), then against fthsdp's rules:
health checks and restart policies everywhere, replicas restarting on their own, resource
limits, dependencies that wait for health, no secret in the file, images that can be built."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_FILE = "deploy/compose.env"
FTHSDP_SERVICES = ("quorum-a", "quorum-b", "checkpoint", "health", "health-agent")


def _schema() -> dict[str, Any]:
    vendor = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    schema: dict[str, Any] = json.loads((vendor / "compose-spec.json").read_text())
    return schema


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # safe_load resolves the `<<` merge keys, as compose itself does before validating.
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator: jsonschema.Draft202012Validator, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def test_compose_file_matches_the_compose_specification(
    compose: dict[str, Any], validator: jsonschema.Draft202012Validator
) -> None:
    assert _errors(validator, compose) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("services", "redis", "helthcheck"), {"test": ["CMD", "true"]}),  # a typo
        (("services", "quorum-a", "restart"), ["always"]),  # wrong type
        (("services", "health", "depends_on", "redis", "condition"), "service_ready"),
    ],
)
def test_the_schema_catches_mistakes(
    compose: dict[str, Any],
    validator: jsonschema.Draft202012Validator,
    path: tuple[str, ...],
    value: Any,
) -> None:
    broken = copy.deepcopy(compose)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert _errors(validator, broken), f"the schema accepted {path}={value!r}"


def test_every_service_has_a_health_check_and_a_restart_policy(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        check = service.get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), f"{name}: no health check"
        assert service.get("restart") in ("on-failure", "unless-stopped", "always"), name


def test_replicas_restart_on_their_own(compose: dict[str, Any]) -> None:
    replicas = {n: s for n, s in compose["services"].items() if n.startswith("replica-")}
    assert len(replicas) >= 2
    ids = set()
    for name, service in replicas.items():
        assert service["restart"] == "on-failure", name
        command = service["command"]
        assert command[command.index("-m") + 1] == "fthsdp.deploy.demo.train", name
        replica_id = command[command.index("--replica-id") + 1]
        ids.add(replica_id)
        assert command[command.index("--total-replicas") + 1] == str(len(replicas)), name
        # the health check reads the log of this id
        assert service["environment"]["FTHSDP_REPLICA_ID"] == replica_id, name
    assert len(ids) == len(replicas), "replica ids must be distinct"


def test_the_quorum_service_runs_as_leader_and_standby_on_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("quorum-a", "quorum-b"):
        command = services[name]["command"]
        assert command[command.index("--redis-url") + 1] == "redis://redis:6379/0"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name, service in services.items():
        if name.startswith("replica-"):
            command = service["command"]
            assert command[command.index("--quorum") + 1] == "quorum-a:7450,quorum-b:7450"


def test_every_service_has_resource_limits(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        limits = service.get("deploy", {}).get("resources", {}).get("limits", {})
        assert limits.get("cpus") and limits.get("memory"), f"{name}: no cpu/memory limit"


def test_dependencies_wait_for_health(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in compose["services"], f"{name} depends on unknown {dependency}"
            assert isinstance(condition, dict) and "condition" in condition, name
            # training must not wait for the health service or its node agent
            if dependency not in ("health", "health-agent"):
                assert condition["condition"] == "service_healthy", f"{name} -> {dependency}"


def test_services_bind_all_interfaces_explicitly_and_publish_on_loopback(
    compose: dict[str, Any],
) -> None:
    for name in FTHSDP_SERVICES:
        command = compose["services"][name]["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0", name
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif node is not None:
        yield str(node)


def test_no_secret_is_written_in_the_file(compose: dict[str, Any]) -> None:
    secret_name = re.compile(r"TOKEN|PASSWORD|SECRET|PASSWD|API_KEY", re.IGNORECASE)
    for name, service in compose["services"].items():
        environment = service.get("environment", {})
        assert isinstance(environment, dict), f"{name}: use a mapping for environment"
        for key in environment:
            assert not secret_name.search(key), f"{name}: {key} inline; use {ENV_FILE}"
        command = [str(c) for c in service.get("command", [])]
        assert "--token" not in command, name
        assert service.get("env_file") == [ENV_FILE], name
    for text in _strings(compose):
        assert not re.search(r"redis://[^/@\s]*:[^/@\s]+@", text), "a password in a Redis URL"


def test_the_env_file_example_carries_no_token() -> None:
    example = (ROOT / "deploy" / "compose.env.example").read_text()
    values = dict(
        line.split("=", 1)
        for line in example.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    assert values["FTHSDP_TOKEN"] == "", "the example must not ship a usable token"
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ENV_FILE in ignored, "the real env file must never reach an image"


def test_images_build_from_dockerfiles_that_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is None:
            image = service["image"]
            assert re.search(r":\d+\.\d+\.\d+", image), f"{name}: pin {image} to a version"
            continue
        context = ROOT / build["context"]
        assert context.is_dir(), name
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']}"
