"""The memory model behind ``deepspeed.zero_stage: auto``: its choice, and its estimate against real engines."""

import pytest

from train.config import load_config
from train.memory import HEADROOM, activation_bytes, choose_zero_stage, measure_on_workers, model_state_bytes
from train.model import GPT
from train.schema import ConfigError

GIB = 2**30


def _needs(cfg, stage: int) -> int:
    return model_state_bytes(cfg, stage, cfg.scaling.min_workers) + activation_bytes(cfg)


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_are_16_bytes_per_parameter_unsharded_and_shard_with_the_stage(precision):
    cfg = load_config("small", [f"deepspeed.precision={precision}"])
    params = GPT(cfg.model).num_params()
    assert model_state_bytes(cfg, 0, 4) == 16 * params
    per_stage = [model_state_bytes(cfg, stage, 4) for stage in (0, 1, 2, 3)]
    assert per_stage == sorted(per_stage, reverse=True)
    # Stage 3 shards it all; in fp32 DeepSpeed adds a 4-byte master copy beside the 4-byte weights.
    assert per_stage[3] == pytest.approx(params * (20 if precision == "fp32" else 16) / 4, rel=0.01)
    assert model_state_bytes(cfg, 3, 8) < model_state_bytes(cfg, 3, 4)


@pytest.mark.unit
def test_auto_takes_the_lowest_stage_that_fits_and_says_why():
    cfg = load_config("medium")  # 382M parameters in bf16, 4 workers
    assert choose_zero_stage(cfg, 80 * GIB).stage == 0
    # Just too small for stage 0: the next stage that fits, and no lower one would have.
    capacity = int(_needs(cfg, 0) / HEADROOM) - 1
    choice = choose_zero_stage(cfg, capacity)
    assert choice.stage >= 1 and _needs(cfg, choice.stage) <= HEADROOM * capacity
    assert all(_needs(cfg, lower) > HEADROOM * capacity for lower in range(choice.stage))
    assert f"stage {choice.stage}" in choice.describe() and "4 workers" in choice.describe()
    # Fitting only at stage 3.
    assert choose_zero_stage(cfg, int(_needs(cfg, 3) / HEADROOM) + 1).stage == 3


@pytest.mark.unit
def test_an_elastic_run_chooses_at_its_smallest_size():
    fixed, elastic = (load_config("medium", [f"scaling.num_workers={workers}"]) for workers in ("2", "[2,4]"))
    capacity = int(_needs(fixed, 1) / HEADROOM) + 1  # stage 1 fits at 2 workers; at 4 workers stage 0 nearly does
    assert choose_zero_stage(elastic, capacity) == choose_zero_stage(fixed, capacity)
    assert choose_zero_stage(elastic, capacity).world_size == 2


@pytest.mark.unit
def test_a_model_that_fits_nowhere_is_a_config_error_naming_what_to_change():
    with pytest.raises(ConfigError, match="deepspeed.zero_stage auto: even stage 3 needs .* optim.micro_batch_size"):
        choose_zero_stage(load_config("medium"), 2 * GIB)


@pytest.mark.cluster
def test_the_estimate_matches_what_deepspeed_engines_hold(ray_session):
    configs = [
        load_config("tiny", [f"deepspeed.zero_stage={stage}", f"deepspeed.precision={precision}"])
        for precision in ("fp32", "bf16")
        for stage in (0, 1, 2, 3)
    ]
    for cfg, held in zip(configs, measure_on_workers(configs, workers=2), strict=True):
        estimate = model_state_bytes(cfg, cfg.deepspeed.zero_stage, 2)
        where = f"{cfg.deepspeed.precision} stage {cfg.deepspeed.zero_stage}: {estimate} estimated, {held:.0f} held"
        if cfg.deepspeed.zero_stage == 1:  # whole gradients counted: an upper bound of what is held after reduction
            assert held <= estimate <= 1.15 * held, where
        else:
            assert estimate == pytest.approx(held, rel=0.05), where
