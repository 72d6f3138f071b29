"""Extra bytes in the demo model's state, so its catch-up moves as much as a larger model's.

The demo's model is a few hundred kilobytes: its catch-up is over before a source notices it.
With `train.py --state-pad-mb N`, the model carries an N MiB buffer more. It travels like a
parameter does: in every snapshot and peer fetch, loaded in place after a catch-up, and covered
by the I1 fingerprint. That makes the cost of serving a recovering peer (the healthy replicas'
publish, their sidecars sending while they train, the recovering replica's load) measurable on
the real path (`bench.source_stall`)."""

from __future__ import annotations

import torch
from torch import nn

from fthsdp.deploy.demo.mixes import MAX_STATE_PAD_MB

BUFFER = "state_ballast"
"""The buffer's name in the model (so in its state: `model/state_ballast`)."""


def pattern(num_bytes: int) -> torch.Tensor:
    """The ballast's bytes: the same on every replica, and not all one value, so a catch-up that
    delivered shifted or zeroed bytes would break I1's fingerprint."""
    period = torch.arange(251, dtype=torch.uint8)  # a prime: no power-of-two shift matches
    return period.repeat(-(-num_bytes // 251))[:num_bytes].clone()


def add_ballast(model: nn.Module, mb: int) -> None:
    """Gives `model` a constant uint8 buffer of `mb` MiB that its forward never reads."""
    if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_STATE_PAD_MB:
        raise ValueError(f"state ballast must be 1..{MAX_STATE_PAD_MB} MiB, got {mb!r}")
    model.register_buffer(BUFFER, pattern(mb << 20))
