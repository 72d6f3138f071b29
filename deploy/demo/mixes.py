"""Choices and bounds of the demo's flags (`--seq-len-mix`, `--state-pad-mb`), torch-free so the
CLI can check them without importing torch (`corpus.PackedDataset` builds the packed mixes,
`ballast.add_ballast` the padding)."""

from __future__ import annotations

SEQ_LEN_MIXES = ("uniform", "phases", "random")
"""Document lengths of the demo's samples: `uniform`, one window of `block_size` per sample (the
default); `phases`, packed samples whose documents are short (8-32 tokens) and long (256-512
tokens) in alternating phases of `corpus.PHASE_ROUNDS` micro-batches; `random`, packed samples
whose documents are 8-512 tokens, drawn afresh for every document."""

MAX_STATE_PAD_MB = 16 * 1024
"""The most state padding a rank may carry (16 GiB): a typo should not exhaust the host."""
