"""Training state as named tensors: round trip and fingerprints (the I1 yardstick)."""

from __future__ import annotations

import torch

from fthsdp.worker.state import fingerprint, load_state_tensors, state_tensors


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


def test_fingerprint_sees_a_single_flipped_bit() -> None:
    model, opt = _trained(0)
    tensors = state_tensors(model, opt)
    before = fingerprint(tensors)
    weight = tensors["model/0.weight"]
    weight.view(torch.int32)[0, 0] ^= 1
    assert fingerprint(tensors) != before
