"""Client-side failover across the instances of a quorum service (a leader and its standbys).

Clients are given every address. They stay on one until it answers UNAVAILABLE (dead, draining,
or a standby), then move to the next at once; they back off only after every address refused in
a row. Every answer carries the leader's lease epoch: an answer from an epoch lower than one
already seen comes from a deposed leader (delayed in the network, or not yet aware it lost its
lease) and is treated like UNAVAILABLE, never as a decision."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from fthsdp.services.common.parse import host_port

MAX_ADDRESSES = 16


def parse_addresses(address: str | Sequence[str]) -> tuple[str, ...]:
    """`host:port` addresses from a comma-separated string or a sequence (ValueError if none,
    too many, or one without a port)."""
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = tuple(item.strip() for item in items if item.strip())
    if not addresses:
        raise ValueError("at least one quorum service address is required")
    if len(addresses) > MAX_ADDRESSES:
        raise ValueError(f"at most {MAX_ADDRESSES} quorum service addresses")
    for item in addresses:
        try:
            host_port(item)
        except ValueError:
            raise ValueError(f"quorum service address {item!r} is not host:port") from None
    return addresses


class Failover:
    """Which address a client uses now, and the highest leader epoch it has seen (thread-safe)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = tuple(addresses)
        self._current = 0
        self._epoch = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        """Index of the address to try now."""
        return self._current

    @property
    def leader_epoch(self) -> int:
        """Highest leader epoch seen in an answer."""
        return self._epoch

    def advance(self, failed: int) -> None:
        """Moves past `failed` (unless another thread already did)."""
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self.addresses)

    def accept(self, response: Any) -> bool:
        """Whether an answer may be used: its leader epoch is not older than one already seen."""
        epoch = int(getattr(response, "leader_epoch", 0))
        with self._lock:
            if epoch < self._epoch:
                return False
            self._epoch = epoch
            return True
