"""Training state as named tensors: round trip and fingerprints (the I1 yardstick)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch

from fthsdp.worker.state import fingerprint, load_state_tensors, state_digest, state_tensors


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_state_round_trip_is_bitwise_and_fingerprints_agree() -> None:
    source_model, source_opt = _trained(0)
    target_model, target_opt = _trained(1)
    assert fingerprint(state_tensors(source_model, source_opt)) != fingerprint(
        state_tensors(target_model, target_opt)
    )
    load_state_tensors(target_model, target_opt, state_tensors(source_model, source_opt))
    assert fingerprint(state_tensors(target_model, target_opt)) == fingerprint(
        state_tensors(source_model, source_opt)
    )
    # The loaded optimizer keeps training identically.
    for model, opt in ((source_model, source_opt), (target_model, target_opt)):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert fingerprint(state_tensors(target_model, target_opt)) == fingerprint(
        state_tensors(source_model, source_opt)
    )


@pytest.mark.parametrize("digest", [fingerprint, state_digest])
def test_a_digest_sees_a_single_flipped_bit(
    digest: Callable[[Mapping[str, torch.Tensor]], str],
) -> None:
    model, opt = _trained(0)
    tensors = state_tensors(model, opt)
    before = digest(tensors)
    assert digest({k: v.clone() for k, v in tensors.items()}) == before  # bytes, not identity
    weight = tensors["model/0.weight"]
    weight.view(torch.int32)[0, 0] ^= 1
    assert digest(tensors) != before


def test_the_cheap_digest_covers_names_dtypes_and_shapes_not_only_bytes() -> None:
    flat = torch.arange(6, dtype=torch.int32)
    base = state_digest({"a": flat})
    assert state_digest({"b": flat}) != base
    assert state_digest({"a": flat.view(2, 3)}) != base
    assert state_digest({"a": flat.view(torch.float32)}) != base
    # The same bytes split differently between two tensors.
    assert state_digest({"a": flat[:2], "b": flat[2:]}) != state_digest(
        {"a": flat[:3], "b": flat[3:]}
    )
