"""Token-by-token inference of a trained GPT for many sequences at once, with a KV cache.

The GPT runs its own incremental forward (``GPT.hidden_states`` with positions and one cache per layer);
this module owns the cache and the untied, quantizable output projection.

The cache has one slot per sequence in flight. The prompts of the sequences that arrive together are
run into free slots in one pass (``prefill``); then all live sequences advance one token per ``decode``
call, whatever their lengths: each attends over its own slot, masked to its own length. Live sequences occupy slots
0..B-1 (``move`` closes the gap a finished one leaves), so a decode step reads the cache
without copying it.

A decode step reads the cache only up to the longest live sequence, rounded up to a power of two
(``span_bucket``): a step's cost follows the lengths in flight rather than the context length,
and the step has few distinct shapes. On a GPU each shape (batch rounded up the same way, times
span) is captured once as a CUDA graph and replayed: a small model's decode step is otherwise
bound by the time the host takes to launch its hundreds of kernels. Inside a graph, a small model's step
at batch 1 still takes about as long as it has kernels, so on a GPU each layer of the step is also
``torch.compile``d first: the compiler fuses its norms, bias adds, GELU, residual adds and cache writes into
a few kernels. One layer is compiled, and its code serves every layer (each layer's cache is an input, not
an index into one), so a replica's start does not grow with the model's depth. Small prefills are
launch-bound in the same way (one 32-byte prompt: ~270 kernels, 9 ms on an H200 of which 0.8 ms on the
GPU), so those too replay a graph per (batch, width) bucket on a GPU.
"""

import logging
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental import _config as shape_config

from serve.precision import apply_precision
from train.model import GPT

logger = logging.getLogger(__name__)

# The shortest span a decode step attends over: shorter ones would only add shapes.
MIN_SPAN = 16
# Prefills up to this many tokens (batch times width, each rounded up to a power of two) replay CUDA graphs;
# larger ones are bound by compute, where the padding would cost more than launching saves.
GRAPHED_PREFILL_TOKENS = 8192


def span_bucket(length: int, context: int) -> int:
    """The cache span a decode step reads for sequences up to ``length`` tokens: a power of two, at most ``context``."""
    return min(context, max(MIN_SPAN, 1 << (length - 1).bit_length()))


def batch_bucket(batch: int, max_batch: int) -> int:
    """The batch size a CUDA graph is captured for: ``batch`` rounded up to a power of two, at most ``max_batch``."""
    return min(max_batch, 1 << (batch - 1).bit_length())


class Decoder:
    def __init__(
        self,
        model: GPT,
        max_batch: int,
        precision: str = "fp32",
        device: str | torch.device = "cpu",
        cuda_graphs: bool = True,
        compile: bool | Literal["auto"] = "auto",
    ):
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
        # One spare position, never read: no span is then the whole cache, whose slice the compiler treats as a
        # case of its own (contiguous), so that a step attending over the full context would be compiled again.
        shape = (cfg.n_layer, max_batch, cfg.n_head, cfg.seq_len + 1, head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=device)
        self.decode_layer = _decode_layer
        if compile is True or (compile == "auto" and device.type == "cuda"):
            _compile(self)
        captured = _CapturedSteps() if cuda_graphs and device.type == "cuda" else None
        self.decode_graphs = _DecodeGraphs(self, captured) if captured else None
        self.prefill_graphs = _PrefillGraphs(self, captured) if captured else None

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]], every_position: list[bool]) -> list[torch.Tensor]:
        """Run each prompt into its cache slot, all in one forward pass (right-padded to the longest prompt).

        Returns, per prompt, the logits (1, vocab) of the token after its last position, or where
        ``every_position`` those (len(prompt), vocab) after each of its positions.
        """
        lengths = [len(prompt) for prompt in prompts]
        if self.prefill_graphs is not None and not any(every_position):
            last = self.prefill_graphs.prefill(slots, prompts)
            if last is not None:
                return list(last.split(1))
        inputs = padded_prompts(slots, prompts, len(prompts), max(lengths))
        hidden, last = self.prefill_pass(*(tensor.to(self.device) for tensor in inputs))
        return [
            self.head(hidden[i, :length]).float() if every else last[i : i + 1]
            for i, (length, every) in enumerate(zip(lengths, every_position, strict=True))
        ]

    def prefill_pass(
        self, tokens: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``prefill`` of device tensors: prompts ``tokens`` (batch, width) into cache ``slots``; returns their
        hidden states and the logits (batch, vocab) after each one's position ``ends``."""
        width = tokens.shape[1]
        caches = [_PrefillCache(self.keys[i], self.values[i], slots, width) for i in range(self.cfg.n_layer)]
        hidden = self.model.hidden_states(tokens, torch.arange(width, device=self.device), caches)
        return hidden, self.head(hidden[torch.arange(len(slots), device=self.device), ends]).float()

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of the sequences in slots 0..B-1: token i sits at positions[i].

        Returns the logits (B, vocab) for each sequence's next token.
        """
        span = span_bucket(max(positions) + 1, self.cfg.seq_len)
        if self.decode_graphs is not None:
            return self.decode_graphs.decode(tokens, positions, span)
        return self.decode_span(
            torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device), span
        )

    def decode_span(self, tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """``decode`` of device tensors, attending over the first ``span`` cache positions: ``GPT.hidden_states``
        one layer at a time, each through ``decode_layer`` (compiled or not)."""
        batch = len(tokens)
        where = (
            torch.arange(batch, device=self.device)[:, None],
            torch.arange(self.cfg.n_head, device=self.device)[None, :],
            positions[:, None],
        )
        visible = torch.arange(span, device=self.device)[None, :] <= positions[:, None]
        # Additive, in the attention's dtype, made once per step: attention converts a boolean mask to this
        # itself, in every layer (a `where` and scalar tensors each: kernels inside the graph on a GPU).
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, -torch.inf)
        mask = mask[:, None, None, :]  # (batch, 1 head, 1 query, span)
        x = self.model.embed(tokens[:, None], positions[:, None])
        for layer, block in enumerate(self.model.blocks):
            x = self.decode_layer(block, x, _DecodeCache(self.keys[layer], self.values[layer], where, mask))
        return self.head(self.model.ln_out(x)).float()[:, 0]

    def move(self, source: int, target: int) -> None:
        """Copy the cache of slot ``source`` to slot ``target`` (to keep live slots contiguous)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]


def _decode_layer(block: nn.Module, x: torch.Tensor, cache: "_DecodeCache") -> torch.Tensor:
    """One layer of a decode step: the part that is compiled, once for all layers."""
    return block(x, cache)


def _compile(decoder: Decoder) -> None:
    """Make ``decoder.decode_layer`` ``_decode_layer`` compiled, its batch and span dynamic, or, where compiling
    fails, leave it uncompiled.

    Compiled here, at batch 1 and 2 (two compilations: the compiler specializes size 1), so that a replica
    is ready only once compiled, and a precision the compiler cannot handle serves uncompiled from the
    start. Nothing in a layer's code names its index, so the compiled code of the first layer serves the
    others. The step writes keys and values at position 0 of slots 0 and 1, free now: a prefill overwrites
    them before any sequence reads them.
    """
    # Compiled code is shared by all decoders of a process and keyed by their shapes and dtypes: a process
    # may hold several (the benchmarks build one per precision and batch), and past dynamo's default of 8
    # variants it would run the step uncompiled without a word.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    decoder.decode_layer = torch.compile(_decode_layer, dynamic=True)
    start = time.perf_counter()
    try:
        # Each size a symbol of its own: the compiler would otherwise take a span equal to, say, the head size
        # or the head count for that size, which it fixes, and compile each span again while serving.
        with torch.inference_mode(), shape_config.patch(use_duck_shape=False):
            for batch in sorted({1, min(2, decoder.max_batch)}):
                tokens, positions = (torch.zeros(batch, dtype=torch.long, device=decoder.device) for _ in range(2))
                # Two tensors: one passed twice would be compiled apart.
                decoder.decode_span(tokens, positions, MIN_SPAN)
    except RuntimeError:  # the compiler's errors are RuntimeErrors (torch._dynamo.exc.BackendCompilerFailed)
        logger.exception("the decode step cannot be compiled; decoding uncompiled")
        decoder.decode_layer = _decode_layer
        return
    # A replica's start waits for it: the log says how long.
    logger.info("compiled the decode step in %.1f s", time.perf_counter() - start)


class _PrefillCache:
    """One layer's cache in a prefill: each prompt's keys and values go into its slot; each prompt attends
    causally to itself.

    Prompts are right-padded to one width: padding only follows a prompt's tokens, so causal attention
    keeps it out of them, and its keys and values land past the prompt in the slot, where each decode
    step writes its own before any query reads that far.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, width: int):
        self.keys, self.values, self.slots, self.width = keys, values, slots, width

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys[self.slots, :, : self.width] = k
        self.values[self.slots, :, : self.width] = v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _DecodeCache:
    """One layer's cache in a decode step: one new token per slot 0..B-1, stored at its position (``where``
    indexes slot, head, position); each attends over its own slot up to there (``mask``: batch, 1, 1, span).

    The span is the mask's size, not an int of its own: the compiler would take an int attribute for a
    constant and compile each span apart, where a tensor's sizes stay symbolic.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, where: tuple[torch.Tensor, ...], mask: torch.Tensor):
        self.keys, self.values, self.where, self.mask = keys, values, where, mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.index_put_(self.where, k[:, :, 0])
        self.values.index_put_(self.where, v[:, :, 0])
        batch, span = len(q), self.mask.shape[-1]
        return F.scaled_dot_product_attention(
            q, self.keys[:batch, :, :span], self.values[:batch, :, :span], attn_mask=self.mask
        )


class _CapturedSteps:
    """Steps on a GPU captured as CUDA graphs on first use, one per key (what the step is, and its shapes).

    A graph reads fixed input buffers and writes a fixed output, which the next replay of any of these graphs
    may overwrite: they replay one at a time and share one memory pool.
    """

    def __init__(self):
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def replay(self, key: tuple, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self.captured:
            self.captured[key] = self._capture(step)
            logger.info("captured %s as a CUDA graph", key)
        graph, output = self.captured[key]
        graph.replay()
        return output

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # One eager run on a side stream first, as PyTorch's CUDA graph recipe does: lazy initialization
        # (cuBLAS workspaces, quantized kernels' setup) must not happen inside the capture. It writes the
        # same keys and values into the cache that the replay then writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        return graph, output


class _DecodeGraphs:
    """The decode step on a GPU as CUDA graphs, one per (batch bucket, span bucket).

    Rows beyond the live batch are padding: they write position 0 of free slots, which a prefill
    overwrites before any sequence reads it.
    """

    def __init__(self, decoder: Decoder, captured: _CapturedSteps):
        self.decoder, self.captured = decoder, captured
        # Inference tensors, as the eager step's inputs are: the compiled step would otherwise compile again.
        with torch.inference_mode():
            self.tokens = torch.zeros(decoder.max_batch, dtype=torch.long, device=decoder.device)
            self.positions = torch.zeros(decoder.max_batch, dtype=torch.long, device=decoder.device)

    def decode(self, tokens: list[int], positions: list[int], span: int) -> torch.Tensor:
        batch = len(tokens)
        padded = batch_bucket(batch, self.decoder.max_batch)
        padding = [0] * (padded - batch)
        self.tokens[:padded].copy_(torch.tensor(tokens + padding))
        self.positions[:padded].copy_(torch.tensor(positions + padding))

        def step() -> torch.Tensor:
            return self.decoder.decode_span(self.tokens[:padded], self.positions[:padded], span)

        try:
            logits = self.captured.replay(("decode", padded, span), step)
        except RuntimeError:  # e.g. a quantized kernel that syncs with the host: serve, eagerly
            logger.exception("the decode step cannot be captured as a CUDA graph; decoding eagerly from now on")
            self.decoder.decode_graphs = None
            return self.decoder.decode_span(self.tokens[:batch], self.positions[:batch], span)
        return logits[:batch].clone()  # the next replay overwrites the graph's output


def padded_prompts(
    slots: list[int], prompts: list[list[int]], batch: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill's inputs, ``batch`` rows of ``width`` tokens: the prompts right-padded with zeros, their slots, and
    the position of each one's last token. Rows beyond the prompts repeat the first prompt, slot included: they
    compute its keys and values again and write the same into its slot.
    """
    rows = prompts + [prompts[0]] * (batch - len(prompts))
    tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    ends = torch.tensor([len(row) - 1 for row in rows])
    return tokens, torch.tensor(slots + [slots[0]] * (batch - len(prompts))), ends


class _PrefillGraphs:
    """Prefills of up to ``GRAPHED_PREFILL_TOKENS`` on a GPU as CUDA graphs, one per (batch bucket, width bucket).

    A prompt padded past its length (to the bucket's width, as an eager prefill pads it to the longest
    prompt) writes keys and values past it in its slot, which decode steps overwrite before reading.
    """

    def __init__(self, decoder: Decoder, captured: _CapturedSteps):
        self.decoder, self.captured = decoder, captured
        max_batch, context = decoder.max_batch, decoder.cfg.seq_len
        self.tokens = torch.zeros((max_batch, context), dtype=torch.long, device=decoder.device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=decoder.device)
        self.ends = torch.zeros(max_batch, dtype=torch.long, device=decoder.device)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor | None:
        """The logits (len(prompts), vocab) after each prompt, or None where this prefill is not graphed."""
        batch = batch_bucket(len(prompts), self.decoder.max_batch)
        width = span_bucket(max(len(prompt) for prompt in prompts), self.decoder.cfg.seq_len)
        if batch * width > GRAPHED_PREFILL_TOKENS:
            return None
        tokens, prompt_slots, ends = padded_prompts(slots, prompts, batch, width)
        self.tokens[:batch, :width].copy_(tokens)
        self.slots[:batch].copy_(prompt_slots)
        self.ends[:batch].copy_(ends)

        def step() -> torch.Tensor:
            return self.decoder.prefill_pass(self.tokens[:batch, :width], self.slots[:batch], self.ends[:batch])[1]

        try:
            logits = self.captured.replay(("prefill", batch, width), step)
        except RuntimeError:
            logger.exception("a prefill cannot be captured as a CUDA graph; prefilling eagerly from now on")
            self.decoder.prefill_graphs = None
            return None
        return logits[: len(prompts)].clone()
