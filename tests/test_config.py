import os

import pytest

from serve.config import ServeConfig
from train.config import TrainConfig, load_config, recipe_names
from train.launch import set_ray_train_env, train_worker_env
from train.schema import ConfigError, fields_help
from tune.config import SweepConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_shipped_recipe_loads(recipe):
    load_config(recipe)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown key optim.lrr; optim allows: ['betas'"),
        ("nosuch.key=1", "unknown key nosuch; the top level allows: ['checkpoint'"),
        ("deepspeed.zero_stage=5", "deepspeed.zero_stage: 5 is not one of [0, 1, 2, 3, 'auto']"),
        ("deepspeed.zero_stage=true", "deepspeed.zero_stage: must be 0, 1, 2, 3 or auto, got True"),
        (
            "deepspeed={zero_stage: auto, offload_optimizer: true}",
            "deepspeed: offload_optimizer needs zero_stage 1, 2 or 3, not auto",
        ),
        ("deepspeed.precision=fp8", "deepspeed.precision: 'fp8' is not one of ['fp32', 'bf16', 'fp16']"),
        ("optim.max_steps=ten", "optim.max_steps: 'ten' is not an integer"),
        ("optim.max_steps=true", "optim.max_steps: True is not an integer"),
        ("optim.max_steps=1e5", "optim.max_steps: 100000.0 is not an integer"),
        ("optim.lr=-1", "optim.lr: must be greater than 0, got -1"),
        ("optim.lr=.nan", "optim.lr: must be a finite number"),
        ("optim.lr='1e-3'", "optim.lr: '1e-3' is not a number"),  # quoted: a string, said so
        ("model.n_head=3", "model: d_model (128) must be divisible by n_head (3)"),
        ("model.n_head=0", "model.n_head: must be greater than or equal to 1, got 0"),
        ("scaling.num_workers=[3,1]", "scaling: num_workers must be >= 1, or [min, max]"),
        ("scaling.num_workers=true", "scaling.num_workers: True is not an integer or a list"),
        ("deepspeed.offload_params=true", "deepspeed: offload_params needs zero_stage 3"),
        ("deepspeed.precision=fp16", "deepspeed.precision fp16 needs GPU workers (scaling.use_gpu: true)"),
        ("run.name=..", "run.name: must be letters, digits"),
        ("run.name=a/b", "run.name: must be letters, digits"),
        ("run.eval_samples=0", "run.eval_samples: must be greater than or equal to 1, got 0"),
        ("optim.betas=[0.9]", "optim.betas: must have at least 2 items"),
        ("model=3", "model: 3 is not a mapping of keys"),
        ("optim", "must look like section.key=value"),
        ("optim.lr=[", "override 'optim.lr=[': not valid YAML"),
    ],
)
def test_bad_values_get_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_scientific_notation_and_ints_are_numbers():
    cfg = load_config("tiny", ["optim.lr=1e-3", "optim.eps=1E-8", "optim.weight_decay=0", "scaling.num_workers=[1,2]"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.eps == 1e-8
    assert cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers) == (1, 2)


def test_a_malformed_recipe_names_the_file_and_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("optim:\n  lr: 1e-3\n  betas: [0.9,\n")
    with pytest.raises(ConfigError, match=rf"{recipe}: not valid YAML at line \d+"):
        load_config(str(recipe))


def test_batch_that_cannot_divide_names_sizes_and_suggests():
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["optim.global_batch_size=32", "optim.micro_batch_size=4", "scaling.num_workers=[2,3]"])
    assert "[3] workers" in str(info.value) and "24 or 48" in str(info.value)


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="shipped recipes: .*'tiny'"):
        load_config("nosuch")


def test_a_config_survives_its_own_dict():
    cfg = load_config("tiny", ["scaling.num_workers=[1,2]", "cost.price_per_hour={spot: 1, ondemand: 3}"])
    assert TrainConfig.model_validate(cfg.to_dict()) == cfg


@pytest.mark.parametrize("schema", [TrainConfig, SweepConfig, ServeConfig])
def test_help_lists_every_field_with_a_description(schema):
    text = fields_help(schema)

    def leaves(model, prefix=""):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                yield from leaves(field.annotation, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field

    for key, field in leaves(schema):
        assert f"  {key}  (" in text, key
        assert field.description and len(field.description) > 10, f"{key} has no description"


def test_raywright_env_defaults_yield_to_the_users(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "99")
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    set_ray_train_env(load_config("tiny"))
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "99"  # the user's
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"  # raywright's default

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": "4096"}
    assert train_worker_env(load_config("small")) == malloc  # GPU workers: Ray gives each the GPUs it reserved


def test_a_cpu_runs_workers_use_the_cpu_and_see_no_gpu_wherever_ray_places_them():
    env = train_worker_env(load_config("tiny"))
    assert env["DS_ACCELERATOR"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_raywright_storage_is_the_default_storage_path(monkeypatch):
    monkeypatch.setenv("RAYWRIGHT_STORAGE", "s3://bucket/raywright")
    assert load_config("tiny").run.storage_path == "s3://bucket/raywright"
    assert load_config("tiny", ["run.storage_path=elsewhere"]).run.storage_path == "elsewhere"
    monkeypatch.delenv("RAYWRIGHT_STORAGE")
    assert load_config("tiny").run.storage_path == "runs"
