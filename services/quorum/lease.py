"""Leader election for quorum service instances through a Redis lease with a fencing epoch.

One key holds the lease (`<epoch>|<holder>|<address>`, with a TTL); one counter hands out
epochs. Acquiring increments the counter, so every leadership has a larger epoch than the one
before, and the store's fenced writes (`store_redis.py`) refuse a deposed leader.

Safety does not depend on clocks agreeing across machines, only on clock *rates*: a leader
trusts its lease until `sent + ttl * (1 - drift_margin)`, where `sent` is its own monotonic
time just before the request that set the TTL. Redis started the TTL later than `sent`, so the
leader always gives up before Redis could hand the lease to anyone else, even when it cannot
reach Redis at all (a partition).

Stopping is bounded whatever Redis does: no Redis call made while stopping is waited on for longer
than one lease `ttl`. A lease that cannot be released in that time is left to expire (it lives
at most `ttl` more, and the fencing epoch refuses its holder's writes once anyone else has
acquired it), so waiting longer would buy nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

# KEYS[1] lease, KEYS[2] epoch counter; ARGV[1] holder, ARGV[2] ttl ms, ARGV[3] address,
# ARGV[4] epoch floor (wall clock ms): a Redis that lost its data must not restart epochs at 1,
# or clients that saw a larger epoch would reject every new leader.
_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then return {0, current} end
if not redis.call('GET', KEYS[2]) then redis.call('SET', KEYS[2], ARGV[4]) end
local epoch = redis.call('INCR', KEYS[2])
local value = epoch .. '|' .. ARGV[1] .. '|' .. ARGV[3]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {epoch, value}
"""
# KEYS[1] lease; ARGV[1] our value, ARGV[2] ttl ms
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseConfig:
    """Timing of the lease."""

    ttl: timedelta = timedelta(seconds=1)
    """How long a lease lives without renewal. A standby takes over at most `ttl` plus
    `poll_interval` after the leader dies; 1 s keeps failover under the 2 s target."""
    renew_interval: timedelta = timedelta(milliseconds=200)
    """How often the leader renews: several tries fit in one `ttl`, so one slow round trip does
    not depose it."""
    poll_interval: timedelta = timedelta(milliseconds=100)
    """How often a standby tries to acquire."""
    drift_margin: float = 0.1
    """Fraction of `ttl` the leader gives up early, for clock-rate differences."""

    def __post_init__(self) -> None:
        if self.ttl <= timedelta(0) or self.renew_interval <= timedelta(0):
            raise ValueError("lease ttl and renew_interval must be positive")
        if self.renew_interval * 2 > self.ttl:
            raise ValueError("renew_interval must be at most half the lease ttl")
        if self.poll_interval <= timedelta(0):
            raise ValueError("poll_interval must be positive")
        if not 0.0 <= self.drift_margin < 0.5:
            raise ValueError("drift_margin must be in [0, 0.5)")


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseHolder:
    """Who holds the lease."""

    epoch: int
    holder: str
    address: str


def parse_holder(value: str | bytes) -> LeaseHolder:
    """Parses the lease key's value (ValueError when malformed)."""
    text = value.decode() if isinstance(value, bytes) else value
    epoch, holder, address = text.split("|", 2)
    return LeaseHolder(epoch=int(epoch), holder=holder, address=address)


class RedisLease:
    """The lease operations for one instance (`holder`, reachable at `address`)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str, holder: str, address: str) -> None:
        if "|" in holder:
            raise ValueError("holder must not contain '|'")
        self._redis = client
        tag = "{" + prefix + "}"
        self.key = f"{tag}:leader"
        self.epoch_key = f"{tag}:fence"
        self.holder = holder
        self.address = address
        self._value: str | None = None
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @property
    def held(self) -> bool:
        """Whether this instance acquired the lease and has not released it (as far as it
        knows: Redis may have expired it since)."""
        return self._value is not None

    async def try_acquire(self, ttl: timedelta) -> int | None:
        """The new epoch when this instance now holds the lease; None when another does."""
        epoch, value = await self._acquire(
            keys=[self.key, self.epoch_key],
            args=[self.holder, _ms(ttl), self.address, time.time_ns() // 1_000_000],
        )
        if int(epoch) == 0:
            return None
        self._value = value.decode() if isinstance(value, bytes) else str(value)
        return int(epoch)

    async def renew(self, ttl: timedelta) -> bool:
        """Extends the lease; False when it is no longer ours."""
        if self._value is None:
            return False
        return bool(await self._renew(keys=[self.key], args=[self._value, _ms(ttl)]))

    async def release(self) -> None:
        """Gives the lease up at once (graceful stop), so a standby need not wait for the TTL."""
        value, self._value = self._value, None
        if value is not None:
            await self._release(keys=[self.key], args=[value])

    async def holder_now(self) -> LeaseHolder | None:
        """The current holder as Redis sees it."""
        raw = await self._redis.get(self.key)
        return None if raw is None else parse_holder(raw)


async def _settle(future: asyncio.Future[None], bound: float, what: str) -> None:
    """Waits up to `bound` seconds for `future` (already cancelled or finishing) and logs how it
    ended. Unlike awaiting it under `suppress(CancelledError)`, this neither absorbs a
    cancellation of the caller nor waits without end on a task that does not finish."""
    await asyncio.wait({future}, timeout=bound)
    if not future.done():
        log.error("%s did not end within %.1f s of stopping; not waiting for it", what, bound)
    elif not future.cancelled() and future.exception() is not None:
        log.error("%s failed while stopping", what, exc_info=future.exception())


def _ms(value: timedelta) -> int:
    return max(1, int(value.total_seconds() * 1000))


class Leadership:
    """Runs the election for one instance: acquire as a standby, renew as the leader, step down
    when the lease can no longer be trusted (see the module doc). `on_elected(epoch)` runs before
    the instance answers as leader; `on_deposed(reason)` runs as soon as it must stop."""

    def __init__(
        self,
        lease: RedisLease,
        config: LeaseConfig,
        *,
        on_elected: Callable[[int], Awaitable[None]],
        on_deposed: Callable[[str], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lease = lease
        self._config = config
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._clock = clock
        self._epoch: int | None = None
        self._valid_until = 0.0
        self._step_down = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deposing: asyncio.Future[None] | None = None
        self._stopped = False

    @property
    def epoch(self) -> int | None:
        """The epoch of this instance's leadership; None while it is a standby."""
        return self._epoch

    def start(self) -> None:
        """Starts the election loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="quorum-leadership")

    def step_down(self) -> None:
        """Asks the loop to give up leadership now (a fenced write showed it is stale)."""
        self._step_down.set()

    async def stop(self) -> None:
        """Ends the loop; a leader steps down and releases the lease. Each wait is bounded by
        the lease `ttl` (see the module doc), so this returns even when Redis is unreachable."""
        self._stopped = True
        bound = self._config.ttl.total_seconds()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await _settle(task, bound, "the election loop")
        if self._deposing is not None:
            # A step-down the cancellation interrupted goes on in its own task (see _depose):
            # the coordinator is closed before stop() returns.
            await _settle(self._deposing, bound, "stepping down")
        if self._epoch is not None:
            await _settle(asyncio.ensure_future(self._depose("stopping")), bound, "stepping down")
        if self._lease.held:
            await self._release()

    async def _run(self) -> None:
        # The flag, besides the cancellation, ends the loop: a stopping instance must never
        # campaign again, even if a cancellation was absorbed somewhere below.
        while not self._stopped:
            if self._epoch is None:
                await self._campaign()
            else:
                await self._hold()

    async def _release(self) -> None:
        """Releases the lease within one `ttl`, or leaves it to expire (module doc)."""
        try:
            await asyncio.wait_for(self._lease.release(), timeout=self._config.ttl.total_seconds())
        except Exception as exc:  # whatever went wrong, the lease expires by itself
            log.info("lease not released, left to expire: %s", exc or type(exc).__name__)

    async def _campaign(self) -> None:
        ttl = self._config.ttl
        sent = self._clock()
        try:
            epoch = await asyncio.wait_for(
                self._lease.try_acquire(ttl), timeout=ttl.total_seconds()
            )
        except (TimeoutError, OSError, aioredis.RedisError) as exc:
            log.debug("lease acquire failed: %s", exc)
            epoch = None
        if epoch is None:
            await asyncio.sleep(self._config.poll_interval.total_seconds())
            return
        if self._stopped:  # acquired as stop() came: no takeover; stop() releases it
            return
        self._valid_until = sent + self._trusted()
        self._step_down.clear()
        self._epoch = epoch
        log.warning("elected quorum leader", extra={"leader_epoch": epoch})
        try:
            await self._on_elected(epoch)
        except Exception:
            log.exception("taking over as leader failed; stepping down")
            await self._depose("takeover failed")
            await self._release()

    async def _hold(self) -> None:
        """One renewal period of a leader."""
        wait = min(self._config.renew_interval.total_seconds(), self._valid_until - self._clock())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._step_down.wait(), timeout=max(0.0, wait))
        if self._step_down.is_set():
            await self._depose("fenced by a newer leader")
            return
        sent = self._clock()
        remaining = self._valid_until - sent
        if remaining <= 0:
            await self._depose("lease not renewed in time")
            return
        try:
            renewed = await asyncio.wait_for(self._lease.renew(self._config.ttl), timeout=remaining)
        except (TimeoutError, OSError, aioredis.RedisError) as exc:
            log.debug("lease renewal failed: %s", exc)
            if self._clock() >= self._valid_until:
                await self._depose(f"lease not renewed in time ({exc or type(exc).__name__})")
            return
        if not renewed:
            await self._depose("the lease was lost")
            return
        self._valid_until = sent + self._trusted()

    async def _depose(self, reason: str) -> None:
        if self._epoch is None:
            return
        epoch, self._epoch = self._epoch, None
        log.warning("stepping down as quorum leader: %s", reason, extra={"leader_epoch": epoch})
        # The step-down runs in a task of its own, shielded: a stop() that cancels this loop
        # meanwhile must neither leave the coordinator half closed nor have its cancellation
        # absorbed by the step-down's own awaits (Coordinator.close() awaits its cancelled
        # sweeper and suppresses CancelledError, which swallowed stop()'s cancellation here and
        # kept the loop campaigning, so stop() never returned while Redis was unreachable).
        self._deposing = asyncio.ensure_future(self._on_deposed(reason))
        await asyncio.shield(self._deposing)
        self._deposing = None

    def _trusted(self) -> float:
        return self._config.ttl.total_seconds() * (1.0 - self._config.drift_margin)
