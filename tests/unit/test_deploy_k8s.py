"""deploy/k8s, validated offline against the Kubernetes schemas that kubernetes-validate bundles
(strict: unknown fields are errors), then against fthsdp's rules: probes, non-root security
contexts, resource limits, Services that select real pods, NetworkPolicies that cover every pod
and admit only labelled clients, and a token that is never inline."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from fthsdp.services.common.tokens import Token

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# A version that every maintained cluster offers and that has native sidecars, gRPC probes,
# Indexed Jobs with backoffLimitPerIndex and podReplacementPolicy.
KUBERNETES_VERSION = "1.33"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
GRPC_PORTS = {"quorum": 7450, "health": 7460, "health-agent": 7462}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _documents()


def _workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    for _, doc in DOCS:
        if doc["kind"] in WORKLOADS:
            yield doc["metadata"]["name"], doc["spec"]["template"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


@pytest.mark.parametrize(
    "doc", [d for _, d in DOCS], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS]
)
def test_manifest_matches_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kv.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_catches_mistakes() -> None:
    deployment = next(d for _, d in DOCS if d["kind"] == "Deployment")
    typo = copy.deepcopy(deployment)
    typo["spec"]["replicass"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, KUBERNETES_VERSION, strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kv.ValidationError):
        kv.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_everything_lives_in_the_fthsdp_namespace() -> None:
    for _, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "fthsdp", doc["metadata"]["name"]


def test_every_container_has_probes_limits_and_a_locked_down_security_context() -> None:
    for name, pod in _workloads():
        spec = pod["spec"]
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True, name
        assert security["runAsUser"] != 0, name
        assert security["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        # Service links would inject FTHSDP_<SERVICE>_PORT=tcp://..., colliding with settings.
        assert spec["enableServiceLinks"] is False, name
        for container in _containers(pod):
            where = f"{name}/{container['name']}"
            limits = container["resources"]["limits"]
            assert limits.get("cpu") and limits.get("memory"), where
            assert container["resources"]["requests"], where
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert "livenessProbe" in container, f"{where}: no liveness probe"
            if pod["metadata"]["labels"].get("fthsdp.io/role") != "replica" or container.get(
                "restartPolicy"
            ):
                assert "readinessProbe" in container, f"{where}: no readiness probe"


def _probes(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in container
    ]


def test_services_probe_livez_readyz_and_grpc_health() -> None:
    seen = set()
    for name, pod in _workloads():
        for container in _containers(pod):
            kind = container["name"]
            if kind not in ("quorum", "health", "health-agent", "checkpoint"):
                continue
            seen.add(kind)
            paths = {p["httpGet"]["path"] for p in _probes(container) if "httpGet" in p}
            assert "/livez" in paths, f"{name}/{kind}: no /livez probe"
            if kind in GRPC_PORTS:
                grpc = [p["grpc"]["port"] for p in _probes(container) if "grpc" in p]
                assert grpc == [GRPC_PORTS[kind]], f"{name}/{kind}: gRPC health probe"
                ports = {p["containerPort"] for p in container["ports"]}
                assert GRPC_PORTS[kind] in ports
            if kind != "quorum":  # the quorum's readiness is gRPC health (same as its /readyz)
                assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", kind
    assert seen == {"quorum", "health", "health-agent", "checkpoint"}


def test_the_quorum_service_runs_as_leader_and_standby() -> None:
    quorum = [n for n, _ in _workloads() if n.startswith("fthsdp-quorum-")]
    assert sorted(quorum) == ["fthsdp-quorum-a", "fthsdp-quorum-b"]
    for name, pod in _workloads():
        for container in pod["spec"]["containers"]:
            args = container.get("args", [])
            if container["name"] == "quorum":
                assert args[args.index("--redis-url") + 1].startswith("redis://fthsdp-redis:")
            if "--quorum" in args:
                assert args[args.index("--quorum") + 1] == (
                    "fthsdp-quorum-a:7450,fthsdp-quorum-b:7450"
                ), name


def test_each_replica_restarts_on_its_own() -> None:
    job = next(d for _, d in DOCS if d["kind"] == "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert spec["backoffLimitPerIndex"] > 0
    assert spec["podReplacementPolicy"] == "Failed"
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"])
    args = trainer["args"]
    assert args[args.index("--total-replicas") + 1] == str(spec["completions"])
    sidecar = job["spec"]["template"]["spec"]["initContainers"][0]
    assert sidecar["name"] == "checkpoint" and sidecar["restartPolicy"] == "Always"


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_select_pods_and_name_their_ports() -> None:
    pods = [pod for _, pod in _workloads()]
    for _, doc in DOCS:
        if doc["kind"] != "Service":
            continue
        matched = [p for p in pods if _selects(doc["spec"]["selector"], p["metadata"]["labels"])]
        assert matched, f"Service {doc['metadata']['name']} selects no pod"
        for port in doc["spec"]["ports"]:
            target = port["targetPort"]
            for pod in matched:
                names = {p.get("name") for c in _containers(pod) for p in c.get("ports", [])}
                numbers = {p["containerPort"] for c in _containers(pod) for p in c.get("ports", [])}
                assert target in names | numbers, f"{doc['metadata']['name']}: {target}"


def test_network_policies_cover_every_pod_and_admit_only_labelled_clients() -> None:
    policies = [d for _, d in DOCS if d["kind"] == "NetworkPolicy"]
    for name, pod in _workloads():
        labels = pod["metadata"]["labels"]
        covering = [
            p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], labels)
        ]
        assert covering, f"{name}: no NetworkPolicy selects its pods"
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            peers = rule.get("from")
            assert peers, f"{policy['metadata']['name']}: a rule without `from` admits everyone"
            for peer in peers:
                assert set(peer) == {"podSelector"}, "peers are selected by pod label only"
                assert peer["podSelector"]["matchLabels"], "an empty selector admits every pod"
    services = next(p for p in policies if p["metadata"]["name"] == "fthsdp-services")
    allowed = [
        peer["podSelector"]["matchLabels"] for peer in services["spec"]["ingress"][0]["from"]
    ]
    assert {"fthsdp.io/client": "true"} in allowed
    replica_labels = next(p for n, p in _workloads() if n == "fthsdp-demo")["metadata"]["labels"]
    assert replica_labels["fthsdp.io/client"] == "true", "workers must be able to reach services"


def test_the_token_is_a_mounted_secret_with_a_placeholder_no_service_accepts() -> None:
    secret = next(d for _, d in DOCS if d["kind"] == "Secret")
    with pytest.raises(ValueError):
        Token(secret["stringData"]["token"])
    for name, pod in _workloads():
        mounts = {v["name"] for v in pod["spec"].get("volumes", []) if "secret" in v}
        for container in _containers(pod):
            env = {e["name"]: e for e in container.get("env", [])}
            assert "FTHSDP_TOKEN" not in env, f"{name}: the token must not be an env var"
            if container["name"] == "redis":
                continue
            assert env["FTHSDP_TOKEN_FILE"]["value"] == "/var/run/secrets/fthsdp/token", name
            assert "token" in mounts and any(
                m["name"] == "token" and m["readOnly"] for m in container["volumeMounts"]
            ), name


def test_images_are_pinned() -> None:
    for name, pod in _workloads():
        for container in _containers(pod):
            image = container["image"]
            repository, _, tag = image.rpartition(":")
            assert repository and tag and tag != "latest", f"{name}: pin {image}"
            if repository.startswith("fthsdp/"):
                dockerfile = ROOT / "deploy" / "docker" / f"{repository.split('/')[1]}.Dockerfile"
                assert dockerfile.is_file(), f"{image} has no Dockerfile"
