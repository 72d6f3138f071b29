"""`--seq-len-mix`: packed samples of variable-length documents (a pure function of the sample
id, the budget filled exactly, Σ l² as reported) and the model's attention, which never crosses a
document boundary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fthsdp.deploy.demo.corpus import (
    CORPUS_PATH,
    DOC_CHAR,
    PACK_BUDGET,
    PHASE_ROUNDS,
    CharDataset,
    PackedDataset,
    demo_dataset,
)
from fthsdp.deploy.demo.model import TinyGPTConfig, build_model, document_layout

ROUND = 24  # 3 replicas x 2 ranks x 4 samples: the demo's default


@pytest.fixture(scope="module")
def phases() -> PackedDataset:
    dataset = demo_dataset("phases", samples_per_round=ROUND)
    assert isinstance(dataset, PackedDataset)
    return dataset


@pytest.fixture(scope="module")
def mixed() -> PackedDataset:
    dataset = demo_dataset("random", samples_per_round=ROUND)
    assert isinstance(dataset, PackedDataset)
    return dataset


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _documents(dataset: PackedDataset, sample: torch.Tensor) -> list[list[int]]:
    """The inputs of a sample split at its document tokens."""
    docs: list[list[int]] = []
    for token in sample[:-1].tolist():
        if token == dataset.doc_token:
            docs.append([])
        docs[-1].append(token)
    return docs


def test_uniform_is_todays_dataset_and_reports_todays_constants() -> None:
    dataset = demo_dataset("uniform", samples_per_round=ROUND)
    assert type(dataset) is CharDataset and dataset.doc_token is None
    assert torch.equal(dataset.sample(5), CharDataset().sample(5))
    assert dataset.work(range(4)) == (4 * 64, 4 * 64**2)


@pytest.mark.parametrize("mix", ["phases", "random"])
def test_a_packed_sample_is_a_pure_function_of_its_id(mix: str) -> None:
    a = demo_dataset(mix, samples_per_round=ROUND)
    b = demo_dataset(mix, samples_per_round=ROUND)
    for global_id in (0, 1, 479, 480, 12_345, 10**30):
        assert torch.equal(a.sample(global_id), b.sample(global_id))
        assert a.lengths(global_id) == b.lengths(global_id)
    # Neighbouring ids are different samples, not one repeated.
    assert len({tuple(a.sample(i)[:32].tolist()) for i in range(32)}) == 32
    with pytest.raises(ValueError, match=">= 0"):
        a.sample(-1)


@pytest.mark.parametrize("mix", ["phases", "random"])
def test_documents_fill_the_budget_exactly_and_sigma_l2_is_theirs(mix: str) -> None:
    dataset = demo_dataset(mix, samples_per_round=ROUND)
    assert isinstance(dataset, PackedDataset)
    text = CORPUS_PATH.read_text(encoding="utf-8")
    for global_id in range(0, 2000, 37):
        sample = dataset.sample(global_id)
        assert sample.shape == (PACK_BUDGET + 1,) and sample.dtype == torch.int64
        # The last input's target is the next document's start.
        assert sample[-1].item() == dataset.doc_token
        docs = _documents(dataset, sample)
        lengths = dataset.lengths(global_id)
        assert [len(d) for d in docs] == list(lengths)
        assert sum(lengths) == PACK_BUDGET
        assert all(1 <= length <= PACK_BUDGET for length in lengths)
        # Each document is its start token, then contiguous corpus text (no start token in it).
        for doc in docs:
            assert doc[0] == dataset.doc_token and dataset.doc_token not in doc[1:]
            assert dataset.decode(doc[1:]) in text
        tokens, sum_sq = dataset.work([global_id])
        assert tokens == PACK_BUDGET
        assert sum_sq == sum(len(d) ** 2 for d in docs)
    ids = [3, 500, 1001]
    parts = [dataset.work([i]) for i in ids]
    assert dataset.work(ids) == (sum(p[0] for p in parts), sum(p[1] for p in parts))


def test_phases_alternate_short_and_long_documents_by_round(phases: PackedDataset) -> None:
    span = ROUND * PHASE_ROUNDS
    for phase in range(4):
        for global_id in (phase * span, phase * span + span // 2, (phase + 1) * span - 1):
            lengths = phases.lengths(global_id)
            if phase % 2 == 0:
                assert max(lengths) <= 32 and len(lengths) >= PACK_BUDGET // 32
            else:
                assert min(lengths) >= 256 and len(lengths) <= 2
    short = phases.work(range(0, 4))[1]
    long = phases.work(range(span, span + 4))[1]
    assert long >= 4 * short  # what makes the step time swing


def test_random_mixes_lengths_within_the_budget(mixed: PackedDataset) -> None:
    seen = {length for i in range(200) for length in mixed.lengths(i)}
    assert {8, 16, 32, 64, 128, 256, 512} <= seen
    sums = {mixed.work([i])[1] for i in range(50)}
    assert len(sums) > 10  # Σ l² varies sample by sample


def test_the_document_token_is_appended_to_the_vocabulary(phases: PackedDataset) -> None:
    plain = CharDataset()
    assert phases.chars[:-1] == plain.chars and phases.chars[-1] == DOC_CHAR
    assert phases.vocab_size == plain.vocab_size + 1 == phases.doc_token + 1
    assert phases.encode("The sea.") == plain.encode("The sea.")
    with pytest.raises(ValueError, match="mix"):
        PackedDataset(mix="uniform")
    with pytest.raises(ValueError, match="mix"):
        demo_dataset("zipf", samples_per_round=ROUND)


def test_layout_groups_documents_by_length_and_restarts_positions() -> None:
    # Row 0: documents of 3, 4, 1 tokens; row 1 starts a document (no token there), then 6.
    idx = torch.tensor([[9, 1, 2, 9, 3, 4, 4, 9], [1, 1, 9, 2, 2, 2, 2, 2]])
    layout = document_layout(idx, doc_token=9)
    assert layout.groups == ((1, 1), (2, 1), (3, 1), (4, 1), (6, 1))
    assert layout.order.tolist() == [7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15]
    assert layout.positions.tolist() == [0, 0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert torch.equal(layout.order[layout.inverse], torch.arange(16))
    assert sum(length * n for length, n in layout.groups) == idx.numel()


def _model(dataset: PackedDataset) -> torch.nn.Module:
    config = TinyGPTConfig(
        vocab_size=dataset.vocab_size, block_size=dataset.block_size, doc_token=dataset.doc_token
    )
    return build_model(config, seed=3)


@pytest.mark.usefixtures("one_thread")
def test_a_token_never_sees_another_document(mixed: PackedDataset) -> None:
    model = _model(mixed)
    first = next(i for i in range(100) if len(mixed.lengths(i)) >= 3)
    batch = torch.stack([mixed.sample(first + i) for i in range(4)])[:, :-1]
    lengths = mixed.lengths(first)
    first_end = lengths[0]
    second_end = first_end + lengths[1]
    changed = batch.clone()
    # Rewrite the first document's text (same length) and every other sample in the batch.
    changed[0, 1:first_end] = (changed[0, 1:first_end] + 1) % mixed.doc_token
    changed[1:] = torch.flip(changed[1:], dims=[0])
    with torch.no_grad():
        before, _ = model(batch)
        after, _ = model(changed)
    # The second document of sample 0 computes exactly the same outputs...
    assert torch.equal(before[0, first_end:second_end], after[0, first_end:second_end])
    # ...which are those of the document alone, in a batch of its own.
    alone = batch[0:1, first_end:second_end]
    with torch.no_grad():
        own, _ = model(alone)
    torch.testing.assert_close(own[0], before[0, first_end:second_end])
    # The rewritten document itself did change.
    assert not torch.equal(before[0, 1:first_end], after[0, 1:first_end])


@pytest.mark.usefixtures("one_thread")
def test_attention_is_causal_inside_a_document(phases: PackedDataset) -> None:
    model = _model(phases)
    sample = phases.sample(5)[:-1].unsqueeze(0)
    cut = phases.lengths(5)[0] // 2
    changed = sample.clone()
    changed[0, cut:] = (changed[0, cut:] + 3) % phases.doc_token
    changed[0, cut:][sample[0, cut:] == phases.doc_token] = phases.doc_token  # keep the layout
    with torch.no_grad():
        before, _ = model(sample)
        after, _ = model(changed)
    assert torch.equal(before[0, :cut], after[0, :cut])


@pytest.mark.usefixtures("one_thread")
def test_packed_training_is_bitwise_reproducible(phases: PackedDataset) -> None:
    def train() -> list[bytes]:
        model = _model(phases)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(3):
            batch = torch.stack([phases.sample(step * 4 + i) for i in range(4)])
            _, loss = model(batch[:, :-1], batch[:, 1:])
            assert loss is not None
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return [p.detach().numpy().tobytes() for p in model.parameters()]

    assert train() == train()


@pytest.mark.usefixtures("one_thread")
def test_the_packed_loss_is_the_mean_over_every_token(phases: PackedDataset) -> None:
    model = _model(phases)
    batch = torch.stack([phases.sample(i) for i in range(2)])
    with torch.no_grad():
        logits, loss = model(batch[:, :-1], batch[:, 1:])
    assert loss is not None
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(loss, expected)
