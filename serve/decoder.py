"""Token-by-token inference of a trained GPT for many sequences at once, with a KV cache.

The cache has one slot per sequence in flight. A new sequence's prompt is run alone into a free
slot (``prefill``); then all live sequences advance one token per ``decode`` call, whatever their
lengths: each attends over its own slot, masked to its own length. Live sequences occupy slots
0..B-1 (``move`` closes the gap a finished one leaves), so a decode step reads the cache
without copying it, and every sequence attends over the same full-context shape whether it is
alone or in a batch of 64.
"""

import torch
import torch.nn.functional as F
from torch import nn

from serve.precision import apply_precision
from train.model import GPT


class Decoder:
    def __init__(self, model: GPT, max_batch: int, precision: str = "fp32", device: str | torch.device = "cpu"):
        device = torch.device(device)
        cfg = model.cfg
        # Serving unties the output projection so that quantization treats it as any other Linear.
        head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
        modules = apply_precision(nn.ModuleDict({"model": model, "head": head}), precision, device)
        self.model, self.head = modules["model"], modules["head"]
        self.cfg = cfg
        self.max_batch = max_batch
        self.device = device
        dtype = (
            torch.bfloat16 if precision in ("bf16", "fp8") or (precision == "int8" and device.type == "cuda") else None
        )
        self.dtype = dtype or torch.float32
        head_dim = cfg.d_model // cfg.n_head
        shape = (cfg.n_layer, max_batch, cfg.n_head, cfg.seq_len, head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=device)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d_model) -> (batch, head, seq, head_dim)"""
        batch, seq, dim = x.shape
        return x.view(batch, seq, self.cfg.n_head, dim // self.cfg.n_head).transpose(1, 2)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Shared body of prefill and decode; ``attend(layer, q, k, v)`` stores k/v and attends."""
        x = self.model.tok_emb(tokens) + self.model.pos_emb(positions)
        for layer, block in enumerate(self.model.blocks):
            q, k, v = block.attn.qkv(block.ln_attn(x)).split(self.cfg.d_model, dim=2)
            y = attend(layer, self._heads(q), self._heads(k), self._heads(v))
            x = x + block.attn.proj(y.transpose(1, 2).reshape(x.shape))
            x = x + block.mlp(block.ln_mlp(x))
        return self.head(self.model.ln_out(x)).float()

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: list[int]) -> torch.Tensor:
        """Run ``prompt`` into cache ``slot``; the logits (len(prompt), vocab) of the token after each position."""
        length = len(prompt)
        tokens = torch.tensor([prompt], device=self.device)

        def attend(layer, q, k, v):
            self.keys[layer, slot, :, :length] = k[0]
            self.values[layer, slot, :, :length] = v[0]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return self._forward(tokens, torch.arange(length, device=self.device), attend)[0]

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of the sequences in slots 0..B-1: token i sits at positions[i].

        Returns the logits (B, vocab) for each sequence's next token.
        """
        batch = len(tokens)
        slots = torch.arange(batch, device=self.device)
        where = torch.tensor(positions, device=self.device)
        visible = torch.arange(self.cfg.seq_len, device=self.device)[None, :] <= where[:, None]
        mask = visible[:, None, None, :]  # (batch, 1 head, 1 query, seq_len)

        def attend(layer, q, k, v):
            self.keys[layer, slots, :, where] = k[:, :, 0]
            self.values[layer, slots, :, where] = v[:, :, 0]
            keys, values = self.keys[layer, :batch], self.values[layer, :batch]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

        tokens_t = torch.tensor(tokens, device=self.device)[:, None]
        return self._forward(tokens_t, where[:, None], attend)[:, 0]

    def move(self, source: int, target: int) -> None:
        """Copy the cache of slot ``source`` to slot ``target`` (to keep live slots contiguous)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]
