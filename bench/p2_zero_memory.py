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
import tempfile

import ray
import torch
import torch.distributed as dist
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from train.config import config_from_dict, load_config
from train.ds_config import build_engine
from train.model import GPT


def held_tensor_bytes(*roots) -> int:
    """Bytes of the distinct storages reachable from ``roots`` through containers and DeepSpeed/optim objects."""
    storages, visited, total = set(), set(), 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
            stack += [t for t in (obj.grad, getattr(obj, "ds_tensor", None)) if t is not None]
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            stack += list(obj)
        elif type(obj).__module__.startswith(("deepspeed.runtime", "torch.optim", "deepspeed.ops")):
            stack += list(vars(obj).values())
    return total


def measure(args: dict) -> None:
    cfg = config_from_dict(args["config"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = build_engine(cfg, model, dist.get_world_size())
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.optim.micro_batch_size, cfg.model.seq_len + 1))
    for step in range(2):
        for micro_step in range(engine.gradient_accumulation_steps()):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            if step == 1 and micro_step == engine.gradient_accumulation_steps() - 1:
                params = list(engine.module.parameters())
                held = torch.tensor([held_tensor_bytes(params, engine.optimizer)], dtype=torch.float64)
            engine.step()
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(args["out"], "w") as f:
            json.dump({"bytes_per_worker": held.item()}, f)


def bytes_per_worker(stage: int, workers: int, overrides: list[str]) -> float:
    cfg = load_config("tiny", [f"deepspeed.zero_stage={stage}", f"scaling.num_workers={workers}", *overrides])
    out = tempfile.mktemp(suffix=".json")
    trainer = TorchTrainer(
        measure,
        train_loop_config={"config": cfg.to_dict(), "out": out},
        scaling_config=ScalingConfig(num_workers=workers),
        torch_config=TorchConfig(backend="gloo"),
    )
    trainer.fit()
    with open(out) as f:
        return json.load(f)["bytes_per_worker"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    # 8x512 (25.4M params) in bf16; micro-batch 4 splits tiny's global batch of 16 over 4 workers.
    model = ["model.d_model=512", "model.n_layer=8", "model.n_head=8"]
    default_set = [*model, "deepspeed.precision=bf16", "optim.micro_batch_size=4"]
    parser.add_argument("--set", action="append", default=default_set, help="a training config override")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False)
    zero0, zero3 = (bytes_per_worker(stage, args.workers, args.set) for stage in (0, 3))
    params = GPT(load_config("tiny", args.set).model).num_params()
    print(json.dumps({"P2": zero3 / zero0, "zero0_bytes": zero0, "zero3_bytes": zero3, "params": params}, indent=2))


if __name__ == "__main__":
    main()
