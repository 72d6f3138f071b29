"""Which network-namespace mechanisms this machine has, probed once per process.

`mechanisms()` makes a throwaway namespace and tries each mechanism there (a veth pair, a bridge,
a link down, a static neighbour entry, the `tbf`, `htb` and `netem` qdiscs, a blackhole route,
`nft`, `iptables`), records the error of each one that fails, and deletes the namespace. A fault
of `deploy.netns.Topology` that needs a missing mechanism raises `MechanismMissing` naming it, so
a test skips exactly the cases this machine cannot run; `CI_MECHANISMS` are the ones every root
Linux CI runner has, whose absence is a failure there rather than a skip."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field

from fthsdp.deploy.netns_cleanup import (
    PREFIX,
    CommandFailed,
    NetnsError,
    OwnerRecord,
    command,
    destroy,
    new_id,
)

MECHANISMS = (
    "namespaces",
    "veth",
    "bridge",
    "static neighbours",
    "link down",
    "tbf",
    "htb",
    "netem",
    "blackhole routes",
    "nftables",
    "iptables",
)
"""Everything `mechanisms()` probes, whether a fault here uses it or not."""
CI_MECHANISMS = frozenset(
    {"namespaces", "veth", "bridge", "static neighbours", "link down", "tbf", "htb"}
)
"""What every root Linux CI runner has: a test needing one of these fails in CI, never skips."""


class NetnsUnavailable(NetnsError):
    """Namespaces cannot be made here: not root, not permitted, or no iproute2."""


class MechanismMissing(NetnsError):
    """A fault needs a kernel or user-space mechanism this machine lacks."""

    def __init__(self, mechanism: str, reason: str) -> None:
        self.mechanism = mechanism
        self.reason = reason
        super().__init__(f"mechanism {mechanism!r} is not available here: {reason}")


@dataclass(frozen=True, slots=True)
class Mechanisms:
    """Which mechanisms work on this machine."""

    missing: Mapping[str, str] = field(default_factory=dict)
    """Mechanism → why it does not work (the failing command's error)."""

    def has(self, mechanism: str) -> bool:
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown mechanism {mechanism!r}; one of {MECHANISMS}")
        return mechanism not in self.missing

    def require(self, mechanism: str) -> None:
        """Raises MechanismMissing, naming `mechanism` and why, if it does not work here."""
        if not self.has(mechanism):
            raise MechanismMissing(mechanism, self.missing[mechanism])

    @property
    def available(self) -> tuple[str, ...]:
        return tuple(m for m in MECHANISMS if m not in self.missing)


def require_root() -> None:
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN): run as root, as CI "
            "does, or under sudo"
        )
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsUnavailable("`ip` and `tc` (iproute2) are missing: apt-get install iproute2")


def add_namespace(name: str) -> None:
    try:
        command(["ip", "netns", "add", name])
    except CommandFailed as exc:
        raise NetnsUnavailable(
            f"`ip netns add` is not permitted here ({exc.stderr}): it needs root with "
            "CAP_SYS_ADMIN and CAP_NET_ADMIN in the machine's own namespaces (in a container: "
            "--privileged, or --cap-add SYS_ADMIN --cap-add NET_ADMIN with /run writable)"
        ) from exc


def _probe_steps(ns: str) -> list[tuple[str, list[list[str]]]]:
    """Mechanism → the commands showing it works, in order, inside namespace `ns`."""
    a = f"{ns}a"
    qdisc_del = f"tc -n {ns} qdisc del dev {a} root"
    steps = {
        "veth": [f"ip -n {ns} link add {a} type veth peer name {ns}b"],
        "bridge": [f"ip -n {ns} link add {ns}br type bridge stp_state 0"],
        "link down": [f"ip -n {ns} link set {a} up", f"ip -n {ns} link set {a} down"],
        "static neighbours": [
            f"ip -n {ns} neigh replace 10.213.0.9 lladdr 02:00:00:ff:ff:ff dev {a}"
        ],
        "tbf": [
            f"tc -n {ns} qdisc add dev {a} root tbf rate 1mbit burst 32kbit latency 50ms",
            qdisc_del,
        ],
        "htb": [f"tc -n {ns} qdisc add dev {a} root handle 1: htb", qdisc_del],
        "netem": [f"tc -n {ns} qdisc add dev {a} root netem delay 1ms", qdisc_del],
        "blackhole routes": [f"ip -n {ns} route add blackhole 10.213.0.9/32"],
        "nftables": [f"ip netns exec {ns} nft add table inet probe"],
        "iptables": [f"ip netns exec {ns} iptables -w -L -n"],
    }
    # Every word is ours (a topology id, fixed flags): splitting on spaces is exact.
    return [(mechanism, [line.split() for line in lines]) for mechanism, lines in steps.items()]


@functools.cache
def mechanisms() -> Mechanisms:
    """Probes every mechanism once per process, in a throwaway namespace, and caches the
    answer. Without root or namespaces, everything is missing, each saying why."""
    try:
        require_root()
        probe_id = new_id(PREFIX)
        record = OwnerRecord.mine(probe_id, ())
        record.write()
    except (NetnsUnavailable, OSError) as exc:
        return Mechanisms(missing=dict.fromkeys(MECHANISMS, str(exc)))
    missing: dict[str, str] = {}
    try:
        add_namespace(probe_id)
        for mechanism, steps in _probe_steps(probe_id):
            try:
                for argv in steps:
                    command(argv)
            except (CommandFailed, OSError) as exc:
                missing[mechanism] = str(exc)
    except NetnsUnavailable as exc:
        missing = dict.fromkeys(MECHANISMS, str(exc))
    finally:
        destroy(probe_id, [probe_id])
    return Mechanisms(missing=missing)
