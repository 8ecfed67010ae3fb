"""The per-worker training loop that Ray Train runs: DeepSpeed engine, data, metrics, checkpoints.

Each (re)start of the worker group runs this function from the top: it restores the newest
complete checkpoint (converting it if the world size changed), then trains optimizer steps
``[restored step, max_steps)`` on the samples that those steps own, whatever the world size.
"""

import math
import time
from collections.abc import Callable
from typing import Any

import deepspeed
import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist

from train import checkpoint, storage
from train.config import config_from_dict
from train.data import load_split
from train.decisions import Notice, Rank0View, StepPolicy, share_rank0_view
from train.ds_config import build_ds_config
from train.early_checkpoint import latest_checkpoint_request, record_checkpoint
from train.export import export_model, export_uri
from train.hf_gpt2 import load_weights
from train.loader import SampleOrder, micro_batch_samples
from train.metrics import format_progress, memory_gb, peak_tflops
from train.model import GPT, flops_per_token
from train.run_files import JsonlLog
from train.schedule import lr_at
from train.timeline import describe_resize
from train.tokenizer import load_tokenizer

SAMPLE_LOG = "samples.jsonl"


def _to_batch(rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(rows.astype(np.int64)).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _mean_over_ranks(total: float, count: float, device: torch.device) -> float:
    pair = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


@torch.no_grad()
def evaluate(engine, val_rows: np.ndarray, micro_batch: int) -> float:
    """Mean validation loss. Every rank runs the same number of forward passes (ZeRO-3 needs that)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = len(val_rows) // world // micro_batch * micro_batch
    if per_rank == 0:
        raise ValueError(f"run.eval_samples must be >= optim.micro_batch_size x {world} workers")
    mine = val_rows[rank * per_rank : (rank + 1) * per_rank]
    engine.eval()
    total = 0.0
    for start in range(0, per_rank, micro_batch):
        _, loss = engine(*_to_batch(mine[start : start + micro_batch], engine.device))
        total += loss.item() * micro_batch
    engine.train()
    return _mean_over_ranks(total, per_rank, engine.device)


def _val_metrics(val_loss: float, tokens_per_byte: float) -> dict[str, float]:
    """Validation loss (nats per token), perplexity, and bits per byte, which compares across tokenizers."""
    return {
        "val_loss": val_loss,
        "val_perplexity": float(np.exp(val_loss)),
        "val_bpb": val_loss * tokens_per_byte / math.log(2),
    }


def _report(metrics: dict[str, Any], max_steps: int, report: Callable[[dict], None]) -> None:
    """Print a progress line from rank 0 and report (every rank reports, in step)."""
    metrics["time"] = time.time()
    if dist.get_rank() == 0:
        print(format_progress(metrics, max_steps), flush=True)
    report(metrics)


def _log_samples(log: JsonlLog | None, step: int, my_rows: np.ndarray, my_loss: float, device: torch.device) -> None:
    """Append the dataset rows every rank trained on in ``step``, and the step's loss, to the sample log.

    Rank 0 writes it directly (not through Ray's reports, the newest of which a restart can drop),
    so every step that finished is in it.
    """
    mine = torch.from_numpy(my_rows.astype(np.int64)).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    loss = _mean_over_ranks(my_loss, 1.0, device)
    if log is not None:
        log.append({"step": step, "world_size": len(gathered), "loss": loss, "rows": torch.cat(gathered).tolist()})


def train_loop(
    args: dict[str, Any],
    report: Callable[[dict], None] = ray.train.report,
    preemption_info: Callable[[], Any] = ray.train.get_preemption_info,
) -> None:
    """Ray Train worker entry point; also run directly, in one process, by single-worker sweep trials.

    ``args``: config (dict), run_uri, data_path, provenance, timeline (actor name or None),
    tokens_per_byte (of the dataset, for bits per byte).
    ``report`` and ``preemption_info`` default to Ray Train's; a Tune trial passes Tune's report.
    """
    cfg = config_from_dict(args["config"])
    run_uri = args["run_uri"]
    optim = cfg.optim
    torch.set_num_threads(cfg.scaling.cpus_per_worker)
    rank, world = dist.get_rank(), dist.get_world_size()
    timeline = ray.get_actor(args["timeline"]) if args.get("timeline") and rank == 0 else None
    startup = {"entered": time.time()}  # where a (re)start's seconds go, for the timeline's resize record

    tokenizer = load_tokenizer(args["data_path"])
    train_rows = load_split(args["data_path"], "train")
    val_rows = load_split(args["data_path"], "val")[: cfg.run.eval_samples]
    order = SampleOrder(len(train_rows), cfg.run.seed)
    startup["data_s"] = time.time() - startup["entered"]

    latest = checkpoint.latest_complete(run_uri)
    universal = latest is not None and checkpoint.needs_universal(latest, world)
    mark = time.time()
    if universal:
        checkpoint.convert_to_universal(latest)
    startup["convert_s"] = time.time() - mark

    mark = time.time()
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    model = GPT(cfg.model)
    if cfg.model.init_from and latest is None:
        load_weights(model, cfg.model.init_from)
    ds_config = build_ds_config(cfg, world, load_universal=universal)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config, dist_init_required=False
    )
    grad_accum = ds_config["gradient_accumulation_steps"]
    startup["engine_s"] = time.time() - mark

    step = 0
    if latest is not None:
        mark = time.time()
        checkpoint.load(engine, latest, universal)
        startup["load_s"] = time.time() - mark
        step = latest["step"]
        if rank == 0:
            via = f", converted from {latest['world_size']} workers" if universal else ""
            print(f"resumed from {latest['uri']} at step {step} on {world} workers{via}", flush=True)
    else:
        val_loss = evaluate(engine, val_rows, optim.micro_batch_size)
        _report({"step": 0, **_val_metrics(val_loss, args["tokens_per_byte"])}, optim.max_steps, report)
    node_ids = [None] * world
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    if timeline:
        timeline.attempt_started.remote(world, node_ids, step, startup)

    peak = peak_tflops(cfg.run.peak_tflops)
    tokens_per_step = optim.global_batch_size * cfg.model.seq_len
    metadata = {
        "world_size": world,
        "global_batch_size": optim.global_batch_size,
        "config": cfg.to_dict(),
        "tokenizer": tokenizer.spec(),
        "data_manifest_sha256": args["provenance"]["data_manifest_sha256"],
    }
    # Every rank gathers the rows; rank 0 writes them, and makes them visible at each checkpoint.
    sample_log = JsonlLog(storage.join(run_uri, SAMPLE_LOG)) if cfg.run.sample_log and rank == 0 else None
    first_step = step + 1
    policy = StepPolicy(cfg)
    preemption_check_every = 1  # steps; set from the measured step time at each loss report
    steps_to_preemption_check = 1
    last_save = time.time()  # the time-based schedule starts with the attempt
    answered_until = latest["time"] if latest else startup["entered"]  # early-checkpoint requests up to then
    save_seconds = 0.0
    window_loss, window_steps, window_time = 0.0, 0, 0.0  # since the last loss report
    while step < optim.max_steps:
        step_start = time.time()
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, optim)
        my_rows, step_loss = [], 0.0
        for micro_step in range(grad_accum):
            samples = micro_batch_samples(
                step, micro_step, rank, world, optim.global_batch_size, optim.micro_batch_size
            )
            rows = order.rows(samples)
            my_rows.append(rows)
            # Dropout masks depend on (seed, step, rank) only, so a resumed run draws the same ones.
            torch.manual_seed(hash((cfg.run.seed, step, micro_step, rank)) % 2**63)
            _, loss = engine(*_to_batch(train_rows[rows], engine.device))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / grad_accum
        window_loss += step_loss
        step += 1
        window_steps += 1
        step_seconds = time.time() - step_start
        window_time += step_seconds
        if timeline:
            timeline.step_done.remote(step, step_seconds, time.time())
        if cfg.run.sample_log:
            _log_samples(sample_log, step, np.concatenate(my_rows), step_loss, engine.device)

        metrics: dict[str, Any] = {}
        if step % cfg.run.log_every == 0 or step == optim.max_steps or step == first_step:
            # The same on every rank (an all-reduced time), so all ranks join the same checks.
            step_time = _mean_over_ranks(window_time, window_steps, engine.device)
            tokens_per_s = tokens_per_step / step_time
            preemption_check_every = max(1, round(cfg.checkpoint.preemption_check_s / step_time))
            metrics = {
                "step": step,
                "loss": _mean_over_ranks(window_loss, window_steps, engine.device),
                "lr": lr_at(step - 1, optim),
                "tokens_per_s": tokens_per_s,
                "step_time_s": step_time,
                "mfu": flops_per_token(cfg.model) * tokens_per_s / (peak * 1e12 * world) if peak else None,
                "memory_gb": memory_gb(),
                "samples_seen": step * optim.global_batch_size,
                "world_size": world,
            }
            window_loss, window_steps, window_time = 0.0, 0, 0.0
        resize = ray.get(timeline.latest_resize.remote()) if step == first_step and timeline else None
        if resize:
            print(describe_resize(resize), flush=True)
            metrics.update({f"resize_{key}": value for key, value in resize.items()})
        # Ask Ray about pre-emption every few steps (a round trip; the same steps on every rank, which
        # its agreement across workers needs), then decide this step's evaluation and checkpoint.
        steps_to_preemption_check -= 1
        poll = not policy.notice_seen and steps_to_preemption_check <= 0
        notice = None
        if poll:
            steps_to_preemption_check = preemption_check_every
            info = preemption_info()
            if info is not None:
                notice = Notice(deadline=info.deadline_ms / 1000 if info.deadline_ms else None)
        view = None
        if poll or policy.needs_view():
            requested = latest_checkpoint_request(run_uri) if poll and rank == 0 else 0.0
            mine = Rank0View(time.time(), last_save, step_seconds, save_seconds, requested, answered_until)
            view = share_rank0_view(mine, engine.device)
        decision = policy.decide(step, notice, view)
        if decision.evaluate:
            val_loss = evaluate(engine, val_rows, optim.micro_batch_size)
            metrics.update(step=step, **_val_metrics(val_loss, args["tokens_per_byte"]))
        reason = decision.checkpoint
        if reason:
            save_start = time.time()
            uri = checkpoint.save(
                engine,
                run_uri,
                step,
                {**metadata, "samples_seen": step * optim.global_batch_size, "reason": reason},
                cfg.checkpoint.keep_last,
                tokenizer,
            )
            last_save = answered_until = time.time()
            save_seconds = last_save - save_start
            if rank == 0:
                record_checkpoint(run_uri, last_save)
            if sample_log:
                sample_log.flush()
            metrics.update(step=step, checkpoint=uri)
            if timeline:
                timeline.checkpoint_saved.remote(step, reason)
                if reason == "preemption":
                    timeline.preemption_notice.remote()
        if metrics:
            _report(metrics, optim.max_steps, report)

    if sample_log:
        sample_log.flush()
    provenance = {**args["provenance"], "step": step, "config": cfg.to_dict()}
    export_model(engine, cfg.model, tokenizer, export_uri(run_uri), provenance)
