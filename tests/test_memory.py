"""The memory model behind ``deepspeed.zero_stage: auto`` and ``optim.micro_batch_size: auto``: its choices,
and its estimate against real engines."""

from pathlib import Path

import pytest
import torch

from train.batching import grad_accum_steps
from train.config import load_config
from train.ds_config import reduce_bucket_elements
from train.memory import (
    HEADROOM,
    MAX_MICRO_BATCH_TOKENS,
    activation_bytes,
    measure_on_workers,
    measured_activation_bytes,
    micro_batch_candidates,
    model_and_batch,
    model_state_bytes,
    plan_memory,
    value_bytes,
)
from train.model import GPT
from train.schema import ConfigError, replace

GIB = 2**30


def _needs(cfg, stage: int, micro_batch: int = 4) -> int:
    return model_state_bytes(cfg, stage, cfg.scaling.min_workers) + activation_bytes(cfg, micro_batch)


def _medium(*overrides: str):
    """The medium recipe (382M parameters in bf16, 4 workers) at micro-batch 4 unless overridden."""
    return load_config("medium", ["optim.micro_batch_size=4", *overrides])


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_are_16_bytes_per_parameter_unsharded_and_shard_with_the_stage(precision):
    cfg = load_config("small", [f"deepspeed.precision={precision}"])
    params = GPT(cfg.model).num_params()
    assert model_state_bytes(cfg, 0, 4) == 16 * params
    per_stage = [model_state_bytes(cfg, stage, 4) for stage in (0, 1, 2, 3)]
    assert per_stage == sorted(per_stage, reverse=True)
    # Stage 3 shards it all; in fp32 DeepSpeed adds a 4-byte master copy beside the 4-byte weights. The gradient
    # bucket comes on top, a quarter of the weights' shard.
    weight = 4 if precision == "fp32" else 2
    bucket = weight * params / 4 / 4
    assert per_stage[3] == pytest.approx(params * (20 if precision == "fp32" else 16) / 4 + bucket, rel=0.01)
    assert model_state_bytes(cfg, 3, 8) < model_state_bytes(cfg, 3, 4)


@pytest.mark.unit
def test_auto_takes_the_lowest_stage_that_fits_and_says_why():
    cfg = _medium()
    assert plan_memory(cfg, 80 * GIB).stage == 0
    # Just too small for stage 0: the next stage that fits, and no lower one would have.
    capacity = int(_needs(cfg, 0) / HEADROOM) - 1
    plan = plan_memory(cfg, capacity)
    assert plan.stage >= 1 and _needs(cfg, plan.stage) <= HEADROOM * capacity
    assert all(_needs(cfg, lower) > HEADROOM * capacity for lower in range(plan.stage))
    assert plan.micro_batch_size == 4  # as set
    assert f"ZeRO stage {plan.stage}, micro-batch 4" in plan.describe() and "4 workers" in plan.describe()
    # Fitting only at stage 3.
    assert plan_memory(cfg, int(_needs(cfg, 3) / HEADROOM) + 1).stage == 3


@pytest.mark.unit
def test_an_elastic_run_chooses_at_its_smallest_size():
    fixed, elastic = (_medium(f"scaling.num_workers={workers}") for workers in ("2", "[2,4]"))
    capacity = int(_needs(fixed, 1) / HEADROOM) + 1  # stage 1 fits at 2 workers; at 4 workers stage 0 nearly does
    assert plan_memory(elastic, capacity) == plan_memory(fixed, capacity)
    assert plan_memory(elastic, capacity).world_size == 2


@pytest.mark.unit
def test_auto_micro_batch_splits_the_batch_at_every_size_and_is_the_largest_that_fits():
    cfg = load_config("small", ["scaling.num_workers=[2,4]"])  # global batch 480, micro_batch_size auto
    candidates = micro_batch_candidates(cfg)
    assert candidates == [1, 2, 4, 5, 8, 10, 20]  # 24 and 30 would not split 480 over 3 workers, 40 is > 32768 tokens
    for micro in candidates:
        assert all(grad_accum_steps(480, micro, world) for world in (2, 3, 4))
    assert max(candidates) * cfg.model.seq_len <= MAX_MICRO_BATCH_TOKENS
    plan = plan_memory(cfg, 80 * GIB)
    assert (plan.stage, plan.micro_batch_size) == (0, 20)
    # Less memory: stage 0 still holds a smaller micro-batch, the largest that fits.
    capacity = int(_needs(cfg, 0, 8) / HEADROOM) + 1
    assert (plan_memory(cfg, capacity).stage, plan_memory(cfg, capacity).micro_batch_size) == (0, 8)
    # A set stage is kept; the micro-batch fills what it leaves.
    staged = load_config("small", ["scaling.num_workers=[2,4]", "deepspeed.zero_stage=3"])
    assert plan_memory(staged, capacity).stage == 3 and plan_memory(staged, capacity).micro_batch_size == 10


def _bytes_saved_for_backward(cfg, micro_batch: int) -> int:
    """What autograd keeps from the forward pass of one micro-batch for the backward (weights excluded)."""
    model, tokens = model_and_batch(cfg, micro_batch)
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens[:, :-1], tokens[:, 1:])
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in saved.items() if pointer not in weights)


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_activation_estimate_bounds_what_autograd_saves(precision):
    """The estimate that sizes an auto micro-batch, against the model's real forward (2 of the small shape's layers)."""
    cfg = load_config("small", ["model.n_layer=2", f"deepspeed.precision={precision}"])
    saved = _bytes_saved_for_backward(cfg, 2)
    assert saved <= activation_bytes(cfg, 2) <= 1.10 * saved


@pytest.mark.unit
@pytest.mark.parametrize("checkpointing", ["false", "true"])
@pytest.mark.parametrize(
    "shape",
    [
        ["model.n_layer=2", "model.seq_len=256", "deepspeed.precision=fp32"],  # the small shape's width
        # Narrower: bf16 arithmetic on a CPU without bf16 instructions is what the fake tensors spare the other tests.
        ["model.n_layer=2", "model.seq_len=256", "model.d_model=128", "model.n_head=4", "deepspeed.precision=bf16"],
    ],
    ids=["fp32", "bf16"],
)
def test_fake_tensors_count_the_bytes_that_computing_holds(shape, checkpointing):
    """The memory measurements run the model on fake tensors: they count what the real forward and backward hold."""
    cfg = load_config("small", [*shape, f"deepspeed.activation_checkpointing={checkpointing}"])
    assert measured_activation_bytes(cfg, 2) == measured_activation_bytes(cfg, 2, compute=True)


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_holds_a_block_input_per_layer_and_the_estimate_bounds_it(precision):
    """The small shape's width, 4 layers of 256 tokens: recomputing each block keeps under a third of the
    activations, which the estimate bounds (it counts the recomputed block's activations whole)."""
    shape = ["model.n_layer=4", "model.seq_len=256", f"deepspeed.precision={precision}"]
    plain, checkpointed = (
        load_config("small", [*shape, f"deepspeed.activation_checkpointing={on}"]) for on in ("false", "true")
    )
    held = measured_activation_bytes(checkpointed, 2)
    assert held < measured_activation_bytes(plain, 2) / 3
    assert held <= activation_bytes(checkpointed, 2) <= 1.25 * held
    # What a layer more costs: its block's input alone.
    deeper = replace(checkpointed, model=replace(checkpointed.model, n_layer=8))
    per_layer = value_bytes(checkpointed) * 2 * checkpointed.model.seq_len * checkpointed.model.d_model
    assert measured_activation_bytes(deeper, 2) - held == pytest.approx(4 * per_layer, rel=0.05)


@pytest.mark.unit
def test_activation_checkpointing_lets_auto_take_a_larger_micro_batch_and_says_so():
    capacity = 24 * GIB  # an A10G, the cheap spot GPU
    plain = plan_memory(load_config("medium"), capacity)
    checkpointed = plan_memory(load_config("medium", ["deepspeed.activation_checkpointing=true"]), capacity)
    assert checkpointed.micro_batch_size > plain.micro_batch_size
    assert checkpointed.stage == plain.stage
    assert "activations (checkpointed)" in checkpointed.describe() and "checkpointed" not in plain.describe()


@pytest.mark.unit
def test_a_model_that_fits_nowhere_is_a_config_error_naming_what_to_change():
    needs = "even stage 3 at micro-batch 4 needs .* lower optim.micro_batch_size, .* deepspeed.activation_checkpointing"
    with pytest.raises(ConfigError, match=needs):
        plan_memory(_medium(), 2 * GIB)
    with pytest.raises(ConfigError) as refused:
        plan_memory(_medium("deepspeed.activation_checkpointing=true"), GIB)
    assert "activation_checkpointing" not in str(refused.value)  # already on: not offered again


@pytest.mark.cluster
def test_the_estimate_matches_what_deepspeed_engines_hold(ray_session):
    configs = [
        load_config("tiny", [f"deepspeed.zero_stage={stage}", f"deepspeed.precision={precision}"])
        for precision in ("fp32", "bf16")
        for stage in (0, 1, 2, 3)
    ]
    ray_results = Path.home() / "ray_results"  # Ray Train's default storage: the measuring run leaves nothing there
    before = set(ray_results.iterdir()) if ray_results.exists() else set()
    measured = measure_on_workers(configs, workers=2)
    assert (set(ray_results.iterdir()) if ray_results.exists() else set()) == before
    for cfg, held in zip(configs, measured, strict=True):
        stage = cfg.deepspeed.zero_stage
        # Stages 1-2 hold their gradient bucket through each backward pass (the peak the estimate is for) and free
        # it before the moment measured.
        transient = reduce_bucket_elements(cfg.model, stage, 2) * value_bytes(cfg) if stage in (1, 2) else 0
        estimate = model_state_bytes(cfg, stage, 2) - transient
        where = f"{cfg.deepspeed.precision} stage {cfg.deepspeed.zero_stage}: {estimate} estimated, {held:.0f} held"
        if cfg.deepspeed.zero_stage == 1:  # whole gradients counted: an upper bound of what is held after reduction
            assert held <= estimate <= 1.15 * held, where
        else:
            assert estimate == pytest.approx(held, rel=0.05), where
