"""ZeRO's gradient buckets: seconds per step with raywright's bucket size (a quarter of the weights each
worker holds, train/ds_config.py) over those with Hugging Face's auto value (d_model^2, raywright's before).

    python bench/zero_buckets.py [--config tiny] [--stages 2 3] [--rounds 2] [--steps 30] [--profile] [--set K=V]

Per stage, rounds alternate the two sizes; the figure is the median over rounds of the ratio. Seconds per step
come from the run's report stamps, the first and last reports' windows left out (``steady_step_seconds``).
The losses of both must be the same: a bucket changes how gradients are batched into collectives, not their sums.
``--profile`` adds an untimed run per stage that profiles steps (run.profile_steps): rank 0 prints the top ops.
On one GPU: ``--config small --set scaling.num_workers=1 --set optim.micro_batch_size=8 --set
optim.global_batch_size=32 --set run.compile=false --stages 1 2 3`` (bench/gpu_checks.sh zero).
"""

import argparse
import json
import os
import tempfile

import numpy as np

from train.config import load_config
from train.launch import ensure_dataset, init_ray, run_training, run_uri
from train.metrics import read_metrics, steady_step_seconds


def losses_by_step(cfg) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_uri(cfg)) if "loss" in m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="rw-buckets-")
    base = [
        f"optim.max_steps={args.steps}",
        "optim.warmup_steps=2",
        "run.log_every=5",
        f"run.eval_every={args.steps}",
        "run.eval_samples=32",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0",
        f"run.storage_path={storage}",
        *args.set,
    ]
    cfg = load_config(args.config, base)
    init_ray(cfg)
    ensure_dataset(cfg)
    hf_auto = os.path.join(storage, "hf_auto_buckets.json")
    with open(hf_auto, "w") as f:
        json.dump({"zero_optimization": {"reduce_bucket_size": cfg.model.d_model**2}}, f)

    results = {}
    for stage in args.stages:
        seconds: dict[str, list[float]] = {"raywright": [], "hf_auto": []}
        loss_gap = 0.0
        for round_index in range(args.rounds):
            losses = {}
            for variant in ("raywright", "hf_auto") if stage else ("raywright",):  # stage 0 has no buckets
                overrides = [*base, f"deepspeed.zero_stage={stage}", f"run.name=z{stage}-{variant}-{round_index}"]
                if variant == "hf_auto":
                    overrides.append(f"deepspeed.config_file={hf_auto}")
                run = load_config(args.config, overrides)
                run_training(run)
                seconds[variant].append(steady_step_seconds(run_uri(run)))
                losses[variant] = losses_by_step(run)
            if len(losses) == 2:
                loss_gap = max(loss_gap, *(abs(a - losses["hf_auto"][s]) for s, a in losses["raywright"].items()))
        if args.profile:  # a run of its own: the profiler slows the steps it records
            profile = [f"run.profile_steps=[{args.steps - 3},{args.steps - 1}]", f"run.name=z{stage}-profile"]
            run_training(load_config(args.config, [*base, f"deepspeed.zero_stage={stage}", *profile]))
        ratios = [a / b for a, b in zip(seconds["raywright"], seconds["hf_auto"], strict=False)]
        results[f"zero{stage}"] = {
            "raywright_over_hf_auto": float(np.median(ratios)) if ratios else None,
            "ratios": ratios,
            "step_s": seconds,
            "largest_loss_difference": loss_gap,
        }
    print(json.dumps({"config": args.config, "set": args.set, **results}, indent=2))


if __name__ == "__main__":
    main()
