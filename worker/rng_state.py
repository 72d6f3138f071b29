"""The random number generators of a rank as a stateful object that travels with its state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Python's, NumPy's and torch's generators (CPU, and every CUDA device once CUDA is
    initialised), for `Manager(state={"rng": RNGState()})`: after a catch-up, a rank draws the
    same dropout masks and augmentations as the rank of the healthy replica it copied."""

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
