import subprocess
import sys

import pytest

from train.config import ConfigError, load_config, recipe_names


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_loads(recipe):
    load_config(recipe)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown key optim.lrr; optim allows: ['betas'"),
        ("nosuch.key=1", "unknown key nosuch"),
        ("deepspeed.zero_stage=5", "deepspeed.zero_stage: 5 is not one of [0, 1, 2, 3]"),
        ("deepspeed.precision=fp8", "deepspeed.precision: 'fp8' is not one of ['fp32', 'bf16', 'fp16']"),
        ("optim.max_steps=ten", "optim.max_steps: 'ten' is not a int"),
        ("optim.max_steps=true", "optim.max_steps: True is not a int"),
        ("optim.lr=-1", "optim.lr must be > 0"),
        ("model.n_head=3", "model.d_model (128) must be divisible by model.n_head (3)"),
        ("scaling.num_workers=[3,1]", "scaling.num_workers must be an int or [min, max]"),
        ("deepspeed.offload_params=true", "deepspeed.offload_params needs deepspeed.zero_stage 3"),
        ("deepspeed.config_file=/no/such.json", "deepspeed.config_file: no such file"),
        ("optim", "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config("tiny", [override])
    assert message in str(info.value)


def test_overrides_are_typed_and_ints_widen_to_floats():
    cfg = load_config("tiny", ["optim.lr=1", "scaling.num_workers=[1,2]", "run.name=exp1"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers) == (1, 2)
    assert cfg.run.name == "exp1"


def test_batch_that_cannot_divide_names_sizes_and_suggests():
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["optim.global_batch_size=32", "optim.micro_batch_size=4", "scaling.num_workers=[2,3]"])
    assert "[3] workers" in str(info.value) and "24 or 48" in str(info.value)


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(ConfigError, match="recipes in configs/: .*'tiny'"):
        load_config("nosuch")


def test_cli_rejects_bad_config_before_starting_ray():
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--set", "optim.lrr=1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "config error: unknown key optim.lrr" in proc.stderr
    assert "ray" not in proc.stderr.lower()
