"""Pytest fixtures and helpers for tests on real hosts in network namespaces (`deploy.netns`).

A test module loads them with `pytest_plugins = ("tests.netns_support",)`, then asks for
`netns_topology`, a factory: `netns_topology(["ctl", "r0", "r1"])` makes a topology that is
removed after the test, whatever happens in it. Where namespaces cannot be made (not root, a
container without CAP_SYS_ADMIN), tests skip saying why, except in CI (CI set), which runs as root
and must run them: there they fail. A test needing a fault mechanism calls `require_mechanism`
first, which skips naming the mechanism where this machine lacks it (and fails in CI for the
mechanisms every CI runner has, `CI_MECHANISMS`).

The session fixture `netns_session` removes stale topologies of crashed runs when the first test
asks for it, and at the end of the session fails if this session left a namespace, an owner
record or a link behind (after removing them).

`run_netns_demo` runs `fthsdp demo --hosts netns` in a process of its own and returns its
report. The helpers also run small standard-library Python programs inside the namespaces: a
TCP server that echoes lines prefixed with the peer's address (and sends N bytes on `bulk N`),
and clients that report how a connect ended (`ok <reply>`, `timeout`, `refused`,
`error <errno>`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest

from fthsdp.deploy.netns import (
    CI_MECHANISMS,
    PREFIX,
    CleanupError,
    Mechanisms,
    NetnsUnavailable,
    Topology,
    cleanup_stale,
    leftovers,
    mechanisms,
    read_first_line,
)
from fthsdp.deploy.netns_cleanup import namespaces

TopologyFactory = Callable[..., Topology]
PYTHON = [sys.executable, "-I", "-S"]
"""Standard library only: starts in tens of milliseconds inside a namespace."""

SERVER = r"""
import socket, sys, threading
srv = socket.create_server((sys.argv[1], int(sys.argv[2])), backlog=128)
print("ready", flush=True)
def serve(conn, peer):
    with conn, conn.makefile("rwb") as stream:
        for line in stream:
            if line.startswith(b"bulk "):
                stream.write(bytes(int(line.split()[1])))
                return
            stream.write(peer.encode() + b" " + line)
            stream.flush()
while True:
    conn, (peer, _) = srv.accept()
    threading.Thread(target=serve, args=(conn, peer), daemon=True).start()
"""

PROBE = r"""
import socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(b"ping\n")
        print("ok", sock.makefile().readline().strip())
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print("error", exc.errno)
"""

BULK = r"""
import socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.monotonic()
got = 0
with socket.create_connection((host, port), timeout=60) as sock:
    sock.sendall(b"bulk %d\n" % size)
    while chunk := sock.recv(1 << 16):
        got += len(chunk)
print(got, time.monotonic() - start)
"""

ROUND_TRIPS = r"""
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.create_connection((host, port), timeout=30) as sock:
    stream = sock.makefile("rwb")
    for i in range(count):
        start = time.monotonic()
        stream.write(b"rt%d\n" % i)
        stream.flush()
        reply = stream.readline().decode().strip()
        print(time.monotonic() - start, reply, flush=True)
"""

CHAT = r"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as sock:
    sock.settimeout(None)
    stream = sock.makefile("rwb")
    for line in sys.stdin:
        stream.write(line.encode())
        stream.flush()
        print(stream.readline().decode().strip(), flush=True)
"""
"""A long-lived connection: each line on stdin is sent, each reply printed."""


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def unavailable(reason: str) -> NoReturn:
    """Skips, or fails in CI, where namespaces must work (CI runs as root)."""
    if in_ci():
        pytest.fail(f"network namespaces must work in CI (root): {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")


def require_mechanism(mechanism: str) -> None:
    """Skips naming `mechanism` where this machine lacks it; fails in CI for one of
    `CI_MECHANISMS`."""
    found = mechanisms()
    if found.has(mechanism):
        return
    reason = f"needs mechanism {mechanism!r}, missing here: {found.missing[mechanism]}"
    if in_ci() and mechanism in CI_MECHANISMS:
        pytest.fail(f"{reason} (every CI runner should have it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def netns_session() -> Iterator[Mechanisms]:
    """This machine's mechanisms; skips (fails in CI) without namespaces. Removes stale
    topologies first; at the end, fails if the session left anything behind."""
    found = mechanisms()
    if not found.has("namespaces"):
        unavailable(found.missing["namespaces"])
    cleanup_stale()
    yield found
    mine = leftovers(owner=os.getpid())
    cleanup_stale(owner=os.getpid())
    remaining = leftovers(owner=os.getpid())
    if mine or remaining:
        pytest.fail(f"left behind by this session: {mine}; not removable: {remaining}")


@pytest.fixture
def netns_topology(netns_session: Mechanisms) -> Iterator[TopologyFactory]:
    """Makes topologies (`Topology.create` arguments); removes them all after the test."""
    made: list[Topology] = []

    def make(hosts: Sequence[str], **kwargs: Any) -> Topology:
        try:
            topology = Topology.create(hosts, **kwargs)
        except NetnsUnavailable as exc:
            unavailable(str(exc))
        made.append(topology)
        return topology

    yield make
    errors = []
    for topology in made:
        try:
            topology.close()
        except CleanupError as exc:
            errors.append(str(exc))
    if errors:
        pytest.fail(f"topology cleanup failed: {errors}")


# ---- programs inside the namespaces ---------------------------------------------------------


def start_server(
    topology: Topology, host: str, port: int, *, bind: str = "0.0.0.0"
) -> subprocess.Popen[str]:
    """The echo/bulk server on `bind:port` in `host`, once it listens."""
    proc = topology.popen(
        host, [*PYTHON, "-c", SERVER, bind, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert read_first_line(proc, timedelta(seconds=15)) == "ready"
    return proc


@dataclass(frozen=True, slots=True)
class Probe:
    """One connect attempt: from `source` to `address:port`, giving up after `timeout_s`."""

    source: str
    address: str
    port: int
    timeout_s: float = 10.0


def probe_all(topology: Topology, probes: Sequence[Probe]) -> list[str]:
    """Runs the probes at once; how each ended: `ok <reply>`, `timeout`, `refused`,
    `error <errno>`."""
    procs = [
        topology.popen(
            p.source,
            [*PYTHON, "-c", PROBE, p.address, str(p.port), str(p.timeout_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in probes
    ]
    outcomes = []
    for probe, proc in zip(probes, procs, strict=True):
        out, _ = proc.communicate(timeout=probe.timeout_s + 30)
        outcomes.append(out.strip())
    return outcomes


def probe(topology: Topology, source: str, address: str, port: int, timeout_s: float = 10) -> str:
    return probe_all(topology, [Probe(source, address, port, timeout_s)])[0]


def bulk_transfer(topology: Topology, host: str, address: str, port: int, size: int) -> float:
    """Downloads `size` bytes from the server at `address:port` into `host`; seconds taken
    from before the connect to the last byte."""
    result = topology.run(host, [*PYTHON, "-c", BULK, address, str(port), str(size)], timeout=120)
    got, elapsed = result.stdout.split()
    assert int(got) == size, f"received {got} of {size} bytes"
    return float(elapsed)


def round_trips(
    topology: Topology, host: str, address: str, port: int, count: int
) -> list[tuple[float, str]]:
    """`count` line round trips over one connection from `host`: (seconds, reply) each."""
    result = topology.run(host, [*PYTHON, "-c", ROUND_TRIPS, address, str(port), str(count)])
    trips = []
    for line in result.stdout.splitlines():
        seconds, reply = line.split(" ", 1)
        trips.append((float(seconds), reply))
    return trips


def start_chat(topology: Topology, host: str, address: str, port: int) -> subprocess.Popen[str]:
    """A connection from `host` kept open: write lines to its stdin, read replies from stdout."""
    return topology.popen(
        host,
        [*PYTHON, "-c", CHAT, address, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Polls `check` until it holds; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within {timeout_s} s")
        time.sleep(0.05)


# ---- the demo on namespaces (`fthsdp demo --hosts netns`) ------------------------------------


@dataclass(frozen=True, slots=True)
class NetnsDemoRun:
    """A finished `fthsdp demo --hosts netns` run: its report, the records of its network
    faults (`netns_faults.jsonl`) and its run directory."""

    report: dict[str, Any]
    faults: list[dict[str, Any]]
    run_dir: Path
    stderr: str
    """The launcher's log (the embedded quorum service's too: evictions, incarnations)."""


def demo_argv(run_dir: Path, *flags: str) -> list[str]:
    """`fthsdp demo --hosts netns` with small, fast settings (3 replicas of 1 rank); `flags`
    come last and win."""
    return [
        sys.executable, "-m", "fthsdp.deploy.cli", "demo", "--hosts", "netns",
        "--replicas", "3", "--ranks", "1", "--no-live", "--durable-every-steps", "10",
        "--run-dir", str(run_dir), *flags,
    ]  # fmt: skip


def run_netns_demo(run_dir: Path, *flags: str, timeout_s: float = 240.0) -> NetnsDemoRun:
    """Runs the demo in its own process (it moves itself into a namespace, which a test
    process must not do) and checks it removed its topology; fails on a non-zero exit (the
    CLI exits 1 when an invariant does not hold)."""
    before = set(namespaces(PREFIX))
    proc = subprocess.run(
        demo_argv(run_dir, *flags), capture_output=True, text=True, timeout=timeout_s
    )
    left = set(namespaces(PREFIX)) - before
    assert not left, f"the demo left topologies behind: {sorted(left)}"
    report_path = run_dir / "report.json"
    assert report_path.exists(), f"no report (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(report_path.read_text())
    assert proc.returncode == 0, f"exit {proc.returncode}: {report['invariants']}"
    records = run_dir / "netns_faults.jsonl"
    faults = [json.loads(x) for x in records.read_text().splitlines()] if records.exists() else []
    return NetnsDemoRun(report=report, faults=faults, run_dir=run_dir, stderr=proc.stderr)
