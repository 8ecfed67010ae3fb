"""A run whose loss stops being finite ends at once, before a checkpoint keeps its weights (its newest checkpoints
stay good), without a restart; a sweep trial that diverges ends as the worst result (tests/test_tune.py).

With an lr of 1e30 the tiny model's weights are ~1e30 after step 1 (finite), and step 2's loss and gradients
are NaN. A checkpoint is taken after every step."""

import math

import pytest
import torch

from train import checkpoint, storage
from train.config import load_config
from train.launch import loop_args, run_training, run_uri
from train.loop import train_loop
from train.manifest import load_manifest
from train.metrics import read_metrics
from train.run_layout import export_uri
from train.stops import DivergedError
from train.timeline import read_summary

pytestmark = pytest.mark.cluster

DIVERGING = ["optim.lr=1e30", "optim.warmup_steps=0", "optim.max_steps=20", "checkpoint.every_steps=1"]


def assert_newest_checkpoint_is_finite_and_named(run: str, message: str) -> None:
    newest = checkpoint.latest_complete(run)
    assert f"(newest checkpoint: step {newest.step})" in message
    states = torch.load(f"{newest.uri}/mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert all(torch.isfinite(weights).all() for weights in states.values())


def test_a_diverging_run_ends_at_once_and_keeps_no_checkpoint_of_it(tiny_config):
    """2 workers, ZeRO-2: DeepSpeed skips the updates whose gradients are NaN; the loss report catches it."""
    cfg = tiny_config(*DIVERGING, "run.log_every=5", "run.name=diverges")
    with pytest.raises(DivergedError, match=r"the training loss up to step 5 is nan") as diverged:
        run_training(cfg)
    run = run_uri(cfg)
    assert_newest_checkpoint_is_finite_and_named(run, str(diverged.value))
    assert len(read_summary(run).world_size_timeline) == 1  # not restarted
    reports = read_metrics(run)
    assert reports[-1]["diverged"] == str(diverged.value)
    assert all(math.isfinite(m["loss"]) for m in reports if "loss" in m)  # no NaN was reported
    assert not storage.exists(export_uri(run))


def test_the_weights_are_checked_before_each_checkpoint(ray_session, process_group, tiny_dataset, tmp_path):
    """ZeRO-0 applies the NaN update: step 2's checkpoint is not taken. The loop as a one-rank sweep trial runs it."""
    settings = [*DIVERGING, "deepspeed.zero_stage=0", "scaling.num_workers=1", "run.log_every=20", "run.name=nan"]
    cfg = load_config("tiny", [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", *settings])
    reports = []
    args = loop_args(cfg, tiny_dataset, load_manifest(tiny_dataset)).to_dict()
    train_loop(args, reports.append, preemption_info=lambda: None)
    assert reports[-1]["step"] == 2 and "the weights after step 2 are not finite" in reports[-1]["diverged"]
    assert_newest_checkpoint_is_finite_and_named(run_uri(cfg), reports[-1]["diverged"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_fp16_run_reports_its_loss_scale_and_ends_at_once_where_no_scale_keeps_its_gradients_finite(tiny_config):
    """fp16 skips a step whose gradients overflow and halves its loss scale: the weights DeepSpeed keeps stay those
    of the last good step, and DeepSpeed raises once the scale is at its lowest (~18 overflowing steps from 2^16,
    before the loss report at step 40). The run ends there, diverged, rather than restarting to diverge again."""
    fp16 = ["deepspeed.precision=fp16", "scaling.use_gpu=true", "scaling.num_workers=1"]
    healthy = tiny_config(*fp16, "optim.max_steps=10", "run.log_every=5", "run.name=fp16")
    run_training(healthy)
    scales = [(m["loss_scale"], m["skipped_steps"]) for m in read_metrics(run_uri(healthy)) if "loss" in m]
    assert len(scales) == 3 and all(0 < scale <= 2**16 and 0 <= skipped <= 10 for scale, skipped in scales)

    no_checks_before_40 = ["checkpoint.every_steps=0", "run.log_every=40", "run.eval_every=40"]
    cfg = tiny_config(*fp16, *DIVERGING, "optim.max_steps=40", *no_checks_before_40, "run.name=overflows")
    with pytest.raises(DivergedError, match=r"the fp16 gradients of step \d+ overflow at the lowest loss scale"):
        run_training(cfg)
    run = run_uri(cfg)
    assert len(read_summary(run).world_size_timeline) == 1  # not restarted
    assert "overflow at the lowest loss scale" in read_metrics(run)[-1]["diverged"]
