"""The random number generators of a rank as a stateful object that travels with its state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Python's, NumPy's and torch's generators (CPU, and every CUDA device once CUDA is
    initialised), for `Manager(state={"rng": RNGState(seed=...)})`: after a catch-up, a rank
    draws the same dropout masks and augmentations as the rank of the healthy replica it copied.

    The generators are part of the replicated state, so every replica must start them alike:
    pass the same `seed` on every replica (it seeds all three now). Left unseeded, Python's and
    NumPy's start from OS entropy, different in each process: healthy replicas then hold
    different states, and a catch-up striped over two of them fails, its sources disagreeing."""

    def __init__(self, *, seed: int | None = None) -> None:
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
                raise ValueError(f"seed must be an integer in 0..2**32-1, got {seed!r}")
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)  # every CUDA device too

    def state_dict(self) -> dict[str, Any]:
        """The generators' states: tensors and JSON values only."""
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": random.getstate(),
            # The state format carries no uint32: the key words travel widened to int64.
            "numpy": [str(kind), torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos),
                      int(has_gauss), float(cached)],
            "torch": torch.get_rng_state(),
        }  # fmt: skip
        cuda_used = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if cuda_used:
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the generators; CUDA states only if this rank uses as many devices."""
        random.setstate(state_dict["python"])  # the state codec keeps its tuples
        kind, keys, pos, has_gauss, cached = state_dict["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state_dict["torch"])
        cuda = state_dict.get("cuda")
        if (
            cuda is not None
            and torch.cuda.is_available()
            and len(cuda) == torch.cuda.device_count()
        ):
            torch.cuda.set_rng_state_all(cuda)
