"""A tiny GPT that trains in milliseconds per step on one CPU thread.

It exists so the demo shows real learning (a falling loss) while replicas are killed and recover.
Determinism matters more than quality here: there is no dropout, and `build_model` draws every
initial parameter from a generator seeded explicitly, so all replicas start bitwise identical
without any broadcast (invariant I1 starts at step 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyGPTConfig:
    """Shape of the model."""

    vocab_size: int
    """Number of distinct token ids (characters of the corpus)."""
    block_size: int = 64
    """Longest context in tokens; inputs may be shorter."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide d_model."""
    d_model: int = 64
    """Width of the residual stream."""
    doc_token: int | None = None
    """The token id that starts every document of a packed sample (`corpus.PackedDataset`):
    attention stays inside a document and positions restart at each one, so a document's
    outputs do not depend on its neighbours and attention costs Σ l² over the documents, not
    T² per sample. None: each sample is one sequence with plain causal attention."""
    dropout: float = 0.0
    """Dropout probability. Only 0 is accepted: dropout draws random numbers per rank, which would
    make replicas diverge unless every RNG stream were also replicated."""

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.n_layer < 1:
            raise ValueError("n_layer must be >= 1")
        if self.n_head < 1 or self.d_model < 1 or self.d_model % self.n_head != 0:
            raise ValueError("d_model must be a positive multiple of n_head")
        if self.doc_token is not None and not 0 <= self.doc_token < self.vocab_size:
            raise ValueError("doc_token must be a token id below vocab_size")
        if self.dropout != 0.0:
            raise ValueError("dropout must be 0: the demo needs deterministic replicas")


@dataclass(frozen=True, slots=True)
class DocumentLayout:
    """The documents of a packed batch, regrouped for attention that costs Σ l².

    The batch's tokens are flattened and reordered so that documents of equal length sit next to
    each other (shortest first, each in its original order: a stable sort, so the layout is a
    pure function of the token ids). Every group of n documents of length L is then one
    [n, heads, L, L] causal attention: no query ever meets a key of another document, and the
    work is Σ n·L² = Σ l², with one attention call per distinct length rather than per document.
    Everything else in the model works token by token, so it runs on the reordered tokens
    unchanged."""

    order: torch.Tensor
    """[B*T] int64: flattened token index at each reordered position."""
    inverse: torch.Tensor
    """[B*T] int64: reordered position of each flattened token (undoes `order`)."""
    positions: torch.Tensor
    """[B*T] int64: each reordered token's position inside its document."""
    groups: tuple[tuple[int, int], ...]
    """(length, documents) per run of equal-length documents, in reordered order."""


def document_layout(idx: torch.Tensor, doc_token: int) -> DocumentLayout:
    """Where the documents of `idx` [B, T] are: each starts at a `doc_token` or at the start of
    its row (a sample never attends into the next one)."""
    b, t = idx.shape
    starts = idx == doc_token
    starts[:, 0] = True
    flat = starts.reshape(-1)
    first = flat.nonzero().squeeze(1)  # each document's first flattened index, in order
    ends = torch.cat([first[1:], first.new_tensor([b * t])])
    lengths = ends - first
    by_length = torch.sort(lengths, stable=True).indices
    sorted_lengths = lengths[by_length]
    # The flattened indices of the documents in sorted order, token by token.
    doc_first = torch.repeat_interleave(first[by_length], sorted_lengths)
    doc_offset = torch.arange(b * t, device=idx.device) - torch.repeat_interleave(
        torch.cumsum(sorted_lengths, 0) - sorted_lengths, sorted_lengths
    )
    order = doc_first + doc_offset
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(b * t, device=idx.device)
    values, counts = torch.unique_consecutive(sorted_lengths, return_counts=True)
    groups = tuple(zip(values.tolist(), counts.tolist(), strict=True))
    return DocumentLayout(order=order, inverse=inverse, positions=doc_offset, groups=groups)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, groups: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        """x is [B, T, C] without `groups`; with them, [B*T, C] in `DocumentLayout` order."""
        if groups:
            return self._packed(x, groups)
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return out

    def _packed(self, x: torch.Tensor, groups: tuple[tuple[int, int], ...]) -> torch.Tensor:
        c = x.shape[1]
        qkv = self.qkv(x)
        outputs = []
        offset = 0
        for length, documents in groups:
            size = length * documents
            chunk = qkv[offset : offset + size].view(documents, length, 3, self.n_head, -1)
            q, k, v = (chunk[:, :, i].transpose(1, 2) for i in range(3))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            outputs.append(y.transpose(1, 2).reshape(size, c))
            offset += size
        out: torch.Tensor = self.proj(torch.cat(outputs))
        return out


class Block(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )

    def forward(self, x: torch.Tensor, groups: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), groups)
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LN, LM head."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] and, with targets [B, T], the mean cross-entropy loss."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        if self.config.doc_token is not None:
            return self._packed(idx, targets, self.config.doc_token)
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def _packed(
        self, idx: torch.Tensor, targets: torch.Tensor | None, doc_token: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward pass over packed documents (`DocumentLayout`): the tokens are reordered
        once on the way in and the logits once on the way out."""
        b, t = idx.shape
        layout = document_layout(idx, doc_token)
        if layout.groups[-1][0] > self.config.block_size:
            raise ValueError(
                f"document length {layout.groups[-1][0]} exceeds block_size "
                f"{self.config.block_size}"
            )
        x = self.tok_emb(idx.reshape(-1)[layout.order]) + self.pos_emb(layout.positions)
        for block in self.blocks:
            x = block(x, layout.groups)
        grouped = self.head(self.ln_f(x))
        logits = grouped[layout.inverse].view(b, t, -1)
        if targets is None:
            return logits, None
        # The mean over the same tokens as the unpacked loss, in the reordered order.
        loss = F.cross_entropy(grouped, targets.reshape(-1)[layout.order])
        return logits, loss


def _init_(model: TinyGPT, generator: torch.Generator) -> None:
    """GPT-2 style init, drawn in module registration order from one generator, so the result
    depends only on the seed and the config, never on the global RNG or on what ran before."""
    std = 0.02
    # Residual projections are scaled down so the residual stream's variance stays bounded as
    # blocks are added (GPT-2, section 2.3).
    residual_std = std / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attn.proj") or name.endswith("mlp.2")
                module.weight.normal_(
                    0.0, residual_std if is_residual else std, generator=generator
                )
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


def build_model(config: TinyGPTConfig, seed: int) -> TinyGPT:
    """A model whose initial parameters are a pure function of (config, seed)."""
    if seed < 0:
        raise ValueError("seed must be >= 0")
    # Construction itself draws from the global RNG (default nn init); fork it so building a model
    # neither depends on nor disturbs the caller's RNG state. Every value is overwritten below.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGPT(config)
    generator = torch.Generator().manual_seed(seed)
    _init_(model, generator)
    return model
