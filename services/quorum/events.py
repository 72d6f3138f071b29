"""The quorum service's membership events fanned out to Watch streams: one bounded queue per
stream, and a subscriber that falls behind is cut off rather than slowing the service."""

from __future__ import annotations

import asyncio

from fthsdp.services.quorum.domain import MembershipEvent


class Subscription:
    """One Watch stream's queue of events; `None` in the queue ends the stream."""

    def __init__(
        self, size: int, *, without_joins: bool = False, replicas: frozenset[str] | None = None
    ) -> None:
        self.queue: asyncio.Queue[MembershipEvent | None] = asyncio.Queue(maxsize=size)
        self.overflowed = False
        self.holder: tuple[str, int] | None = None
        """The replica (and incarnation) this stream keeps alive, if its leader opened it."""
        self.without_joins = without_joins
        """`joined` events are not sent to it."""
        self.replicas = replicas
        """Only events about these replicas are sent to it (no `quorum` events), if set."""

    def takes(self, event: MembershipEvent) -> bool:
        """Whether `event` goes to this stream."""
        if self.replicas is not None:
            return event.replica_id in self.replicas
        return not (self.without_joins and event.kind == "joined")

    def offer(self, event: MembershipEvent | None) -> None:
        """Queues an event; a subscriber that fell `size` events behind is cut off."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)


class EventHub:
    """The open Watch streams of one coordinator."""

    def __init__(self, queue_size: int) -> None:
        self._queue_size = queue_size
        self._subscribers: set[Subscription] = set()

    @property
    def active(self) -> bool:
        """Whether any stream is open (events are built only then)."""
        return bool(self._subscribers)

    @property
    def streams(self) -> int:
        """Open streams."""
        return len(self._subscribers)

    def subscribe(
        self,
        snapshot: MembershipEvent,
        *,
        without_joins: bool = False,
        replicas: frozenset[str] | None = None,
    ) -> Subscription:
        """A new stream whose first event is `snapshot` (`Subscription` for the filters)."""
        sub = Subscription(self._queue_size, without_joins=without_joins, replicas=replicas)
        sub.offer(snapshot)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Ends delivery to a stream."""
        self._subscribers.discard(sub)

    def publish(self, event: MembershipEvent) -> None:
        """Delivers `event` to every stream that takes its kind; one that overflowed is
        dropped."""
        for sub in list(self._subscribers):
            if not sub.takes(event):
                continue
            sub.offer(event)
            if sub.overflowed:
                self._subscribers.discard(sub)

    def end_all(self) -> None:
        """Ends every stream (the service is stopping)."""
        for sub in list(self._subscribers):
            sub.offer(None)
