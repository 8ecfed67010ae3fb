import pytest

from train.batching import check_batch_divides, failing_world_sizes, grad_accum_steps
from train.config import OptimConfig
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
