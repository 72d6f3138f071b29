"""The network-namespace topology (`deploy.netns`) on real namespaces: hosts reach each other over
real TCP, each fault drops exactly what it should (a dropped packet makes a connect time out, it
is never refused), the delay proxy delays, and nothing is ever left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.deploy import netns, netns_cleanup, netns_mechanisms
from fthsdp.deploy.netns import (
    CommandFailed,
    MechanismMissing,
    Mechanisms,
    NetnsUnavailable,
    SubnetCollision,
    Topology,
    check_subnet,
    cleanup_stale,
    leftovers,
    mechanisms,
    read_first_line,
)
from fthsdp.deploy.netns_cleanup import NETNS_DIR, holders, namespace_inode
from tests import netns_support
from tests.netns_support import (
    Probe,
    TopologyFactory,
    bulk_transfer,
    eventually,
    probe,
    probe_all,
    require_mechanism,
    round_trips,
    start_chat,
    start_server,
)

# The fixtures, for this module (tests/conftest.py would make them everyone's).
netns_session = netns_support.netns_session
netns_topology = netns_support.netns_topology

PORT = 7000
LOST = 1.0
"""Connect timeout of a probe that must time out: a dropped SYN never gets an answer."""


def _existing(names: list[str]) -> set[str]:
    return set(names) & set(os.listdir(NETNS_DIR))


def _port_state(topo: Topology, host: str) -> str:
    out = netns_cleanup.command(
        ["ip", "-n", topo.bridge_namespace, "-j", "link", "show", topo.port(host)]
    )
    return str(json.loads(out)[0]["operstate"])


def _gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for its reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ---- reachability -------------------------------------------------------------------------


def test_hosts_reach_each_other_over_tcp_from_their_own_addresses(
    netns_topology: TopologyFactory,
) -> None:
    topo = netns_topology(["a", "b", "c"])
    assert [topo.address(h) for h in topo.hosts] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    for host in topo.hosts:  # the same port in every host: each has its own port space
        start_server(topo, host, PORT)
    start_server(topo, "a", PORT + 1, bind="127.0.0.1")
    pairs = [(s, d) for s in topo.hosts for d in topo.hosts if s != d]
    outcomes = probe_all(topo, [Probe(s, topo.address(d), PORT) for s, d in pairs])
    # The server answers with the peer address it saw: each client speaks from its own host.
    assert outcomes == [f"ok {topo.address(s)} ping" for s, _ in pairs]
    # Loopback is each host's own: a's loopback-only server is not b's.
    assert probe(topo, "a", "127.0.0.1", PORT + 1) == "ok 127.0.0.1 ping"
    assert probe(topo, "b", "127.0.0.1", PORT + 1) == "refused"


# ---- faults -------------------------------------------------------------------------------


def test_blackhole_drops_every_packet_of_a_live_host_until_healed(
    netns_topology: TopologyFactory,
) -> None:
    require_mechanism("link down")
    topo = netns_topology(["a", "b", "c"])
    a, b, c = (topo.address(h) for h in ("a", "b", "c"))
    servers = {host: start_server(topo, host, PORT) for host in topo.hosts}
    chat = start_chat(topo, "b", a, PORT)  # a connection open across the blackhole
    assert chat.stdin is not None
    chat.stdin.write("before\n")
    chat.stdin.flush()
    assert read_first_line(chat, timedelta(seconds=15)) == f"{b} before"

    topo.blackhole("a")
    assert topo.blackholed("a")
    chat.stdin.write("across\n")  # sent into the void: retransmitted until the heal
    chat.stdin.flush()
    outcomes = probe_all(topo, [
        Probe("b", a, PORT, LOST),
        Probe("a", b, PORT, LOST),
        Probe("c", a, PORT, LOST),
        Probe("b", c, PORT),
        Probe("c", b, PORT),
        Probe("a", "127.0.0.1", PORT),
    ])  # fmt: skip
    assert outcomes == ["timeout", "timeout", "timeout", f"ok {b} ping", f"ok {c} ping",
                        "ok 127.0.0.1 ping"]  # fmt: skip
    assert servers["a"].poll() is None, "a blackholed host's processes keep running"

    topo.heal("a")
    eventually(lambda: probe(topo, "b", a, PORT, LOST) == f"ok {b} ping", "b reaches a again")
    assert probe(topo, "a", b, PORT) == f"ok {a} ping"
    # The open connection was never reset: the bytes sent while dark arrive after the heal.
    assert read_first_line(chat, timedelta(seconds=30)) == f"{b} across"


def test_partition_cuts_only_the_pair(netns_topology: TopologyFactory) -> None:
    require_mechanism("static neighbours")
    topo = netns_topology(["a", "b", "c"])
    a, b, c = (topo.address(h) for h in ("a", "b", "c"))
    for host in topo.hosts:
        start_server(topo, host, PORT)
    topo.partition("a", "b")
    assert topo.partitioned("b", "a")
    outcomes = probe_all(topo, [
        Probe("a", b, PORT, LOST),
        Probe("b", a, PORT, LOST),
        Probe("a", c, PORT),
        Probe("c", a, PORT),
        Probe("b", c, PORT),
        Probe("c", b, PORT),
    ])  # fmt: skip
    assert outcomes == ["timeout", "timeout", f"ok {a} ping", f"ok {c} ping", f"ok {b} ping",
                        f"ok {c} ping"]  # fmt: skip
    topo.heal_partition("b", "a")
    assert not topo.partitioned("a", "b")
    eventually(lambda: probe(topo, "a", b, PORT, LOST) == f"ok {a} ping", "a reaches b again")
    assert probe(topo, "b", a, PORT) == f"ok {b} ping"
    with pytest.raises(ValueError, match="itself"):
        topo.partition("a", "a")
    with pytest.raises(ValueError, match="no host 'zz'"):
        topo.partition("a", "zz")


def test_rate_limit_installs_tbf_on_both_ends_and_slows_a_bulk_transfer(
    netns_topology: TopologyFactory,
) -> None:
    require_mechanism("tbf")
    topo = netns_topology(["a", "b"])
    start_server(topo, "a", PORT)
    start_server(topo, "b", PORT)
    size = 1 << 20
    unlimited = bulk_transfer(topo, "a", topo.address("b"), PORT, size)

    limit = topo.rate_limit("b", 16)
    host_end = ["tc", "-n", topo.namespace("b"), "qdisc", "show", "dev", topo.interface("b")]
    port_end = ["tc", "-n", topo.bridge_namespace, "qdisc", "show", "dev", topo.port("b")]
    for argv in (host_end, port_end):
        shown = netns_cleanup.command(argv)
        assert "qdisc tbf" in shown and "rate 16Mbit" in shown, shown
    assert topo.rate_limits() == {"b": limit}
    # A token bucket passes at most burst + rate x time: a lower bound, not a speed measurement.
    floor_s = (size - limit.burst_bytes) * 8 / (limit.rate_mbit * 1e6)
    uploads = bulk_transfer(topo, "a", topo.address("b"), PORT, size)  # b sends: its own end
    downloads = bulk_transfer(topo, "b", topo.address("a"), PORT, size)  # b receives: its port
    assert uploads >= floor_s and downloads >= floor_s, (uploads, downloads, floor_s)
    assert uploads > 2 * unlimited, (uploads, unlimited)

    topo.clear_rate_limit("b")
    topo.clear_rate_limit("b")  # a no-op the second time
    assert topo.rate_limits() == {}
    for argv in (host_end, port_end):
        assert "tbf" not in netns_cleanup.command(argv)
    bulk_transfer(topo, "a", topo.address("b"), PORT, size)  # still every byte
    with pytest.raises(ValueError, match="rate_mbit"):
        topo.rate_limit("b", 0)


def test_link_flap_toggles_the_port_and_leaves_it_as_blackhole_wants(
    netns_topology: TopologyFactory,
) -> None:
    require_mechanism("link down")
    topo = netns_topology(["a", "b"])
    start_server(topo, "a", PORT)
    a, b = topo.address("a"), topo.address("b")
    with topo.link_flap("b", period=timedelta(milliseconds=100)) as flap:
        eventually(lambda: _port_state(topo, "b") == "DOWN", "the flap takes b's port down")
        eventually(lambda: flap.cycles >= 3, "three flaps")
        with pytest.raises(ValueError, match="already flaps"):
            topo.link_flap("b", period=timedelta(seconds=1))
    assert not flap.active
    assert _port_state(topo, "b") == "UP"
    eventually(lambda: probe(topo, "b", a, PORT, LOST) == f"ok {b} ping", "b reaches a")

    timed = topo.link_flap("b", period=timedelta(milliseconds=100), duration=timedelta(seconds=0.5))
    assert timed.wait(timeout=10), "a flap with a duration ends by itself"
    assert timed.cycles >= 1 and _port_state(topo, "b") == "UP"

    # A blackhole outlasts a flap that ends while it holds.
    flap = topo.link_flap("b", period=timedelta(milliseconds=100))
    topo.blackhole("b")
    flap.stop()
    assert _port_state(topo, "b") == "DOWN"
    assert probe(topo, "b", a, PORT, LOST) == "timeout"
    topo.heal("b")
    eventually(lambda: probe(topo, "b", a, PORT, LOST) == f"ok {b} ping", "b reaches a again")


def test_delay_proxy_adds_its_delay_to_each_direction(netns_topology: TopologyFactory) -> None:
    topo = netns_topology(["a", "b"])
    start_server(topo, "b", PORT)
    delay = timedelta(milliseconds=100)
    proxy = topo.delay_proxy("a", target=(topo.address("b"), PORT), delay=delay)
    trips = round_trips(topo, "a", topo.address("a"), proxy.port, 3)
    # The server sees the proxy (on a) as its peer; each reply crossed the proxy both ways.
    assert [reply for _, reply in trips] == [f"{topo.address('a')} rt{i}" for i in range(3)]
    assert min(seconds for seconds, _ in trips) >= 2 * delay.total_seconds(), trips
    size = 1 << 20
    bulk_transfer(topo, "a", topo.address("a"), proxy.port, size)  # every byte, in order
    proxy.process.send_signal(signal.SIGTERM)
    assert proxy.process.wait(timeout=10) == 0


# ---- mechanisms and validation ------------------------------------------------------------


def test_mechanisms_are_probed_once_and_a_missing_one_is_named() -> None:
    found = mechanisms()
    assert Topology.mechanisms() is found, "probed once per process"
    assert set(found.available) | set(found.missing) == set(netns.MECHANISMS)
    assert not leftovers(owner=os.getpid()), "the probe's namespace was removed"
    fake = Mechanisms(missing={"tbf": "Specified qdisc kind is unknown"})
    assert fake.has("htb") and not fake.has("tbf")
    with pytest.raises(MechanismMissing, match=r"'tbf'.*qdisc kind is unknown") as info:
        fake.require("tbf")
    assert info.value.mechanism == "tbf"
    with pytest.raises(ValueError, match="unknown mechanism"):
        fake.has("carrier pigeons")


@pytest.mark.parametrize("hosts", [[], ["A"], ["a_b"], ["-a"], ["a" * 16], ["a", "a"]])
def test_bad_host_names_are_refused_before_anything_is_made(hosts: list[str]) -> None:
    with pytest.raises(ValueError, match="host"):
        Topology.create(hosts)


def test_a_subnet_overlapping_a_route_of_this_machine_is_refused() -> None:
    with pytest.raises(SubnetCollision, match=r"192\.168\.1\.0/24 \(dev eth7\)"):
        check_subnet("192.168.0.0/16", [("default", "eth0"), ("192.168.1.0/24", "eth7")])
    assert str(check_subnet("10.213.0.0/24", [("default", "eth0"), ("10.0.0.0/24", "x")])) == (
        "10.213.0.0/24"
    )
    with pytest.raises(ValueError, match="IPv4"):
        check_subnet("fd00::/64", [])
    if os.geteuid() == 0:  # every Linux machine routes 127.0.0.0/8 (its local table)
        with pytest.raises(SubnetCollision, match=r"127\.0\.0\.0/8"):
            Topology.create(["a"], subnet="127.0.0.0/24")


def test_without_root_or_permission_the_error_says_what_is_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if os.geteuid() == 0:  # as root, `ip netns add` is refused the way a container refuses it

        def refuse(argv: list[str], **_: object) -> str:
            raise CommandFailed(argv, 1, "mount --make-shared /run/netns failed: not permitted")

        before = leftovers(owner=os.getpid())
        monkeypatch.setattr(netns_mechanisms, "command", refuse)
        with pytest.raises(NetnsUnavailable, match=r"not permitted.*CAP_SYS_ADMIN"):
            Topology.create(["a"])
        assert leftovers(owner=os.getpid()) == before, "the owner record went too"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="need root"):
        Topology.create(["a"])


# ---- cleanup ------------------------------------------------------------------------------


def test_cleanup_leaves_nothing_even_after_an_exception(netns_topology: TopologyFactory) -> None:
    netns_topology(["x"])  # the session's checks, and a live topology that must survive
    before = (leftovers(), netns_cleanup.root_links())
    seen: dict[str, object] = {}

    def fail_inside() -> None:
        with Topology.create(["a", "b"]) as topo:
            seen["topo"] = topo
            seen["sleeper"] = topo.popen("a", ["sleep", "300"])
            detached = topo.run("b", ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"])
            seen["detached"] = int(detached.stdout)
            names = topo.namespaces()
            seen["inodes"] = [i for n in names if (i := namespace_inode(n)) is not None]
            assert _existing(names) == set(names)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    topo, sleeper = seen["topo"], seen["sleeper"]
    assert isinstance(topo, Topology) and isinstance(sleeper, subprocess.Popen)
    names, inodes = topo.namespaces(), seen["inodes"]
    assert isinstance(inodes, list) and len(inodes) == 3
    assert _existing(names) == set(), "every namespace deleted"
    assert holders(inodes) == {}, "no process keeps a deleted namespace (and its links) alive"
    assert sleeper.returncode is not None and _gone(int(str(seen["detached"])))
    assert (leftovers(), netns_cleanup.root_links()) == before
    assert not (netns_cleanup.RECORDS_DIR / f"{topo.id}.json").exists()
    topo.close()  # idempotent


def test_a_failed_create_removes_what_it_made(
    netns_topology: TopologyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    netns_topology(["x"])
    made: list[str] = []
    real = netns_mechanisms.add_namespace

    def third_fails(name: str) -> None:
        if len(made) == 2:
            raise NetnsUnavailable("injected")
        real(name)
        made.append(name)

    monkeypatch.setattr(netns, "add_namespace", third_fails)
    with pytest.raises(NetnsUnavailable, match="injected"):
        Topology.create(["a", "b", "c"])
    assert len(made) == 2 and _existing(made) == set()
    assert not (netns_cleanup.RECORDS_DIR / f"{made[0]}.json").exists(), "nor its owner record"


CRASHING_OWNER = """
import json, sys, time
from fthsdp.deploy.netns import Topology
topo = Topology.create(["a", "b"])
sleeper = topo.popen("a", ["sleep", "300"])
print(json.dumps({"id": topo.id, "namespaces": topo.namespaces(), "pid": sleeper.pid}), flush=True)
time.sleep(300)
"""


def test_cleanup_stale_removes_what_a_killed_owner_left(netns_topology: TopologyFactory) -> None:
    mine = netns_topology(["x", "y"])
    start_server(mine, "x", PORT)
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_OWNER], stdout=subprocess.PIPE, text=True
    )
    try:
        made = json.loads(read_first_line(child, timedelta(seconds=30)))
    finally:
        child.kill()  # SIGKILL: no finally, no context manager exit runs in the child
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    names, sleeper = made["namespaces"], made["pid"]
    assert _existing(names) == set(names) and not _gone(sleeper), "the crash left them behind"
    assert any(name in item for item in leftovers() for name in names)

    removed = cleanup_stale()
    assert made["id"] in removed
    assert _existing(names) == set() and _gone(sleeper)
    assert not any(made["id"] in item for item in leftovers())
    # A live topology (this test's own) is not stale: it still works.
    assert mine.id not in removed and _existing(mine.namespaces()) == set(mine.namespaces())
    assert probe(mine, "y", mine.address("x"), PORT) == f"ok {mine.address('y')} ping"


def test_a_missing_mechanism_skips_outside_ci_and_fails_in_ci_only_where_ci_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Mechanisms(missing={"tbf": "no sch_tbf", "nftables": "nft is not installed"})
    monkeypatch.setattr(netns_support, "mechanisms", lambda: fake)
    monkeypatch.delenv("CI", raising=False)
    require_mechanism("htb")  # present: nothing happens
    with pytest.raises(pytest.skip.Exception, match=r"'tbf'.*no sch_tbf"):
        require_mechanism("tbf")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"'tbf'.*every CI runner"):
        require_mechanism("tbf")
    with pytest.raises(pytest.skip.Exception, match="'nftables'"):
        require_mechanism("nftables")  # not part of a CI runner's kernel: still a skip
    with pytest.raises(pytest.fail.Exception, match="must work in CI"):
        netns_support.unavailable("not root")
