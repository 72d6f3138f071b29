"""The Redis adapter of `PositionStore`: data-position records that outlive the sidecar and its
host, shared by every sidecar of a job (a replica restarted on another host finds them).

One sorted set per (job, replica), scored by step. Appending is one Lua script that drops every
record with step ≥ the new one and adds it, so the timeline semantics of `core.PositionTimeline`
(a rewind abandons the recorded future) hold atomically, whichever sidecar writes. Durability is
Redis's: run it with `appendonly yes` and `appendfsync always` (or `everysec`, accepting the loss
of the last second on a Redis crash), as the deployment files do. Values are JSON, never pickle,
and are validated when read back."""

from __future__ import annotations

import json
from typing import cast

import redis

from fthsdp.services.checkpoint.client_errors import InvalidArgumentError
from fthsdp.services.checkpoint.client_manifest import check_id, check_step
from fthsdp.services.checkpoint.core import PositionRecord, check_position

DEFAULT_PREFIX = "fthsdp:positions"
DEFAULT_MAX_RECORDS = 100_000
"""Newest records kept per replica: far more steps than any retained durable checkpoint spans."""

# KEYS[1] the replica's sorted set; ARGV[1] step, ARGV[2] JSON record, ARGV[3] records kept
_APPEND = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[3]) - 1)
return 1
"""


class RedisPositionStore:
    """`PositionStore` on Redis (see the module doc)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_records: int = DEFAULT_MAX_RECORDS,
        timeout_s: float = 5.0,
    ) -> None:
        if max_records < 1:
            raise ValueError("max_records must be >= 1")
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._prefix = prefix
        self._max_records = max_records
        self._append = self._redis.register_script(_APPEND)

    def _key(self, job: str, replica: str) -> str:
        return f"{self._prefix}:{check_id('job', job)}:{check_id('replica', replica)}"

    def append(self, job: str, replica: str, record: PositionRecord) -> None:
        value = json.dumps({"step": record.step, "position": record.position}, sort_keys=True)
        self._append(keys=[self._key(job, replica)], args=[record.step, value, self._max_records])

    def at(self, job: str, replica: str, step: int | None) -> PositionRecord | None:
        top = "+inf" if step is None else step
        raw = self._redis.zrevrangebyscore(self._key(job, replica), top, "-inf", start=0, num=1)
        if not raw:
            return None
        try:
            data = json.loads(cast(bytes, raw[0]))
            return PositionRecord(check_step(data["step"]), check_position(data["position"]))
        except (ValueError, KeyError, TypeError, InvalidArgumentError) as exc:
            raise ValueError(f"unreadable position record in Redis: {exc}") from None

    def close(self) -> None:
        self._redis.close()
