"""Bytes a training worker needs, and the ZeRO stage and micro-batch that fit them (``deepspeed.zero_stage:
auto``, ``optim.micro_batch_size: auto``).

Model states per parameter, with torch's AdamW (two fp32 moments): fp32 training holds a 4-byte
weight, a 4-byte gradient and 8 bytes of moments; bf16/fp16 hold a 2-byte weight and gradient, a
4-byte fp32 master copy and the 8 bytes of moments. Both are 16 B/param at stage 0, as
bench/p2_zero_memory.py measures. ZeRO stage 1 shards the optimizer's part over the workers (in
fp32 too, DeepSpeed then keeps an fp32 master partition beside the weights), stage 2 the gradients
too, stage 3 the weights too, except the small parameters DeepSpeed keeps whole on every rank
(``stage3_param_persistence_threshold``, set in train/ds_config.py). Stage 1 is counted with whole
gradients: they accumulate whole until the step's last backward pass reduces them. Stages 1-3 add
the gradient bucket that ZeRO reduces from (``reduce_bucket_size``, also set in train/ds_config.py).

Activations per micro-batch follow Korthikanti et al. (2022, "Reducing Activation Recomputation")
with fused attention (no seq x seq scores): about 17 values of the residual width per token per
layer, plus the logits and their float32 loss and gradient. With ``deepspeed.activation_checkpointing`` a
block keeps only its input (one value per token per layer), and the backward holds one block's activations
again while it recomputes them. Both bound what the model's forward and backward really hold for the small
shape (tests/test_memory.py); the gradients in flight during the backward are left to the headroom.
"""

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from train.batching import failing_world_sizes
from train.config import TrainConfig, config_from_dict
from train.ds_config import build_engine, persistence_threshold, reduce_bucket_elements
from train.model import GPT, param_sizes
from train.schema import ConfigError

HEADROOM = 0.85
"""Share of a worker's memory the estimate may fill: the rest is for the CUDA context, the allocator's
fragmentation and the communication buffers."""


MAX_MICRO_BATCH_TOKENS = 32 * 1024
"""An auto micro-batch holds at most this many tokens: at 32 x 1024 the 128M model ran at 40% MFU on an
H100 (34% at 8 x 1024), and a larger one would only widen what an error in the activation estimate costs."""


@dataclass(frozen=True)
class MemoryPlan:
    """The ZeRO stage and micro-batch a run trains with, and the estimate they were chosen from."""

    stage: int
    micro_batch_size: int
    world_size: int
    model_state_bytes: int
    activation_bytes: int
    capacity_bytes: int
    activation_checkpointing: bool

    def describe(self) -> str:
        gib = 2**30
        need = (self.model_state_bytes + self.activation_bytes) / gib
        activations = "activations (checkpointed)" if self.activation_checkpointing else "activations"
        return (
            f"memory plan: ZeRO stage {self.stage}, micro-batch {self.micro_batch_size}; a worker at the run's "
            f"smallest size ({self.world_size} workers) needs {self.model_state_bytes / gib:.2f} GiB of model states "
            f"+ {self.activation_bytes / gib:.2f} GiB of {activations} = {need:.2f} GiB, within {HEADROOM:.0%} of "
            f"{self.capacity_bytes / gib:.1f} GiB"
        )


def training_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the weights, gradients and activations at the run's training precision."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.deepspeed.precision]


def value_bytes(cfg: TrainConfig) -> int:
    """Bytes of one weight, gradient or activation value at the run's training precision."""
    return training_dtype(cfg).itemsize


def model_state_bytes(cfg: TrainConfig, stage: int, world_size: int) -> int:
    """Bytes of weights, gradients and optimizer state each of ``world_size`` workers holds at ``stage``."""
    weight = value_bytes(cfg)
    fp32_without_master = cfg.deepspeed.precision == "fp32" and stage == 0
    optimizer = 8 if fp32_without_master else 12  # the moments, and fp32 master weights
    sizes = param_sizes(cfg.model)
    params = sum(sizes)
    sharded = {0: 0, 1: optimizer, 2: optimizer + weight, 3: optimizer + 2 * weight}[stage]
    whole = optimizer + 2 * weight - sharded
    total = params * (whole + sharded / world_size)
    if stage == 3:  # persistent parameters keep their weight and gradient whole on every rank
        persistent = sum(n for n in sizes if n <= persistence_threshold(cfg.model.d_model))
        total += persistent * 2 * weight * (1 - 1 / world_size)
    if stage >= 1:  # the gradient bucket that ZeRO reduces from
        total += reduce_bucket_elements(cfg.model, stage, world_size) * weight
    return int(total)


def activation_bytes(cfg: TrainConfig, micro_batch: int) -> int:
    """Peak bytes of the activations and logits of a micro-batch of ``micro_batch`` sequences through the backward."""
    m, value = cfg.model, value_bytes(cfg)
    tokens = micro_batch * m.seq_len
    per_layer = value * tokens * m.d_model
    if cfg.deepspeed.activation_checkpointing:  # every block's input, and one block's activations recomputed
        layers = per_layer * (m.n_layer + 17)
    else:
        layers = 17 * per_layer * m.n_layer
    logits = tokens * m.vocab_size * (2 * value + 8)  # logits, their gradient, the float32 loss input and its grad
    return layers + logits


def micro_batch_candidates(cfg: TrainConfig) -> list[int]:
    """The micro-batch sizes ``optim.micro_batch_size: auto`` may take, smallest first: they split the global
    batch at every worker count in range, within ``MAX_MICRO_BATCH_TOKENS``."""
    o, s = cfg.optim, cfg.scaling
    if o.micro_batch_size != "auto":
        return [o.micro_batch_size]
    largest = o.global_batch_size // s.max_workers
    return [
        m
        for m in range(1, largest + 1)
        if not failing_world_sizes(o.global_batch_size, m, s.min_workers, s.max_workers)
        and (m == 1 or m * cfg.model.seq_len <= MAX_MICRO_BATCH_TOKENS)
    ]


def plan_memory(cfg: TrainConfig, capacity_bytes: int) -> MemoryPlan:
    """The lowest ZeRO stage at which a worker at the run's smallest size fits the smallest candidate micro-batch
    in ``HEADROOM`` of ``capacity_bytes``; then the largest micro-batch that fits at that stage.

    Lower stages communicate less and larger micro-batches keep a GPU busier. Both are fixed for a run
    from its smallest world size, where each worker holds the most: they fit at every size in range.
    A stage or micro-batch that the config sets is taken as it is.
    """
    world = cfg.scaling.min_workers
    stages = (0, 1, 2, 3) if cfg.deepspeed.zero_stage == "auto" else (cfg.deepspeed.zero_stage,)
    micro_batches = micro_batch_candidates(cfg)
    budget = HEADROOM * capacity_bytes
    for stage in stages:
        states = model_state_bytes(cfg, stage, world)
        fitting = [m for m in micro_batches if states + activation_bytes(cfg, m) <= budget]
        if fitting:
            activations = activation_bytes(cfg, fitting[-1])
            checkpointed = cfg.deepspeed.activation_checkpointing
            return MemoryPlan(stage, fitting[-1], world, states, activations, capacity_bytes, checkpointed)
    needed = (model_state_bytes(cfg, stages[-1], world) + activation_bytes(cfg, micro_batches[0])) / 2**30
    recompute = "" if cfg.deepspeed.activation_checkpointing else "set deepspeed.activation_checkpointing, "
    raise ConfigError(
        f"deepspeed.zero_stage {cfg.deepspeed.zero_stage}, optim.micro_batch_size {cfg.optim.micro_batch_size}: "
        f"even stage {stages[-1]} at micro-batch {micro_batches[0]} needs {needed:.2f} GiB per worker at {world} "
        f"workers, more than {HEADROOM:.0%} of the {capacity_bytes / 2**30:.1f} GiB a worker has; lower "
        f"optim.micro_batch_size, raise the smallest scaling.num_workers, {recompute}or set zero_stage 3 with "
        "deepspeed.offload_optimizer"
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


def model_and_batch(cfg: TrainConfig, micro_batch: int) -> tuple[GPT, torch.Tensor]:
    """The run's model as a DeepSpeed engine holds it (its precision, its activation checkpointing), seeded, and
    ``micro_batch`` random sequences of ``seq_len + 1`` tokens: what the measurements of its memory run."""
    torch.manual_seed(0)
    # Made in the run's dtype rather than cast to it: a cast cannot swap the tied embedding's weight of fake tensors.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(training_dtype(cfg))
    try:
        model = GPT(cfg.model, cfg.deepspeed.activation_checkpointing)
    finally:
        torch.set_default_dtype(default_dtype)
    return model, torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1))


def measured_activation_bytes(cfg: TrainConfig, micro_batch: int, *, compute: bool = False) -> int:
    """Activation bytes one forward and backward of ``micro_batch`` random sequences hold at their peak on the CPU, in
    the run's precision and with its activation checkpointing, as torch's memory tracker counts them (weights,
    gradients and the backward's temporaries not counted).

    The model runs on torch's fake tensors (shapes and dtypes, no values) unless ``compute``: the same bytes
    (tests/test_memory.py), without the arithmetic, which in bf16 on a CPU without bf16 instructions takes minutes.
    """
    # Imported here, not with the module: torch's tracker loads torch._dynamo and inductor (~1 s), which the driver
    # of every run, importing this module for the memory plan, would otherwise pay for what only P2 and tests use.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    with contextlib.nullcontext() if compute else FakeTensorMode():
        model, tokens = model_and_batch(cfg, micro_batch)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # held from the start, as a training step's are: the peak is the activations'
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")][_MemRefType.ACT]


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
            run_config=RunConfig(name="measure", storage_path=scratch),  # not a run of its own in ~/ray_results
        ).fit()
        with open(out) as f:
            return json.load(f)


def _measure_configs(args: dict) -> None:
    held = []
    for tree in args["configs"]:
        cfg = config_from_dict(tree)
        torch.manual_seed(0)
        engine = build_engine(cfg, GPT(cfg.model), dist.get_world_size())
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.optim.smallest_micro_batch, cfg.model.seq_len + 1))
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
