"""Small GPT- and Llama-style decoders for the benchmarks, with a hook that checkpoints each block.

Every way of checkpointing is a `Checkpoint`: a function that takes a block (a callable
from activations to activations) and returns a callable that computes the same thing.
`checkpoint_modes` lists them: plain autograd, `torch.utils.checkpoint`, and `remat` with
every policy object in `remat.policies`, so a new policy shows up without edits here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

import remat

__all__ = [
    "GPT",
    "Llama",
    "Checkpoint",
    "GPTConfig",
    "checkpoint_modes",
    "make_batches",
    "no_checkpoint",
    "torch_checkpoint",
]

Block = Callable[..., Tensor]
Checkpoint = Callable[[Block], Block]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder; ``seq`` is the longest sequence it accepts."""

    vocab: int = 512
    seq: int = 128
    width: int = 256
    heads: int = 4
    blocks: int = 6
    dropout: float = 0.1


class Attention(nn.Module):
    """Causal multi-head self-attention, written with plain ops."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width = config.width
        self.heads = config.heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.drop = nn.Dropout(config.dropout)
        mask = torch.ones(config.seq, config.seq, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def _split(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        return x.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = (self._split(proj(x)) for proj in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~self.mask[:seq, :seq], float("-inf"))
        y = self.drop(scores.softmax(dim=-1)) @ v
        return self.drop(self.out(y.transpose(1, 2).reshape(batch, seq, width)))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width = config.width
        self.ln1 = nn.LayerNorm(width)
        self.attention = Attention(config)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Linear(4 * width, width),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def no_checkpoint(block: Block) -> Block:
    """Plain autograd: the block keeps every activation its backward reads."""
    return block


def torch_checkpoint(block: Block) -> Block:
    """`torch.utils.checkpoint.checkpoint` (non-reentrant) around the block."""
    return functools.partial(torch.utils.checkpoint.checkpoint, block, use_reentrant=False)


class GPT(nn.Module):
    """Token and learned position embeddings, decoder blocks, final LayerNorm, LM head.

    Args:
        config: the sizes.
        checkpoint: applied to each block at every call; `no_checkpoint` by default.
    """

    def __init__(self, config: GPTConfig, checkpoint: Checkpoint = no_checkpoint) -> None:
        super().__init__()
        self.config = config
        self.checkpoint = checkpoint
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Parameter(0.02 * torch.randn(config.seq, config.width))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.blocks))
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.drop(self.tokens(tokens) + self.positions[: tokens.shape[1]])
        for block in self.blocks:
            x = self.checkpoint(block)(x)
        return self.head(self.ln(x))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    """RMSNorm, rotary attention through SDPA, RMSNorm, SwiGLU MLP; no biases, no dropout.

    The rotary tables come in as arguments, as in Hugging Face's Llama.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width, hidden = config.width, 8 * config.width // 3
        self.heads = config.heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, width = x.shape
        h = self.norm1(x)
        q, k, v = (
            p(h).view(batch, seq, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(batch, seq, width))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Token embeddings, Llama blocks sharing one rotary table, final RMSNorm, LM head."""

    def __init__(self, config: GPTConfig, checkpoint: Checkpoint = no_checkpoint) -> None:
        super().__init__()
        self.config = config
        self.checkpoint = checkpoint
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.blocks))
        self.norm = RMSNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        dim = config.width // config.heads
        inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)
        angles = torch.outer(torch.arange(config.seq).float(), inverse).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        seq = tokens.shape[1]
        x, cos, sin = self.tokens(tokens), self.cos[:seq], self.sin[:seq]
        for block in self.blocks:
            x = self.checkpoint(block)(x, cos, sin)
        return self.head(self.norm(x))

    loss = GPT.loss


def checkpoint_modes() -> dict[str, Checkpoint]:
    """Every way to run a block, by name: plain, torch's checkpoint, `remat` per policy."""
    modes: dict[str, Checkpoint] = {
        "plain": no_checkpoint,
        "torch.utils.checkpoint": torch_checkpoint,
    }
    for name in remat.policies.__all__:
        policy = getattr(remat.policies, name)
        if isinstance(policy, remat.policies.Policy):
            modes[f"remat {name}"] = remat.remat(policy=policy)
    return modes


def make_batches(
    config: GPTConfig, batch: int, count: int, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of ``(tokens, next tokens)``: arithmetic progressions mod ``vocab``.

    Each row starts at a random token and steps by a random stride, so the next token
    is predictable from the two before it and the loss falls as the model trains.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        start = torch.randint(config.vocab, (batch, 1), generator=generator)
        stride = torch.randint(1, 8, (batch, 1), generator=generator)
        rows = (start + stride * torch.arange(config.seq + 1)) % config.vocab
        batches.append((rows[:, :-1], rows[:, 1:]))
    return batches
