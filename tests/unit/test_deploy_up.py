"""`fthsdp up` without running services: the plan (argv, ports, env file), the token file, the
leader + standby rules, and the supervisor's restart policy on real short-lived processes."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.deploy.job import JobConfig
from fthsdp.deploy.processes import (
    GaveUp,
    RestartPolicy,
    ServiceSpec,
    ServiceSupervisor,
    terminate_all,
)
from fthsdp.deploy.up import ENV_FILE_NAME, ensure_token_file, render_env, run_up
from fthsdp.deploy.up_cli import add_up_parser, job_of
from fthsdp.deploy.up_plan import UpConfig, plan_stack
from fthsdp.services.common.tokens import load_token


def _argv(stack_services: list[ServiceSpec], name: str) -> list[str]:
    return list(next(s for s in stack_services if s.name == name).argv)


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_plan_binds_loopback_on_distinct_ports_and_passes_no_secret(tmp_path: Path) -> None:
    token, generated = ensure_token_file(UpConfig(run_dir=tmp_path), tmp_path)
    assert generated
    stack = plan_stack(UpConfig(run_dir=tmp_path), token)
    assert [s.name for s in stack.services] == ["quorum", "checkpoint", "health"]
    ports = []
    secret = load_token(path=str(token)).value
    for spec in stack.services:
        argv = list(spec.argv)
        assert _value(argv, "--host") == "127.0.0.1"
        assert _value(argv, "--token-file") == str(token)
        assert secret not in " ".join(argv) and secret not in str(spec.env)
        ports += [
            int(_value(argv, f)) for f in ("--port", "--admin-port", "--http-port") if f in argv
        ]
    assert len(ports) == 5 and len(set(ports)) == 5 and all(ports)
    quorum = _argv(stack.services, "quorum")
    health = _argv(stack.services, "health")
    assert _value(health, "--quorum") == f"127.0.0.1:{_value(quorum, '--port')}"
    assert _value(health, "--mode") == "central"
    assert stack.env["FTHSDP_QUORUM"] == f"127.0.0.1:{_value(quorum, '--port')}"
    assert stack.env["FTHSDP_TOKEN_FILE"] == str(token)


def test_ports_from_flags_are_kept(tmp_path: Path) -> None:
    config = UpConfig(run_dir=tmp_path, quorum_port=17450, checkpoint_port=17470, health=False)
    token, _ = ensure_token_file(config, tmp_path)
    stack = plan_stack(config, token)
    assert _value(_argv(stack.services, "quorum"), "--port") == "17450"
    assert stack.env["FTHSDP_CHECKPOINT_URL"] == "http://127.0.0.1:17470"
    assert "FTHSDP_HEALTH" not in stack.env  # --no-health
    assert [s.name for s in stack.services] == ["quorum", "checkpoint"]


def test_the_quorum_timeouts_given_reach_the_service_and_the_rest_keep_its_defaults(
    tmp_path: Path,
) -> None:
    config = UpConfig(run_dir=tmp_path, join_timeout_ms=5000, catchup_timeout_ms=90000)
    token, _ = ensure_token_file(config, tmp_path)
    quorum = _argv(plan_stack(config, token).services, "quorum")
    assert _value(quorum, "--join-timeout-ms") == "5000"
    assert _value(quorum, "--catchup-timeout-ms") == "90000"
    assert "--heartbeat-timeout-ms" not in quorum


def test_a_wildcard_host_advertises_a_reachable_name(tmp_path: Path) -> None:
    config = UpConfig(run_dir=tmp_path, host="0.0.0.0", advertise_host="node7")
    token, _ = ensure_token_file(config, tmp_path)
    stack = plan_stack(config, token)
    assert stack.env["FTHSDP_QUORUM"].startswith("node7:")
    assert stack.env["FTHSDP_HEALTH_URL"].startswith("http://node7:")
    assert _value(_argv(stack.services, "quorum"), "--host") == "0.0.0.0"


def test_redis_plan_runs_leader_and_standby_over_a_private_socket(tmp_path: Path) -> None:
    config = UpConfig(run_dir=tmp_path, redis=True)
    token, _ = ensure_token_file(config, tmp_path)
    stack = plan_stack(config, token)
    names = [s.name for s in stack.services]
    assert names == ["redis", "quorum-a", "quorum-b", "checkpoint", "health"]
    redis = next(s for s in stack.services if s.name == "redis")
    assert redis.tier == 0 and all(s.tier == 1 for s in stack.services[1:])
    conf = Path(redis.argv[1]).read_text()
    assert "port 0" in conf and "unixsocketperm 700" in conf
    url = f"unix://{redis.addresses['unix_socket']}"
    variables = {
        "quorum-a": "FTHSDP_QUORUM_REDIS_URL",
        "quorum-b": "FTHSDP_QUORUM_REDIS_URL",
        "checkpoint": "FTHSDP_CHECKPOINT_REDIS_URL",
        "health": "FTHSDP_HEALTH_REDIS_URL",
    }
    for spec in stack.services[1:]:
        # In the environment, never on a command line (a Redis URL may hold a password).
        assert "--redis-url" not in spec.argv and url not in " ".join(spec.argv)
        assert dict(spec.env) == {variables[spec.name]: url}
    a, b = (_value(_argv(stack.services, n), "--port") for n in ("quorum-a", "quorum-b"))
    assert stack.env["FTHSDP_QUORUM"] == f"127.0.0.1:{a},127.0.0.1:{b}"
    assert {s.group for s in stack.services if s.name.startswith("quorum")} == {"quorum"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quorum_port": 7450, "checkpoint_port": 7450},
        {"quorum_port": 70000},
        {"redis": True, "redis_url": "redis://x:1/0"},
        {"redis_url": "http://x"},
        {"ready_timeout": timedelta(0)},
        {"max_restarts": -1},
    ],
)
def test_bad_configurations_are_value_errors(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        UpConfig(run_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


def test_token_file_is_private_reused_and_validated(tmp_path: Path) -> None:
    path, generated = ensure_token_file(UpConfig(run_dir=tmp_path), tmp_path)
    assert generated and stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    again, generated = ensure_token_file(UpConfig(run_dir=tmp_path), tmp_path)
    assert again == path and not generated and path.read_text() == first
    bad = tmp_path / "bad"
    bad.write_text("short\n")
    with pytest.raises(ValueError):
        ensure_token_file(UpConfig(run_dir=tmp_path, token_file=bad), tmp_path)


def test_env_file_can_be_sourced_and_read_by_docker(tmp_path: Path) -> None:
    text = render_env({"FTHSDP_QUORUM": "h:1,h:2", "FTHSDP_SHM_DIR": "/a b"}, tmp_path)
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines == ["FTHSDP_QUORUM=h:1,h:2", "FTHSDP_SHM_DIR='/a b'"]
    assert str(tmp_path / ENV_FILE_NAME) in text


def _crasher(tmp_path: Path, name: str = "crasher") -> ServiceSpec:
    return ServiceSpec(
        name=name,
        argv=[sys.executable, "-c", "import sys; sys.exit(3)"],
        log_path=tmp_path / f"{name}.log",
    )


def _tick_until(supervisor: ServiceSupervisor, condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        supervisor.tick(time.monotonic())
        time.sleep(0.02)


def test_supervisor_restarts_a_dead_child_then_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    messages: list[str] = []
    policy = RestartPolicy(first_delay_s=0.01, max_delay_s=0.02, max_failures_in_a_row=2)
    supervisor = ServiceSupervisor([_crasher(tmp_path)], policy=policy, report=messages.append)
    supervisor.start_all()
    process = supervisor.processes[0]
    _tick_until(supervisor, lambda: process.restarts == 2)
    with pytest.raises(GaveUp, match="3 times in a row"):
        _tick_until(supervisor, lambda: False)
    assert any("exit code 3" in m for m in messages)
    assert sum("restarted" in m for m in messages) == 2
    supervisor.stop_all(1.0)


def test_restart_delay_doubles_up_to_a_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.2, max_delay_s=1.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.2, 0.4, 0.8, 1.0, 1.0]


_GRACEFUL = """
import signal, sys, time
from pathlib import Path
log, name = Path(sys.argv[1]), sys.argv[2]
def stop(*_):
    with log.open("a") as out:
        out.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(log.parent / ("ready-" + name)).touch()
time.sleep(60)
"""


def test_stop_all_stops_clients_before_their_store(tmp_path: Path) -> None:
    log = tmp_path / "stopped"
    specs = [
        ServiceSpec(
            name=name,
            argv=[sys.executable, "-c", _GRACEFUL, str(log), name],
            log_path=tmp_path / f"{name}.log",
            tier=tier,
        )
        for name, tier in (("store", 0), ("client-a", 1), ("client-b", 1))
    ]
    supervisor = ServiceSupervisor(specs, policy=RestartPolicy(), report=lambda _: None)
    supervisor.start_all()
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"ready-{s.name}").exists() for s in specs):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.02)
    supervisor.stop_all(5.0)
    assert all(not p.running() and p.proc and p.proc.returncode == 0 for p in supervisor.processes)
    stopped = log.read_text().split()
    assert sorted(stopped[:2]) == ["client-a", "client-b"] and stopped[2] == "store"


def test_a_second_launcher_on_a_live_run_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "services.json").write_text(json.dumps({"up_pid": os.getppid()}))
    with pytest.raises(ValueError, match="already runs"):
        run_up(UpConfig(run_dir=tmp_path))
    assert (tmp_path / "services.json").exists(), "the live launcher's state must stay"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--spares", "1"], "need --replicas"),
        (["--", "python", "train.py"], "need --replicas"),
        (["--replicas", "2"], "needs a command"),
        (["--replicas", "0", "--", "x"], "at least 1"),
        (["--replicas", "2", "--spares", "65", "--", "x"], "0..64"),
        (["--replicas", "600", "--ranks", "2", "--", "x"], "at most 1024"),
        (["--replicas", "2", "--await-replicas-s", "-1", "--", "x"], "0..3600"),
    ],
)
def test_a_half_given_job_is_refused(argv: list[str], error: str) -> None:
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match=error):
        job_of(parser.parse_args(["up", *argv]))


def test_the_job_runs_the_command_after_the_double_dash(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers(dest="command"))
    argv = ["up", "--replicas", "3", "--ranks", "2", "--spares", "2", "--max-restarts", "4",
            "--await-replicas-s", "12"]  # fmt: skip
    job = job_of(parser.parse_args([*argv, "--", "python", "train.py", "--steps", "5"]))
    assert job == JobConfig(
        command=("python", "train.py", "--steps", "5"),
        replicas=3,
        ranks=2,
        spares=2,
        restart_delay_s=1.0,
        max_failures_in_a_row=4,
        await_replicas_s=12.0,
    )
    assert job_of(parser.parse_args(["up"])) is None


def test_terminate_all_continues_stopped_processes_and_kills_stubborn_ones() -> None:
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen(
        [sys.executable, "-c", _IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    stopped.send_signal(signal.SIGSTOP)
    terminate_all([stopped, stubborn], grace_s=0.5)
    assert stopped.returncode == -signal.SIGTERM  # continued, then it acted on SIGTERM
    assert stubborn.returncode == -signal.SIGKILL  # after the grace
    stubborn.stdout.close()


_IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""
