"""Builds the DeepSpeed config for one world size from the typed training config."""

import json
from typing import Any

from train.batching import grad_accum_steps
from train.config import TrainConfig


def build_ds_config(cfg: TrainConfig, world_size: int, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config for ``world_size`` workers, with ``deepspeed.config_file`` merged over it.

    ``load_universal``: the engine will restore a universal checkpoint (from another world size).
    The learning rate here is only the initial value: the training loop sets it every step
    from the schedule, so the schedule has no state to save or restore.
    """
    ds = cfg.deepspeed
    config: dict[str, Any] = {
        "train_batch_size": cfg.optim.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.optim.micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps(
            cfg.optim.global_batch_size, cfg.optim.micro_batch_size, world_size
        ),
        "gradient_clipping": cfg.optim.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.optim.lr,
                "betas": list(cfg.optim.betas),
                "eps": cfg.optim.eps,
                "weight_decay": cfg.optim.weight_decay,
            },
        },
        "zero_optimization": _zero_buckets(ds.zero_stage, cfg.model.d_model),
        "bf16": {"enabled": ds.precision == "bf16"},
        "fp16": {"enabled": ds.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 2**31 - 1,  # raywright reports its own metrics
        "wall_clock_breakdown": False,
    }
    if ds.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.scaling.use_gpu}
    if ds.offload_params:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": cfg.scaling.use_gpu}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    if ds.config_file:
        with open(ds.config_file) as f:
            config = merge(config, json.load(f))
    return config


def _zero_buckets(stage: int, d_model: int) -> dict[str, Any]:
    """ZeRO communication buffers sized from the model, as Hugging Face's ``auto`` values do.

    DeepSpeed's defaults (5e8-element buckets: 2 GB in fp32 per buffer) suit billion-parameter
    models and dwarf the model state of smaller ones.
    """
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero["reduce_bucket_size"] = d_model * d_model
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * d_model * d_model)
        zero["stage3_param_persistence_threshold"] = 10 * d_model
    return zero


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``override`` into a copy of ``base``; the override wins on conflicts."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged
