"""I3 across restarts of the in-memory quorum service: epochs start above a floor."""

from __future__ import annotations

import time

from fthsdp.services.quorum.core import CoreState, form
from fthsdp.services.quorum.store import InMemoryStore, clock_epoch_floor
from tests.unit.test_quorum_core import ask, register


def test_a_floor_lifts_the_first_epoch_above_it() -> None:
    state = CoreState(epoch_floor=5_000)
    register(state, "a", 0.0)
    ask(state, "a", 0.0)
    assert form(0.0, state, reason="test", formed_unix=0.0).record.quorum_id == 5_001


def test_a_saved_quorum_above_the_floor_wins() -> None:
    state = CoreState(epoch_floor=10)
    register(state, "a", 0.0)
    ask(state, "a", 0.0)
    first = form(0.0, state, reason="test", formed_unix=0.0)
    state.apply(first, 0.0)
    restored = CoreState(last=first.record, epoch_floor=3)
    assert restored.last_quorum_id == first.record.quorum_id == 11


async def test_a_restarted_in_memory_store_never_reissues_an_epoch() -> None:
    before = InMemoryStore(epoch_floor=clock_epoch_floor())
    issued_before = await before.epoch_floor() + 1  # the first id the old service issued
    deadline = time.monotonic() + 1.0
    while clock_epoch_floor() <= issued_before and time.monotonic() < deadline:
        time.sleep(0.001)
    after = InMemoryStore(epoch_floor=clock_epoch_floor())
    assert await after.epoch_floor() >= issued_before
    assert await InMemoryStore().epoch_floor() == 0  # tests and embedders may opt out
