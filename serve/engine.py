"""Continuous batching: concurrent requests share one decode batch.

A background task runs the decode loop. Before each step, waiting requests take the free
cache slots (up to ``max_batch``) and run their prompts; then every live sequence advances one
token together. A sequence that finishes leaves at once and its slot goes to the next waiting
request, so the batch stays full under load. The next batch is formed only when the current
step is done — the property that Serve's ``@serve.batch`` lacks (see ../shared/stack-notes.md).

No request can hurt another: a sequence whose sampling fails finishes alone with ``error``, a
caller that goes away frees its slot at the next step, and nothing the loop meets stops it.

``run_batch`` runs a fixed list of requests to completion, for callers that batch elsewhere.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from serve.decoder import Decoder
from serve.sampling import GREEDY_BELOW, TokenLogprob, apply_penalties, make_generator, next_token, token_logprob
from serve.textstream import TextStream
from train.tokenizer import BPETokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What a client is told when its generation fails; the cause goes to the replica's log only.
GENERATION_FAILED = "generation failed on the server"


@dataclass
class GenerationParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely alternatives
    prompt_logprobs: bool = False  # also the logprob of every prompt token after the first (echo)


@dataclass
class Chunk:
    text: str
    finish_reason: str | None = None  # "stop", "length" (or "error", "timeout") on the last chunk of a sequence
    tokens: int = 1  # tokens generated for this chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of those tokens, when asked for


def joined(chunks: list[Chunk]) -> Chunk:
    """One chunk that says what ``chunks`` (a sequence's, in order) say."""
    return Chunk(
        "".join(chunk.text for chunk in chunks),
        chunks[-1].finish_reason,
        sum(chunk.tokens for chunk in chunks),
        [logprob for chunk in chunks for logprob in chunk.logprobs],
    )


@dataclass
class LoopTimes:
    """Where a decode loop's time went, summed since it started (the replica's /ready shows them).

    ``loop_s`` less ``step_s`` is the loop's own turnaround: handing a step to its thread and back,
    waiting for the GIL and the event loop, giving out chunks. On a GPU, the device idles meanwhile.
    """

    steps: int = 0
    loop_s: float = 0.0  # the loop's iterations, from taking waiting requests to giving out the step's chunks
    step_s: float = 0.0  # of that, in Engine.step: decoding, prefilling, sampling
    prefills: int = 0
    prompts_prefilled: int = 0
    prefill_s: float = 0.0  # of step_s, prefilling (the first tokens included)


class Sequence:
    """One request in flight: its tokens, sampler and text, and a queue of chunks for its caller."""

    def __init__(self, prompt: list[int], params: GenerationParams):
        self.prompt = prompt
        self.params = params
        self.generator: torch.Generator | None = None  # made on the logits' device, when sampling
        self.counts: torch.Tensor | None = None  # of each generated token, when penalties apply
        self.text = TextStream(params.stop)
        self.last_token = prompt[-1]
        self.position = len(prompt) - 1  # where last_token sits
        self.generated = 0
        self.finish_reason: str | None = None
        self.prompt_logprobs: list[TokenLogprob] = []  # for prompt[1:], with params.prompt_logprobs
        self.chunks: list[Chunk] = []  # produced, not yet handed out
        self.queue: asyncio.Queue[Chunk] | None = None
        self.whole = False  # hand the chunks out only when the sequence ends (see ContinuousBatcher.generate)
        self.cancelled = False


def _plain_greedy(params: GenerationParams) -> bool:
    return params.temperature < GREEDY_BELOW and not params.presence_penalty and not params.frequency_penalty


class Engine:
    def __init__(self, decoder: Decoder, tokenizer: BPETokenizer):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.context = decoder.cfg.seq_len
        self.live: list[Sequence] = []  # live[i] owns cache slot i
        self.times = LoopTimes()

    @property
    def free_slots(self) -> int:
        return self.decoder.max_batch - len(self.live)

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each sequence's next token from its row of ``logits``; record its text and finish.

        The tokens are chosen on the logits' device and reach the host in one copy: one sync per step,
        not one per sequence (on a GPU each sync waits for the whole step). Plain greedy rows, the
        common case, take theirs from one argmax over the batch and cost no per-row tensor work.
        """
        tokens = torch.argmax(logits, dim=-1)
        failed = set()
        for i, seq in enumerate(seqs):
            if _plain_greedy(seq.params):
                continue
            token = self._guarded(seq, lambda seq=seq, row=logits[i]: self._choose(seq, row))
            if token is None:
                failed.add(i)
            else:
                tokens[i] = token
        for i, (seq, token) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
            if i not in failed:
                self._guarded(seq, lambda seq=seq, i=i, token=token: self._record(seq, logits[i], token))

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The next token of ``seq`` (penalized, or sampled) on the logits' device."""
        params = seq.params
        # Penalty counts and a generator only for the requests that use them: this runs per token.
        if (params.presence_penalty or params.frequency_penalty) and seq.counts is None:
            seq.counts = torch.zeros_like(logits)
        if params.temperature >= GREEDY_BELOW and seq.generator is None:
            seq.generator = make_generator(params.seed, logits.device)
        if seq.counts is not None:
            logits = apply_penalties(logits, seq.counts, params.presence_penalty, params.frequency_penalty)
        return next_token(logits, params.temperature, params.top_p, seq.generator)

    def _record(self, seq: Sequence, logits: torch.Tensor, token: int) -> None:
        """``token`` follows in ``seq``: its count, logprobs, text, and whether the sequence is done."""
        params = seq.params
        if seq.counts is not None:
            seq.counts[token] += 1
        logprobs = [token_logprob(logits, token, params.logprobs)] if params.logprobs is not None else []
        seq.generated += 1
        seq.last_token, seq.position = token, seq.position + 1
        text = "" if token == self.tokenizer.eot_id else seq.text.push(self.tokenizer.decode([token]))
        if seq.text.stopped or token == self.tokenizer.eot_id:
            seq.finish_reason = "stop"
        elif seq.generated >= params.max_tokens or seq.position >= self.context:
            seq.finish_reason = "length"
        if seq.finish_reason:
            text += seq.text.finish()
        seq.chunks.append(Chunk(text, seq.finish_reason, 1, logprobs))

    def _guarded(self, seq: Sequence, work: Callable[[], T]) -> T | None:
        """``work()`` for ``seq``; if it fails, ``seq`` alone finishes with an error (and this returns None)."""
        try:
            return work()
        except Exception:
            logger.exception("sequence failed; the rest of the batch goes on")
            seq.finish_reason = "error"
            seq.chunks = [Chunk(GENERATION_FAILED, "error", 0)]
            return None

    def _admit(self, admitted: list[Sequence]) -> None:
        """Prefill ``admitted`` into the next free slots in one pass and take each one's first token.

        Should the pass fail, each sequence is prefilled alone, so that only one that fails alone fails.
        """
        start = time.perf_counter()
        first = len(self.live)
        self.live.extend(admitted)
        slots = list(range(first, len(self.live)))
        every = [seq.params.prompt_logprobs for seq in admitted]
        try:
            logits = self.decoder.prefill(slots, [seq.prompt for seq in admitted], every)
        except Exception:
            logger.exception("prefilling %d prompts together failed; prefilling them one at a time", len(admitted))
            logits = [
                self._guarded(seq, lambda seq=seq, slot=slot, e=e: self.decoder.prefill([slot], [seq.prompt], [e])[0])
                for seq, slot, e in zip(admitted, slots, every, strict=True)
            ]
        prefilled = [(seq, rows) for seq, rows in zip(admitted, logits, strict=True) if rows is not None]
        for seq, rows in prefilled:
            if seq.params.prompt_logprobs:
                self._guarded(seq, lambda seq=seq, rows=rows: self._record_prompt_logprobs(seq, rows))
            if seq.params.max_tokens == 0 and seq.finish_reason is None:  # the prompt scored, nothing generated
                seq.finish_reason = "length"
                seq.chunks.append(Chunk("", "length", 0))
        prefilled = [(seq, rows) for seq, rows in prefilled if seq.finish_reason is None]
        if prefilled:
            self._accept([seq for seq, _ in prefilled], torch.cat([rows[-1:] for _, rows in prefilled]))
        self.times.prefills += 1
        self.times.prompts_prefilled += len(admitted)
        self.times.prefill_s += time.perf_counter() - start

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, rows: torch.Tensor) -> None:
        top = seq.params.logprobs or 0
        seq.prompt_logprobs = [token_logprob(row, t, top) for row, t in zip(rows, seq.prompt[1:], strict=False)]

    def step(self, admitted: list[Sequence]) -> list[Sequence]:
        """Admit ``admitted`` (at most ``free_slots``), advance every live sequence one token.

        Returns the sequences that produced chunks. Finished and cancelled sequences leave.
        """
        start = time.perf_counter()
        # Decode first: a sequence admitted now gets its first token from its prompt's logits.
        self._compact([seq for seq in self.live if not seq.cancelled])
        stepping = list(self.live)  # in slot order: a decode row is its slot
        if stepping:
            logits = self.decoder.decode([s.last_token for s in stepping], [s.position for s in stepping])
            self._accept(stepping, logits)
        if admitted:
            self._admit(admitted)
        self._compact([seq for seq in self.live if seq.finish_reason is None])
        self.times.steps += 1
        self.times.step_s += time.perf_counter() - start
        return stepping + admitted

    def _compact(self, keep: list[Sequence]) -> None:
        """Keep only ``keep`` in slots 0..len(keep)-1: each slot below that line whose sequence leaves takes
        the cache of one kept above it. So a step moves at most one cache per leaving sequence (each
        a slot's keys and values of every layer: 56 MB for the `small` shape), whatever slot it left."""
        kept = {id(seq) for seq in keep}
        size = len(keep)
        holes = [slot for slot in range(size) if id(self.live[slot]) not in kept]
        movers = [slot for slot in range(size, len(self.live)) if id(self.live[slot]) in kept]
        for hole, mover in zip(holes, movers, strict=True):
            self.decoder.move(mover, hole)
            self.live[hole] = self.live[mover]
        del self.live[size:]

    def run_batch(self, batch: list[Sequence]) -> list[str]:
        """Run ``batch`` (at most max_batch sequences) to completion; their full texts."""
        self.step(batch)
        while self.live:
            self.step([])
        return ["".join(chunk.text for chunk in seq.chunks) for seq in batch]


async def stream_chunks(queue: asyncio.Queue[Chunk], timeout_s: float | None) -> AsyncIterator[Chunk]:
    """A sequence's chunks from ``queue``, up to its last; after ``timeout_s`` a last chunk ``timeout``."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finish_reason:
                    return
    except TimeoutError:
        yield Chunk(f"the request took longer than {timeout_s:g} s", "timeout", 0)


class ContinuousBatcher:
    """The asyncio face of an Engine: ``generate`` streams chunks; one loop task drives all requests.

    ``step_in_thread``: each step runs in a worker thread, so that the event loop serves HTTP meanwhile.
    Where the loop has nothing else to do (the engine process), a step runs on it: handing each step to a
    thread and back cost more than the step on a CPU (the loop ran 1.7-2.2x the steps a second without it).
    """

    def __init__(self, engine: Engine, on_step: Callable[[int, int], None] | None = None, step_in_thread: bool = True):
        self.engine = engine
        self.step_in_thread = step_in_thread
        self.waiting: list[Sequence] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        # on_step(batch_size, queue_depth) feeds metrics.
        self._on_step = on_step

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def in_flight(self) -> int:
        return len(self.engine.live)

    @property
    def times(self) -> LoopTimes:
        return self.engine.times

    @property
    def loop_failed(self) -> BaseException | None:
        """Why the decode loop stopped, if it did (it is built not to: this is for health checks)."""
        task = self._loop_task
        return task.exception() if task is not None and task.done() and not task.cancelled() else None

    async def generate(
        self, seq: Sequence, timeout_s: float | None = None, whole: bool = False
    ) -> AsyncIterator[Chunk]:
        """The chunks of one request; after ``timeout_s`` a last chunk with finish_reason ``timeout``.

        With ``whole`` (a caller that wants only the full text) they come joined in one chunk when the
        sequence ends: the event loop handles one chunk per request instead of one per token, and the
        decode step shares the GIL with it.
        """
        seq.queue = asyncio.Queue()
        seq.whole = whole
        self.waiting.append(seq)
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        try:
            async for chunk in stream_chunks(seq.queue, timeout_s):
                yield chunk
        finally:
            # A caller that went away (client disconnect) or timed out frees its slot at the next step.
            seq.cancelled = True
            if seq in self.waiting:
                self.waiting.remove(seq)

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.engine.live:
                self._wakeup.clear()
                await self._wakeup.wait()
            start = time.perf_counter()
            admitted = self.waiting[: self.engine.free_slots]
            del self.waiting[: len(admitted)]
            try:
                if self.step_in_thread:  # torch releases the GIL: HTTP keeps flowing meanwhile
                    stepped = await asyncio.to_thread(self.engine.step, admitted)
                else:
                    stepped = self.engine.step(admitted)
            except Exception:  # the batch's forward failed: fail the requests in flight, keep serving
                logger.exception("decode step failed; failing the requests in flight")
                stepped = self.engine.live + [seq for seq in admitted if seq not in self.engine.live]
                self.engine.live = []
                for seq in stepped:
                    seq.chunks = [Chunk(GENERATION_FAILED, "error", 0)]
            for seq in stepped:
                if seq.whole:
                    if not (seq.chunks and seq.chunks[-1].finish_reason):
                        continue
                    seq.chunks = [joined(seq.chunks)]
                for chunk in seq.chunks:
                    seq.queue.put_nowait(chunk)
                seq.chunks.clear()
            if self._on_step:
                try:
                    self._on_step(len(stepped), len(self.waiting))
                except Exception:  # metrics must never stop the loop
                    logger.exception("step metrics failed")
            if not self.step_in_thread:  # new requests, cancellations and this step's chunks go in and out now
                await asyncio.sleep(0)
            self.engine.times.loop_s += time.perf_counter() - start
