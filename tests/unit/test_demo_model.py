"""The demo's tiny GPT: deterministic construction (I1 starts at step 0), shapes, and speed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fthsdp.deploy.demo.corpus import CharDataset
from fthsdp.deploy.demo.model import TinyGPTConfig, build_model


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _state_bytes(model: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


def test_same_seed_builds_bitwise_identical_models_whatever_the_global_rng() -> None:
    config = TinyGPTConfig(vocab_size=33)
    torch.manual_seed(1)
    a = build_model(config, seed=7)
    torch.manual_seed(12345)
    torch.rand(100)
    b = build_model(config, seed=7)
    assert _state_bytes(a) == _state_bytes(b)
    c = build_model(config, seed=8)
    assert _state_bytes(a)["tok_emb.weight"] != _state_bytes(c)["tok_emb.weight"]


def test_build_model_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    build_model(TinyGPTConfig(vocab_size=10), seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_forward_shapes_and_loss() -> None:
    model = build_model(TinyGPTConfig(vocab_size=33, block_size=16), seed=0)
    idx = torch.randint(0, 33, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 33)
    assert loss is None
    _, loss = model(idx, idx)
    assert loss is not None
    # Freshly initialised logits are near zero, so the loss is near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(33.0)).item()) < 0.3


def test_output_is_causal() -> None:
    model = build_model(TinyGPTConfig(vocab_size=20, block_size=8), seed=0)
    idx = torch.randint(0, 20, (1, 8))
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 20
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[0, :-1], b[0, :-1])
    assert not torch.equal(a[0, -1], b[0, -1])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": 0},
        {"vocab_size": 10, "d_model": 63, "n_head": 2},
        {"vocab_size": 10, "dropout": 0.1},
        {"vocab_size": 10, "n_layer": 0},
    ],
)
def test_bad_config_raises_value_error(kwargs: dict[str, int | float]) -> None:
    with pytest.raises(ValueError, match="must"):
        TinyGPTConfig(**kwargs)  # type: ignore[arg-type]


def test_too_long_input_raises() -> None:
    model = build_model(TinyGPTConfig(vocab_size=10, block_size=4), seed=0)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 5, dtype=torch.int64))


@pytest.mark.usefixtures("one_thread")
def test_the_loss_falls_on_the_corpus() -> None:
    dataset = CharDataset()
    model = build_model(TinyGPTConfig(vocab_size=dataset.vocab_size), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # (A step's time is the demo's median_step_s, which bench.recovery reports.)
    losses = []
    for step in range(50):
        x, y = dataset.collate([dataset.sample(step * 4 + k) for k in range(4)])
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 3.0
    assert sum(losses[-5:]) / 5 < 2.6
