"""The shipped corpus and the id-addressed character dataset."""

from __future__ import annotations

import pytest
import torch

from fthsdp.deploy.demo.corpus import CORPUS_PATH, CharDataset, generate_corpus, main


@pytest.fixture(scope="module")
def dataset() -> CharDataset:
    return CharDataset()


def test_committed_corpus_matches_the_generator() -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert text == generate_corpus()
    assert 150_000 <= len(text.encode()) <= 250_000
    assert main(["--check"]) == 0


def test_generator_is_a_function_of_its_seed() -> None:
    assert generate_corpus(seed=1, target_bytes=2000) == generate_corpus(seed=1, target_bytes=2000)
    assert generate_corpus(seed=1, target_bytes=2000) != generate_corpus(seed=2, target_bytes=2000)


def test_vocabulary_is_sorted_and_round_trips(dataset: CharDataset) -> None:
    assert list(dataset.chars) == sorted(dataset.chars)
    assert dataset.vocab_size == len(dataset.chars)
    text = "The replica waits."
    assert dataset.decode(dataset.encode(text)) == text
    assert dataset.decode(torch.tensor(dataset.encode(text))) == text
    with pytest.raises(ValueError, match="vocabulary"):
        dataset.encode("\u00e9")
    with pytest.raises(ValueError, match="range"):
        dataset.decode([dataset.vocab_size])


def test_sample_is_a_deterministic_window_of_the_corpus(dataset: CharDataset) -> None:
    other = CharDataset()
    for global_id in (0, 1, 2, 999, 10**30):
        window = dataset.sample(global_id)
        assert window.shape == (dataset.block_size + 1,)
        assert window.dtype == torch.int64
        assert torch.equal(window, other.sample(global_id))
        assert dataset.decode(window) in CORPUS_PATH.read_text(encoding="utf-8")
    # Consecutive ids land in different places, so a batch is not one repeated window.
    starts = {dataset.decode(dataset.sample(i))[:16] for i in range(32)}
    assert len(starts) == 32
    with pytest.raises(ValueError, match=">= 0"):
        dataset.sample(-1)


def test_collate_shifts_targets_by_one(dataset: CharDataset) -> None:
    samples = [dataset.sample(i) for i in range(3)]
    x, y = CharDataset.collate(samples)
    assert x.shape == y.shape == (3, dataset.block_size)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[1], samples[1][1:])
    with pytest.raises(ValueError, match="at least one"):
        CharDataset.collate([])


def test_custom_text_and_bad_block_size() -> None:
    small = CharDataset(block_size=4, text="abcabcabc")
    assert small.vocab_size == 3
    assert small.sample(5).tolist() in ([0, 1, 2, 0, 1], [1, 2, 0, 1, 2], [2, 0, 1, 2, 0])
    with pytest.raises(ValueError, match="too short"):
        CharDataset(block_size=8, text="abc")
    with pytest.raises(ValueError, match="block_size"):
        CharDataset(block_size=0, text="abc")
