"""A settled service process: start-up objects frozen, young collections spaced out. Run in a
child interpreter: the test process keeps its own collector settings."""

from __future__ import annotations

import json
import subprocess
import sys

from fthsdp.services.common import gc_tuning


def test_settle_freezes_what_exists_and_spaces_out_collections() -> None:
    code = (
        "import gc, json\n"
        "from fthsdp.services.common import gc_tuning\n"
        "before = gc.get_threshold()\n"
        "gc_tuning.settle()\n"
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    before, after, frozen = json.loads(out)
    assert after == [gc_tuning.YOUNG_THRESHOLD, before[1], before[2]]
    assert frozen > 1000  # at least the imported modules' objects
