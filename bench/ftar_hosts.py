"""Where ``bench.ftar``'s ranks run: all on this machine's loopback, or each on a host of its own.

``netns``: every rank is a network namespace on a private bridge (:mod:`deploy.netns`, root
only), its link optionally rate-limited (``tbf``, each way), so FTAR and gloo cross a real
(if emulated) network rather than loopback. The launcher stays in the machine's namespace, which
cannot reach the bridge, so rank 0 hosts the TCPStore on its own address (a fixed port: every
namespace has the whole port space) and the others connect to it there. FTAR binds and
advertises the rank's address; gloo is told the namespace's interface (``GLOO_SOCKET_IFNAME``),
since it would otherwise resolve the hostname to a loopback address that no other host reaches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from fthsdp.deploy.netns import Topology

__all__ = [
    "DEFAULT_RATE_MBIT",
    "HOSTS",
    "STORE_PORT",
    "host_names",
    "link_gbs",
    "netns_ranks",
    "placement_flags",
    "resolve_rate",
]

HOSTS = ("loopback", "netns")
DEFAULT_RATE_MBIT = 1000.0
"""``--hosts netns`` without ``--rate-mbit``: a 1 Gbit/s link each way."""
MAX_RATE_MBIT = 100_000.0
"""`Topology.rate_limit`'s ceiling."""
STORE_PORT = 29500
"""Rank 0's TCPStore port on its host."""


def resolve_rate(hosts: str, rate_mbit: float | None) -> float | None:
    """The link rate limit in force (Mbit/s each way; 0: none; None: loopback, no links).

    ValueError for a limit on loopback (nothing to limit) or one outside [0, MAX_RATE_MBIT]."""
    if hosts not in HOSTS:
        raise ValueError(f"--hosts takes {' or '.join(HOSTS)}, got {hosts!r}")
    if hosts == "loopback":
        if rate_mbit is not None:
            raise ValueError("--rate-mbit needs --hosts netns (loopback has no link to limit)")
        return None
    rate = DEFAULT_RATE_MBIT if rate_mbit is None else rate_mbit
    if not 0 <= rate <= MAX_RATE_MBIT:
        raise ValueError(f"--rate-mbit must be in [0, {MAX_RATE_MBIT:g}] (0: no limit), got {rate}")
    return rate


def link_gbs(rate_mbit: float | None) -> float | None:
    """A link's rate in GB/s each way, the ceiling of a ring's bus bandwidth; None if unlimited."""
    return rate_mbit * 1e6 / 8 / 1e9 if rate_mbit else None


def host_names(n: int) -> list[str]:
    return [f"h{r}" for r in range(n)]


def placement_flags(rank: int, address: str, store_address: str) -> list[str]:
    """The worker flags that place one rank on its host: rank 0 hosts the store."""
    flags = ["--bind-host", address, "--store-host", store_address]
    flags += ["--store-port", str(STORE_PORT)]
    return [*flags, "--store-master"] if rank == 0 else flags


@contextmanager
def netns_ranks(
    argv: Sequence[str], n: int, rate_mbit: float, **popen: Any
) -> Iterator[list[subprocess.Popen[Any]]]:
    """Starts rank r of ``argv`` (the worker's command, without placement) on host ``h<r>`` of a
    new topology; the ranks are stopped and the namespaces removed on the way out, also after
    an error, Ctrl-C or SIGTERM. NetnsUnavailable without root."""
    hosts = host_names(n)
    with _sigterm_as_exit(), Topology.create(hosts) as topo:
        if rate_mbit:
            for host in hosts:
                topo.rate_limit(host, rate_mbit)
        store = topo.address(hosts[0])
        yield [
            topo.popen(
                host,
                [*argv, "--rank", str(r), *placement_flags(r, topo.address(host), store)],
                env={**os.environ, "GLOO_SOCKET_IFNAME": topo.interface(host)},
                **popen,
            )
            for r, host in enumerate(hosts)
        ]


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the namespaces are removed (its default ends the process
    at once and leaves them behind)."""

    def leave(signum: int, frame: FrameType | None) -> None:
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
