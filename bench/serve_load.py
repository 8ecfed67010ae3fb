"""P6a/P6b/P6c: serving throughput, latency, Serve's overhead and the cost and gain of int8.

    python bench/serve_load.py [--checkpoint RUN_OR_EXPORT] [--seconds 12] [--max-tokens 32]

Without --checkpoint it first trains a 4-layer, 256-wide byte-level GPT (the tiny recipe, wider)
for a few minutes. Then, on one local Ray with one Serve replica (1 CPU, one torch thread):
- P6a: requests/s and p50/p99 latency at 1, 8, 32 and 64 concurrent clients for continuous
  batching, Ray's ``@serve.batch`` and no batching (a batch of one), all int8; the headline ratio
  (continuous ÷ no batching at 32 clients) is the median of ``--p6a-rounds`` back-to-back pairs, both
  apps deployed side by side, so that the machine's drift between two distant points cannot make it;
- P6b: throughput through Serve at 32 clients / the engine's own throughput with 32 requests
  in flight in-process, no HTTP;
- P6c: int8 / fp32 throughput at 32 clients through Serve, and validation perplexity of the
  served int8 model vs fp32 (computed through the serving decoder, head included).
Every client sends a prompt of 32 bytes cut from the validation split and asks for
``--max-tokens`` greedy tokens. Prints a JSON report.
"""

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import fields, replace

import aiohttp
import numpy as np
import ray
import torch
from ray import serve

from serve.app import build_app
from serve.decoder import Decoder
from serve.engine import ContinuousBatcher, Engine, GenerationParams, LoopTimes, Sequence
from train.config import config_from_dict, load_config
from train.data import dataset_path
from train.export import load_exported
from train.node_copy import load_split
from train.run_layout import resolve_export

CLIENTS = (1, 8, 32, 64)
PROMPT_BYTES = 32


def train_model(storage_path: str) -> str:
    from train.launch import run_training

    cfg = load_config(
        "tiny",
        [
            f"run.storage_path={storage_path}",
            "run.name=serve-bench",
            "model.n_layer=4",
            "model.d_model=256",
            "optim.max_steps=150",
            "run.eval_every=150",
        ],
    )
    return run_training(cfg).export


def prompts_from(rows: np.ndarray, count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    while len(texts) < count:
        row = rows[rng.randrange(len(rows))]
        start = rng.randrange(len(row) - PROMPT_BYTES)
        text = bytes(int(t) for t in row[start : start + PROMPT_BYTES] if t < 256).decode("utf-8", "ignore")
        if text.strip():
            texts.append(text)
    return texts


async def load(url: str, clients: int, seconds: float, prompts: list[str], max_tokens: int) -> dict:
    """``clients`` closed-loop clients for ``seconds``; requests/s, tokens/s and latency percentiles, and the
    failed requests' statuses with the first one's reply (None where none succeeded)."""
    latencies, tokens, failures, first_failure = [], [], Counter(), None
    deadline = time.perf_counter() + seconds

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal first_failure
        i = index
        while time.perf_counter() < deadline:
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0}
            i += clients
            start = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as reply:
                text = await reply.text()
            if reply.status != 200:
                failures[reply.status] += 1
                first_failure = first_failure or f"{reply.status}: {text[:300]}"
                continue
            latencies.append(time.perf_counter() - start)
            tokens.append(json.loads(text)["usage"]["completion_tokens"])

    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / wall,
        "tokens_per_s": sum(tokens) / wall,
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "failures": sum(failures.values()),
        "failure_statuses": dict(failures),
        "first_failure": first_failure,
    }


def engine_throughput(
    export: str,
    prompts: list[str],
    in_flight: int,
    seconds: float,
    max_tokens: int,
    precision: str = "int8",
    device: str = "cpu",
    warmup_s: float = 5.0,
) -> tuple[float, dict]:
    """Requests/s of the continuous-batching engine alone, ``in_flight`` requests at all times, each asking
    for its whole text at once (as the benchmarks' HTTP requests do), after ``warmup_s`` of the same load
    untimed, as the HTTP loads get: on a GPU that is where the decode step's CUDA graphs are captured.
    Its steps run on the event loop, as in a replica's engine process. Also where its decode loop's time went
    meanwhile (``loop_summary``)."""
    exported = load_exported(export)
    engine = Engine(Decoder(exported.model, in_flight, precision, device), exported.tokenizer)
    batcher = ContinuousBatcher(engine, step_in_thread=False)
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0)

    async def client(index: int, deadline: float) -> int:
        done, i = 0, index
        while time.perf_counter() < deadline:
            prompt = [int(t) for t in exported.tokenizer.encode(prompts[i % len(prompts)])]
            i += in_flight
            async for _ in batcher.generate(Sequence(prompt, params), whole=True):
                pass
            done += 1
        return done

    async def requests_per_s(duration: float) -> float:
        start = time.perf_counter()
        done = await asyncio.gather(*(client(i, start + duration) for i in range(in_flight)))
        return sum(done) / (time.perf_counter() - start)

    async def run() -> tuple[float, dict]:
        await requests_per_s(warmup_s)
        before = replace(engine.times)  # a copy: the engine adds to its own
        rate = await requests_per_s(seconds)
        return rate, loop_summary(before, engine.times)

    return asyncio.run(run())


def loop_summary(before: LoopTimes, after: LoopTimes) -> dict:
    """Where a decode loop's time went between two readings of its times (a replica's /ready has them):
    per step, in Engine.step and in the loop's own turnaround, and the share of prefilling."""
    done = LoopTimes(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(LoopTimes)})
    steps = max(done.steps, 1)
    return {
        "steps_per_s": done.steps / done.loop_s,
        "step_ms": 1000 * done.step_s / steps,
        "turnaround_ms": 1000 * (done.loop_s - done.step_s) / steps,
        "prefill_share": done.prefill_s / done.loop_s,
        "prompts_per_prefill": done.prompts_prefilled / max(done.prefills, 1),
    }


def perplexity(export: str, precision: str, rows: np.ndarray, device: str = "cpu") -> float:
    """exp(mean next-token cross-entropy) of ``rows`` through the serving decoder at ``precision``."""
    decoder = Decoder(load_exported(export).model, 1, precision, device, compile=False)  # prefill only
    losses = []
    for row in rows:
        tokens = [int(t) for t in row]
        (logits,) = decoder.prefill([0], [tokens[:-1]], [True])
        losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:], device=device)).item())
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="a training run or export dir; default: train one first")
    parser.add_argument("--seconds", type=float, default=12.0, help="load duration per measurement")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--p6a-rounds", type=int, default=3, help="back-to-back pairs for the P6a ratio")
    args = parser.parse_args()
    torch.set_num_threads(1)

    ray.init(address="local", _temp_dir=tempfile.mkdtemp(prefix="/tmp/rwb-"))
    export = resolve_export(args.checkpoint or train_model(tempfile.mkdtemp(prefix="rw-serve-bench-")))
    exported = load_exported(export)
    val = load_split(dataset_path(config_from_dict(exported.provenance.config)), "val")
    prompts = prompts_from(val, 256)
    report: dict = {"model": vars(exported.model.cfg), "max_tokens": args.max_tokens, "seconds_per_point": args.seconds}

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"

    def deploy(batching: str, precision: str, name: str) -> str:
        app = build_app(
            {
                "checkpoint": export,
                "batching": batching,
                "precision": precision,
                "max_batch_size": 64,
                "max_ongoing_requests": 64,
                "max_queued_requests": 1024,
            }
        )
        serve.run(app, name=name, route_prefix=f"/{name}")
        asyncio.run(load(f"{url}/{name}", 4, 2.0, prompts, args.max_tokens))  # warm up
        return f"{url}/{name}"

    variants = [("continuous", "int8", CLIENTS), ("serve_batch", "int8", CLIENTS), ("none", "int8", CLIENTS)]
    variants.append(("continuous", "fp32", (32,)))
    results: dict = {}
    for batching, precision, levels in variants:
        app_url = deploy(batching, precision, "bench")
        for clients in levels:
            point = asyncio.run(load(app_url, clients, args.seconds, prompts, args.max_tokens))
            results[f"{batching}/{precision}/{clients}"] = point
            print(batching, precision, clients, json.dumps(point), flush=True)
        serve.delete("bench")

    pair_urls = {batching: deploy(batching, "int8", batching) for batching in ("continuous", "none")}
    pairs = []
    for round_index in range(args.p6a_rounds):
        order = ("continuous", "none") if round_index % 2 == 0 else ("none", "continuous")
        rps = {}
        for batching in order:
            point = asyncio.run(load(pair_urls[batching], 32, args.seconds, prompts, args.max_tokens))
            rps[batching] = point["requests_per_s"]
        pairs.append(rps)
        print("P6a pair", json.dumps(rps), flush=True)
    serve.shutdown()

    engine_rps, _ = engine_throughput(export, prompts, 32, args.seconds, args.max_tokens)
    ppl = {precision: perplexity(export, precision, val[:64]) for precision in ("fp32", "int8")}
    at32 = {
        name: results[f"{name}/32"]["requests_per_s"]
        for name in ("continuous/int8", "serve_batch/int8", "none/int8", "continuous/fp32")
    }
    report.update(
        {
            "points": results,
            "P6a_continuous_over_no_batching_32": statistics.median(p["continuous"] / p["none"] for p in pairs),
            "P6a_pairs": pairs,
            "P6a_continuous_over_no_batching_32_sweep": at32["continuous/int8"] / at32["none/int8"],
            "P6a_serve_batch_over_no_batching_32": at32["serve_batch/int8"] / at32["none/int8"],
            "P6b_serve_over_engine_32": at32["continuous/int8"] / engine_rps,
            "engine_requests_per_s_32": engine_rps,
            "P6c_int8_over_fp32_32": at32["continuous/int8"] / at32["continuous/fp32"],
            "perplexity": ppl,
            "P6c_perplexity_rise": ppl["int8"] / ppl["fp32"] - 1,
            "cpus": os.cpu_count(),
        }
    )
    print(json.dumps(report, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
