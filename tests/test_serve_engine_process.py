"""The decode loop in a child process (serve/engine_process.py), without Ray: what a replica relies on."""

import asyncio
import os
import shutil
import signal
import time
from dataclasses import replace

import pytest
import uvloop

from serve.engine import GENERATION_FAILED, Chunk, GenerationParams, Sequence
from serve.engine_process import EngineProcess, EngineSpec
from tests.test_serve_engine import PROMPTS, encode, make_engine, text_of

pytestmark = pytest.mark.unit


def spec(export: str, max_batch: int) -> EngineSpec:
    return EngineSpec(export, max_batch, "int8", "cpu", cuda_graphs=False, compile=False, torch_threads=1)


async def generated(engine: EngineProcess, prompt: str, params: GenerationParams, **options) -> list[Chunk]:
    return [chunk async for chunk in engine.generate(Sequence(encode(prompt), params), **options)]


def test_requests_through_the_engine_process_get_the_in_process_engine_text(memorized_export):
    """Greedy and seeded sampled requests, streamed and whole, with logprobs, sharing a batch of fewer slots
    than requests: each gets what the engine in this process gives it alone; one past its timeout frees its
    slot for the next."""
    batch_sizes = []
    engine = EngineProcess(spec(memorized_export, 3), on_step=lambda size, waiting: batch_sizes.append(size))
    params = [
        GenerationParams(max_tokens=6 + 5 * i, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2) for i in range(6)
    ]
    echoed = Sequence(encode(PROMPTS[0]), GenerationParams(max_tokens=4, temperature=0.0, prompt_logprobs=True))

    async def run() -> tuple[list[list[Chunk]], list[Chunk], list[Chunk]]:
        requests = [
            generated(engine, prompt, p, whole=i % 3 == 0)
            for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=False))
        ]
        texts = await asyncio.gather(*requests)
        echo = [chunk async for chunk in engine.generate(echoed)]
        late = await generated(engine, "K", replace(params[1], max_tokens=500), timeout_s=0.05)
        return texts, echo, late

    try:
        texts, echo, late = asyncio.run(run())
        after = asyncio.run(generated(engine, "Grüße", replace(params[1], max_tokens=5)))
    finally:
        engine.close()
    local = make_engine(memorized_export, "int8", max_batch=1)
    for prompt, p, chunks in zip(PROMPTS, params, texts, strict=False):
        alone = Sequence(encode(prompt), p)
        assert text_of(chunks) == local.run_batch([alone])[0]
        got, expected = ([lp for c in cs for lp in c.logprobs] for cs in (chunks, alone.chunks))
        assert [lp.token for lp in got] == [lp.token for lp in expected] and len(got) == p.max_tokens
        assert got[-1].logprob == pytest.approx(expected[-1].logprob, abs=1e-4)
    assert max(batch_sizes) == 3
    alone = Sequence(echoed.prompt, echoed.params)
    local.run_batch([alone])
    assert [lp.token for lp in echoed.prompt_logprobs] == echoed.prompt[1:]
    assert echoed.prompt_logprobs[-1].logprob == pytest.approx(alone.prompt_logprobs[-1].logprob, abs=1e-4)
    assert late[-1].finish_reason == "timeout"
    assert text_of(after) == " aus " and engine.loop_failed is None


def test_a_report_that_arrives_in_pieces_is_read_whole_on_uvloop(memorized_export):
    """A Serve replica's loop is uvloop, which made the socket non-blocking: a report not yet wholly arrived
    failed as if the child had gone, and every request then ended in error with the child alive (on an H200,
    after 318 requests). Eight whole answers with 20 alternatives per token make one report of ~190 kB, which
    arrives in pieces."""
    engine = EngineProcess(spec(memorized_export, 8))
    params = GenerationParams(max_tokens=80, temperature=0.0, logprobs=20)

    async def run() -> list[list[Chunk]]:
        return await asyncio.gather(*(generated(engine, "def ", params, whole=True) for _ in range(8)))

    try:
        answers = uvloop.run(run())
    finally:
        engine.close()
    assert engine.loop_failed is None
    assert [chunks[-1].finish_reason for chunks in answers] == ["length"] * 8
    assert all(len(chunks[-1].logprobs) == 80 for chunks in answers)


def _time_out(signum, frame):
    pytest.fail("the replica and its engine process wait for each other")


def test_a_replica_whose_loop_fell_behind_and_then_submits_a_burst_does_not_hang(memorized_export):
    """A replica's loop busy with other work (300 requests arriving) reads no reports meanwhile, so the child's
    reports fill the socket and the child waits to send; a burst of submissions then filled the socket the
    other way. Each end waited for the other to read: the replica's health checks, its requests and the decode
    loop all stopped (the redeploy test of test_serve.py, 2026-11-28)."""
    engine = EngineProcess(spec(memorized_export, 8))
    reporting = GenerationParams(max_tokens=90, temperature=0.0, logprobs=20)  # ~24 kB of reports a request
    short = GenerationParams(max_tokens=1, temperature=0.0)

    async def run() -> list[list[Chunk]]:
        busy = [asyncio.create_task(generated(engine, "def ", reporting)) for _ in range(64)]
        while engine.in_flight == 0:
            await asyncio.sleep(0.01)
        time.sleep(3)  # the loop is elsewhere: ~1.5 MB of reports pile up, far more than the socket holds
        burst = [asyncio.create_task(generated(engine, PROMPTS[0] * 4, short)) for _ in range(1000)]  # ~0.5 MB
        return await asyncio.gather(*busy, *burst)

    previous = signal.signal(signal.SIGALRM, _time_out)
    signal.alarm(60)
    try:
        answers = uvloop.run(run())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        engine.close()
    assert engine.loop_failed is None
    assert [chunks[-1].finish_reason for chunks in answers] == ["length"] * 1064


def test_a_crashed_engine_process_fails_its_requests_and_the_health_check(memorized_export, capfd):
    """Its requests in flight and any later one end with an error instead of waiting; ``loop_failed`` (the
    replica's health check) says why, so that Serve replaces the replica; the crash's stack is in the log."""
    engine = EngineProcess(spec(memorized_export, 2))
    long = GenerationParams(max_tokens=400, temperature=0.0)

    async def run() -> tuple[list[Chunk], list[Chunk]]:
        async with asyncio.timeout(60):
            request = asyncio.create_task(generated(engine, "K", long))
            while engine.in_flight == 0:
                await asyncio.sleep(0.01)
            os.kill(engine.process.pid, signal.SIGSEGV)
            return await request, await generated(engine, "Grüße", long)

    try:
        in_flight, later = asyncio.run(run())
    finally:
        engine.close()
    assert in_flight[-1] == Chunk(GENERATION_FAILED, "error", 0) and later == [in_flight[-1]]
    assert f"engine process stopped (exit code -{signal.SIGSEGV})" in str(engine.loop_failed)
    assert "Fatal Python error: Segmentation fault" in capfd.readouterr().err


def test_an_engine_that_cannot_be_built_says_why(memorized_export, tmp_path):
    broken = tmp_path / "export"
    shutil.copytree(memorized_export, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match="the engine could not be built: .*"):
        EngineProcess(spec(str(broken), 2))
