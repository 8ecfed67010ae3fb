"""Real Ray Train runs of real DeepSpeed engines on the tiny recipe (CPU, gloo, 2 workers)."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from ray._common.test_utils import wait_for_condition

from tests.conftest import interrupt_when, training_worker_pids
from train import checkpoint, storage
from train.config import DataConfig, load_config
from train.data import prepare
from train.export import load_exported
from train.launch import run_training, run_uri
from train.metrics import read_metrics
from train.schema import replace
from train.timeline import ELASTIC_SUMMARY, progress_of, read_summary

pytestmark = pytest.mark.cluster

# A DeepSpeed config that splits the tiny model's ZeRO-3 partitions into several optimizer sub-groups.
ZERO3_SUB_GROUPS = os.path.join(os.path.dirname(__file__), "zero3_sub_groups.json")


def _train_losses(cfg) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_uri(cfg)) if "loss" in m}


def test_zero_stages_1_2_3_learn_the_same_thing(tiny_config, tmp_path):
    losses, cfg_of = {}, {}
    for stage in (1, 2, 3):
        cfg = tiny_config(
            f"deepspeed.zero_stage={stage}",
            f"run.name=zero{stage}",
            "optim.max_steps=20",
            "run.eval_every=20",
            "run.log_every=5",
            *(["run.profile_steps=[3,4]"] if stage == 2 else []),
            *(["deepspeed.activation_checkpointing=true"] if stage == 3 else []),  # recomputing blocks, on 2 workers
        )
        summary = run_training(cfg)
        assert summary.steps == 20
        assert summary.final_val_loss < summary.initial_val_loss - 1.0
        losses[stage], cfg_of[stage] = _train_losses(cfg), cfg
        assert sorted(losses[stage]) == [1, 5, 10, 15, 20]  # the first step always reports
    # Every rank traced steps 3-4 of the ZeRO-2 run, phase by phase (and the profiler changed no loss below).
    for rank in (0, 1):
        trace = json.loads(storage.read_bytes(storage.join(run_uri(cfg_of[2]), "profile", f"steps3-4-rank{rank}.json")))
        phases = [event["name"] for event in trace["traceEvents"] if event.get("cat") == "user_annotation"]
        assert phases.count("forward") == phases.count("backward") == phases.count("optimizer_step") == 2
    # ZeRO partitions state, and the ZeRO-3 run recomputes its blocks' activations; neither may change the math.
    for step in (5, 10, 15, 20):
        assert losses[1][step] == pytest.approx(losses[2][step], abs=1e-4)
        assert losses[1][step] == pytest.approx(losses[3][step], abs=1e-4)

    # The ZeRO-3 export holds exactly the weights of the final checkpoint (under GPT-2's names).
    export = load_exported(summary.export)
    exported = export.model.state_dict()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(f"{summary.run_dir}/checkpoints", tag="step_00000020")
    assert set(exported) == set(consolidated) - {"lm_head.weight"}
    assert all(torch.equal(exported[name], consolidated[name]) for name in exported)
    provenance = export.provenance
    assert provenance.step == 20 and provenance.data_manifest_sha256
    assert provenance.config["deepspeed"]["zero_stage"] == 3
    assert provenance.evaluation.step == 20  # the final evaluation, as reported
    assert provenance.evaluation.val_loss == pytest.approx(summary.final_val_loss)

    # The autos pick stage 0 and the largest micro-batch (8 of 16 sequences at 2 workers) for the tiny model on
    # a CPU node; compiled too, that run learns the same thing (compiled kernels round differently: close, not equal).
    auto = tiny_config(
        "deepspeed.zero_stage=auto",
        "optim.micro_batch_size=auto",
        "run.compile=true",
        "run.name=auto",
        "optim.max_steps=20",
        "run.log_every=5",
    )
    auto_run = run_training(auto)
    chosen = load_exported(auto_run.export).provenance.config
    assert (chosen["deepspeed"]["zero_stage"], chosen["optim"]["micro_batch_size"]) == (0, 8)
    for step in (5, 10, 15, 20):
        assert _train_losses(auto)[step] == pytest.approx(losses[1][step], abs=1e-3)
    # An auto run keeps the stage its checkpoint was written with: the stage-3 run resumes at stage 3.
    resumed = run_training(
        replace(cfg, deepspeed=replace(cfg.deepspeed, zero_stage="auto"), optim=replace(cfg.optim, max_steps=25))
    )
    assert resumed.steps == 25
    assert load_exported(resumed.export).provenance.config["deepspeed"]["zero_stage"] == 3

    # Stopped (SIGTERM) while it converts the 2 workers' ZeRO-3 shards, an export says so and leaves neither the
    # export nor its scratch copy of the state (killed before, it left that copy: GBs for a real model).
    scratch, out, log = tmp_path / "scratch", f"{resumed.run_dir}/exports/step_00000020", tmp_path / "export.log"
    scratch.mkdir()
    command = [sys.executable, "-m", "train.export_checkpoint", resumed.run_dir, "--step", "20"]
    interrupt_when(command, log, lambda: any(scratch.glob("*/universal")), env={"TMPDIR": str(scratch)})
    said = log.read_text()
    assert said.strip().splitlines()[-1] == "interrupted", said[-3000:]
    assert list(scratch.iterdir()) == [] and not os.path.exists(out)

    # A checkpoint exported afterwards, in one process, holds exactly what its run exported at that step: through
    # the universal conversion of its 2 workers' ZeRO-3 shards, and from the whole state of a stage-0 checkpoint.
    auto_exported = load_exported(auto_run.export).model.state_dict()
    for run_dir, at_step_20 in ((resumed.run_dir, exported), (auto_run.run_dir, auto_exported)):
        out = f"{run_dir}/exports/step_00000020"
        command = [sys.executable, "-m", "train.export_checkpoint", run_dir, "--step", "20"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        said = f"to {out} (to serve it: python -m serve --checkpoint {out})"
        assert done.returncode == 0 and said in done.stdout, done.stderr[-3000:]
        later = load_exported(out)
        assert later.provenance.step == 20 and later.provenance.code_version
        assert all(torch.equal(tensor, at_step_20[name]) for name, tensor in later.model.state_dict().items())


def test_resume_skips_half_written_checkpoint_and_matches_uninterrupted_losses(tiny_config, caplog, capsys):
    cfg = tiny_config(
        "run.name=resume",
        "model.dropout=0.1",  # the resumed steps must draw the masks the uninterrupted ones drew
        "optim.max_steps=20",
        "checkpoint.every_steps=10",
        "run.log_every=1",
        "run.eval_every=100",
        "checkpoint.keep_last=5",
    )
    first = run_training(cfg)
    uninterrupted = _train_losses(cfg)
    assert sorted(uninterrupted) == list(range(1, 21))

    # Simulate a crash after step 10's checkpoint, in the middle of writing step 15's.
    run = first.run_dir
    shutil.rmtree(checkpoint.checkpoint_uri(run, 20))
    shutil.rmtree(f"{run}/export")
    half = checkpoint.checkpoint_uri(run, 15)
    shutil.copytree(checkpoint.checkpoint_uri(run, 10), half)
    storage.write_json(f"{half}/metadata.json", {**storage.read_json(f"{half}/metadata.json"), "step": 15})
    with open(f"{half}/mp_rank_00_model_states.pt", "r+b") as f:
        f.truncate(100)  # metadata written, but one shard cut short
    with caplog.at_level(logging.WARNING, logger="train.checkpoint"):
        assert checkpoint.latest_complete(run).step == 10
    assert "skipping incomplete checkpoint" in caplog.text and "step_00000015" in caplog.text

    resumed = run_training(cfg)
    assert resumed.steps == 20 and resumed.checkpoint == checkpoint.checkpoint_uri(run, 20)
    records = read_metrics(run_uri(cfg))
    after_resume = [m for m in records[len(uninterrupted) + 1 :] if "loss" in m]
    assert [m["step"] for m in after_resume] == list(range(11, 21))
    for m in after_resume:
        assert m["loss"] == pytest.approx(uninterrupted[m["step"]], abs=1e-6)

    # Run once more, finished: nothing trains, and the record of the training that did is kept as it was.
    elastic, written = read_summary(run), storage.read_bytes(f"{run}/{ELASTIC_SUMMARY}")
    capsys.readouterr()
    again = run_training(cfg)
    assert "'resume' is already trained to step 20 and exported; nothing to train" in capsys.readouterr().out
    assert again == resumed
    assert read_metrics(run_uri(cfg)) == records and storage.read_bytes(f"{run}/{ELASTIC_SUMMARY}") == written
    # A driver that stopped after the export, before it wrote that record: the same record, from the saved events.
    os.remove(f"{run}/{ELASTIC_SUMMARY}")
    assert run_training(cfg).elastic == elastic


@pytest.mark.parametrize(
    "zero",
    [
        # Sharded state, through DeepSpeed's universal conversion.
        ["run.name=offload", "deepspeed.zero_stage=1", "deepspeed.offload_optimizer=true"],
        # Whole state in one file, loaded as it is (the GPU recipes' auto stage on large GPUs): its conversion
        # failed ("can't find *_optim_states.pt files"), so a stage-0 run could not resize.
        ["run.name=zero0", "deepspeed.zero_stage=0", "deepspeed.precision=bf16"],
        # Several optimizer sub-groups (parameter groups, and partitions split at sub_group_size, as in large
        # models): DeepSpeed's ZeRO-3 universal load gave them one shared step counter.
        ["run.name=zero3", "deepspeed.zero_stage=3", f"deepspeed.config_file={ZERO3_SUB_GROUPS}"],
    ],
    ids=["zero1-offload", "zero0-bf16", "zero3"],
)
def test_restore_at_another_world_size_is_exact(tiny_config, zero):
    """2 workers checkpoint, 1 worker continues."""
    overrides = [
        *zero,
        "optim.max_steps=12",
        "checkpoint.every_steps=6",
        "run.log_every=4",  # the losses come from the sample log
        "run.eval_every=100",
        "run.sample_log=true",
    ]
    cfg = tiny_config(*overrides)
    first = run_training(cfg)
    shutil.rmtree(checkpoint.checkpoint_uri(first.run_dir, 12))
    sharded = cfg.deepspeed.zero_stage > 0
    # A conversion killed midway left a partial result (no done.json): it is redone, never loaded.
    partial = f"{checkpoint.checkpoint_uri(first.run_dir, 6)}/{checkpoint.UNIVERSAL}"
    if sharded:
        storage.write_bytes(f"{partial}/zero/cut-short.pt", b"half")

    resumed = run_training(tiny_config(*overrides, "scaling.num_workers=1"))
    assert resumed.steps == 12
    if sharded:
        assert storage.exists(f"{partial}/done.json") and not storage.exists(f"{partial}/zero/cut-short.pt")
    else:
        assert not storage.exists(partial)
    with open(f"{run_uri(cfg)}/samples.jsonl") as f:
        records = [json.loads(line) for line in f]
    uninterrupted = {r["step"]: r["loss"] for r in records[:12]}
    after = records[12:]
    assert [(r["step"], r["world_size"]) for r in after] == [(s, 1) for s in range(7, 13)]
    for r in after:  # Adam moments and step counts came through the conversion
        assert r["loss"] == pytest.approx(uninterrupted[r["step"]], abs=1e-5)


def _kill_a_worker_while_a_checkpoint_is_written(run: str, deadline: float) -> int:
    """SIGKILL a training worker while a step directory holds shards but no metadata; returns the step."""
    root = f"{run}/{checkpoint.CHECKPOINTS}"
    pids = training_worker_pids()
    while time.time() < deadline:
        for name in storage.list_dir(root):
            step_dir = f"{root}/{name}"
            if name.startswith("step_") and os.listdir(step_dir) and not os.path.exists(f"{step_dir}/metadata.json"):
                os.kill(pids[-1], signal.SIGKILL)
                return int(name.removeprefix("step_"))
        time.sleep(0.002)
    raise AssertionError(f"no checkpoint was being written in {root}")


def test_a_worker_killed_mid_checkpoint_then_a_second_failure_resume_from_complete_checkpoints(tiny_config):
    """keep_last 1: the half-written checkpoint neither counts as latest nor as the one kept, so a second
    failure still resumes from a complete checkpoint (a count of directories kept only the broken one)."""
    cfg = tiny_config(
        "run.name=killed",
        "optim.max_steps=40",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=1",
        "run.log_every=4",
        "run.eval_every=100",
    )
    result = []
    thread = threading.Thread(target=lambda: result.append(run_training(cfg)))
    thread.start()
    run = run_uri(cfg)
    wait_for_condition(lambda: progress_of(cfg.run.name).step >= 5, timeout=180)  # step 4's checkpoint exists
    killed_at = _kill_a_worker_while_a_checkpoint_is_written(run, time.time() + 60)
    wait_for_condition(lambda: progress_of(cfg.run.name).attempts == 2, timeout=120)
    wait_for_condition(lambda: progress_of(cfg.run.name).step >= killed_at + 6, timeout=120)
    os.kill(training_worker_pids()[0], signal.SIGKILL)  # the second failure, between checkpoints
    thread.join(timeout=300)

    assert result and result[0].steps == 40
    resumed_from = [segment.from_step for segment in result[0].elastic.world_size_timeline]
    # Attempt 2 resumed from the checkpoint before the broken one, attempt 3 from one written after it.
    assert resumed_from[:2] == [0, killed_at - 4] and resumed_from[2] >= killed_at, resumed_from
    kept = [name for name in storage.list_dir(f"{run}/{checkpoint.CHECKPOINTS}") if name.startswith("step_")]
    assert kept == ["step_00000040"]


@pytest.fixture(scope="module")
def small_dataset(ray_session, corpus_dir, tmp_path_factory) -> str:
    """The corpus prepared for the small recipe's 1024-token sequences."""
    out = str(tmp_path_factory.mktemp("datasets") / "small")
    prepare(DataConfig(source=f"{corpus_dir}/**/*.py", val_fraction=0.1), out, load_config("small").model.seq_len)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_small_shape_learns_on_a_gpu_with_each_zero_stage(small_dataset, tmp_path, stage):
    cfg = load_config(
        "small",
        [
            f"data.path={small_dataset}",
            f"run.storage_path={tmp_path}",
            f"deepspeed.zero_stage={stage}",
            "scaling.num_workers=1",
            "optim.global_batch_size=8",
            "optim.warmup_steps=5",
            "optim.max_steps=30",
            "run.eval_every=30",
            "run.eval_samples=16",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
            "run.compile=false",  # P3 runs the compiled recipe; here compiling would only cost minutes of GPU
            *(["deepspeed.activation_checkpointing=true"] if stage == 3 else []),  # recomputing blocks on a GPU
        ],
    )
    summary = run_training(cfg)
    assert summary.steps == 30
    assert summary.final_val_loss < summary.initial_val_loss - 0.5
    # Its last checkpoint, exported afterwards on the GPU, holds exactly the weights the run exported.
    command = [sys.executable, "-m", "train.export_checkpoint", summary.run_dir, "--out", f"{tmp_path}/again"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    final = load_exported(summary.export).model.state_dict()
    again = load_exported(f"{tmp_path}/again").model.state_dict()
    assert all(torch.equal(tensor, final[name]) for name, tensor in again.items())
