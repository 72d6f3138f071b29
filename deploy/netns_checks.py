"""What a network-namespace topology checks before it makes anything: its host names and a test
subnet that no route of this machine overlaps."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Sequence

from fthsdp.deploy.netns_cleanup import NetnsError, command

_HOST_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,13}[a-z0-9])?$")


class SubnetCollision(NetnsError):
    """The test subnet overlaps a route of this machine."""


def check_hosts(hosts: Sequence[str]) -> tuple[str, ...]:
    """`hosts` if they are distinct, 1-15 characters of [a-z0-9-], not starting or ending
    with '-'."""
    if not hosts:
        raise ValueError("a topology needs at least one host")
    for host in hosts:
        if not isinstance(host, str) or not _HOST_NAME.fullmatch(host):
            raise ValueError(f"host names are 1-15 characters of [a-z0-9-], got {host!r}")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"host names must be distinct: {list(hosts)}")
    return tuple(hosts)


def host_routes() -> list[tuple[str, str]]:
    """This machine's IPv4 routes, every table: (destination, device)."""
    routes = json.loads(command(["ip", "-j", "-4", "route", "show", "table", "all"]) or "[]")
    return [(str(r.get("dst", "")), str(r.get("dev", "?"))) for r in routes]


def check_subnet(subnet: str, routes: Sequence[tuple[str, str]]) -> ipaddress.IPv4Network:
    """`subnet` as a network, if it is IPv4 and overlaps none of `routes` but the default one
    (then nothing reachable from this machine can ever be confused with a test host)."""
    network = ipaddress.ip_network(subnet)
    if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 29:
        raise ValueError(f"subnet must be an IPv4 network of /29 or larger, got {subnet!r}")
    for destination, device in routes:
        if destination in ("", "default"):
            continue
        route = ipaddress.ip_network(destination, strict=False)
        if network.overlaps(route):
            raise SubnetCollision(
                f"the test subnet {subnet} overlaps this machine's route to {destination} "
                f"(dev {device}); pass another private subnet"
            )
    return network
