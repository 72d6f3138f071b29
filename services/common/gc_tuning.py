"""Garbage collection for a long-running service process that holds large, long-lived state.

A control-plane service keeps one object graph per replica, rank and stream for hours, and
allocates a little per request. With the interpreter's defaults (a young collection every 700
allocations, a full one every 100 young ones) the full collections walk that whole graph again
and again: at 1,536 replicas the quorum service spent a third of its CPU in the collector. The
service entry points call `settle` once started: what exists then is frozen out of the
collector's reach, and young collections run every 50,000 allocations instead of 700. Only the
entry points do: an embedding process (a test, a user's program) keeps its own settings."""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
"""Allocations between young collections (the interpreter's default is 700)."""


def settle() -> None:
    """Collects once, moves every surviving object to the permanent generation (never scanned
    again: start-up state, imported modules) and spaces out later collections. Cyclic garbage
    made afterwards is still collected."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
