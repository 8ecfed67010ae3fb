"""The decode loop in a process of its own, so that it shares no GIL with the replica's event loop.

In a replica, HTTP and Serve's own work ran on an event loop that took turns with the decode step for one
GIL: on an H200 the same step took 2.9 ms there against 1.9 ms in-process, and each turn of the loop waited
0.66 ms for the event loop against 0.28 (BENCHMARKS.md, P7). So the replica keeps HTTP, tokenizing and
formatting, and a child process holds the model and runs a ContinuousBatcher, whose steps run on the child's
event loop: it has nothing else to do meanwhile.

They talk over a socket pair that only the two of them hold (``Channel``): requests and cancellations one
way, one message per decode step the other way, with the chunks that step produced. Either end going away
ends the other: the child exits when the replica does, and a replica whose child died fails its requests in
flight and its health check, so that Serve replaces it.
"""

import asyncio
import faulthandler
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from serve.channel import Channel
from serve.decoder import Decoder
from serve.engine import (
    GENERATION_FAILED,
    Chunk,
    ContinuousBatcher,
    Engine,
    GenerationParams,
    LoopTimes,
    Sequence,
    stream_chunks,
)
from serve.sampling import TokenLogprob
from train.export import load_exported

logger = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    """An engine to build: the export's model in a Decoder of these settings, with its tokenizer."""

    export: str
    max_batch: int
    precision: str
    device: str
    cuda_graphs: bool
    compile: bool | str
    torch_threads: int

    def build(self) -> Engine:
        torch.set_num_threads(self.torch_threads)
        exported = load_exported(self.export)
        decoder = Decoder(exported.model, self.max_batch, self.precision, self.device, self.cuda_graphs, self.compile)
        return Engine(decoder, exported.tokenizer)


@dataclass
class Submit:
    request: int
    prompt: list[int]
    params: GenerationParams
    whole: bool  # hand the chunks over only when the sequence ends, joined (ContinuousBatcher.generate)


@dataclass
class Cancel:
    request: int


@dataclass
class Produced:
    request: int
    chunk: Chunk
    prompt_logprobs: list[TokenLogprob]  # with the request's first chunk, where it asked for them


@dataclass
class StepReport:
    """One decode step: the chunks it produced, the batch it stepped, and the loop's figures after it."""

    batch_size: int
    waiting: int
    live: int
    times: LoopTimes
    produced: list[Produced] = field(default_factory=list)


@dataclass
class StartFailed:
    reason: str


class EngineProcess:
    """A ContinuousBatcher in a child process, with its ``generate`` contract; made where the replica starts,
    it returns once the child has built its engine (compiled and captured, on a GPU)."""

    def __init__(self, spec: EngineSpec, on_step: Callable[[int, int], None] | None = None):
        ours, theirs = socket.socketpair()
        # The child imports what this process can: the same modules, wherever Ray put them.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # Not ``-m serve.engine_process``: messages pickled by a ``__main__`` would name classes the replica lacks.
        command = [sys.executable, "-c", "from serve.engine_process import main; main()", str(theirs.fileno())]
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.channel = Channel(ours)
        self.loop_failed: BaseException | None = None  # why the child stopped, if it did (the health check)
        self._on_step = on_step
        self._requests: dict[int, tuple[Sequence, asyncio.Queue[Chunk]]] = {}
        self._ids = itertools.count()
        self.channel.send_now(spec)
        started = None
        while started is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self.process.returncode} while starting")
            try:
                started = self.channel.receive_now(timeout_s=1.0)
            except (EOFError, OSError):
                self.process.wait(timeout=10)  # it is exiting: its code, above, says how
        if not isinstance(started, StepReport):
            self.process.wait()
            raise RuntimeError(started.reason)
        self.last_report = started

    @property
    def queue_depth(self) -> int:
        return self.last_report.waiting

    @property
    def in_flight(self) -> int:
        return self.last_report.live

    @property
    def times(self) -> LoopTimes:
        return self.last_report.times

    async def generate(
        self, seq: Sequence, timeout_s: float | None = None, whole: bool = False
    ) -> AsyncIterator[Chunk]:
        """The chunks of one request, as ContinuousBatcher.generate gives them."""
        self._listen()
        request = next(self._ids)
        queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._requests[request] = (seq, queue)
        self._send(Submit(request, seq.prompt, seq.params, whole))
        try:
            async for chunk in stream_chunks(queue, timeout_s):
                yield chunk
        finally:
            # Still listed: it did not finish (its caller went away or timed out): free its slot.
            if self._requests.pop(request, None) is not None:
                self._send(Cancel(request))

    def close(self) -> None:
        self.channel.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def _listen(self) -> None:
        """Talk to the child on the event loop that asks (a replica has one; a script may run several)."""
        loop = asyncio.get_running_loop()
        if loop is not self.channel.loop and self.loop_failed is None:
            self.channel.start(loop, self._on_report, self._stopped)

    def _send(self, message: Submit | Cancel) -> None:
        if self.loop_failed is not None:
            self._fail_all()
            return
        self.channel.send(message)

    def _on_report(self, report: StepReport) -> None:
        self.last_report = report
        for produced in report.produced:
            entry = self._requests.get(produced.request)
            if entry is None:  # cancelled meanwhile
                continue
            seq, queue = entry
            if produced.prompt_logprobs:
                seq.prompt_logprobs = produced.prompt_logprobs
            if produced.chunk.finish_reason:
                del self._requests[produced.request]
            queue.put_nowait(produced.chunk)
        if self._on_step:
            try:
                self._on_step(report.batch_size, report.waiting)
            except Exception:  # metrics must never stop the replica
                logger.exception("step metrics failed")

    def _stopped(self, error: BaseException) -> None:
        """The child is gone: every request in flight fails, and so does the health check from now on."""
        if self.loop_failed is None:
            # The socket closes as the child dies, a moment before the kernel reports its exit code.
            try:
                code = self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            self.loop_failed = RuntimeError(f"the engine process stopped (exit code {code}): {error!r}")
            logger.error("%s", self.loop_failed)
        self._fail_all()

    def _fail_all(self) -> None:
        for _, queue in self._requests.values():
            queue.put_nowait(Chunk(GENERATION_FAILED, "error", 0))
        self._requests.clear()


async def _serve_engine(channel: Channel, engine: Engine) -> None:
    """The child's loop: submissions become ContinuousBatcher requests; each step's chunks go back at once."""
    loop = asyncio.get_running_loop()
    report: StepReport | None = None
    tasks: dict[int, asyncio.Task] = {}
    closed = loop.create_future()

    def send_report() -> None:
        nonlocal report
        channel.send(report)
        report = None

    def on_step(batch_size: int, waiting: int) -> None:
        # Called after the step's chunks are queued: the requests' tasks, woken first, add them to the report.
        nonlocal report
        report = StepReport(batch_size, waiting, len(engine.live), engine.times)
        loop.call_soon(send_report)

    batcher = ContinuousBatcher(engine, on_step=on_step, step_in_thread=False)

    async def forward(submit: Submit) -> None:
        seq = Sequence(submit.prompt, submit.params)
        first = True
        try:
            async for chunk in batcher.generate(seq, whole=submit.whole):
                report.produced.append(Produced(submit.request, chunk, seq.prompt_logprobs if first else []))
                first = False
        finally:
            tasks.pop(submit.request, None)

    def on_message(message: Submit | Cancel) -> None:
        if isinstance(message, Submit):
            tasks[message.request] = loop.create_task(forward(message))
        elif message.request in tasks:
            tasks.pop(message.request).cancel()

    def on_closed(error: BaseException) -> None:  # the replica is gone
        closed.set_result(None)

    channel.start(loop, on_message, on_closed)
    while not closed.done():
        await asyncio.wait([closed], timeout=1.0)
        if batcher.loop_failed is not None:  # built not to happen; the replica's health check sees the exit
            raise RuntimeError("the decode loop stopped") from batcher.loop_failed


def main() -> None:
    # A crash (a signal: CUDA, a native extension) would end the process without a word: its stack goes to
    # stderr, the replica's log, beside the replica's "the engine process stopped (exit code -N)".
    faulthandler.enable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    channel = Channel(socket.socket(fileno=int(sys.argv[1])))
    spec: EngineSpec = channel.receive_now(timeout_s=None)
    start = time.perf_counter()
    try:
        engine = spec.build()
    except Exception as error:
        logger.exception("the engine could not be built")
        channel.send_now(StartFailed(f"the engine could not be built: {error}"))
        sys.exit(1)
    logger.info("engine built in %.1f s", time.perf_counter() - start)
    channel.send_now(StepReport(0, 0, 0, engine.times))
    asyncio.run(_serve_engine(channel, engine))
