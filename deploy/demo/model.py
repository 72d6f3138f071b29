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
        if self.dropout != 0.0:
            raise ValueError("dropout must be 0: the demo needs deterministic replicas")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
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
