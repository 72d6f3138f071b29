"""Durable checkpoint files and position files, without a server: atomic writes, verification,
partial and corrupt steps, retention, and replay of an append-only position log."""

from __future__ import annotations

from pathlib import Path

import pytest

from fthsdp.services.checkpoint.client_manifest import Manifest, chunk_checksums, plan_layout
from fthsdp.services.checkpoint.core import PositionRecord
from fthsdp.services.checkpoint.durable import DurableStore
from fthsdp.services.checkpoint.store import FilePositionStore, MemoryPositionStore, PositionStore

CHUNK = 4096


def _rank(step: int, rank: int, world_size: int, fill: int = 0) -> tuple[Manifest, memoryview]:
    layout = plan_layout([("w", "float32", (3000,)), ("b", "uint8", (17,))])
    data = bytes((fill + step + rank + i) % 251 for i in range(layout.total_bytes))
    manifest = Manifest(
        job="j", rank=rank, step=step, layout=layout, chunk_bytes=CHUNK,
        checksums=tuple(chunk_checksums(data, CHUNK)), meta={}, world_size=world_size,
    )  # fmt: skip
    return manifest, memoryview(data)


def _write_step(
    store: DurableStore, step: int, world_size: int, ranks: range | None = None
) -> None:
    for rank in ranks if ranks is not None else range(world_size):
        store.write(*_rank(step, rank, world_size))


def test_latest_skips_missing_corrupt_and_mismatched_steps(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, retain=10, max_bytes=1 << 30)
    _write_step(store, 1, 2)
    _write_step(store, 2, 2)
    _write_step(store, 3, 2, ranks=range(1))  # rank 1 never arrived
    data = store.rank_dir("j", 2, 1) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[5000] ^= 0xFF
    data.write_bytes(bytes(raw))
    (store.rank_dir("j", 4, 0).parent / ".tmp-rank-0-xyz").mkdir(parents=True)  # died mid-write
    step, why = store.latest("j", 2)
    assert step == 1
    assert "rank 1 is missing" in why
    assert "chunk 1 of data.bin fails its checksum" in why
    assert store.latest("j", 3)[0] is None  # written for world_size 2
    (store.rank_dir("j", 1, 0) / "manifest.json").write_text("{not json")
    assert store.latest("j", 2)[0] is None


def test_rewrite_of_a_rank_replaces_it_atomically(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, retain=10, max_bytes=1 << 30)
    store.write(*_rank(1, 0, 1, fill=0))
    manifest, data = _rank(1, 0, 1, fill=9)
    store.write(manifest, data)
    assert (store.rank_dir("j", 1, 0) / "data.bin").read_bytes() == bytes(data)
    assert [p.name for p in store.rank_dir("j", 1, 0).parent.iterdir()] == ["rank-0"]


def test_retention_keeps_the_newest_complete_steps(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, retain=2, max_bytes=1 << 30)
    _write_step(store, 1, 2)
    _write_step(store, 2, 2, ranks=range(1))  # abandoned partial, older than what is kept
    _write_step(store, 3, 2)
    _write_step(store, 4, 2)
    _write_step(store, 5, 2, ranks=range(1))  # newer partial: maybe still being written
    assert store.apply_retention("j") == [1, 2]
    assert store.steps("j") == [3, 4, 5]
    assert store.latest("j", 2)[0] == 4


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_position_stores(kind: str, tmp_path: Path) -> None:
    store: PositionStore = (
        MemoryPositionStore() if kind == "memory" else FilePositionStore(tmp_path)
    )
    store.append("j", "r0", PositionRecord(1, {"a": 1}))
    store.append("j", "r0", PositionRecord(3, {"a": 3}))
    assert store.at("j", "r0", 2) == PositionRecord(1, {"a": 1})
    assert store.at("j", "r0", None) == PositionRecord(3, {"a": 3})
    assert store.at("j", "r1", None) is None


def test_file_positions_replay_and_skip_a_torn_line(tmp_path: Path) -> None:
    store = FilePositionStore(tmp_path)
    for step in (1, 2, 3):
        store.append("j", "r0", PositionRecord(step, {"a": step}))
    store.close()
    with (tmp_path / "j" / "r0.jsonl").open("a") as f:
        f.write('{"step": 4, "posi')  # a crash mid-append
    replayed = FilePositionStore(tmp_path)
    assert replayed.at("j", "r0", None) == PositionRecord(3, {"a": 3})
    assert replayed.at("j", "r0", 2) == PositionRecord(2, {"a": 2})
    replayed.append("j", "r0", PositionRecord(4, {"a": 4}))
    again = FilePositionStore(tmp_path)
    assert again.at("j", "r0", None) == PositionRecord(4, {"a": 4})
