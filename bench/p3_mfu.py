"""P3: MFU of ``python -m train`` on one GPU, defaults as shipped, and its ratio to a bare compiled PyTorch loop.

    python bench/p3_mfu.py [--config small] [--steps 40] [--set KEY=VALUE ...]

Needs a GPU. raywright trains the recipe on one worker (its own choices: ZeRO stage, micro-batch,
compile); its seconds per step come from the wall-clock stamps of its reports after the first
(compilation and warm-up excluded). The bare loop trains the same model on the same rows with what
raywright chose (micro-batch, gradient accumulation to the same global batch, torch.compile or not,
bf16 autocast, torch's fused AdamW, gradient clipping), twice after raywright; the ratio is
raywright's step time over the mean of the two. raywright's own figures are printed before the bare
loops run, so that a GPU lease that ends during them still has those. MFU = tokens/s x train.model.flops_per_token /
the GPU's peak (train/metrics.py). It also gives P2's GPU figure: the memory plan's estimate
(train/memory.py) over the peak memory the worker allocated.

P1 on the GPU is the same ratio at ZeRO-0 without compiling on either side, inverted (raywright's time
over the bare loop's): ``--set deepspeed.zero_stage=0 --set run.compile=false``.
"""

import argparse
import json
import tempfile
import time

import numpy as np
import torch

from train.config import config_from_dict, load_config
from train.ds_config import compiles, parameter_groups
from train.export import load_exported
from train.launch import ensure_dataset, init_ray, run_training, run_uri
from train.memory import activation_bytes, model_state_bytes
from train.metrics import peak_tflops, read_metrics, steady_step_seconds
from train.model import GPT, flops_per_token
from train.node_copy import load_split
from train.schedule import lr_at

WARMUP_STEPS = 5  # the bare loop's steps before timing: compilation and the allocator's growth


def bare_step_seconds(cfg, rows: np.ndarray, steps: int, compiled: bool) -> float:
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model).cuda()
    o = cfg.optim
    opt = torch.optim.AdamW(
        parameter_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=True
    )
    forward = torch.compile(model) if compiled else model
    accum = o.global_batch_size // o.micro_batch_size
    tokens = torch.from_numpy(rows[: o.global_batch_size].astype(np.int64)).pin_memory()
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            torch.cuda.synchronize()
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o)
        for k in range(accum):
            batch = tokens[k * o.micro_batch_size : (k + 1) * o.micro_batch_size].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = forward(batch[:, :-1], batch[:, 1:])
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    del model, opt, forward
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    overrides = [
        "scaling.num_workers=1",
        f"optim.max_steps={args.steps}",
        f"optim.warmup_steps={args.steps // 2}",  # the recipe's warmup is longer than a measurement
        "run.log_every=5",
        f"run.eval_every={args.steps}",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0",
        f"run.storage_path={tempfile.mkdtemp(prefix='rw-p3-')}",
        "run.name=p3",
        *args.set,
    ]
    cfg = load_config(args.config, overrides)
    init_ray(cfg)
    data_path, _ = ensure_dataset(cfg)
    rows = load_split(data_path, "train")
    peak = peak_tflops(cfg.run.peak_tflops)

    summary = run_training(cfg)
    reports = [m for m in read_metrics(run_uri(cfg)) if "loss" in m][:-1]  # the last includes the export
    raywright = steady_step_seconds(run_uri(cfg))
    chosen = config_from_dict(load_exported(summary.export).provenance.config)  # the autos resolved
    compiled = compiles(chosen)
    tokens_per_step = cfg.optim.global_batch_size * cfg.model.seq_len

    def mfu(step_seconds: float) -> float:
        return flops_per_token(cfg.model) * tokens_per_step / step_seconds / (peak * 1e12)

    # P2 on the GPU: the memory plan's estimate against the peak the worker allocated (its metrics' memory_gb).
    estimate = model_state_bytes(chosen, chosen.deepspeed.zero_stage, 1) + activation_bytes(
        chosen, chosen.optim.micro_batch_size
    )
    peak_allocated = max(m["memory_gb"] for m in reports) * 2**30
    result = {
        "gpu": torch.cuda.get_device_name(),
        "P2_estimate_over_peak": estimate / peak_allocated,
        "estimate_gib": estimate / 2**30,
        "peak_allocated_gib": peak_allocated / 2**30,
        "P3_mfu": mfu(raywright),
        "raywright_step_s": raywright,
        "tokens_per_s": tokens_per_step / raywright,
        "zero_stage": chosen.deepspeed.zero_stage,
        "micro_batch": chosen.optim.micro_batch_size,
        "compiled": compiled,
        "model": vars(cfg.model),
        "global_batch": cfg.optim.global_batch_size,
    }
    print(json.dumps(result, indent=2), flush=True)
    bare = [bare_step_seconds(chosen, rows, args.steps, compiled) for _ in range(2)]
    result.update(
        bare_mfu=mfu(float(np.mean(bare))),
        P3_ratio_to_bare=float(np.mean(bare)) / raywright,
        P1_raywright_over_bare=raywright / float(np.mean(bare)),
        bare_step_s=bare,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
