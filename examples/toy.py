"""What the example scripts share and what is not about distribution: a toy regression task,
its model, flags and the device choice. Identical for the plain and the fthsdp versions."""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler


class ToyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """y = a fixed random linear map of x, plus a little noise; every sample fixed by its index."""

    def __init__(self, size: int = 4096, features: int = 32) -> None:
        self.size = size
        generator = torch.Generator().manual_seed(1234)
        self.weight = torch.randn(features, 1, generator=generator) / features**0.5
        self.features = features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(self.features, generator=generator)
        return x, x @ self.weight + 0.01 * torch.randn(1, generator=generator)


def build_model(features: int = 32) -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank and replica
    return torch.nn.Sequential(
        torch.nn.Linear(features, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )


def warmup(steps: int) -> Any:
    return lambda step: min(1.0, (step + 1) / steps)


def pick_device() -> torch.device:
    """This rank's GPU under torchrun when there is one, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def forever(loader: Iterable[Any], sampler: DistributedSampler[Any]) -> Iterator[Any]:
    """Batch after batch, epoch after epoch (reshuffled per epoch)."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    return parser.parse_args()
