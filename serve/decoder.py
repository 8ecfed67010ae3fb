"""Token-by-token inference of a trained GPT for many sequences at once, with a KV cache.

The GPT runs its own incremental forward (``GPT.hidden_states`` with positions and a cache);
this module owns the cache and the untied, quantizable output projection.

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
from train.model import GPT, KVCache


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

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: list[int]) -> torch.Tensor:
        """Run ``prompt`` into cache ``slot``; the logits (len(prompt), vocab) of the token after each position."""
        tokens = torch.tensor([prompt], device=self.device)
        cache = _PrefillCache(self, slot, len(prompt))
        return self._logits(tokens, torch.arange(len(prompt), device=self.device), cache)[0]

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of the sequences in slots 0..B-1: token i sits at positions[i].

        Returns the logits (B, vocab) for each sequence's next token.
        """
        where = torch.tensor(positions, device=self.device)
        tokens_t = torch.tensor(tokens, device=self.device)[:, None]
        return self._logits(tokens_t, where[:, None], _DecodeCache(self, where))[:, 0]

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.head(self.model.hidden_states(tokens, positions, cache)).float()

    def move(self, source: int, target: int) -> None:
        """Copy the cache of slot ``source`` to slot ``target`` (to keep live slots contiguous)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]


class _PrefillCache:
    """A prompt's keys and values go into one slot; the prompt attends causally to itself."""

    def __init__(self, decoder: Decoder, slot: int, length: int):
        self.decoder, self.slot, self.length = decoder, slot, length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.decoder.keys[layer, self.slot, :, : self.length] = k[0]
        self.decoder.values[layer, self.slot, :, : self.length] = v[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _DecodeCache:
    """One new token per slot 0..B-1, stored at its position; each attends over its own slot up to there."""

    def __init__(self, decoder: Decoder, where: torch.Tensor):
        self.decoder, self.where = decoder, where
        self.slots = torch.arange(len(where), device=where.device)
        visible = torch.arange(decoder.cfg.seq_len, device=where.device)[None, :] <= where[:, None]
        self.mask = visible[:, None, None, :]  # (batch, 1 head, 1 query, seq_len)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.decoder.keys[layer], self.decoder.values[layer]
        keys[self.slots, :, self.where] = k[:, :, 0]
        values[self.slots, :, self.where] = v[:, :, 0]
        batch = len(self.slots)
        return F.scaled_dot_product_attention(q, keys[:batch], values[:batch], attn_mask=self.mask)
