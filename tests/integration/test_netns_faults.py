"""Network faults on real hosts (`fthsdp demo --hosts netns`): each host a network namespace,
each fault one that a loopback run cannot produce, where packets vanish instead of being
refused. Every test runs the demo as a process of its own and checks the invariants of its
report by name (I1 identical replicas, I2 exactly-once data, I6 no minority quorum), plus the
detection / stall figures of the fault, which it prints (`-s`) for the README's table.

Bounds on wall time are asserted only where the bound is the property (evicted by the heartbeat
timeout rather than after a collective timeout, failing over rather than waiting out a
deadline), with a margin for a loaded 2-core machine."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from fthsdp.deploy.demo.events import InjectEvent, QuorumEvent, RunLog, StartEvent
from fthsdp.deploy.netns import PREFIX, Mechanisms
from fthsdp.deploy.netns_cleanup import namespaces
from fthsdp.deploy.netns_demo import NetnsHosts
from tests import netns_support
from tests.netns_support import demo_argv, eventually, require_mechanism, run_netns_demo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

netns_session = netns_support.netns_session

HEARTBEAT_TIMEOUT_S = 1.0
"""The demo's default `--heartbeat-timeout-ms`."""
MARGIN_S = 4.0
"""Slack on top of a bound that is the property, for a loaded machine (at load averages of
11-14 on 2 cores the launcher saw evictions 2.9 and 3.3 s after a blackhole): still far below
the 30 s exchange timeout that survivors would wait out without the eviction, and below the
7.9 s that survivors stalled behind a blackholed leader before the keepalive fix."""
RPC_DEADLINE_S = 5.0
"""The quorum client's per-attempt RPC deadline, which a failover must not wait out."""


def _check_invariants(report: dict[str, Any]) -> None:
    """I1, I2 and I6 hold, and every replica ended at one step with one fingerprint."""
    for name in ("I1", "I2", "I6"):
        assert report["invariants"][name]["ok"], report["invariants"][name]
    finals = {r["final_step"] for r in report["replicas"].values()}
    prints = {r["fingerprint"] for r in report["replicas"].values()}
    assert len(finals) == 1 and len(prints) == 1 and None not in prints, report["replicas"]


def _only_failure(report: dict[str, Any], mode: str) -> dict[str, Any]:
    (failure,) = report["failures"]
    assert isinstance(failure, dict)
    assert failure["mode"] == mode
    print(f"\n{mode}: {json.dumps(failure)} median step {report['summary']['median_step_s']} s")
    return failure


def test_a_blackholed_replica_host_is_evicted_and_rejoins_as_a_new_incarnation(
    netns_session: Mechanisms, tmp_path: Path
) -> None:
    """I1 I2 I6. Its processes live on but every packet is dropped: the heartbeat timeout
    evicts it (FTAR peers see no reset, only silence), survivors stall about that long, and
    once healed it comes back as a new incarnation that catches up."""
    require_mechanism("link down")
    run = run_netns_demo(
        tmp_path / "run", "--kill-mode", "blackhole", "--kill-every", "6",
        "--duration", "20", "--fault-for", "5",
    )  # fmt: skip
    report = run.report
    _check_invariants(report)
    failure = _only_failure(report, "blackhole")
    victim = failure["replica"]
    median = report["summary"]["median_step_s"]
    assert failure["detection_s"] is not None, "never evicted"
    assert failure["detection_s"] <= HEARTBEAT_TIMEOUT_S + MARGIN_S, failure
    # Survivors wait for the eviction, not for an exchange or collective timeout.
    assert failure["survivor_stall_s"] is not None
    assert failure["survivor_stall_s"] <= median + HEARTBEAT_TIMEOUT_S + MARGIN_S, failure
    # Healthy again only after the heal (5 s), at a later step than it was cut off at.
    assert failure["time_to_healthy_s"] is not None and failure["time_to_healthy_s"] >= 5.0
    assert failure["healthy_step"] > failure["step"]
    log = RunLog.load(run.run_dir)
    (inject,) = log.of_type(InjectEvent)
    back = [q for q in log.of_type(QuorumEvent) if q.t > inject.t and victim in q.healthy]
    assert back, f"{victim} never rejoined a quorum as healthy"
    # Restarted by a teardown or rejoined by itself: either way a new incarnation, which the
    # quorum service names when the replica leaves at the end.
    left = re.findall(
        rf"replica removed replica_id={victim} incarnation=(\d+) cause=left", run.stderr
    )
    assert left and int(left[-1]) > 1, f"{victim} did not come back as a new incarnation: {left}"


def test_a_blackholed_quorum_leader_is_replaced_and_clients_fail_over(
    netns_session: Mechanisms, tmp_path: Path
) -> None:
    """I1 I2 I6. The leader lives but its host drops every packet: it loses its Redis lease to
    the standby, and a client connected to it fails over through keepalive within ~2 s rather
    than after its 5 s RPC deadline (which it used to wait out, then fail); no replica is
    evicted."""
    require_mechanism("link down")
    run = run_netns_demo(
        tmp_path / "run", "--redis", "--kill-mode", "leader-blackhole", "--kill-every", "5",
        "--duration", "16", "--fault-for", "4",
    )  # fmt: skip
    report = run.report
    _check_invariants(report)
    failure = _only_failure(report, "leader-blackhole")
    (probe,) = run.faults
    print(f"client failover: {probe}")
    assert "failover_s" in probe, probe
    assert probe["failover_s"] < RPC_DEADLINE_S - 1.0, probe
    assert failure["survivor_stall_s"] is not None
    assert failure["survivor_stall_s"] <= 2.0 + MARGIN_S, failure
    log = RunLog.load(run.run_dir)
    everyone = set(report["replicas"])
    (inject,) = log.of_type(InjectEvent)
    later = [q for q in log.of_type(QuorumEvent) if q.t > inject.t]
    assert all(set(q.members) == everyone for q in later), f"a replica was evicted: {later}"


def test_a_leader_cut_from_redis_is_fenced_without_split_brain(
    netns_session: Mechanisms, tmp_path: Path
) -> None:
    """I1 I2 I6. The leader still reaches every replica but not Redis: its lease lapses, it
    stops serving, the standby takes over, and no step is ever committed under two quorums."""
    require_mechanism("static neighbours")
    run = run_netns_demo(
        tmp_path / "run", "--redis", "--kill-mode", "leader-redis-cut", "--kill-every", "5",
        "--duration", "16", "--fault-for", "4",
    )  # fmt: skip
    report = run.report
    _check_invariants(report)
    failure = _only_failure(report, "leader-redis-cut")
    assert failure["survivor_stall_s"] is not None
    assert failure["survivor_stall_s"] <= 2.0 + MARGIN_S, failure
    quorums_of_step: dict[int, set[int]] = {}
    for commit in RunLog.load(run.run_dir).commits():
        quorums_of_step.setdefault(commit.step, set()).add(commit.quorum_id)
    split = {step: ids for step, ids in quorums_of_step.items() if len(ids) > 1}
    assert not split, f"steps committed under two quorums: {split}"
    logs = run.run_dir / "logs"
    old = (logs / "quorum-a.log").read_text()
    assert "stepping down as quorum leader: lease not renewed" in old, "the cut leader led on"
    assert "elected quorum leader" in (logs / "quorum-b.log").read_text()


def test_a_flapping_replica_link_loses_nothing_and_the_job_trains_on(
    netns_session: Mechanisms, tmp_path: Path
) -> None:
    """I1 I2 I6. A replica's link goes down and up every 3 s for a minute: the others keep
    committing, the flapping one restarts at most once per cycle (incarnations stay bounded),
    and every replica ends identical."""
    require_mechanism("link down")
    fault_s = 60.0
    run = run_netns_demo(
        tmp_path / "run", "--kill-mode", "flap", "--kill-every", "6", "--duration", "82",
        "--fault-for", str(fault_s),
    )  # fmt: skip
    report = run.report
    _check_invariants(report)
    failure = _only_failure(report, "flap")
    victim = failure["replica"]
    log = RunLog.load(run.run_dir)
    (inject,) = log.of_type(InjectEvent)
    starts = [e for e in log.replicas[victim] if isinstance(e, StartEvent) and e.t > inject.t]
    cycles = fault_s / 3.0
    during = [
        c for c in log.commits() if c.replica != victim and inject.t < c.t < inject.t + fault_s
    ]
    print(
        f"flap: {len(starts)} restart(s) of {victim} over {cycles:.0f} cycles; the others "
        f"committed {len(during)} times meanwhile"
    )
    # Bounded incarnations: a flapping link must not cost a restart every cycle (most cycles
    # the victim is evicted and rejoins as it is; 2 restarts in 20 cycles were seen).
    assert len(starts) <= cycles / 2, starts
    # Each cycle is down half the time, and the survivors stall about one heartbeat timeout per
    # eviction: they still train in every cycle, not only once the flapping ends (7,980 commits
    # in the minute were seen, at a median step of 0.015 s).
    assert len(during) >= 20 * cycles, f"the others stopped training while {victim} flapped"
    assert failure["time_to_healthy_s"] is not None


def test_a_replica_cut_from_health_central_only_is_not_evicted(
    netns_session: Mechanisms, tmp_path: Path
) -> None:
    """I1 I2 I6. Its host cannot reach health central, but trains and beats the quorum service
    as before: nothing may evict it. Central sees every rank behind the lost agent link fall
    silent, and leaves their liveness to the quorum service's heartbeats instead of reporting
    fail-stops (issue 15; before the fix it evicted the victim about 1 s into the cut)."""
    require_mechanism("static neighbours")
    run = run_netns_demo(
        tmp_path / "run", "--kill-mode", "health-cut", "--kill-every", "5",
        "--duration", "16", "--fault-for", "5",
    )  # fmt: skip
    report = run.report
    _check_invariants(report)
    failure = _only_failure(report, "health-cut")
    victim = failure["replica"]
    log = RunLog.load(run.run_dir)
    (inject,) = log.of_type(InjectEvent)
    evicted = [q for q in log.of_type(QuorumEvent) if q.t > inject.t and victim not in q.members]
    assert not evicted, f"a lost link to health central got {victim} evicted: {evicted[0]}"


def test_a_slow_replica_link_slows_the_job_and_evicts_nobody(
    netns_session: Mechanisms, tmp_path: Path
) -> None:
    """I1 I2 I6. One replica's link is rate-limited (`tbf`): every replica's steps slow down
    (they meet in the ring), nothing is evicted under the fail-slow policy `report`, and the
    health service names the slow replica by its two ring links (`detectors.links`: the
    step-time detector cannot, since every replica slows down alike)."""
    require_mechanism("tbf")
    fault_s = 8.0
    run = run_netns_demo(
        tmp_path / "run", "--kill-mode", "slow-link", "--kill-every", "5", "--duration", "18",
        "--fault-for", str(fault_s),
    )  # fmt: skip
    report = run.report
    _check_invariants(report)
    failure = _only_failure(report, "slow-link")
    victim = failure["replica"]
    log = RunLog.load(run.run_dir)
    (inject,) = log.of_type(InjectEvent)
    evicted = [q for q in log.of_type(QuorumEvent) if q.t > inject.t and victim not in q.members]
    assert not evicted, f"a slow link got {victim} evicted: {evicted}"
    others = [c.t for c in log.commits() if c.replica != victim]
    before = sum(1 for t in others if inject.t - fault_s < t < inject.t)
    during = sum(1 for t in others if inject.t < t < inject.t + fault_s)
    print(f"slow-link: the others committed {before} steps before, {during} during")
    assert during < before / 2, "the rate limit did not slow the exchange"
    verdicts = [
        i for i in report["incidents"] if i["kind"] == "fail_slow" and i["detected_at"] > inject.t
    ]
    # What the health service did say, and the quorums meanwhile (a recovery holds the link
    # detector), so that a miss here can be told apart from a slow detector.
    assert verdicts, (
        f"no fail-slow verdict named {victim} behind its slow link; incidents: "
        f"{report['incidents']}; quorums after the inject: "
        f"{[(q.t - inject.t, q.members) for q in log.of_type(QuorumEvent) if q.t > inject.t]}"
    )
    print(f"slow-link: named after {verdicts[0]['detected_at'] - inject.t:.2f} s: "
          f"{verdicts[0]['summary']}")  # fmt: skip
    assert {i["replica_id"] for i in verdicts} == {victim}, verdicts
    assert verdicts[0]["evidence"]["source"] == "links", verdicts[0]


def test_ctrl_c_removes_every_namespace(netns_session: Mechanisms, tmp_path: Path) -> None:
    """SIGINT while the replicas train: the launcher stops everything and removes its
    topology (the namespaces, and with them every veth)."""
    before = set(namespaces(PREFIX))
    run_dir = tmp_path / "run"
    argv = demo_argv(run_dir, "--no-kills", "--duration", "120")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        eventually(lambda: set(namespaces(PREFIX)) - before != set(), "topology made", 60)
        replicas = run_dir / "replicas"
        eventually(
            lambda: replicas.exists() and any(p.stat().st_size for p in replicas.glob("*.jsonl")),
            "a replica committed",
            90,
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    left = set(namespaces(PREFIX)) - before
    assert not left, f"left behind after Ctrl-C: {sorted(left)}"


def test_netns_hosts_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without root, `--hosts netns` is a clear user error, before anything is made, and
    whatever else is wrong (here: a thread already running, as in a test session)."""
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    before = set(namespaces(PREFIX))
    release = threading.Event()
    other = threading.Thread(target=release.wait, daemon=True)
    other.start()
    try:
        with pytest.raises(ValueError, match="--hosts netns: network namespaces need root"):
            NetnsHosts(["r0"], redis=False).__enter__()
    finally:
        release.set()
        other.join()
    assert set(namespaces(PREFIX)) == before
