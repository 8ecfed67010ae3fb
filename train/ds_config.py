"""Builds the DeepSpeed config for one world size from the typed training config, and the engine."""

import importlib
import json
import math
import os
import re
import sys
import warnings
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from train.batching import grad_accum_steps
from train.config import TrainConfig
from train.model import param_sizes
from train.model_config import ModelConfig


def build_ds_config(cfg: TrainConfig, world_size: int, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config for ``world_size`` workers, with ``deepspeed.config_file`` merged over it.

    ``load_universal``: the engine will restore a universal checkpoint (from another world size).
    The learning rate is set by the training loop every step from the schedule, so the schedule
    has no state to save or restore.
    """
    ds = cfg.deepspeed
    config: dict[str, Any] = {
        "train_batch_size": cfg.optim.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.optim.micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps(
            cfg.optim.global_batch_size, cfg.optim.micro_batch_size, world_size
        ),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": _zero_buckets(ds.zero_stage, cfg.model, world_size),
        "bf16": {"enabled": ds.precision == "bf16"},
        "fp16": {"enabled": ds.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 2**31 - 1,  # raywright reports its own metrics
        "wall_clock_breakdown": False,
    }
    if ds.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.scaling.use_gpu}
        # The step runs on the host, where DeepSpeed's CPU Adam (built from this entry) is the fast one.
        config["optimizer"] = _host_adam_entry(cfg)
    if ds.offload_params:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": cfg.scaling.use_gpu}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    if ds.config_file:
        with open(ds.config_file) as f:
            config = merge(config, json.load(f))
    return config


DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def build_engine(
    cfg: TrainConfig,
    model: torch.nn.Module,
    world_size: int,
    load_universal: bool = False,
    exempt_norms_and_biases: bool = True,
):
    """A DeepSpeed engine training ``model`` on this process's device; ``build_ds_config``'s arguments, and
    ``parameter_groups``'s exemption."""
    model.to(get_accelerator().current_device_name())  # where DeepSpeed puts it; the optimizer is built there
    _strip_cuda_arch_suffixes()
    _skip_inference_all_reduce_op()
    # DeepSpeed's ZeRO calls collectives that torch has deprecated, and the warning is not shown once per process:
    # something resets Python's record of shown warnings every step, so a 40-step ZeRO-3 run on 2 workers logged it
    # 1,400 times. Nothing a user can act on.
    warnings.filterwarnings("ignore", DEPRECATED_COLLECTIVES, FutureWarning)
    ds_config = build_ds_config(cfg, world_size, load_universal)
    if ds_config.get("optimizer") == _host_adam_entry(cfg) and not _host_adam_builds():
        # The offloaded step then runs torch's AdamW on the host: slower than DeepSpeed's, the same math.
        del ds_config["optimizer"]
        ds_config["zero_force_ds_cpu_optimizer"] = False
    if str(ds_config.get("optimizer", {}).get("type", "")).lower() != "muon":
        _import_deepspeed_muon_uncompiled()
    groups = parameter_groups(model, cfg.optim.weight_decay, exempt_norms_and_biases)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=_client_optimizer(cfg, ds_config, groups),
        model_parameters=groups,  # what a DeepSpeed-built optimizer (offload's CPU Adam) takes
        config=ds_config,
        dist_init_required=False,
    )
    if compiles(cfg):
        engine.compile()
    return engine


def compiles(cfg: TrainConfig) -> bool:
    """Whether the engine is compiled: ``run.compile``, with auto resolved for the run's devices and stage."""
    if cfg.run.compile != "auto":
        return cfg.run.compile
    return cfg.scaling.use_gpu and cfg.deepspeed.zero_stage in (0, 1)


def parameter_groups(
    model: torch.nn.Module, weight_decay: float, exempt_norms_and_biases: bool = True
) -> list[dict[str, Any]]:
    """The weight matrices and embeddings decay; biases and LayerNorm gains and shifts do not (decaying a gain
    pulls it toward 0, nothing a regularizer should do), as in GPT-2, nanoGPT and Megatron. Without the exemption,
    one group that all decays: the optimizer state of checkpoints raywright wrote before it, which a run resuming
    from one must build to load it (train/checkpoint.py, ``exempts_norms_and_biases``)."""
    params = list(model.parameters())  # a tied weight once
    if not exempt_norms_and_biases:
        return [{"params": params, "weight_decay": weight_decay}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _client_optimizer(
    cfg: TrainConfig, ds_config: dict[str, Any], groups: list[dict[str, Any]]
) -> torch.optim.AdamW | None:
    """torch's AdamW over ``groups``, or None where ``ds_config`` names the optimizer.

    DeepSpeed builds a configured AdamW as its FusedAdam, a JIT-built op: seconds of compiler probing
    on every worker (re)start, and a crash on images whose TORCH_CUDA_ARCH_LIST it cannot parse.
    torch's AdamW does the same math (fused into one kernel when the model is on CUDA) with nothing to build.
    """
    if "optimizer" in ds_config:
        return None
    return torch.optim.AdamW(groups, **_adamw_params(cfg), fused=groups[0]["params"][0].is_cuda)


def _host_adam_entry(cfg: TrainConfig) -> dict[str, Any]:
    return {"type": "AdamW", "params": _adamw_params(cfg)}


def _host_adam_builds() -> bool:
    """Whether DeepSpeed's CPU Adam, a JIT-built op, builds (or is built) here; rank 0 says why when it does not."""
    try:
        get_accelerator().create_op_builder("CPUAdamBuilder").load()
        return True
    except Exception as exc:  # a compiler missing or failing, an unparsable arch list: any build failure
        if dist.get_rank() == 0:
            print(f"DeepSpeed's CPU Adam could not be built ({exc}); the offloaded step runs torch's AdamW", flush=True)
        return False


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _import_deepspeed_muon_uncompiled() -> None:
    """DeepSpeed's ZeRO and bf16 optimizers import its Muon optimizer on every engine build, to ask whether the
    optimizer is Muon, and that import compiles Muon's kernels (``torch.compile``), which loads the compiler:
    1.5-2 s of every worker's (re)start on a CPU core (engine build 3.4-3.6 -> 1.5-1.6 s), more where workers
    share cores, and ~45 MB each. For a run that does not train with Muon, it is imported once here with the
    compiler off (``TORCHDYNAMO_DISABLE``, read where ``torch.compile`` is called): its kernels stay uncompiled,
    everything else is as it was."""
    if MUON_MODULE in sys.modules:
        return
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        if previous is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous


def _skip_inference_all_reduce_op() -> None:
    """DeepSpeed's communication backend builds its shared-memory all-reduce on a CPU when it starts: a JIT-built
    op, ~30 s of compiling on a machine's first run (and every run's where the build cache is not kept), which
    only its tensor-parallel inference calls (``inference_all_reduce``); training reduces through
    torch.distributed. Marked incompatible, as where it cannot build, it is not built. The mark must precede the
    backend (made once per process, by the first engine); DeepSpeed keeps that dict for such edits. Only where the
    accelerator has the op (CPUs): reading the dict probes every op DeepSpeed has, which GPU workers never did."""
    builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


_ARCH_SUFFIX = re.compile(r"^(\d+\.\d+)[a-z]+(\+PTX)?$")


def cuda_arch_list_for_deepspeed(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without arch-specific suffixes (``9.0a`` -> ``9.0``), which DeepSpeed's op builder
    parses as integers and crashes on; ``+PTX`` stays."""
    tokens = arch_list.replace(" ", ";").split(";")
    return ";".join(_ARCH_SUFFIX.sub(r"\1\2", token.strip()) for token in tokens if token.strip())


def _strip_cuda_arch_suffixes() -> None:
    """GPU images for Hopper and Blackwell set e.g. ``TORCH_CUDA_ARCH_LIST=9.0a``; the ops DeepSpeed builds need
    no arch-specific features, so they build for the plain arch."""
    current = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    usable = cuda_arch_list_for_deepspeed(current)
    if usable.split(";") != current.replace(" ", ";").split(";"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = usable
        if dist.get_rank() == 0:
            print(f"TORCH_CUDA_ARCH_LIST {current!r} is read as {usable!r} for DeepSpeed's op builds", flush=True)


def _adamw_params(cfg: TrainConfig) -> dict[str, Any]:
    o = cfg.optim
    return {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}


def _zero_buckets(stage: int, model: ModelConfig, world_size: int) -> dict[str, Any]:
    """ZeRO communication buffers sized from the model (DeepSpeed's defaults suit billion-parameter models)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero["reduce_bucket_size"] = reduce_bucket_elements(model, stage, world_size)
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * model.d_model**2)  # Hugging Face's auto value
        zero["stage3_param_persistence_threshold"] = persistence_threshold(model.d_model)
    return zero


def reduce_bucket_elements(model: ModelConfig, stage: int, world_size: int) -> int:
    """Gradient elements ZeRO reduces in one collective: a quarter of the weights each worker holds (all of them
    below stage 3, a 1/world_size share at stage 3), at most DeepSpeed's default (5e8).

    Each bucket is a collective plus DeepSpeed's bookkeeping (on a GPU, launches), the same cost whatever its
    size. At Hugging Face's auto value (d_model^2) the small model's backward reduced ~220 buckets per
    micro-batch, this size 4. On the CPU (tiny model, 2 workers, bench/zero_buckets.py) ZeRO-3 steps took 7%
    less time, ZeRO-2 steps 2% (within noise), losses unchanged. Its buffer holds the bucket at the weights' precision
    (train/memory.py counts it): at stage 3 it shrinks with the workers as the weights' shards do.
    """
    held = sum(param_sizes(model)) / (world_size if stage == 3 else 1)
    return int(min(max(math.ceil(held / 4), model.d_model**2), 5e8))


def persistence_threshold(d_model: int) -> int:
    """ZeRO-3 keeps parameters up to this many elements whole on every rank (norms, biases): gathering them
    would cost more than holding them."""
    return 10 * d_model


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``override`` into a copy of ``base``; the override wins on conflicts."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged
