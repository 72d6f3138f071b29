"""The demo's run log has one schema: every event the writers write reads back as the same typed
event, and every kind has a reader (a `launch` line was once written and silently dropped)."""

from __future__ import annotations

import typing
from pathlib import Path

from fthsdp.deploy.demo import events as ev

EXAMPLES: list[ev.Event] = [
    ev.StartEvent(t=1.0, replica="r0", step=7, pid=4242),
    ev.CommitEvent(
        t=2.0,
        replica="r0",
        step=8,
        quorum_id=3,
        healthy=("r0", "r1"),
        recovered=False,
        trained={"r0": (0, 4), "r1": (4, 8)},
        loss=1.25,
        tokens=256,
        attempts=2,
        seconds={"quorum": 0.001, "vote": 0.002, "total": 0.03},
        without_control_plane=True,
        samples=(3, 1, 4),
    ),
    ev.FinalEvent(t=3.0, replica="r1", step=9, fingerprint="ab" * 32),
    ev.RunEvent(
        t=0.5,
        replicas=("r0", "r1"),
        world_size=2,
        kill_every_s=None,
        kill_mode="slow",
        seed=1,
        samples_per_step=4,
        total_replicas=2,
        min_replicas=1,
    ),
    ev.InjectEvent(t=4.0, replica=None, mode="quorum", rank=None),
    ev.ExitEvent(t=5.0, replica="r1", rank=1, code=-9),
    ev.LaunchEvent(t=0.6, replica="r1"),
    ev.RestartEvent(t=6.0, replica="r1", spare=True),
    ev.QuorumEvent(t=7.0, quorum_id=4, members=("r0", "r1"), healthy=("r0",), max_step=9),
    ev.RollbackEvent(t=8.0, replica="r1"),
    ev.EndEvent(t=9.0),
    ev.SparesEvent(t=10.0, warm=2),
]


def test_every_event_class_has_an_example_and_a_reader() -> None:
    classes = set(typing.get_args(ev.ReplicaEvent)) | set(typing.get_args(ev.SupervisorEvent))
    assert {type(e) for e in EXAMPLES} == classes
    assert {cls.kind for cls in classes} == set(ev._PARSERS)


def test_what_the_writer_writes_reads_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = ev.EventLog(path)
    for event in EXAMPLES:
        log.write(event)
    log.close()
    assert ev.JsonlTail(path).poll(final=True) == EXAMPLES


def test_an_event_written_without_a_time_is_stamped_now() -> None:
    assert ev.EndEvent().t > 1e9


def test_a_tail_skipped_to_the_end_reads_only_what_is_appended_after(tmp_path: Path) -> None:
    path = tmp_path / "r0.jsonl"
    log = ev.EventLog(path)
    log.write(EXAMPLES[0])
    log.write(EXAMPLES[1])
    tail = ev.JsonlTail(path)
    tail.skip_to_end()
    assert tail.poll() == []
    log.write(EXAMPLES[2])
    log.close()
    assert tail.poll() == [EXAMPLES[2]]


def test_a_tail_skipped_to_the_end_of_a_missing_file_reads_it_from_the_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r0.jsonl"
    tail = ev.JsonlTail(path)
    tail.skip_to_end()
    log = ev.EventLog(path)
    log.write(EXAMPLES[0])
    log.close()
    assert tail.poll() == [EXAMPLES[0]]
