"""The Redis adapter of `QuorumStore`: incarnations, membership and quorum epochs that survive the
quorum service and let a standby take over where the leader stopped.

Every write is a Lua script that first checks the fencing epoch: the store is opened with the
epoch of the lease its service holds (`lease.py`), and a write is refused with `FencedError` once
any other instance has acquired the lease since (the lease's epoch counter moved past ours). A
deposed leader therefore cannot regress membership or epochs, however late its writes arrive.
Without a lease (`fence=None`) writes are unconditional: one service, a durable store, no standby.

Keys share one hash tag (`{prefix}`), so the scripts stay valid on a Redis Cluster.

Values are JSON (never pickle); what is read back is validated by the domain constructors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fthsdp.services.quorum.core import QuorumRecord, Registration
from fthsdp.services.quorum.domain import RankEndpoint
from fthsdp.services.quorum.errors import FencedError

DEFAULT_PREFIX = "fthsdp:quorum"
_FENCED = "FENCED"

# Every script: KEYS[1] = the fence counter, ARGV[1] = our fence ("" = unfenced).
_GUARD = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED')
end
"""
_NEXT_INCARNATION = (
    _GUARD
    + """
return redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
"""
)
# ARGV[2] replica, ARGV[3] incarnation, ARGV[4] JSON registration
_PUT_MEMBER = (
    _GUARD
    + """
local current = redis.call('HGET', KEYS[2], ARGV[2])
if current then
  local inc = cjson.decode(current)['incarnation']
  if inc > tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
return 1
"""
)
_REMOVE_MEMBER = (
    _GUARD
    + """
local current = redis.call('HGET', KEYS[2], ARGV[2])
if current and cjson.decode(current)['incarnation'] == tonumber(ARGV[3]) then
  redis.call('HDEL', KEYS[2], ARGV[2])
  return 1
end
return 0
"""
)
# KEYS[2] last id, KEYS[3] history list; ARGV[2] id, ARGV[3] JSON record, ARGV[4] history size
_SAVE_QUORUM = (
    _GUARD
    + """
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[2]) < last then
  return redis.error_reply('EPOCH quorum id would go back from ' .. last .. ' to ' .. ARGV[2])
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[4]), -1)
return 1
"""
)


def registration_to_json(reg: Registration) -> str:
    """The stored form of a registration."""
    return json.dumps(
        {
            "replica_id": reg.replica_id,
            "incarnation": reg.incarnation,
            "world_size": reg.world_size,
            "ranks": [{"ftar": r.ftar, "checkpoint": r.checkpoint} for r in reg.ranks],
        },
        separators=(",", ":"),
    )


def registration_from_json(text: str | bytes) -> Registration:
    """Parses a stored registration (ValueError when it is malformed)."""
    data = _object(text)
    ranks = tuple(
        RankEndpoint(ftar=str(r["ftar"]), checkpoint=str(r["checkpoint"])) for r in data["ranks"]
    )
    return Registration(
        replica_id=str(data["replica_id"]),
        incarnation=int(data["incarnation"]),
        world_size=int(data["world_size"]),
        ranks=ranks,
    )


def record_to_json(record: QuorumRecord) -> str:
    """The stored form of a formed quorum."""
    return json.dumps(
        {
            "quorum_id": record.quorum_id,
            "round": record.round,
            "members": [[rid, inc] for rid, inc in record.members],
            "max_step": record.max_step,
            "healthy": list(record.healthy),
            "reason": record.reason,
            "formed_unix": record.formed_unix,
        },
        separators=(",", ":"),
    )


def record_from_json(text: str | bytes) -> QuorumRecord:
    """Parses a stored quorum record (ValueError when it is malformed)."""
    data = _object(text)
    return QuorumRecord(
        quorum_id=int(data["quorum_id"]),
        round=int(data["round"]),
        members=tuple((str(rid), int(inc)) for rid, inc in data["members"]),
        max_step=int(data["max_step"]),
        healthy=tuple(str(rid) for rid in data["healthy"]),
        reason=str(data["reason"]),
        formed_unix=float(data["formed_unix"]),
    )


def _object(text: str | bytes) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed stored value: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("malformed stored value: not an object")
    return data


class RedisQuorumStore:
    """`QuorumStore` on Redis, fenced by a lease epoch (see the module doc)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        fence: int | None = None,
        history_size: int = 128,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        """`on_fenced` runs when a write is refused by the fence (the owner steps down)."""
        if history_size < 1:
            raise ValueError("history_size must be >= 1")
        self._redis = client
        self._fence = "" if fence is None else str(fence)
        self._on_fenced = on_fenced
        self._history_size = history_size
        tag = "{" + prefix + "}"
        self.fence_key = f"{tag}:fence"
        self._incarnations = f"{tag}:incarnations"
        self._members = f"{tag}:members"
        self._last_id = f"{tag}:quorum_id"
        self._history = f"{tag}:history"
        self._scripts = {
            name: client.register_script(body)
            for name, body in (
                ("incarnation", _NEXT_INCARNATION),
                ("put", _PUT_MEMBER),
                ("remove", _REMOVE_MEMBER),
                ("save", _SAVE_QUORUM),
            )
        }

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[name](
                keys=[self.fence_key, *keys], args=[self._fence, *args]
            )
        except ResponseError as exc:
            text = str(exc)
            if text.startswith(_FENCED):
                if self._on_fenced is not None:
                    self._on_fenced()
                raise FencedError(
                    f"fenced: another quorum service took the lease after epoch {self._fence}"
                ) from None
            if text.startswith("EPOCH"):
                raise ValueError(text.removeprefix("EPOCH ")) from None
            raise

    async def next_incarnation(self, replica_id: str) -> int:
        return int(await self._run("incarnation", [self._incarnations], [replica_id]))

    async def put_member(self, registration: Registration) -> None:
        await self._run(
            "put",
            [self._members],
            [
                registration.replica_id,
                registration.incarnation,
                registration_to_json(registration),
            ],
        )

    async def remove_member(self, replica_id: str, incarnation: int) -> None:
        await self._run("remove", [self._members], [replica_id, incarnation])

    async def members(self) -> list[Registration]:
        raw = await self._redis.hgetall(self._members)
        return [registration_from_json(value) for value in raw.values()]

    async def save_quorum(self, record: QuorumRecord) -> None:
        await self._run(
            "save",
            [self._last_id, self._history],
            [record.quorum_id, record_to_json(record), self._history_size],
        )

    async def last_quorum(self) -> QuorumRecord | None:
        raw = await self._redis.lindex(self._history, -1)
        return None if raw is None else record_from_json(raw)

    async def epoch_floor(self) -> int:
        # A store that has never formed a quorum may be one that lost its data (Redis restarted
        # without persistence): start above the wall clock in ms, as the in-memory store does,
        # so ids a previous life handed out are never reissued (I3). With a stored quorum the
        # stored id is the floor, so a failover with unchanged membership keeps the same id and
        # no ring is rebuilt.
        stored = await self._redis.get(self._last_id)
        return int(stored) if stored is not None else time.time_ns() // 1_000_000

    async def history(self, limit: int) -> list[QuorumRecord]:
        start = -limit if limit > 0 else 0
        raw = await self._redis.lrange(self._history, start, -1)
        return [record_from_json(value) for value in raw]
