"""Fixtures shared by every test tier."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator

import pytest

from tests.redis_support import RedisServer, redis_binary


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """The root logger is shared by the whole session: a test that runs a CLI or bench `main()`
    in process sets its level and adds its handler (a bench sets ERROR), which would silence the
    warnings a later test listens for. Each test's changes go with it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def token() -> str:
    """A fresh bearer token per test, so no test can pass on another's credentials."""
    return secrets.token_urlsafe(24)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port, with a password; killed after the test.

    Skips only outside CI when redis-server is missing; in CI (CI=true) a missing binary fails."""
    if redis_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: scripts/bootstrap.sh should have installed it")
        pytest.skip("redis-server is not installed (run scripts/bootstrap.sh)")
    server = RedisServer(tmp_path_factory.mktemp("redis"), password=secrets.token_hex(8))
    server.start()
    yield server
    server.stop()
