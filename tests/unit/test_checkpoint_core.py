"""Pure pieces of the checkpoint service: ranges, retention, restore choice, position timelines,
manifest validation, the error table, the config and the fetcher's byte mapping."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fthsdp.services.checkpoint.client_errors import (
    GoneError,
    InvalidArgumentError,
    NotFoundError,
    RangeNotSatisfiableError,
)
from fthsdp.services.checkpoint.client_fetch import _Destination
from fthsdp.services.checkpoint.client_manifest import (
    ALIGN_BYTES,
    Layout,
    Manifest,
    TensorEntry,
    check_id,
    chunk_checksums,
    plan_layout,
)
from fthsdp.services.checkpoint.config import CheckpointConfig
from fthsdp.services.checkpoint.core import (
    PositionRecord,
    PositionTimeline,
    check_position,
    checkpoint_steps_to_delete,
    choose_latest,
    parse_range,
    steps_to_collect,
)


def test_parse_range() -> None:
    assert parse_range("bytes=0-9", 100, 50) == (0, 10)
    assert parse_range("bytes=90-", 100, 50) == (90, 100)
    assert parse_range("bytes=90-1000", 100, 50) == (90, 100)
    assert parse_range(None, 40, 50) == (0, 40)
    for bad in ("bytes=0-1,3-4", "items=0-1", "bytes=-5", "bytes=a-b", "bytes=5-1x"):
        with pytest.raises(InvalidArgumentError):
            parse_range(bad, 100, 50)
    for unsatisfiable in ("bytes=100-200", "bytes=0-60", "bytes=9-3"):
        with pytest.raises(RangeNotSatisfiableError):
            parse_range(unsatisfiable, 100, 50)
    with pytest.raises(RangeNotSatisfiableError, match="send a Range"):
        parse_range(None, 100, 50)


def test_retention_decisions() -> None:
    assert steps_to_collect([5, 1, 3, 4], 2) == [1, 3]
    assert steps_to_collect([1], 2) == []
    doomed, _ = checkpoint_steps_to_delete({1: True, 2: False, 3: True, 4: True, 5: False}, 2)
    assert doomed == [1, 2]  # 5 is a newer partial, maybe still being written
    assert checkpoint_steps_to_delete({1: False, 2: False}, 2)[0] == []


def test_choose_latest_skips_bad_steps_and_says_why() -> None:
    step, why = choose_latest([(3, "rank 1 is missing"), (2, None), (1, None)])
    assert step == 2
    assert "rank 1 is missing" in why
    assert choose_latest([(3, "bad")])[0] is None
    assert choose_latest([])[0] is None


def test_position_timeline_rewinds() -> None:
    timeline = PositionTimeline()
    for step in (1, 2, 5, 6):
        timeline.apply(PositionRecord(step, {"k": step * 10}))
    assert timeline.at(4) == PositionRecord(2, {"k": 20})
    assert timeline.at(None) == PositionRecord(6, {"k": 60})
    assert timeline.at(0) is None
    timeline.apply(PositionRecord(5, {"k": 51}))  # a retry of step 5 supersedes 5 and 6
    assert timeline.at(None) == PositionRecord(5, {"k": 51})
    assert len(timeline) == 3
    with pytest.raises(InvalidArgumentError):
        check_position({str(i): 0 for i in range(65)})
    with pytest.raises(InvalidArgumentError):
        check_position({"a": 2**63})


def _entry(**changes: object) -> TensorEntry:
    values: dict[str, object] = {
        "name": "a",
        "dtype": "float32",
        "shape": (4,),
        "offset": 0,
        "nbytes": 16,
    }
    values.update(changes)
    return TensorEntry(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("entries", "total", "message"),
    [
        ([_entry(dtype="object")], 16, "not one of"),
        ([_entry(nbytes=12)], 16, "does not match"),
        ([_entry(offset=2, dtype="float32", nbytes=16)], 32, "aligned"),
        ([_entry(), _entry(name="b", offset=8, shape=(2,), nbytes=8)], 16, "overlaps"),
        ([_entry(), _entry()], 64, "twice"),
        ([_entry(offset=16)], 16, "past total_bytes"),
        ([_entry(shape=(-1,), nbytes=-4)], 16, "non-negative"),
    ],
)
def test_layout_validation(entries: list[TensorEntry], total: int, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Layout(tuple(entries), total).check(max_total_bytes=1 << 30)


def test_manifest_round_trip_and_bounds() -> None:
    layout = plan_layout([("a", "bfloat16", (3, 5)), ("b", "bool", ()), ("c", "int64", (0,))])
    assert all(t.offset % ALIGN_BYTES == 0 for t in layout.tensors)
    data = bytes(range(256)) * (layout.total_bytes // 256 + 1)
    manifest = Manifest(
        job="j", rank=1, step=2, layout=layout, chunk_bytes=16,
        checksums=tuple(chunk_checksums(data[: layout.total_bytes], 16)), meta={"a": 1},
    )  # fmt: skip
    raw = manifest.to_json()
    assert Manifest.from_json(raw, max_total_bytes=1 << 20) == manifest
    with pytest.raises(InvalidArgumentError, match="outside"):
        Manifest.from_json(raw, max_total_bytes=8)  # refused before anything is allocated
    with pytest.raises(InvalidArgumentError, match="one value per chunk"):
        Manifest.from_json({**raw, "checksums": raw["checksums"][:-1]}, max_total_bytes=1 << 20)
    other = Manifest.from_json(
        {**raw, "checksums": [0, *raw["checksums"][1:]]}, max_total_bytes=1 << 20
    )
    assert "chunk 0" in str(manifest.disagreement(other))
    assert manifest.disagreement(manifest) is None


def test_ids_refuse_paths() -> None:
    for bad in ("..", "a/b", "a..b", "", ".hidden", "x" * 65):
        with pytest.raises(InvalidArgumentError):
            check_id("job", bad)
    assert check_id("job", "job-1.a_b") == "job-1.a_b"


def test_gone_is_410_and_a_not_found() -> None:
    # Every class's code and statuses round-trip: tests/unit/test_common_errors.py.
    assert GoneError.http_status == 410
    assert issubclass(GoneError, NotFoundError)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="retain"):
        CheckpointConfig(retain_snapshots=0)
    with pytest.raises(ValueError, match="max_range_bytes"):
        CheckpointConfig(chunk_bytes=1 << 20, max_range_bytes=4096)
    with pytest.raises(ValueError, match="checksum_wait"):
        CheckpointConfig(checksum_wait=timedelta(0))
    with pytest.raises(ValueError, match="port"):
        CheckpointConfig(port=70000)


@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    chunk=st.integers(1, 200),
)
def test_destination_pieces_cover_every_byte_once(sizes: list[int], chunk: int) -> None:
    layout = plan_layout([(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)])
    manifest = Manifest(
        job="j", rank=0, step=0, layout=layout, chunk_bytes=chunk,
        checksums=tuple(0 for _ in range(-(-layout.total_bytes // chunk))), meta={},
    )  # fmt: skip
    into = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    dest = _Destination(manifest, into)
    source = bytes((i * 7 + 3) % 256 for i in range(layout.total_bytes))
    scratch = memoryview(bytearray(chunk))
    for start in range(0, layout.total_bytes, chunk):
        stop = min(start + chunk, layout.total_bytes)
        pieces = dest.pieces(start, stop, scratch)
        assert sum(len(p) for p in pieces) == stop - start
        at = start
        for piece in pieces:
            piece[:] = source[at : at + len(piece)]
            at += len(piece)
    for entry in layout.tensors:
        want = source[entry.offset : entry.offset + entry.nbytes]
        assert into[entry.name].numpy().tobytes() == want
