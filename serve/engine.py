"""Continuous batching: concurrent requests share one decode batch.

A background task runs the decode loop. Before each step, waiting requests take the free
cache slots (up to ``max_batch``) and run their prompts; then every live sequence advances one
token together. A sequence that finishes leaves at once and its slot goes to the next waiting
request, so the batch stays full under load. The next batch is formed only when the current
step is done — the property that Serve's ``@serve.batch`` lacks (see ../shared/stack-notes.md).

``run_batch`` runs a fixed list of requests to completion, for callers that batch elsewhere.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from serve.decoder import Decoder
from serve.sampling import make_generator, next_token
from serve.textstream import TextStream
from train.tokenizer import BPETokenizer


@dataclass
class GenerationParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Chunk:
    text: str
    finish_reason: str | None = None  # "stop", "length" (or "error") on the last chunk of a sequence
    tokens: int = 1  # tokens generated for this chunk


class Sequence:
    """One request in flight: its tokens, sampler and text, and a queue of chunks for its caller."""

    def __init__(self, prompt: list[int], params: GenerationParams):
        self.prompt = prompt
        self.params = params
        self.generator = make_generator(params.seed)
        self.text = TextStream(params.stop)
        self.last_token = prompt[-1]
        self.position = len(prompt) - 1  # where last_token sits
        self.generated = 0
        self.finish_reason: str | None = None
        self.chunks: list[Chunk] = []  # produced by the last step, not yet handed out
        self.queue: asyncio.Queue[Chunk] | None = None
        self.cancelled = False


class Engine:
    def __init__(self, decoder: Decoder, tokenizer: BPETokenizer):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.context = decoder.cfg.seq_len
        self.live: list[Sequence] = []  # live[i] owns cache slot i

    @property
    def free_slots(self) -> int:
        return self.decoder.max_batch - len(self.live)

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of ``seq`` from ``logits`` and record its text and finish."""
        token = next_token(logits, seq.params.temperature, seq.params.top_p, seq.generator)
        seq.generated += 1
        seq.last_token, seq.position = token, seq.position + 1
        text = "" if token == self.tokenizer.eot_id else seq.text.push(self.tokenizer.decode([token]))
        if seq.text.stopped or token == self.tokenizer.eot_id:
            seq.finish_reason = "stop"
        elif seq.generated >= seq.params.max_tokens or seq.position >= self.context:
            seq.finish_reason = "length"
        if seq.finish_reason:
            text += seq.text.finish()
        seq.chunks.append(Chunk(text, seq.finish_reason))

    def step(self, admitted: list[Sequence]) -> list[Sequence]:
        """Admit ``admitted`` (at most ``free_slots``), advance every live sequence one token.

        Returns the sequences that produced chunks. Finished and cancelled sequences leave.
        """
        # Decode first: a sequence admitted now gets its first token from its prompt's logits.
        stepping = [seq for seq in self.live if not seq.cancelled]
        self._compact(stepping)
        if stepping:
            logits = self.decoder.decode([s.last_token for s in stepping], [s.position for s in stepping])
            for seq, row in zip(stepping, logits, strict=True):
                self._accept(seq, row)
        for seq in admitted:
            slot = len(self.live)
            self.live.append(seq)
            self._accept(seq, self.decoder.prefill(slot, seq.prompt)[-1])
        self._compact([seq for seq in self.live if seq.finish_reason is None])
        return stepping + admitted

    def _compact(self, keep: list[Sequence]) -> None:
        """Keep only ``keep`` (in order) in slots 0..len(keep)-1, moving caches down."""
        for slot, seq in enumerate(keep):
            old = self.live.index(seq)
            if old != slot:
                self.decoder.move(old, slot)
                self.live[slot] = seq
        del self.live[len(keep) :]

    def run_batch(self, batch: list[Sequence]) -> list[str]:
        """Run ``batch`` (at most max_batch sequences) to completion; their full texts."""
        self.step(batch)
        while self.live:
            self.step([])
        return ["".join(chunk.text for chunk in seq.chunks) for seq in batch]


class ContinuousBatcher:
    """The asyncio face of an Engine: ``generate`` streams chunks; one loop task drives all requests."""

    def __init__(self, engine: Engine, on_step=None):
        self.engine = engine
        self.waiting: list[Sequence] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        # on_step(batch_size, queue_depth) feeds metrics.
        self._on_step = on_step

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    async def generate(self, prompt: list[int], params: GenerationParams) -> AsyncIterator[Chunk]:
        seq = Sequence(prompt, params)
        seq.queue = asyncio.Queue()
        self.waiting.append(seq)
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        try:
            while True:
                chunk = await seq.queue.get()
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            # A caller that went away (client disconnect) frees its slot at the next step.
            seq.cancelled = True
            if seq in self.waiting:
                self.waiting.remove(seq)

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.engine.live:
                self._wakeup.clear()
                await self._wakeup.wait()
            admitted = self.waiting[: self.engine.free_slots]
            del self.waiting[: len(admitted)]
            # The step runs in a thread (torch releases the GIL) so HTTP keeps flowing meanwhile.
            try:
                stepped = await asyncio.to_thread(self.engine.step, admitted)
            except Exception as exc:  # fail the requests in flight, keep serving the next ones
                stepped = self.engine.live + [seq for seq in admitted if seq not in self.engine.live]
                self.engine.live = []
                for seq in stepped:
                    seq.chunks = [Chunk(f"generation failed: {exc!r}", "error", 0)]
            if self._on_step:
                self._on_step(len(stepped), len(self.waiting))
            for seq in stepped:
                for chunk in seq.chunks:
                    seq.queue.put_nowait(chunk)
                seq.chunks.clear()
