"""The tests' redis-server: `deploy.local_redis.LocalRedis` (a real server on a free port, killable
and restartable with its data). `tests/conftest.py` starts one per test that asks for
`redis_server`; in CI a missing redis-server fails instead of skipping."""

from __future__ import annotations

from fthsdp.deploy.local_redis import LocalRedis as RedisServer
from fthsdp.deploy.local_redis import redis_binary

__all__ = ["RedisServer", "redis_binary"]
