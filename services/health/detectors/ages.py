"""The open collectives by age, so that the hang check looks only at the ones old enough to hang.

Every open collective is in exactly one phase:

- young: first entered less than the hang timeout ago. They also sit in a heap by first entry,
  so an evaluation takes out only the ones that came of age since the last one and never looks
  at the others: 5,000 young collectives cost one comparison with the top of the heap.
- ripe: older than the hang timeout; the hang check resolves these on every evaluation.
- settled: part of a hang whose culprit was named. What it shows later is that verdict's
  aftermath (the core's rule), so it is not resolved again.
- idle: older than the hang timeout and nobody is inside it (every entrant left): it blocks
  nobody, whoever never entered it.

A record that changes a settled or idle collective (a member entered or left it, or left the
group) makes it ripe again: its verdict may have changed.

Ripe, settled and idle keep insertion order, and collectives join them from the heap in the order
of their first entry, so the ones older than the retention are at their fronts and expiry costs
what it removes. One that comes back on a record joins at the end, behind younger ones; it is
then expired at most one retention after it came back."""

from __future__ import annotations

import heapq
from collections import OrderedDict

Key = tuple[str, int]
"""(group, seq): one collective."""

_HEAP_SLACK = 1024
"""Stale heap entries tolerated beyond the young ones before the heap is rebuilt (entries of
collectives that completed young are left behind, not searched for)."""


class AgeQueue:
    """See the module docstring. Values are each collective's first entry time."""

    __slots__ = (
        "_gone",
        "_heap",
        "_watched",
        "idle",
        "ripe",
        "settled",
        "taken",
        "visited",
        "young",
    )

    def __init__(self) -> None:
        self.young: dict[Key, float] = {}
        """Collectives first entered less than the hang timeout ago."""
        self._heap: list[tuple[float, str, int]] = []
        """(first entry, group, seq) of the young; an entry whose collective closed, ripened or
        was first entered earlier after all is skipped when it comes up."""
        self.ripe: OrderedDict[Key, float] = OrderedDict()
        """Older than the hang timeout, to be resolved."""
        self.settled: OrderedDict[Key, float] = OrderedDict()
        """Part of a named hang: not resolved again until a record changes it."""
        self.idle: OrderedDict[Key, float] = OrderedDict()
        """Older than the hang timeout with nobody inside: not resolved until someone enters."""
        self.taken: list[Key] = []
        """The ripe collectives of the latest `take_ripe` (judged again in that evaluation)."""
        self.visited = 0
        """Collectives handed to the hang check since the start (`take_ripe`): what the
        evaluations cost, in collectives."""
        self._watched: set[Key] = set()
        """Collectives whose closing the core wants to hear of (`drain_gone`)."""
        self._gone: list[Key] = []

    def __len__(self) -> int:
        return len(self.young) + len(self.ripe) + len(self.settled) + len(self.idle)

    def opened(self, key: Key, first_start: float) -> None:
        """A new open collective."""
        self.young[key] = first_start
        heapq.heappush(self._heap, (first_start, key[0], key[1]))
        if len(self._heap) > 2 * len(self.young) + _HEAP_SLACK:
            self._heap = [(at, group, seq) for (group, seq), at in self.young.items()]
            heapq.heapify(self._heap)

    def earlier(self, key: Key, first_start: float) -> None:
        """A member's late record moved the collective's first entry earlier."""
        if key in self.young:
            self.opened(key, first_start)  # the old heap entry no longer matches: skipped
            return
        for phase in (self.ripe, self.settled, self.idle):
            if key in phase:
                phase[key] = first_start
                return

    def touched(self, key: Key) -> None:
        """A record changed the collective: a settled or idle one is judged again."""
        if not (self.settled or self.idle):
            return  # the common case, on every record: nothing is parked
        for phase in (self.settled, self.idle):
            at = phase.pop(key, None)
            if at is not None:
                self.ripe[key] = at
                return

    def closed(self, key: Key) -> None:
        """The collective completed, expired or was forgotten."""
        for phase in (self.young, self.ripe, self.settled, self.idle):
            if phase.pop(key, None) is not None:
                break
        if self._watched and key in self._watched:
            self._unwatch(key)

    def watch(self, key: Key) -> None:
        """`drain_gone` will name the collective once it closes."""
        self._watched.add(key)

    def drain_gone(self) -> list[Key]:
        """The watched collectives that closed since the last call."""
        gone, self._gone = self._gone, []
        return gone

    def _unwatch(self, key: Key) -> None:
        self._watched.discard(key)
        self._gone.append(key)

    def ripen(self, horizon: float) -> None:
        """The young first entered at or before `horizon` become ripe."""
        heap, young = self._heap, self.young
        while heap and heap[0][0] <= horizon:
            at, group, seq = heapq.heappop(heap)
            key = (group, seq)
            if young.get(key) == at:
                del young[key]
                self.ripe[key] = at

    def take_ripe(self) -> list[Key]:
        """The ripe collectives, for one pass of the hang check."""
        self.taken = list(self.ripe)
        self.visited += len(self.taken)
        return self.taken

    def settle(self, key: Key) -> None:
        """The collective is part of a named hang."""
        self._move(key, self.settled)

    def rest(self, key: Key) -> None:
        """Nobody is inside the collective."""
        self._move(key, self.idle)

    def _move(self, key: Key, to: OrderedDict[Key, float]) -> None:
        for phase in (self.ripe, self.young, self.idle, self.settled):
            at = phase.pop(key, None)
            if at is not None:
                to[key] = at
                return

    def expired(self, horizon: float) -> list[Key]:
        """Takes out the collectives past the hang timeout first entered before `horizon`."""
        out = []
        for phase in (self.ripe, self.settled, self.idle):
            while phase:
                key, at = next(iter(phase.items()))
                if at >= horizon:
                    break
                del phase[key]
                out.append(key)
                if key in self._watched:
                    self._unwatch(key)
        return out
