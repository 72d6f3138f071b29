"""The demo's training text and the character dataset over it.

The corpus is generated from a small seeded grammar (so it has structure a tiny model learns within
a hundred steps: recurring words, agreement, punctuation) and committed as `corpus.txt`, so a demo
needs no download. `python -m fthsdp.deploy.demo.corpus --write` regenerates it byte for byte; a
unit test checks the committed file still matches the generator.

Samples are addressed by a global id, not by a position in an epoch: the training loop hands out
ids exactly once (invariant I2), and `CharDataset.sample(id)` turns an id into the same window on
every replica and every restart.

`PackedDataset` (`--seq-len-mix phases|random`) packs variable-length documents into a fixed
token budget per sample, as large-scale training does (ResiHP's setting): the tokens are constant
but attention, which stays inside each document, costs Σ l². Its document lengths are a pure
function of the sample id too."""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from fthsdp.deploy.demo.mixes import SEQ_LEN_MIXES

CORPUS_PATH = Path(__file__).resolve().parent / "corpus.txt"
CORPUS_SEED = 20240611
CORPUS_TARGET_BYTES = 200_000

# Knuth's multiplicative-hash constant: odd and large, so consecutive ids land far apart in the
# corpus and a batch does not see overlapping windows.
_STRIDE = 2_654_435_761

PACK_BUDGET = 512
"""Tokens per packed sample. Long enough for attention to matter next to the MLP on a CPU: at
512, the forward and backward of whole-budget documents take ~2.4x those of 16-token documents
(at 256, ~1.4x: within a loaded machine's noise)."""
PHASE_ROUNDS = 20
"""`phases`: micro-batches of every rank of every replica per phase (20 steps without gradient
accumulation: one step takes one micro-batch of each)."""
DOC_CHAR = "\x02"
"""Starts every document of a packed sample (ASCII start of text; never in the corpus)."""
_SHORT: tuple[int, ...] = (8, 16, 32)
_LONG: tuple[int, ...] = (256, 512)
_ANY: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)

_SUBJECTS = (
    ("the replica", "s"),
    ("the old ship", "s"),
    ("the captain", "s"),
    ("a quiet rank", "s"),
    ("the leader", "s"),
    ("the gradient", "s"),
    ("the harbour", "s"),
    ("the storm", "s"),
    ("every sailor", "s"),
    ("the replicas", "p"),
    ("the ships", "p"),
    ("the gradients", "p"),
    ("the clouds", "p"),
    ("the healthy peers", "p"),
    ("two sailors", "p"),
)
_VERBS = (
    ("waits", "wait"),
    ("sails", "sail"),
    ("recovers", "recover"),
    ("trains", "train"),
    ("listens", "listen"),
    ("returns", "return"),
    ("drifts", "drift"),
    ("commits", "commit"),
)
_TRANSITIVE = (
    ("sends", "send"),
    ("watches", "watch"),
    ("fetches", "fetch"),
    ("follows", "follow"),
    ("averages", "average"),
    ("finds", "find"),
)
_OBJECTS = (
    "the quorum",
    "the harbour lights",
    "a new step",
    "the lost state",
    "the north wind",
    "every checkpoint",
    "the falling loss",
    "the grey sea",
    "a healthy peer",
)
_PLACES = (
    "in the morning",
    "after the storm",
    "near the harbour",
    "before the next step",
    "under a grey sky",
    "at the end of the ring",
    "while the others train",
    "when the wind turns",
)
_WEATHER = (
    "the wind is cold",
    "the sky is clear",
    "the rain is heavy",
    "the sea is calm",
    "the fog is thick",
    "the sun is low",
)
_ADVERBS = ("slowly", "quickly", "again", "quietly", "at once", "without a sound")


def _clause(rng: random.Random) -> str:
    subject, number = rng.choice(_SUBJECTS)
    if rng.random() < 0.5:
        verb = rng.choice(_VERBS)[0 if number == "s" else 1]
        clause = f"{subject} {verb}"
        if rng.random() < 0.5:
            clause += f" {rng.choice(_ADVERBS)}"
    else:
        verb = rng.choice(_TRANSITIVE)[0 if number == "s" else 1]
        clause = f"{subject} {verb} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        clause += f" {rng.choice(_PLACES)}"
    return clause


def _sentence(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.45:
        body = _clause(rng)
    elif roll < 0.7:
        body = f"{_clause(rng)}, and {_clause(rng)}"
    elif roll < 0.85:
        body = f"{rng.choice(_WEATHER)}, so {_clause(rng)}"
    else:
        body = f"when {_clause(rng)}, {_clause(rng)}"
    end = "?" if body.startswith("when") and rng.random() < 0.1 else "."
    return body[0].upper() + body[1:] + end


def generate_corpus(*, seed: int = CORPUS_SEED, target_bytes: int = CORPUS_TARGET_BYTES) -> str:
    """Paragraphs of grammar sentences until `target_bytes` is reached; a pure function of its
    arguments (random.Random's choice/random are stable across Python versions)."""
    if target_bytes < 1:
        raise ValueError("target_bytes must be >= 1")
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


class CharDataset:
    """Character-level windows over the corpus, addressed by global sample id."""

    doc_token: int | None = None
    """The token that starts each document of a sample; None: a sample is one document."""

    def __init__(self, *, block_size: int = 64, text: str | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if text is None:
            text = CORPUS_PATH.read_text(encoding="utf-8")
        if len(text) < block_size + 2:
            raise ValueError(f"text too short for block_size {block_size}: {len(text)} chars")
        self.block_size = block_size
        # Sorted so ids are a function of the character set alone, identical in every process.
        self.chars: tuple[str, ...] = tuple(sorted(set(text)))
        self._stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.data = torch.tensor([self._stoi[ch] for ch in text], dtype=torch.int64)
        self._starts = len(text) - block_size - 1

    @property
    def windows(self) -> int:
        """Distinct windows: sample ids beyond repeat them (`sample` wraps around)."""
        return self._starts + 1

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if any(not 0 <= i < len(self.chars) for i in values):
            raise ValueError("token id out of range")
        return "".join(self.chars[i] for i in values)

    def sample(self, global_id: int) -> torch.Tensor:
        """The (block_size + 1,) int64 window of sample `global_id`: inputs are [:-1], targets
        [1:]. Ids are unbounded; Python ints keep the product exact."""
        if global_id < 0:
            raise ValueError("global_id must be >= 0")
        start = (global_id * _STRIDE) % (self._starts + 1)
        return self.data[start : start + self.block_size + 1].clone()

    def lengths(self, global_id: int) -> tuple[int, ...]:
        """The lengths of the documents of sample `global_id`'s inputs: one full block."""
        return (self.block_size,)

    def work(self, global_ids: Iterable[int]) -> tuple[int, int]:
        """(tokens, Σ l²) of these samples: what their forward and backward cost (the health
        service's fail-slow predictor explains step time by them)."""
        tokens = sum_sq = 0
        for global_id in global_ids:
            lengths = self.lengths(global_id)
            tokens += sum(lengths)
            sum_sq += sum(length * length for length in lengths)
        return tokens, sum_sq

    @staticmethod
    def collate(samples: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack windows into (x[B, T], y[B, T]) with y shifted by one."""
        if not samples:
            raise ValueError("collate needs at least one sample")
        batch = torch.stack(list(samples))
        return batch[:, :-1], batch[:, 1:]


class PackedDataset(CharDataset):
    """Samples of `budget` tokens packed from whole documents of varying length (`mix`).

    Document j of sample i is `DOC_CHAR` and then corpus text from a hashed offset; the lengths
    are drawn from a `random.Random` seeded by i (stable across Python versions), filling the
    budget exactly (the last document takes what is left), so sample i is a pure function of i.
    The window's extra last token (the last input's target) is the `DOC_CHAR` that would start
    the next document. With `phases`, the phase of sample i is `i // phase_samples`: pass the
    ids one micro-batch of every rank takes together (replicas x ranks x micro-batch), so every
    replica trains the same phase at the same step while they stand at the same position."""

    def __init__(
        self,
        *,
        mix: str,
        budget: int = PACK_BUDGET,
        phase_samples: int = 1,
        text: str | None = None,
    ) -> None:
        if mix not in ("phases", "random"):
            raise ValueError(f"mix must be phases or random, got {mix!r}")
        if budget < max(_ANY):
            raise ValueError(f"budget must be >= {max(_ANY)}")
        if phase_samples < 1:
            raise ValueError("phase_samples must be >= 1")
        super().__init__(block_size=budget, text=text)
        if DOC_CHAR in self._stoi:
            raise ValueError("the text must not contain DOC_CHAR")
        # Appended, not sorted in: the corpus characters keep the ids they have in CharDataset.
        self.doc_token = len(self.chars)
        self.chars = (*self.chars, DOC_CHAR)
        self._stoi[DOC_CHAR] = self.doc_token
        self.mix = mix
        self.phase_samples = phase_samples * PHASE_ROUNDS

    def lengths(self, global_id: int) -> tuple[int, ...]:
        """Document lengths of sample `global_id`, in order; they sum to the budget."""
        if global_id < 0:
            raise ValueError("global_id must be >= 0")
        rng = random.Random(global_id)
        if self.mix == "random":
            choices = _ANY
        else:
            choices = _LONG if (global_id // self.phase_samples) % 2 else _SHORT
        out: list[int] = []
        left = self.block_size
        while left > 0:
            out.append(min(rng.choice(choices), left))
            left -= out[-1]
        return tuple(out)

    def sample(self, global_id: int) -> torch.Tensor:
        """The (budget + 1,) int64 packed sample `global_id`."""
        pieces = []
        span = len(self.data) - self.block_size
        for j, length in enumerate(self.lengths(global_id)):
            start = ((global_id * 128 + j) * _STRIDE) % span
            pieces.append(torch.tensor([self.doc_token]))
            pieces.append(self.data[start : start + length - 1])
        pieces.append(torch.tensor([self.doc_token]))
        return torch.cat(pieces)


def demo_dataset(mix: str, *, samples_per_round: int) -> CharDataset:
    """The demo's dataset for a `--seq-len-mix` (SEQ_LEN_MIXES); `samples_per_round` is how many
    sample ids one micro-batch of every rank of every replica takes (the phase unit)."""
    if mix not in SEQ_LEN_MIXES:
        raise ValueError(f"mix must be one of {SEQ_LEN_MIXES}, got {mix!r}")
    if mix == "uniform":
        return CharDataset()
    return PackedDataset(mix=mix, phase_samples=samples_per_round)


class CharWindows(Dataset[tuple[torch.Tensor, int]]):
    """The first `len()` sample ids of a `CharDataset` as a map-style dataset for a DataLoader:
    item i is (window i, i), so a training loop knows which samples a batch holds."""

    def __init__(self, dataset: CharDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return self.dataset.windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.dataset.sample(index), index


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate or check the demo corpus.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help=f"write {CORPUS_PATH.name}")
    group.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = generate_corpus()
    if args.write:
        CORPUS_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {CORPUS_PATH} ({len(text.encode())} bytes)")
        return 0
    current = CORPUS_PATH.read_text(encoding="utf-8") if CORPUS_PATH.exists() else ""
    if current != text:
        print(f"{CORPUS_PATH} is stale; run python -m fthsdp.deploy.demo.corpus --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
