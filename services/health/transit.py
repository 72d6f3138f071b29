"""Batches that arrive long after they were sent.

Decoding rebases a batch's times by `now - sent_at` (`client_codec`), as if it had no transit
delay. A request held up in the network arrives looking fresh: behind a cut link, the forwards an
agent gave up on still sit in its TCP send queue, and are delivered when the link returns. Their
node states then claim, as of now, that ranks beat at steps seconds old; if the agent's next
forward comes later than a heartbeat timeout (it backs off while failing), the central service
finds those ranks silent on a live agent's node and evicts a healthy replica.

Between two batches of one sender the clocks' offset barely moves, so the growth of
`now - sent_at` over the sender's quickest recent batch is transit delay. A batch more than
`LATE_S` late is refused (its sender gave up on it long ago; an agent sends the incidents of a
failed forward again). The reference follows the quickest batches (down at once, up slowly with
clock drift); a sender refused without a break for `RESYNC_S` had its clock stepped back, and
its latest offset becomes the reference."""

from __future__ import annotations

from dataclasses import dataclass

LATE_S = 2.0
"""Transit delay beyond which a batch is refused: past the senders' 1 s deadlines, with room for
a loaded receiver's event loop."""
RESYNC_S = 10.0
"""How long a sender is refused without a break before its clock is taken to have stepped."""
_FOLLOW = 0.05
"""Share of an on-time batch's extra delay the reference moves up by (clock drift)."""
MAX_SENDERS = 200_000
"""Senders remembered (least recently heard forgotten first): a first batch is always on time."""


@dataclass(slots=True)
class _Sender:
    reference: float
    """The sender's clock offset plus its quickest recent transit (receiver minus sender)."""
    refused_since: float | None = None


class TransitDelays:
    """Per sender, how late each batch is against its quickest recent ones."""

    def __init__(self) -> None:
        self._senders: dict[tuple[str, str], _Sender] = {}

    def late(self, sender: tuple[str, str], offset: float, now: float) -> float | None:
        """None when a batch whose `now - sent_at` is `offset` is on time; otherwise the seconds
        it spent in transit beyond the sender's quickest recent batch (refuse it)."""
        entry = self._senders.pop(sender, None)
        if entry is None:
            entry = _Sender(reference=offset)
            if len(self._senders) >= MAX_SENDERS:
                del self._senders[next(iter(self._senders))]
        self._senders[sender] = entry  # most recently heard last
        delay = offset - entry.reference
        if delay <= LATE_S:
            entry.reference = offset if delay < 0 else entry.reference + _FOLLOW * delay
            entry.refused_since = None
            return None
        if entry.refused_since is None:
            entry.refused_since = now
        elif now - entry.refused_since >= RESYNC_S:
            entry.reference, entry.refused_since = offset, None
            return None
        return delay
