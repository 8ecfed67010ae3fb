"""Bytes a training worker needs, and the ZeRO stage that fits them (``deepspeed.zero_stage: auto``).

Model states per parameter, with torch's AdamW (two fp32 moments): fp32 training holds a 4-byte
weight, a 4-byte gradient and 8 bytes of moments; bf16/fp16 hold a 2-byte weight and gradient, a
4-byte fp32 master copy and the 8 bytes of moments. Both are 16 B/param at stage 0, as
bench/p2_zero_memory.py measures. ZeRO stage 1 shards the optimizer's part over the workers (in
fp32 too, DeepSpeed then keeps an fp32 master partition beside the weights), stage 2 the gradients
too, stage 3 the weights too, except the small parameters DeepSpeed keeps whole on every rank
(``stage3_param_persistence_threshold``, set in train/ds_config.py). Stage 1 is counted with whole
gradients: they accumulate whole until the step's last backward pass reduces them.

Activations per micro-batch follow Korthikanti et al. (2022, "Reducing Activation Recomputation")
with fused attention (no seq x seq scores): about 17 values of the residual width per token per
layer, plus the logits and their float32 loss and gradient.
"""

import json
import os
import tempfile
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from train.config import TrainConfig, config_from_dict
from train.ds_config import build_engine, persistence_threshold
from train.model import GPT
from train.schema import ConfigError

HEADROOM = 0.85
"""Share of a worker's memory the estimate may fill: the rest is for the CUDA context, the allocator's
fragmentation and the communication buffers."""


@dataclass(frozen=True)
class StageChoice:
    """The ZeRO stage ``deepspeed.zero_stage: auto`` chose, and the numbers it chose it from."""

    stage: int
    world_size: int
    model_state_bytes: int
    activation_bytes: int
    capacity_bytes: int

    def describe(self) -> str:
        gib = 2**30
        need = (self.model_state_bytes + self.activation_bytes) / gib
        return (
            f"deepspeed.zero_stage auto: stage {self.stage}, the lowest whose estimate fits a worker at the run's "
            f"smallest size ({self.world_size} workers): {self.model_state_bytes / gib:.2f} GiB of "
            f"model states + {self.activation_bytes / gib:.2f} GiB of activations = {need:.2f} GiB, within "
            f"{HEADROOM:.0%} of {self.capacity_bytes / gib:.1f} GiB"
        )


def model_state_bytes(cfg: TrainConfig, stage: int, world_size: int) -> int:
    """Bytes of weights, gradients and optimizer state each of ``world_size`` workers holds at ``stage``."""
    weight = 4 if cfg.deepspeed.precision == "fp32" else 2
    fp32_without_master = cfg.deepspeed.precision == "fp32" and stage == 0
    optimizer = 8 if fp32_without_master else 12  # the moments, and fp32 master weights
    sizes = _param_sizes(cfg)
    params = sum(sizes)
    sharded = {0: 0, 1: optimizer, 2: optimizer + weight, 3: optimizer + 2 * weight}[stage]
    whole = optimizer + 2 * weight - sharded
    total = params * (whole + sharded / world_size)
    if stage == 3:  # persistent parameters keep their weight and gradient whole on every rank
        persistent = sum(n for n in sizes if n <= persistence_threshold(cfg.model.d_model))
        total += persistent * 2 * weight * (1 - 1 / world_size)
    return int(total)


def activation_bytes(cfg: TrainConfig) -> int:
    """Peak bytes of one micro-batch's activations and logits through the backward pass."""
    m = cfg.model
    value = 4 if cfg.deepspeed.precision == "fp32" else 2
    tokens = cfg.optim.micro_batch_size * m.seq_len
    layers = 17 * value * tokens * m.d_model * m.n_layer
    logits = tokens * m.vocab_size * (2 * value + 8)  # logits, their gradient, the float32 loss input and its grad
    return layers + logits


def choose_zero_stage(cfg: TrainConfig, capacity_bytes: int) -> StageChoice:
    """The lowest ZeRO stage whose estimate fits ``HEADROOM`` of ``capacity_bytes`` at the run's smallest size.

    Lower stages communicate less, so the lowest that fits is the fastest. The stage is fixed for the
    run from its smallest world size, where each worker holds the most: it fits at every size in range.
    """
    world = cfg.scaling.min_workers
    activations = activation_bytes(cfg)
    for stage in (0, 1, 2, 3):
        states = model_state_bytes(cfg, stage, world)
        if states + activations <= HEADROOM * capacity_bytes:
            return StageChoice(stage, world, states, activations, capacity_bytes)
    needed = (model_state_bytes(cfg, 3, world) + activations) / 2**30
    raise ConfigError(
        f"deepspeed.zero_stage auto: even stage 3 needs {needed:.2f} GiB per worker at {world} workers, more than "
        f"{HEADROOM:.0%} of the {capacity_bytes / 2**30:.1f} GiB a worker has; lower optim.micro_batch_size, "
        "raise the smallest scaling.num_workers, or set zero_stage 3 with deepspeed.offload_optimizer"
    )


def worker_capacity_bytes(device: torch.device, workers_on_node: int) -> int:
    """Memory one worker may use: its GPU's, or on CPU an equal share of the node's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return psutil.virtual_memory().total // workers_on_node


def measured_model_state_bytes(engine, tokens: torch.Tensor) -> int:
    """Bytes of model states ``engine`` holds while gradients are alive: after one optimizer step on ``tokens``
    (so that the moments exist), at the end of the next step's backward passes; the next step is then taken.

    Counted as the distinct tensor storages reachable from the parameters (with their ZeRO-3 partitions
    and gradients) and from the DeepSpeed optimizer (master weights, moments, flat gradient partitions).
    """
    held = 0
    for step in range(2):
        for micro_step in range(engine.gradient_accumulation_steps()):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            if step == 1 and micro_step == engine.gradient_accumulation_steps() - 1:
                held = _held_tensor_bytes(list(engine.module.parameters()), engine.optimizer)
            engine.step()  # DeepSpeed's step: every micro-step, an optimizer step at the accumulation boundary
    return held


def measure_on_workers(configs: list[TrainConfig], workers: int) -> list[int]:
    """What a DeepSpeed engine of each config holds per worker (the most over the ranks), ``measured_model_state_bytes``
    on ``workers`` Ray Train workers of the connected Ray (gloo; one run for all configs)."""
    with tempfile.TemporaryDirectory(prefix="raywright-memory-") as scratch:
        out = os.path.join(scratch, "held.json")
        TorchTrainer(
            _measure_configs,
            train_loop_config={"configs": [cfg.to_dict() for cfg in configs], "out": out},
            scaling_config=ScalingConfig(num_workers=workers),
            torch_config=TorchConfig(backend="gloo"),
        ).fit()
        with open(out) as f:
            return json.load(f)


def _measure_configs(args: dict) -> None:
    held = []
    for tree in args["configs"]:
        cfg = config_from_dict(tree)
        torch.manual_seed(0)
        engine = build_engine(cfg, GPT(cfg.model), dist.get_world_size())
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.optim.micro_batch_size, cfg.model.seq_len + 1))
        count = torch.tensor([measured_model_state_bytes(engine, tokens)], dtype=torch.float64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        held.append(int(count.item()))
    if dist.get_rank() == 0:
        with open(args["out"], "w") as f:
            json.dump(held, f)


def _held_tensor_bytes(*roots) -> int:
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


def _param_sizes(cfg: TrainConfig) -> list[int]:
    with torch.device("meta"):  # shapes only: no memory, no initialization
        return [p.numel() for p in GPT(cfg.model).parameters()]
