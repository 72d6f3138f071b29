"""User state as tensors + JSON: exact round trips, refusals naming the key, hostile documents."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from fthsdp.worker.rng_state import RNGState
from fthsdp.worker.state import DOCUMENT, ReplicatedState
from fthsdp.worker.state_codec import (
    MAX_DEPTH,
    decode_tree,
    document_tensor,
    encode_tree,
    read_document,
)


def _round_trip(value: Any) -> Any:
    tree, tensors = encode_tree(value, prefix="x/", name="v")
    document = read_document(document_tensor(tree))
    return decode_tree(document, {k: v.clone() for k, v in tensors.items()})


def test_trees_come_back_exactly_with_tuples_odd_keys_and_non_finite_floats() -> None:
    value = {
        "lrs": [0.1, 1e-300, float("inf"), -float("inf")],
        "shape": (2, (3, 4)),
        "by_index": {0: "a", 7: None, "s": True},
        "$looks_tagged": 1,
        "weights": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "nested": [{"t": torch.tensor([1, 2], dtype=torch.int8)}],
    }
    back = _round_trip(value)
    assert back["lrs"][:2] == [0.1, 1e-300] and back["lrs"][2:] == [float("inf"), -float("inf")]
    assert back["shape"] == (2, (3, 4)) and isinstance(back["shape"][1], tuple)
    assert back["by_index"] == {0: "a", 7: None, "s": True}
    assert back["$looks_tagged"] == 1
    assert torch.equal(back["weights"], value["weights"])
    assert back["weights"].dtype == torch.float64
    assert torch.equal(back["nested"][0]["t"], value["nested"][0]["t"])
    nan = _round_trip(float("nan"))
    assert nan != nan


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"fn": print}, "['fn']"),
        ({"a": [1, {"arr": np.zeros(2)}]}, "['a'][1]['arr']"),
        ({"k": {object(): 1}}, "['k']"),
        ({"m": torch.nn.Linear(1, 1)}, "['m']"),
    ],
)
def test_unsupported_values_are_refused_naming_the_key(value: Any, where: str) -> None:
    with pytest.raises(TypeError) as raised:
        encode_tree(value, prefix="x/", name="sched")
    assert "'sched'" in str(raised.value) and where in str(raised.value)


def test_hostile_documents_fail_cleanly() -> None:
    def doc(raw: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw.encode()), dtype=torch.uint8)

    with pytest.raises(ValueError, match="missing tensor"):
        decode_tree(read_document(doc('{"$tensor": "nope"}')), {})
    with pytest.raises(ValueError, match="unknown tag"):
        decode_tree(read_document(doc('{"$pickle": "x", "y": 1}')), {})
    with pytest.raises(ValueError):
        read_document(doc('{"x": NaN}'))
    with pytest.raises(ValueError, match="deeper"):
        decode_tree(json.loads("[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2)), {})
    with pytest.raises(ValueError, match="nests too deeply"):
        read_document(doc("[" * 100_000 + "]" * 100_000))
    with pytest.raises(ValueError, match="uint8"):
        read_document(torch.zeros(3))


def test_rng_state_restores_every_generator_from_views_into_one_buffer() -> None:
    """As received: every tensor a view at an offset into one fetch buffer."""
    rng = RNGState()
    tree, tensors = encode_tree(rng.state_dict(), prefix="x/", name="rng")
    flat = torch.zeros(8 + sum(-(-t.numel() * t.element_size() // 8) * 8 for t in tensors.values()),
                       dtype=torch.uint8)  # fmt: skip
    views, offset = {}, 8
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        piece = flat[offset : offset + size].view(tensor.dtype).reshape(tensor.shape)
        piece.copy_(tensor)
        views[key], offset = piece, offset + -(-size // 8) * 8
    saved = decode_tree(read_document(document_tensor(tree)), views)
    first = (random.random(), np.random.rand(), torch.rand(2))
    rng.load_state_dict(saved)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def test_replicated_state_carries_the_optimizers_scheduled_lr_and_user_objects() -> None:
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    source = ReplicatedState(model, optimizer, {"sched": scheduler})
    tensors = {k: v.clone() for k, v in source.tensors().items()}

    target_model, target_optimizer = _model_and_optimizer()
    target_scheduler = torch.optim.lr_scheduler.StepLR(target_optimizer, step_size=1, gamma=0.1)
    target = ReplicatedState(target_model, target_optimizer, {"sched": target_scheduler})
    target.load(tensors)
    assert target_optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    assert target_scheduler.state_dict() == scheduler.state_dict()
    # Chainable schedulers compute from the group's current lr: the next steps agree too.
    target_scheduler.step()
    scheduler.step()
    assert target_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]

    forged = read_document(tensors[DOCUMENT])
    forged["optim_groups"][0]["params"] = [0]
    with pytest.raises(ValueError, match="keys this optimizer does not"):
        target.load({**tensors, DOCUMENT: document_tensor(forged)})
    with pytest.raises(ValueError, match="user state names differ"):
        ReplicatedState(*_model_and_optimizer()).load(tensors)
    del tensors[DOCUMENT]
    with pytest.raises(ValueError, match="no document"):
        target.load(tensors)


class _Fixed:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_replicated_state_refuses_bad_objects_at_construction() -> None:
    model, optimizer = _model_and_optimizer()
    other = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="scheduler of another optimizer"):
        ReplicatedState(model, optimizer, {"s": torch.optim.lr_scheduler.StepLR(other, 1)})

    class Bad:
        def state_dict(self) -> dict[str, Any]:
            return {"ok": 1, "callback": lambda: None}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(TypeError, match=r"'bad'\['callback'\] is a function"):
        ReplicatedState(model, optimizer, {"bad": Bad()})
    with pytest.raises(TypeError, match=r"'u'\['k'\] is a torch.uint32 tensor"):
        ReplicatedState(model, optimizer, {"u": _Fixed({"k": torch.zeros(2, dtype=torch.uint32)})})
    ReplicatedState(model, optimizer, {"rng": RNGState()})  # its tensors are all carried
    with pytest.raises(TypeError, match="no state_dict"):
        ReplicatedState(model, optimizer, {"x": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="state name"):
        ReplicatedState(model, optimizer, {"a/b": RNGState()})


def test_replicas_seeding_their_generators_alike_hold_the_same_state_bytes() -> None:
    """What two catch-up sources compare: each replica's encoded generator state. Seeded alike
    (as every replica must be), it is the same bytes in two processes; unseeded, Python's and
    NumPy's start from OS entropy, so two replicas' snapshots would disagree."""
    script = (
        "import sys, torch\n"
        "from fthsdp.worker.rng_state import RNGState\n"
        "from fthsdp.worker.state_codec import document_tensor, encode_tree\n"
        "seed = None if sys.argv[1] == 'none' else int(sys.argv[1])\n"
        "tree, tensors = encode_tree(RNGState(seed=seed).state_dict(), prefix='x/', name='rng')\n"
        "blob = document_tensor(tree).numpy().tobytes() + b''.join(\n"
        "    t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values())\n"
        "import hashlib; print(hashlib.sha256(blob).hexdigest())\n"
    )

    def digest(seed: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", script, seed], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    assert digest("7") == digest("7")
    assert digest("none") != digest("none")


def test_a_seed_must_be_a_32_bit_integer() -> None:
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            RNGState(seed=bad)  # type: ignore[arg-type]
