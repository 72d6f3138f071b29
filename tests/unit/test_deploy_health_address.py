"""Every way of running replicas gives their ranks a health address (`--health`, which the demo
job turns into `ManagerConfig.health_address`), and that address is a health process the same
deployment starts: the node agent of the replica's host in docker-compose.yml, deploy/k8s and
deploy/slurm (each agent forwarding to the central service the deployment runs), the central
service itself in the torchrun command that `fthsdp up` prints. Without it the ranks send no
telemetry and the health service sees nothing."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from fthsdp.deploy.demo.train import parse_args
from fthsdp.deploy.up import ensure_token_file, replica_command
from fthsdp.deploy.up_plan import UpConfig, plan_stack

ROOT = Path(__file__).resolve().parents[2]
WORKER = "fthsdp.deploy.demo.train"


def _value(tokens: list[str], flag: str) -> str:
    assert flag in tokens, f"{flag} missing from {tokens}"
    return tokens[tokens.index(flag) + 1]


def _host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    assert sep and host and port, f"not host:port: {address!r}"
    return host, port


def _worker_args(tokens: list[str]) -> list[str]:
    """The demo job's own arguments in a torchrun command line."""
    at = tokens.index("-m")
    assert tokens[at + 1] == WORKER, tokens
    return tokens[at + 2 :]


def _health_address(worker_args: list[str]) -> str:
    """The `--health` value of a worker command line, as written (with its placeholders), after
    checking that the demo job takes exactly it as its health address: parsed as the job parses
    it, with every `$(VAR)` / `$VAR` the platform expands set to 1."""
    raw = _value(worker_args, "--health")
    concrete = [re.sub(r"\$\((\w+)\)|\$\{?\w+\}?", "1", arg) for arg in worker_args]
    assert parse_args(concrete).health == concrete[worker_args.index("--health") + 1]
    return raw


# ---- docker-compose.yml ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def test_compose_replicas_report_to_the_agent_the_file_runs(compose: dict[str, Any]) -> None:
    services = compose["services"]
    replicas = {n: s for n, s in services.items() if n.startswith("replica-")}
    assert len(replicas) >= 2
    for name, replica in replicas.items():
        host, port = _host_port(_health_address(_worker_args(list(replica["command"]))))
        assert host in services, f"{name}: --health names {host}, which compose does not run"
        agent = list(services[host]["command"])
        assert services[host]["image"].startswith("fthsdp-health:"), host
        assert _value(agent, "--mode") == "agent", f"{name} must report to its host's agent"
        assert _value(agent, "--port") == port, f"{name}: {host} listens elsewhere"
        assert _value(agent, "--host") == "0.0.0.0", "other containers must reach it"
        # Telemetry never gates training: the replica starts without the agent.
        assert replica["depends_on"][host] == {"condition": "service_started", "required": False}
        central_host, central_port = _host_port(_value(agent, "--central"))
        central = list(services[central_host]["command"])
        assert _value(central, "--mode") == "central", f"{host} forwards to a non-central"
        assert _value(central, "--port") == central_port
        assert _value(agent, "--quorum") == _value(central, "--quorum")


# ---- deploy/k8s -----------------------------------------------------------------------------


def _k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _central_behind(docs: list[dict[str, Any]], service: str, port: str) -> list[str]:
    """The args of the health container that Service `service`:`port` leads to."""
    svc = next(
        (d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == service), None
    )
    assert svc is not None, f"no Service {service}"
    target = next(p["targetPort"] for p in svc["spec"]["ports"] if str(p["port"]) == port)
    selector = svc["spec"]["selector"]
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]
        if all(pod["metadata"]["labels"].get(k) == v for k, v in selector.items()):
            for container in pod["spec"]["containers"]:
                ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
                if target in ports or target in ports.values():
                    number = ports.get(target, target)
                    args = list(container["args"])
                    assert _value(args, "--port") == str(number)
                    return args
    raise AssertionError(f"Service {service}:{port} leads to no container")


def test_k8s_replicas_report_to_the_agent_in_their_pod() -> None:
    docs = _k8s_docs()
    job = next(d for d in docs if d["kind"] == "Job")
    spec = job["spec"]["template"]["spec"]
    (trainer,) = spec["containers"]
    host, port = _host_port(_health_address(_worker_args(list(trainer["args"]))))
    # The pod's own sidecar, on its loopback: no hostPort, no node-wide agent to find.
    assert host == "127.0.0.1"
    agents = [
        c
        for c in spec.get("initContainers", [])
        if c["image"].startswith("fthsdp/health:") and c.get("restartPolicy") == "Always"
    ]
    assert len(agents) == 1, "one node-agent sidecar per replica pod"
    (agent,) = agents
    args = list(agent["args"])
    assert _value(args, "--mode") == "agent"
    assert _value(args, "--port") == port
    assert int(port) in {p["containerPort"] for p in agent["ports"]}
    # It names the host by the node the pod runs on.
    assert _value(args, "--node") == "$(NODE_NAME)"
    node = _env(agent)["NODE_NAME"]
    assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    central = _central_behind(docs, *_host_port(_value(args, "--central")))
    assert _value(central, "--mode") == "central"
    assert _value(args, "--quorum") == _value(central, "--quorum")


# ---- deploy/slurm ---------------------------------------------------------------------------


def _slurm_text() -> str:
    return re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / "slurm" / "fthsdp.sbatch").read_text())


def _command(text: str, program: str) -> list[str]:
    """The words after `program` on the one line that runs it."""
    pattern = rf"(^|\s){re.escape(program)}\s"
    lines = [line for line in text.splitlines() if re.search(pattern, line)]
    lines = [line for line in lines if not line.lstrip().startswith("#")]
    assert len(lines) == 1, f"{program}: {lines}"
    words = shlex.split(lines[0])
    return words[words.index(program.split()[-1]) + 1 :]


def _variable(text: str, name: str) -> str:
    match = re.search(rf"^{name}=(\S+)", text, re.MULTILINE)
    assert match, f"{name} is never set"
    return match.group(1)


def test_slurm_replicas_report_to_the_agent_their_step_starts() -> None:
    text = _slurm_text()
    step = re.search(r"^STEP='\n(.*?)\n'$", text, re.MULTILINE | re.DOTALL)
    assert step, "the replica step"
    body = step.group(1)
    host, port = _host_port(_health_address(_worker_args(_command(body, "torchrun"))))
    assert host == "127.0.0.1" and port == "$HEALTH_AGENT_PORT"
    # The agent runs in the same step, on the same node, on that port.
    agent = _command(body, "fthsdp-health")
    assert _value(agent, "--mode") == "agent"
    assert _value(agent, "--port") == "$HEALTH_AGENT_PORT"
    assert _value(agent, "--host") == "127.0.0.1"
    assert _value(agent, "--node") == "$host"
    assert _variable(text, "HEALTH_AGENT_PORT").isdigit()
    assert "HEALTH_AGENT_PORT=$HEALTH_AGENT_PORT" in text[step.end() :], "the step gets the port"
    # It forwards to the health service `fthsdp up` runs on node 0 (FTHSDP_HEALTH in the env
    # file, which the script loads and exports; see the `fthsdp up` test below).
    assert _value(agent, "--central") == "$FTHSDP_HEALTH"
    assert _value(agent, "--quorum") == "$FTHSDP_QUORUM"
    up = _command(text, "fthsdp up")
    assert int(_value(up, "--health-port")) > 0
    assert _value(up, "--host") == "0.0.0.0", "agents on other nodes must reach it"
    assert _value(up, "--env-file") == "$ENV_FILE"
    assert re.search(r'^set -a\n.*^\. "\$ENV_FILE"\n.*^set \+a$', text, re.MULTILINE | re.DOTALL)


# ---- fthsdp up ------------------------------------------------------------------------------


def _shell_words(command: str, env: dict[str, str]) -> list[str]:
    """The command's words once a shell that loaded the env file expanded them, and the user
    filled in the ranks (W) and replicas (R) it leaves open."""
    words = shlex.split(command.replace("\\\n", " "))
    words = ["1" if w in ("W", "R") else w for w in words]
    return [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words]


def test_the_command_fthsdp_up_prints_reports_to_its_health_service(tmp_path: Path) -> None:
    config = UpConfig(run_dir=tmp_path)
    token, _ = ensure_token_file(config, tmp_path)
    stack = plan_stack(config, token)
    address = _health_address(_worker_args(_shell_words(replica_command(stack.env), stack.env)))
    # `up` runs the central service only; ranks report to it directly.
    health = next(s for s in stack.services if s.name == "health")
    argv = list(health.argv)
    assert _value(argv, "--mode") == "central"
    assert address == stack.env["FTHSDP_HEALTH"] == f"127.0.0.1:{_value(argv, '--port')}"


def test_without_a_health_service_the_command_passes_no_address(tmp_path: Path) -> None:
    config = UpConfig(run_dir=tmp_path, health=False)
    token, _ = ensure_token_file(config, tmp_path)
    stack = plan_stack(config, token)
    words = _shell_words(replica_command(stack.env), stack.env)
    assert parse_args(_worker_args(words)).health is None
