"""Under a Manager the ring has one exchange bound, `ManagerConfig.exchange_timeout`, and a key
derived from the job's token."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.ftar import FtarConfig
from fthsdp.worker.ftar.auth import ring_key
from fthsdp.worker.manager_ring import ring_config

TOKEN = "t" * 32


def _config(exchange_timeout: timedelta = timedelta(seconds=30)) -> ManagerConfig:
    return ManagerConfig(
        job_id="job",
        replica_id="r0",
        replica_index=0,
        total_replicas=2,
        quorum_address="127.0.0.1:1",
        checkpoint_url="http://127.0.0.1:2",
        token=TOKEN,
        exchange_timeout=exchange_timeout,
    )


def test_the_managers_bound_and_the_jobs_key_replace_the_rings_defaults() -> None:
    ring = ring_config(_config(), None)
    assert ring.exchange_timeout == timedelta(seconds=30)
    assert ring.auth_key == ring_key(TOKEN)


def test_a_short_bound_shortens_the_chunk_timeout_with_it() -> None:
    ring = ring_config(_config(timedelta(seconds=3)), FtarConfig())
    assert ring.exchange_timeout == ring.chunk_timeout == timedelta(seconds=3)


def test_a_second_exchange_bound_is_refused_and_an_own_key_kept() -> None:
    with pytest.raises(ValueError, match=r"ManagerConfig\.exchange_timeout"):
        ring_config(_config(), FtarConfig(exchange_timeout=timedelta(seconds=45)))
    key = b"k" * 32
    assert ring_config(_config(), FtarConfig(auth_key=key)).auth_key == key
