"""`fthsdp demo --state-pad-mb N`: N MiB more state per rank, carried like a model's own bytes
(in the snapshot, the catch-up and the I1 fingerprint), and bad sizes refused up front."""

from __future__ import annotations

import pytest
import torch

from fthsdp.deploy.demo import train
from fthsdp.deploy.demo.ballast import BUFFER, add_ballast, pattern
from fthsdp.deploy.demo.mixes import MAX_STATE_PAD_MB
from fthsdp.deploy.demo.run import DemoConfig
from fthsdp.worker.state import MODEL_PREFIX, fingerprint, load_state_tensors, state_tensors

RANK_ARGS = ["--run-dir", "x", "--total-replicas", "1", "--quorum", "q:1", "--spare"]


def test_the_ballast_is_model_state_of_the_size_asked() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    add_ballast(model, 2)
    tensors = state_tensors(model, optimizer)
    ballast = tensors[MODEL_PREFIX + BUFFER]
    assert ballast.dtype == torch.uint8 and ballast.numel() == 2 << 20
    assert torch.equal(ballast[:300], pattern(300))
    assert len(ballast.unique()) == 251  # not one value: a zeroed or shifted copy would differ


def test_a_catch_up_that_damaged_the_ballast_shows_in_the_fingerprint() -> None:
    source, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    target.load_state_dict(source.state_dict())
    for model in (source, target):
        add_ballast(model, 1)
    opts = [torch.optim.AdamW(m.parameters()) for m in (source, target)]
    sent = state_tensors(source, opts[0])
    damaged = dict(sent, **{MODEL_PREFIX + BUFFER: torch.roll(sent[MODEL_PREFIX + BUFFER], 1)})
    load_state_tensors(target, opts[1], damaged)
    assert fingerprint(state_tensors(target, opts[1])) != fingerprint(sent)
    load_state_tensors(target, opts[1], sent)
    assert fingerprint(state_tensors(target, opts[1])) == fingerprint(sent)


@pytest.mark.parametrize("mb", [0, -1, MAX_STATE_PAD_MB + 1, True])
def test_a_bad_size_is_refused(mb: int) -> None:
    with pytest.raises(ValueError, match="ballast"):
        add_ballast(torch.nn.Linear(1, 1), mb)


def test_the_demo_and_the_rank_check_the_flag_before_starting_anything() -> None:
    assert DemoConfig(state_pad_mb=64).state_pad_mb == 64
    with pytest.raises(ValueError, match="state_pad_mb"):
        DemoConfig(state_pad_mb=-1)
    assert train.parse_args([*RANK_ARGS, "--state-pad-mb", "16"]).state_pad_mb == 16
    assert train.parse_args(RANK_ARGS).state_pad_mb == 0
    with pytest.raises(SystemExit):
        train.parse_args([*RANK_ARGS, "--state-pad-mb", str(MAX_STATE_PAD_MB + 1)])
