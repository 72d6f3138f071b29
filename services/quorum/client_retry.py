"""The retry rule of one logical call to the quorum service, without I/O.

Both clients (blocking and asyncio) drive the same `CallRetry`: it says which instance to ask and
with what timeout, and after a refusal (UNAVAILABLE, or an answer from a deposed leader) whether
to ask the next instance at once, wait first, or give up. Only the clients do RPCs and sleeps, so
the rule is tested on its own with a fake clock."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fthsdp.services.quorum.client_failover import Failover
from fthsdp.services.quorum.domain import QuorumError, QuorumTimeoutError


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a call: the instance (an index into the failover's addresses) and its RPC
    timeout in seconds."""

    index: int
    timeout: float


class CallRetry:
    """One logical call's retries. A call with a `deadline` (a long poll such as `quorum()`)
    spends it across its attempts; any other call gives each attempt `rpc_timeout` and keeps
    retrying refusals for `connect_timeout`. An instance that refuses is left for the next one at
    once; the call waits a backoff delay only after every instance refused in a row. With an
    `unavailable_budget`, the call gives up once every instance refused and none has answered
    for that long (zero: each instance is tried once). All times are `time.monotonic()` seconds."""

    def __init__(
        self,
        failover: Failover,
        delays: Iterator[float],
        *,
        now: float,
        rpc_timeout: float,
        connect_timeout: float,
        deadline: float | None = None,
        unavailable_budget: float | None = None,
    ) -> None:
        self._failover = failover
        self._delays = delays
        self._rpc_timeout = rpc_timeout
        self._deadline = deadline
        self._give_up = deadline if deadline is not None else now + connect_timeout
        self._budget = unavailable_budget
        self._refused_since: float | None = None
        self._refusals = 0
        self._last: QuorumError = QuorumTimeoutError("the call's deadline passed")

    def attempt(self, now: float) -> Attempt:
        """The next try; raises the last refusal (or a timeout) once the call's deadline passed."""
        timeout = self._rpc_timeout if self._deadline is None else self._deadline - now
        if timeout <= 0:
            raise self._last
        return Attempt(self._failover.current, timeout)

    def refused(self, attempt: Attempt, error: QuorumError, now: float) -> float:
        """After `attempt` was refused with `error`: seconds to wait before the next attempt
        (0: ask the next instance at once). Raises `error` when the call gives up."""
        self._last = error
        self._failover.advance(attempt.index)
        self._refusals += 1
        if self._refused_since is None:
            self._refused_since = now
        instances = len(self._failover.addresses)
        give_up = self._give_up
        if self._budget is not None and self._refusals >= instances:
            give_up = min(give_up, self._refused_since + self._budget)
        if now >= give_up:
            raise error
        if self._refusals % instances:
            return 0.0
        return min(next(self._delays), give_up - now)
