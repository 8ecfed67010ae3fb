import pytest

from train.batching import check_batch_divides, failing_world_sizes, grad_accum_steps
from train.config import OptimConfig, load_config
from train.ds_config import build_ds_config, compiles
from train.schedule import lr_at

pytestmark = pytest.mark.unit


def test_warmup_then_cosine_to_floor():
    optim = OptimConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, optim) == pytest.approx(0.1)
    assert lr_at(9, optim) == pytest.approx(1.0)
    assert lr_at(60, optim) == pytest.approx(0.55)
    assert lr_at(110, optim) == pytest.approx(0.1)
    assert all(lr_at(s, optim) >= lr_at(s + 1, optim) for s in range(10, 110))


def test_grad_accum_keeps_global_batch_for_every_world_size():
    for world in (1, 2, 3, 4, 6):
        assert grad_accum_steps(48, 4, world) * 4 * world == 48
    assert failing_world_sizes(32, 4, 1, 4) == [3]
    with pytest.raises(ValueError, match="not divisible"):
        grad_accum_steps(32, 4, 3)
    check_batch_divides(48, 4, 1, 4)


def test_ds_config_from_recipe_and_raw_json_override(tmp_path):
    raw = tmp_path / "ds.json"
    raw.write_text('{"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 0.5}')
    cfg = load_config("tiny", ["deepspeed.zero_stage=3", f"deepspeed.config_file={raw}"])
    ds = build_ds_config(cfg, world_size=2)
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 1
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * cfg.model.d_model
    assert ds["gradient_clipping"] == 0.5
    assert build_ds_config(cfg, world_size=1)["gradient_accumulation_steps"] == 2


def test_run_compile_auto_is_on_for_gpus_at_zero_0_and_1_only():
    def compiled(*overrides: str) -> bool:
        return compiles(load_config("tiny", list(overrides)))

    assert [compiled("scaling.use_gpu=true", f"deepspeed.zero_stage={s}") for s in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    assert not compiled("scaling.use_gpu=false", "deepspeed.zero_stage=0")
    assert compiled("run.compile=true", "deepspeed.zero_stage=3") and not compiled(
        "run.compile=false", "scaling.use_gpu=true"
    )
