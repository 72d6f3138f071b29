"""A warm spare's identity on the wire (`fthsdp.worker.spare`): what is accepted and refused."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from fthsdp.worker import spare
from fthsdp.worker.spare import MAX_IDENTITY_BYTES, Identity, is_spare, take_identity


def test_an_identity_survives_encoding() -> None:
    identity = Identity(
        env={"RANK": "1", "FTHSDP_REPLICA_ID": "r2"}, argv=("--x", "y"), log_file="/l"
    )
    data = identity.encode()
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert Identity.decode(data) == identity


@pytest.mark.parametrize(
    "body",
    [
        [],  # not an object
        {"env": {"RANK": 1}},  # a value that is not a string
        {"env": {"1RANK": "1"}},  # not a variable name
        {"env": {"A=B": "1"}},
        {"env": {"RANK": "a\0b"}},
        {"argv": "--x"},  # not a list
        {"argv": [1]},
        {"log_file": ""},
        {"log_file": 3},
        {"pid": 1},  # an unknown key
    ],
)
def test_a_malformed_identity_is_refused(body: object) -> None:
    with pytest.raises(ValueError, match="identity"):
        Identity.decode(json.dumps(body).encode())


def test_an_oversized_identity_is_refused_both_ways() -> None:
    big = Identity(env={"X": "x" * MAX_IDENTITY_BYTES})
    with pytest.raises(ValueError, match="at most"):
        big.encode()
    with pytest.raises(ValueError, match="at most"):
        Identity.decode(b" " * (MAX_IDENTITY_BYTES + 1))


def test_outside_a_spare_take_identity_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTHSDP_SPARE_FDS", raising=False)
    assert not is_spare()
    assert take_identity(warm=False) is None


def test_a_malformed_fd_pair_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTHSDP_SPARE_FDS", "3")
    assert is_spare()
    with pytest.raises(ValueError, match="FTHSDP_SPARE_FDS"):
        take_identity(warm=False)


def test_take_identity_warms_up_once_outside_a_spare_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTHSDP_SPARE_FDS", raising=False)
    monkeypatch.setattr(spare, "_warmed", False)
    steps = []
    real = torch.optim.AdamW

    class Recording(real):  # type: ignore[misc, valid-type]
        def step(self, closure: object = None) -> object:
            steps.append(1)
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    assert take_identity() is None
    assert take_identity() is None
    assert steps == [1]  # torch's optimizer set-up paid once, before any identity
    assert "fthsdp.worker.manager" in sys.modules
