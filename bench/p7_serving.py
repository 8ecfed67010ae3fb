"""P7: serving engine tokens/s at batch 1 / 32 / 64 on a GPU, per precision; through HTTP at 64 clients ÷ the engine.

    python bench/p7_serving.py [--checkpoint EXPORT] [--precisions bf16,int8,fp8] [--profile]
                               [--no-http | --http-only | --perplexity-only]

Needs a GPU (``--device cpu`` runs the same measurements on a CPU, slowly: ``--set`` a smaller shape).
Without --checkpoint it exports an untrained GPT of the ``small`` recipe's shape (128.6M params,
byte vocabulary, context 1024): tokens/s do not depend on the weights. With a trained export it also
gives each precision's validation perplexity through the serving decoder, relative to bf16.

Engine: ``run_batch`` of B requests (32-byte prompts, ``--max-tokens`` new tokens each, greedy), after
one untimed run of the same batch that captures its CUDA graphs; tokens/s = tokens generated / wall.
The decode step is compiled as served (``compile: auto``: on a GPU); the first precision is also measured
compiled and uncompiled, back to back, at batch 1 and 64.
HTTP: one Serve replica of the same export and precision behind each ``--ingress`` (Serve's Python proxy,
as raywright serves, then Ray's HAProxy ingress; each on a Ray of its own), 64 closed-loop clients for ``--seconds``,
÷ the continuous-batching engine in-process with 64 requests in flight for as long, after the same
5 s warm-up (serve_load.py's load generator and engine loop); for both, where the decode loop's time
went (per step: in the engine's step, and in the loop's turnaround; the share of prefilling; prompts per
prefill), the replica's from its /ready; and how long the replica took to start. Prints a JSON report.
``--profile`` adds where the time goes at batch 1 and 64 (first precision), for a steady decode step and
for the prefill of one prompt: wall time, GPU kernels and their summed time (the rest: the GPU idle while
the host works), and the costliest kernels.
"""

import argparse
import asyncio
import csv
import json
import logging
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import ray
import torch
from serve_load import engine_throughput, load, loop_summary, perplexity
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from serve.app import build_app
from serve.decoder import Decoder
from serve.engine import Engine, GenerationParams, LoopTimes, Sequence
from serve.ingress import HAPROXY_ENV
from train.config import config_from_dict, load_config
from train.data import dataset_path
from train.export import load_exported, save_export
from train.model import GPT
from train.node_copy import load_split
from train.run_layout import resolve_export
from train.tokenizer import ByteTokenizer

BATCHES = (1, 32, 64)
PROMPT_BYTES = 32
INGRESSES = ("proxy", "haproxy")


def untrained_export(overrides: list[str], directory: str) -> str:
    cfg = load_config("small", overrides)
    save_export(GPT(cfg.model).state_dict(), cfg.model, ByteTokenizer(), directory, provenance=None)
    return directory


def prompts(count: int) -> list[str]:
    """Prompts cut from this file's text: any text will do for throughput."""
    text = Path(__file__).read_text()
    starts = (i * PROMPT_BYTES % (len(text) - PROMPT_BYTES) for i in range(count))
    return [text[start : start + PROMPT_BYTES] for start in starts]


def warm_engine(
    export: str, precision: str, device: str, batch: int, max_tokens: int, compile: bool | str = "auto"
) -> tuple[Engine, Callable[[], list[Sequence]]]:
    """An engine of ``batch`` slots that has run one batch of this bench's prompts (so its decode graphs are
    captured), and a maker of that batch's requests: greedy, ``max_tokens`` new tokens each."""
    exported = load_exported(export)
    engine = Engine(Decoder(exported.model, batch, precision, device, compile=compile), exported.tokenizer)
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0)
    encoded = [[int(t) for t in exported.tokenizer.encode(p)] for p in prompts(batch)]

    def requests() -> list[Sequence]:
        return [Sequence(tokens, params) for tokens in encoded]

    engine.run_batch(requests())
    return engine, requests


def engine_tokens_per_s(
    export: str, precision: str, device: str, batch: int, max_tokens: int, compile: bool | str = "auto"
) -> float:
    engine, requests = warm_engine(export, precision, device, batch, max_tokens, compile)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    sequences = requests()
    engine.run_batch(sequences)
    return sum(seq.generated for seq in sequences) / (time.perf_counter() - start)


def profiled(work: Callable[[], object], repeats: int, device: str) -> dict:
    """``work()`` run ``repeats`` times: wall time each, the GPU kernels each runs and their summed time (the
    GPU idles for the rest of the wall time: the host's part), and the costliest kernels."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6 / repeats
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    busy_us = sum(sum(times) for times in kernels.values()) / repeats
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:12]
    return {
        "wall_us": wall_us,
        "kernels": sum(len(times) for times in kernels.values()) / repeats,
        "kernel_us": busy_us,
        "gpu_idle_fraction": 1 - busy_us / wall_us,
        "top_kernels": [
            f"{sum(times) / repeats:7.1f} us {len(times) / repeats:5.1f}x  {name[:90]}" for name, times in top
        ],
    }


def decode_profile(export: str, precision: str, device: str, batch: int, steps: int = 20) -> dict:
    """Where the time goes at ``batch``: a steady decode step (its CUDA graph replayed), and the prefill of one
    32-byte prompt, which each step that admits a request arriving alone runs (as HTTP's do)."""
    engine, requests = warm_engine(export, precision, device, batch, 64 + steps)
    engine.step(requests())
    engine.step([])
    prompt = requests()[0].prompt

    def prefill() -> None:  # into slot 0, over a live sequence's cache: the texts are not looked at any more
        engine.decoder.prefill([0], [prompt], [False])

    prefill()  # on a GPU: captures its graph
    return {
        "decode_step": profiled(lambda: engine.step([]), steps, device),
        "prefill_of_one_prompt": profiled(prefill, 10, device),
    }


def replica_loop_times(url: str) -> LoopTimes:
    with urllib.request.urlopen(f"{url}/ready", timeout=10) as reply:
        return LoopTimes(**json.load(reply)["decode_loop"])


def haproxy_servers() -> list[str]:
    """HAProxy's view of its backends' servers (its stats page, CSV): state, last check, errors, replies."""
    columns = ("pxname", "svname", "status", "check_status", "check_code", "check_desc", "econ", "eresp", "stot")
    columns += ("hrsp_2xx", "hrsp_5xx", "chkfail", "lastchg")
    port = os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats;csv", timeout=10) as reply:
            rows = list(csv.DictReader(reply.read().decode().lstrip("# ").splitlines()))
    except OSError as error:
        return [f"no stats from port {port}: {error}"]
    return [" ".join(f"{c}={row.get(c)}" for c in columns) for row in rows if row.get("svname") != "FRONTEND"]


# The processes a request passes through, by what their command lines hold.
SERVING_PROCESSES = {"proxy": "ProxyActor", "replica": "ServeReplica", "engine": "engine_process", "haproxy": "haproxy"}


def serving_cpu_seconds() -> dict[str, float]:
    """CPU seconds each serving process has used so far (summed over processes of one kind)."""
    used = dict.fromkeys(SERVING_PROCESSES, 0.0)
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        command = " ".join(process.info["cmdline"] or [])
        for kind, mark in SERVING_PROCESSES.items():
            if mark in command and process.info["cpu_times"] is not None:
                used[kind] += process.info["cpu_times"].user + process.info["cpu_times"].system
    return used


def http_load(
    export: str, precision: str, device: str, seconds: float, max_tokens: int, texts: list[str], ingress: str
) -> dict:
    """64 closed-loop clients asking to continue ``texts`` for ``seconds`` through one Serve replica on a local
    Ray with ``ingress`` in front (HAProxy or Serve's Python proxy), after a 5 s warm-up; where the replica's
    decode loop's time went, how long it took to start, the cores each serving process used, and the same load
    for one token (the request path's own cost); what failed, if anything (with HAProxy, its view of the
    replica too)."""
    for name in HAPROXY_ENV:
        os.environ.pop(name, None)
    if ingress == "haproxy":
        os.environ.update(HAPROXY_ENV)
    ray.init(address="local", _temp_dir=tempfile.mkdtemp(prefix="/tmp/rwb-"))
    from ray import serve

    host, port = "127.0.0.1", 8765
    url = f"http://{host}:{port}"
    serve.start(http_options={"host": host, "port": port})
    config = {"checkpoint": export, "precision": precision, "device": device, "max_batch_size": 64}
    start = time.perf_counter()
    serve.run(build_app({**config, "max_ongoing_requests": 64, "max_queued_requests": 1024}), name="p7")
    replica_start_s = time.perf_counter() - start  # on a GPU, with the decode step's compilation
    print(f"the replica was ready in {replica_start_s:.1f} s ({ingress} ingress)", flush=True)
    warm_up = asyncio.run(load(url, 64, 5.0, texts, max_tokens))  # captures the graphs
    print(f"warm-up through {ingress}: {json.dumps(warm_up)}", flush=True)
    before, cpu_before, start = replica_loop_times(url), serving_cpu_seconds(), time.perf_counter()
    http = asyncio.run(load(url, 64, seconds, texts, max_tokens))
    cpu_after, wall = serving_cpu_seconds(), time.perf_counter() - start
    # A process near 1.0 is saturated (Python serves on one thread): requests queue in it.
    http["cores_used"] = {kind: (cpu_after[kind] - cpu_before[kind]) / wall for kind in SERVING_PROCESSES}
    http["replica_start_s"] = replica_start_s
    if ingress == "haproxy":
        http["haproxy_servers"] = haproxy_servers()
    if http["failures"]:
        print(json.dumps(http, indent=2), flush=True)
    else:
        http["decode_loop"] = loop_summary(before, replica_loop_times(url))
        # The request path's own cost at this load: the same clients asking for one token each.
        http["one_token"] = asyncio.run(load(url, 64, 5.0, texts, 1))
    serve.shutdown()
    ray.shutdown()
    return http


def http_over_engine(
    export: str, precision: str, device: str, seconds: float, max_tokens: int, ingresses: list[str]
) -> dict:
    """Requests/s through HTTP with each ingress in front ÷ the engine alone; the first is the headline."""
    texts = prompts(256)
    engine, engine_loop = engine_throughput(export, texts, 64, seconds, max_tokens, precision, device)
    print(f"the engine alone, 64 in flight: {engine:.1f} requests/s", flush=True)
    http = {}
    for ingress in ingresses:  # each figure printed once measured: a GPU lease may end before the next
        http[ingress] = point = http_load(export, precision, device, seconds, max_tokens, texts, ingress)
        point["over_engine"] = point["requests_per_s"] / engine
        print(
            f"through {ingress}: {point['requests_per_s']:.1f} requests/s, {point['over_engine']:.2f} of the engine",
            flush=True,
        )
    return {
        "engine_requests_per_s_64": engine,
        "engine_decode_loop": engine_loop,
        "http": http,
        "P7_http_over_engine_64": http[ingresses[0]]["over_engine"],
    }


def engine_report(export: str, precisions: list[str], args: argparse.Namespace) -> dict:
    """Tokens/s per precision and batch; compiled ÷ uncompiled; with ``--profile``, where a step's time goes."""
    report: dict = {
        "tokens_per_s": {
            precision: {
                batch: engine_tokens_per_s(export, precision, args.device, batch, args.max_tokens) for batch in BATCHES
            }
            for precision in precisions
        }
    }
    print(json.dumps(report["tokens_per_s"]), flush=True)
    # The decode step compiled ÷ uncompiled, first precision, each pair measured back to back.
    compiled = {
        batch: {
            setting: engine_tokens_per_s(export, precisions[0], args.device, batch, args.max_tokens, setting)
            for setting in (True, False)
        }
        for batch in (1, 64)
    }
    report["compiled_tokens_per_s"] = compiled
    report["compiled_over_uncompiled"] = {batch: pair[True] / pair[False] for batch, pair in compiled.items()}
    print(json.dumps(report["compiled_over_uncompiled"]), flush=True)
    if args.profile:
        report["decode_profile"] = {
            batch: decode_profile(export, precisions[0], args.device, batch) for batch in (1, 64)
        }
        print(json.dumps(report["decode_profile"], indent=2), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="an export or run dir; default: an untrained model of the small shape")
    parser.add_argument("--set", action="append", default=[], help="small-recipe overrides for the untrained model")
    parser.add_argument("--precisions", default="bf16,int8,fp8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each HTTP / engine load")
    parser.add_argument(
        "--ingress", default="proxy,haproxy", help="HTTP fronts to measure (proxy, haproxy), the first the headline"
    )
    parser.add_argument("--profile", action="store_true", help="where a decode step's time goes, at batch 1 and 64")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--no-http", action="store_true", help="skip the Serve measurement")
    parts.add_argument("--http-only", action="store_true", help="only HTTP ÷ the engine (first precision)")
    parts.add_argument(
        "--perplexity-only", action="store_true", help="only each precision's perplexity (a trained --checkpoint)"
    )
    args = parser.parse_args()
    # With times, for where a run's time goes: the decoder logs its compilation and each graph it captures.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    precisions = args.precisions.split(",")
    ingresses = args.ingress.split(",")
    if not set(ingresses) <= set(INGRESSES):
        parser.error(f"--ingress: {args.ingress!r}; give one or both of {', '.join(INGRESSES)}")

    if args.checkpoint:
        export = resolve_export(args.checkpoint)
    else:
        export = untrained_export(args.set, tempfile.mkdtemp(prefix="rw-p7-"))
    exported = load_exported(export)
    if args.perplexity_only and not exported.provenance:
        parser.error(f"--perplexity-only: {export} is not a training export (it records no training data)")
    report: dict = {"model": vars(exported.model.cfg), "params": exported.model.num_params(), "device": args.device}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    if not (args.http_only or args.perplexity_only):
        report.update(engine_report(export, precisions, args))
    if exported.provenance and not args.http_only:
        val = load_split(dataset_path(config_from_dict(exported.provenance.config)), "val")[:32][:, :256]
        ppl = {precision: perplexity(export, precision, val, args.device) for precision in precisions}
        report["perplexity"] = ppl
        report["perplexity_rise_over_first"] = {p: ppl[p] / ppl[precisions[0]] - 1 for p in precisions}
    if not (args.no_http or args.perplexity_only):
        report.update(http_over_engine(export, precisions[0], args.device, args.seconds, args.max_tokens, ingresses))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
