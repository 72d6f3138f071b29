"""Converting a plain DDP or FSDP2 script to fthsdp takes at most 15 changed lines of code."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_CHANGED_LINES = 15


def _code(path: Path) -> list[str]:
    """The script without its module docstring (the usage notes differ on purpose)."""
    text = path.read_text()
    assert text.startswith('"""'), path
    return text.split('"""', 2)[2].splitlines()


def changed_lines(before: list[str], after: list[str]) -> int:
    """Lines added, removed or rewritten: a rewritten block of n old and m new lines counts
    max(n, m)."""
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    return sum(
        max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"
    )


def test_changed_lines_counts_rewrites_once() -> None:
    assert changed_lines(["a", "b", "c"], ["a", "B", "c"]) == 1
    assert changed_lines(["a", "b"], ["a", "x", "y", "b"]) == 2
    assert changed_lines(["a", "b", "c"], ["c"]) == 2


@pytest.mark.parametrize("name", ["ddp_train", "fsdp2_train"])
def test_the_fthsdp_version_changes_at_most_15_lines(name: str) -> None:
    plain = _code(EXAMPLES / f"{name}.py")
    converted = _code(EXAMPLES / f"{name}_fthsdp.py")
    assert changed_lines(plain, converted) <= MAX_CHANGED_LINES
    # ... and the rest is really the same script: the training loop is untouched.
    for line in ("        loss.backward()", "        optimizer.step()", "        scheduler.step()"):
        assert line in plain and line in converted
