"""P2: per-worker bytes of parameters + gradients + optimizer state, ZeRO-3 / ZeRO-0, bf16, 4 workers.

    python bench/p2_zero_memory.py [--workers 4] [--set deepspeed.precision=fp32 ...]

Each worker builds the raywright engine for the stage, takes one optimizer step (so that Adam
moments exist), runs the next step's backward passes (so that gradients exist) and counts the
bytes of every distinct tensor storage held by the model's parameters (and their ZeRO-3
partitions), their gradients, and the DeepSpeed optimizer (master weights, moments, flat
gradient partitions, buffers). The figure is the largest count over the workers.
Ideal P2 at N workers: 1/N.
"""

import argparse
import json

import ray

from train.config import load_config
from train.memory import measure_on_workers, model_state_bytes
from train.model import GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    # 8x512 (25.4M params) in bf16; micro-batch 4 splits tiny's global batch of 16 over 4 workers.
    model = ["model.d_model=512", "model.n_layer=8", "model.n_head=8"]
    default_set = [*model, "deepspeed.precision=bf16", "optim.micro_batch_size=4"]
    parser.add_argument("--set", action="append", default=default_set, help="a training config override")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False)
    configs = [
        load_config("tiny", [f"deepspeed.zero_stage={stage}", f"scaling.num_workers={args.workers}", *args.set])
        for stage in (0, 3)
    ]
    zero0, zero3 = measure_on_workers(configs, args.workers)  # one Ray Train run builds both engines
    params = GPT(configs[0].model).num_params()
    estimate = model_state_bytes(configs[1], 3, args.workers)
    figures = {"P2": zero3 / zero0, "zero0_bytes": zero0, "zero3_bytes": zero3, "zero3_estimate": estimate}
    print(json.dumps({**figures, "params": params}, indent=2))


if __name__ == "__main__":
    main()
