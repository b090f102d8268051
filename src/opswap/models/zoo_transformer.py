"""Transformer zoo models: bert (encoder) and gpt (decoder), attention written out by hand.

Nothing here calls a fused PyTorch kernel (no nn.LayerNorm, nn.GELU, SDPA): the
point of these models is to show the long-hand patterns that the fusion,
attention, norm, activation, layout and softmax rules replace.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import SpecError
from opswap.models._common import positive, seeded


def _check_sizes(where: str, hidden: int, heads: int, seq: int, max_positions: int) -> None:
    if hidden % heads:
        raise SpecError(
            f"Override hidden for {where} must be a multiple of heads ({heads}), got {hidden}."
        )
    if seq > max_positions:
        raise SpecError(
            f"Override seq for {where} is {seq} but max_positions is {max_positions}; "
            f"raise max_positions too."
        )


def _near_one(n: int) -> nn.Parameter:
    # Norm weights away from 1 so that folding them into a neighbour is actually tested.
    return nn.Parameter(1.0 + 0.1 * torch.randn(n))


def _crop(buffer: torch.Tensor, n, dims: int = 1) -> torch.Tensor:
    """buffer[:n] (dims=1) or buffer[:n, :n] (dims=2).

    Written with torch.narrow because FX hands buffers over as real tensors, and a
    real tensor cannot be sliced by a traced length; a torch function can.
    """
    for dim in range(dims):
        buffer = torch.narrow(buffer, dim, 0, n)
    return buffer


def _token_ids(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch, seq), dtype=torch.int64),)


# --------------------------------------------------------------------------- bert


class DecomposedLayerNorm(nn.Module):
    """LayerNorm written out: mean, (x - mean)**2 mean, sub, div by sqrt(var + eps), mul, add."""

    def __init__(self, dim: int, eps: float = 1e-12):
        super().__init__()
        self.eps = eps
        self.weight = _near_one(dim)
        self.bias = nn.Parameter(0.05 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class BertEmbeddings(nn.Module):
    position_ids: torch.Tensor  # a buffer

    def __init__(self, vocab: int, hidden: int, max_positions: int, dropout: float):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.register_buffer("position_ids", torch.arange(max_positions), persistent=False)
        self.norm = DecomposedLayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = _crop(self.position_ids, input_ids.size(1))  # [S]
        return self.dropout(self.norm(self.word(input_ids) + self.position(positions)))


class BertSelfAttention(nn.Module):
    """Separate Q, K, V projections of one input, scaled dot-product, softmax, dropout."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.output = nn.Linear(hidden, hidden)
        self.out_dropout = nn.Dropout(dropout)
        self.norm = DecomposedLayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        h, d = self.heads, self.head_dim
        q = self.query(x).view(b, s, h, d).transpose(1, 2)  # q: [B, H, S, D]
        k = self.key(x).view(b, s, h, d).transpose(1, 2)
        v = self.value(x).view(b, s, h, d).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # scores: [B, H, S, S]
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        ctx = (probs @ v).transpose(1, 2).contiguous().view(b, s, h * d)  # ctx: [B, S, H*D]
        # Token-major 2-D GEMM as Megatron-style code writes it: the view above and
        # this reshape form the view -> reshape chain a layout rule collapses.
        out = self.output(ctx.reshape(b * s, h * d)).view(b, s, h * d)
        return self.norm(x + self.out_dropout(out))


class BertFeedForward(nn.Module):
    """Linear, GELU written with erf, Linear, residual, decomposed LayerNorm."""

    def __init__(self, hidden: int, intermediate: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.dropout = nn.Dropout(dropout)
        self.norm = DecomposedLayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
        return self.norm(x + self.dropout(self.down(h)))


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float):
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads, dropout)
        self.ffn = BertFeedForward(hidden, intermediate, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.attention(x))


class BertClassifier(nn.Module):
    def __init__(
        self,
        vocab: int,
        hidden: int,
        heads: int,
        layers: int,
        intermediate: int,
        max_positions: int,
        num_labels: int,
        dropout: float,
    ):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, hidden, max_positions, dropout)
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, intermediate, dropout) for _ in range(layers)
        )
        # Pooler kept as raw parameters, laid out [in, out]: x @ w + b (MatMul+Add -> linear).
        self.pool_weight = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))
        self.pool_bias = nn.Parameter(0.02 * torch.randn(hidden))
        self.pool_dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Sequence-first hidden states [S, B, hidden], the layout older encoder APIs return."""
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x.transpose(0, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.encode(input_ids).transpose(0, 1)  # back to [B, S, hidden]: cancels
        first = hidden[:, 0]
        pooled = torch.tanh(first @ self.pool_weight + self.pool_bias)
        logits = self.classifier(self.pool_dropout(pooled))
        return torch.log(torch.softmax(logits, dim=-1))


def bert(
    batch: int = 2,
    seq: int = 32,
    vocab: int = 1000,
    hidden: int = 64,
    heads: int = 4,
    layers: int = 2,
    intermediate: int = 128,
    max_positions: int = 128,
    num_labels: int = 3,
    dropout: float = 0.1,
    seed: int = 0,
):
    """BERT-style encoder classifier on token ids [batch, seq] (chapters 4, 8, 9, 10, 14, 16).

    Patterns, per layer: three nn.Linear (query, key, value) reading the same node
    (QKV merge); view + transpose to heads, q @ k.transpose(-2, -1) / sqrt(d),
    softmax, eval-mode nn.Dropout, @ v, transpose back (hand-written attention ->
    SDPA); two LayerNorms written out as mean / (x - mean)**2 mean / sub / div by
    sqrt(var + eps) / mul weight / add bias (decomposed LayerNorm); GELU as
    0.5*x*(1+erf(x/sqrt 2)). Once per layer, the head merge `.view(b, s, h*d)` is
    followed by `.reshape(b*s, h*d)` (view -> reshape chain). Also one more
    decomposed LayerNorm after the embeddings; the encoder's sequence-first
    output `.transpose(0, 1)` undone at once by `.transpose(0, 1)` (cancelling
    transposes); the pooler `first @ pool_weight + pool_bias` on raw Parameters
    (MatMul+Add -> linear); the head `torch.log(torch.softmax(logits, -1))`
    (log_softmax).
    """
    where = "zoo:bert"
    positive(
        where,
        batch=batch,
        seq=seq,
        vocab=vocab,
        hidden=hidden,
        heads=heads,
        layers=layers,
        intermediate=intermediate,
        max_positions=max_positions,
        num_labels=num_labels,
    )
    _check_sizes(where, hidden, heads, seq, max_positions)
    with seeded(seed):
        model = BertClassifier(
            vocab, hidden, heads, layers, intermediate, max_positions, num_labels, dropout
        )
        return model.eval(), _token_ids(batch, seq, vocab)


# --------------------------------------------------------------------------- gpt


class HandRMSNorm(nn.Module):
    """RMSNorm written out: x * rsqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _near_one(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    # [x1, x2] -> [-x2, x1] on the last dim, the rotary pairing LLaMA uses.
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CausalSelfAttention(nn.Module):
    """Separate Q, K, V (no bias), rotary positions, causal mask from a buffer, softmax, @ v."""

    future_mask: torch.Tensor  # buffers
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, hidden: int, heads: int, max_positions: int, rope_base: float):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        future = torch.triu(torch.ones(max_positions, max_positions, dtype=torch.bool), diagonal=1)
        self.register_buffer("future_mask", future, persistent=False)
        inv_freq = rope_base ** (-torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [P, D]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        h, d = self.heads, self.head_dim
        q = self.q_proj(x).view(b, s, h, d).transpose(1, 2)  # q: [B, H, S, D]
        k = self.k_proj(x).view(b, s, h, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, h, d).transpose(1, 2)
        cos, sin = _crop(self.rope_cos, s), _crop(self.rope_sin, s)  # [S, D]
        q = q * cos + _rotate_half(q, d // 2) * sin
        k = k * cos + _rotate_half(k, d // 2) * sin
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # scores: [B, H, S, S]
        scores = scores.masked_fill(_crop(self.future_mask, s, dims=2), float("-inf"))
        probs = F.softmax(scores, dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, h * d)
        return self.o_proj(ctx)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the LLaMA feed-forward."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(
        self, hidden: int, heads: int, intermediate: int, max_positions: int, rope_base: float
    ):
        super().__init__()
        self.attn_norm = HandRMSNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, max_positions, rope_base)
        self.mlp_norm = HandRMSNorm(hidden)
        self.mlp = GatedMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(
        self,
        vocab: int,
        hidden: int,
        heads: int,
        layers: int,
        intermediate: int,
        max_positions: int,
        tie_embeddings: bool,
        rope_base: float,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        # std 1/sqrt(hidden) rather than 1: with a tied head, logits then have unit scale.
        nn.init.normal_(self.embed.weight, std=hidden**-0.5)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, heads, intermediate, max_positions, rope_base)
            for _ in range(layers)
        )
        self.norm = HandRMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # logits: [B, S, vocab]


def gpt(
    batch: int = 2,
    seq: int = 32,
    vocab: int = 1000,
    hidden: int = 64,
    heads: int = 4,
    layers: int = 2,
    intermediate: int = 172,
    max_positions: int = 128,
    tie_embeddings: bool = True,
    rope_base: float = 10000.0,
    seed: int = 0,
):
    """GPT/LLaMA-style decoder returning logits [batch, seq, vocab] (chapters 8, 9, 10, 16, 29).

    Patterns, per layer: two RMSNorms written out as x * rsqrt(mean(x^2) + eps) *
    weight; separate bias-free q/k/v projections of one input (QKV merge); rotary
    embedding (slice, neg, cat, mul, add); q @ k^T / sqrt(d); causal mask from a
    boolean buffer applied with masked_fill(-inf); softmax; @ v (hand-written
    causal attention -> SDPA); SiLU-gated MLP down(silu(gate(x)) * up(x)) with two
    Linears reading one node. A final RMSNorm and an LM head whose weight is tied
    to the token embedding unless tie_embeddings=false.
    """
    where = "zoo:gpt"
    positive(
        where,
        batch=batch,
        seq=seq,
        vocab=vocab,
        hidden=hidden,
        heads=heads,
        layers=layers,
        intermediate=intermediate,
        max_positions=max_positions,
    )
    _check_sizes(where, hidden, heads, seq, max_positions)
    if (hidden // heads) % 2:
        raise SpecError(
            f"Rotary embedding in {where} needs an even head size; hidden/heads is {hidden // heads}."
        )
    with seeded(seed):
        model = Decoder(
            vocab, hidden, heads, layers, intermediate, max_positions, tie_embeddings, rope_base
        )
        return model.eval(), _token_ids(batch, seq, vocab)
