"""A GPT-style decoder, readable top to bottom.

Pre-norm transformer blocks, causal self-attention through PyTorch's fused
``scaled_dot_product_attention``, and an output projection tied to the token
embedding. The same class is trained by ``train/`` and served by ``serve/``.
"""

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from train.model_config import ModelConfig

IGNORED_TARGET = -100  # a target the loss leaves out (padding)


class KVCache(Protocol):
    """Where incremental decoding keeps one layer's keys and values (serve/decoder.py holds the implementations)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``/``v`` (batch, head, seq, head_dim); the attention of ``q`` over the cache."""
        ...


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        # (batch, seq, dim) -> (batch, head, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, dim // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = cache.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        # Functional dropout: a module call per use costs more than the whole op in token-by-token decoding.
        x = x + F.dropout(self.attn(self.ln_attn(x), cache), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln_mlp(x)), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, checkpoint_activations: bool = False):
        super().__init__()
        self.cfg = cfg
        self.checkpoint_activations = checkpoint_activations  # deepspeed.activation_checkpointing, in training
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_out = nn.LayerNorm(cfg.d_model)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, caches: Sequence[KVCache] | None = None
    ) -> torch.Tensor:
        """The final normalized hidden states (batch, seq, d_model) of ``tokens``.

        ``positions`` (broadcastable to ``tokens``) default to 0..seq-1; incremental decoding passes
        where each token sits and a cache per layer that holds the keys and values of earlier tokens.
        """
        if positions is None:
            seq = tokens.shape[1]
            if seq > self.cfg.seq_len:
                raise ValueError(f"sequence of {seq} tokens exceeds the context length {self.cfg.seq_len}")
            positions = torch.arange(seq, device=tokens.device)
        x = self.embed(tokens, positions)
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks), strict=True):
            if self.checkpoint_activations and torch.is_grad_enabled():
                # Autograd keeps the block's input alone; the backward runs the block again for the rest.
                x = checkpoint(block, x, cache, use_reentrant=False)
            else:
                x = block(x, cache)
        return self.ln_out(x)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream (batch, seq, d_model) that the blocks of ``hidden_states`` start from."""
        return F.dropout(self.tok_emb(tokens) + self.pos_emb(positions), self.cfg.dropout, self.training)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``tokens`` (batch, seq); with ``targets``, also the mean cross-entropy over the targets that are
        not ``IGNORED_TARGET``."""
        # The output projection reuses the embedding matrix (tied weights).
        logits = F.linear(self.hidden_states(tokens), self.tok_emb.weight)
        if targets is None:
            return logits
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORED_TARGET
        )
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def param_sizes(cfg: ModelConfig) -> list[int]:
    """Elements of each parameter of the model ``cfg`` describes, without building its weights."""
    with torch.device("meta"):  # shapes only: no memory, no initialization
        return [p.numel() for p in GPT(cfg).parameters()]


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) plus attention scores.

    The PaLM paper's estimate (appendix B): 6N + 12 * n_layer * d_model * seq_len.
    """
    weights = cfg.n_layer * 12 * cfg.d_model**2 + cfg.vocab_size * cfg.d_model
    return 6 * weights + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
