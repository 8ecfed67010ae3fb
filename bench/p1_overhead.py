"""P1: raywright's step time (1 worker, ZeRO-0) / a bare PyTorch loop, same model, batch, dtype, threads.

    python bench/p1_overhead.py [--steps 60] [--set model.d_model=256 ...]

Both train the same GPT on the same prepared data with one thread, fp32, the recipe's
global and micro batch (gradient accumulation included) and gradient clipping. The bare loop
runs before and after raywright and is averaged. raywright's time per step comes from the
wall-clock stamps of its own reports (``steady_step_seconds``: the first report's window, start-up
and warm-up, and the last's, the final evaluation and save, left out), so it includes everything
the loop does per step (sample order, reports, metrics); the bare loop leaves out the same
warm-up steps.
The machine is shared and noisy: rounds alternate bare, raywright, bare, ... and P1 is the
median over rounds of raywright / the mean of the bare runs around it.

Each round also runs the bare loop as the train function of a plain one-worker Ray Train run:
raywright over that is raywright's own cost, that over the bare loop Ray Train's (its worker
process, the controller and actors beside it).
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from train.config import load_config
from train.ds_config import parameter_groups
from train.launch import ensure_dataset, init_ray, run_training, run_uri
from train.metrics import steady_step_seconds
from train.model import GPT
from train.node_copy import load_split
from train.schedule import lr_at


def bare_loop_step_time(cfg, rows: np.ndarray, steps: int, warmup: int) -> float:
    """Seconds per step over ``steps`` steps after ``warmup`` untimed ones, each on the global batch ``rows``."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model)
    o = cfg.optim
    opt = torch.optim.AdamW(parameter_groups(model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps)
    accum = o.global_batch_size // o.micro_batch_size
    tokens = torch.from_numpy(rows.astype(np.int64))
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o)
        for k in range(accum):
            batch = tokens[k * o.micro_batch_size : (k + 1) * o.micro_batch_size]
            _, loss = model(batch[:, :-1], batch[:, 1:])
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - start) / steps


def bare_loop_in_ray_train_step_time(cfg, rows: np.ndarray, steps: int, warmup: int) -> float:
    """``bare_loop_step_time`` in the worker of a one-worker, one-CPU Ray Train run on this machine."""
    out = os.path.join(cfg.run.storage_path, f"{cfg.run.name}-bare-in-ray-train.json")

    def train_fn() -> None:
        with open(out, "w") as f:  # the bench runs on one machine: the driver reads the worker's file
            json.dump(bare_loop_step_time(cfg, rows, steps, warmup), f)

    scaling = ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1})
    TorchTrainer(train_fn, scaling_config=scaling, run_config=RunConfig(storage_path=cfg.run.storage_path)).fit()
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    overrides = [
        "scaling.num_workers=1",
        "scaling.cpus_per_worker=1",
        "deepspeed.zero_stage=0",
        "deepspeed.precision=fp32",
        f"optim.max_steps={args.steps}",
        "run.log_every=10",
        f"run.eval_every={args.steps}",
        "checkpoint.every_steps=0",
        f"run.storage_path={tempfile.mkdtemp(prefix='rw-p1-')}",
        "run.name=p1",
        *args.set,
    ]
    cfg = load_config("tiny", overrides)
    init_ray(cfg)
    data_path, _ = ensure_dataset(cfg)
    rows = load_split(data_path, "train")[: cfg.optim.global_batch_size]  # the one batch every bare step trains on

    # raywright's timed window: from its first report after step 1 to its last before the final one.
    warmup, timed = cfg.run.log_every, args.steps - 2 * cfg.run.log_every
    bare = [bare_loop_step_time(cfg, rows, timed, warmup)]
    raywright, in_ray_train = [], []
    for round_index in range(args.rounds):
        cfg.run.name = f"p1-{round_index}"
        run_training(cfg)
        raywright.append(steady_step_seconds(run_uri(cfg)))
        in_ray_train.append(bare_loop_in_ray_train_step_time(cfg, rows, timed, warmup))
        bare.append(bare_loop_step_time(cfg, rows, timed, warmup))
    bare_around = [(bare[i] + bare[i + 1]) / 2 for i in range(args.rounds)]
    ratios = [r / b for r, b in zip(raywright, bare_around, strict=True)]
    result = {
        "P1": float(np.median(ratios)),
        "ratios": ratios,
        "raywright_over_bare_in_ray_train": float(np.median(np.divide(raywright, in_ray_train))),
        "bare_in_ray_train_over_bare": float(np.median(np.divide(in_ray_train, bare_around))),
        "raywright_step_s": raywright,
        "bare_in_ray_train_step_s": in_ray_train,
        "bare_step_s": bare,
        "model": vars(cfg.model),
        "global_batch": cfg.optim.global_batch_size,
        "micro_batch": cfg.optim.micro_batch_size,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
