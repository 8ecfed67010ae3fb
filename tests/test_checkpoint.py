"""Checkpoint bookkeeping that must never lose the last good checkpoint, nor leave a node's disk filling (no Ray)."""

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import metadata_json, run_record
from train import checkpoint, storage
from train.checkpoint_writer import BackgroundWriter
from train.config import load_config
from train.ds_config import build_engine
from train.export_checkpoint import check_out, default_out, find_checkpoint
from train.model import GPT
from train.preflight import check_resume
from train.run_layout import resolve_export
from train.schema import ConfigError
from train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit


def _step(run, step: int, complete: bool) -> str:
    uri = checkpoint.checkpoint_uri(str(run), step)
    shard = f"{uri}/mp_rank_00_model_states.pt"
    storage.write_bytes(shard, b"weights")
    if complete:
        storage.write_json(f"{uri}/{checkpoint.METADATA}", metadata_json(step, {"mp_rank_00_model_states.pt": 7}))
    return uri


def test_keep_last_counts_complete_checkpoints_only(tmp_path):
    """keep_last 1: a crash mid-save left step 137 half-written; the run resumed from 130 and saved 135.

    Pruning keeps 135, the newest complete one, and removes 130 and the broken 137 (not 135, as a count of
    directories would have: the next failure would then restart from step 0).
    """
    _step(tmp_path, 130, complete=True)
    _step(tmp_path, 137, complete=False)
    kept = _step(tmp_path, 135, complete=True)
    checkpoint.prune(str(tmp_path), keep_last=1)
    assert checkpoint.latest_complete(str(tmp_path)).uri == kept
    assert storage.list_dir(f"{tmp_path}/{checkpoint.CHECKPOINTS}") == ["step_00000135"]


def test_keep_last_zero_deletes_every_checkpoint_and_nothing_else(tmp_path):
    """What a sweep does to a trial that ended: its step directories go, the rest of the run stays."""
    _step(tmp_path, 10, complete=True)
    _step(tmp_path, 20, complete=False)
    storage.write_bytes(f"{tmp_path}/{checkpoint.CHECKPOINTS}/notes.txt", b"not a checkpoint")
    checkpoint.prune(str(tmp_path), keep_last=0)
    assert checkpoint.latest_complete(str(tmp_path)) is None
    assert storage.list_dir(f"{tmp_path}/{checkpoint.CHECKPOINTS}") == ["notes.txt"]


def test_a_checkpoint_whose_shard_changed_size_is_not_complete(tmp_path, caplog):
    good = _step(tmp_path, 10, complete=True)
    broken = _step(tmp_path, 20, complete=True)
    storage.write_bytes(f"{broken}/mp_rank_00_model_states.pt", b"cut")  # a rewrite cut short
    assert checkpoint.latest_complete(str(tmp_path)).uri == good
    assert "skipping incomplete checkpoint" in caplog.text and "has 3 bytes instead of 7" in caplog.text


def test_a_complete_checkpoint_whose_metadata_this_version_cannot_read_is_named_and_kept(tmp_path, caplog):
    """Another version's (or an edited) metadata is an error naming the field: skipping it for step 10 would
    resume an older checkpoint and prune this one. Pruning leaves it; the export command names it."""
    _step(tmp_path, 10, complete=True)
    other = _step(tmp_path, 20, complete=True)
    storage.write_json(f"{other}/{checkpoint.METADATA}", {**metadata_json(20, {}), "world_size": "two"})
    with pytest.raises(checkpoint.UnreadableMetadataError, match=r"step_00000020/metadata.json .*world_size: 'two'"):
        checkpoint.latest_complete(str(tmp_path))
    with pytest.raises(ConfigError, match=r"step_00000020/metadata.json is not checkpoint metadata"):
        find_checkpoint(str(tmp_path), None)

    _step(tmp_path, 30, complete=True)
    checkpoint.prune(str(tmp_path), keep_last=1)
    assert storage.list_dir(f"{tmp_path}/{checkpoint.CHECKPOINTS}") == ["step_00000020", "step_00000030"]
    assert "left as it is" in caplog.text


def test_a_resume_names_the_settings_it_trains_on_with_and_refuses_what_its_checkpoint_cannot_take(tmp_path):
    _step(tmp_path / "tiny", 4, complete=True)

    def resume(*overrides: str) -> list[str]:
        return check_resume(load_config("tiny", [f"run.storage_path={tmp_path}", *overrides]))

    assert resume() == []  # the same settings; the storage path only spelled otherwise than the checkpoint's "runs"
    # Raised max_steps and lowered lr are named; an auto batch picks its value as the run starts, and says so.
    assert resume("optim.max_steps=400", "optim.lr=1e-4", "optim.micro_batch_size=auto") == [
        "optim.lr 0.003 -> 0.0001",
        "optim.max_steps 100 -> 400",
    ]
    assert resume("optim.max_steps=4", "optim.warmup_steps=2") == []  # trained: no step is left to train with them
    with pytest.raises(ConfigError, match=r"which cannot take model.n_layer 2 -> 3; optim.global_batch_size 16 -> 32"):
        resume("model.n_layer=3", "optim.global_batch_size=32", "optim.lr=1e-4")


def test_metadata_is_written_whole_or_not_at_all(tmp_path):
    target = tmp_path / "metadata.json"
    storage.write_json(str(target), {"step": 1})
    storage.write_json(str(target), {"step": 2})
    assert json.loads(target.read_text()) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["metadata.json"]  # no temporary left behind


def test_a_remote_runs_checkpoint_clears_the_shards_a_killed_upload_left_on_the_node(process_group, s3_bucket):
    cfg = load_config("tiny")
    engine = build_engine(cfg, GPT(cfg.model), world_size=1)
    engine.checkpoint_engine = BackgroundWriter()
    run_uri = f"{s3_bucket}/staging-{time.time_ns()}"
    staging = Path(checkpoint.staging_root(run_uri))
    left = staging / "killed-mid-upload"  # a worker of this run was killed while it uploaded
    left.mkdir(parents=True)
    (left / "optim_states.pt").write_bytes(b"shards" * 1000)

    pending = checkpoint.begin_save(engine, run_uri, 5, run_record(cfg))
    assert checkpoint.written(pending, wait=True)
    checkpoint.finish_save(pending, keep_last=2, tokenizer=ByteTokenizer())

    assert checkpoint.latest_complete(run_uri).step == 5
    assert list(staging.iterdir()) == []  # neither the leftover nor this checkpoint's own staging


def test_a_checkpoint_whose_metadata_storage_cannot_take_does_not_count(process_group, s3_server, s3_bucket):
    cfg = load_config("tiny")
    engine = build_engine(cfg, GPT(cfg.model), world_size=1)
    run_uri = f"{s3_bucket}/metadata-outage-{time.time_ns()}"
    for step in (5, 10):
        pending = checkpoint.begin_save(engine, run_uri, step, run_record(cfg))
        assert checkpoint.written(pending, wait=True)
        if step == 5:
            checkpoint.finish_save(pending, keep_last=1, tokenizer=ByteTokenizer())
    with (
        s3_server.outage(),
        pytest.raises(checkpoint.CheckpointWriteError, match=r"step_00000010 .* \(rank 0: OSError"),
    ):
        checkpoint.finish_save(pending, keep_last=1, tokenizer=ByteTokenizer())
    assert checkpoint.latest_complete(run_uri).step == 5  # and it is kept: keep_last counts complete ones


def test_a_resume_at_the_saved_size_downloads_only_this_machines_shards(process_group, s3_bucket, caplog):
    """Each machine fetches its own ranks' ZeRO shards and the shared files, not every rank's optimizer state."""
    names = ["mp_rank_00_model_states.pt", "tokenizer.json", "zero_to_fp32.py"]
    shards = [f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1, 2, 10)]
    assert checkpoint.files_for_ranks(names + shards, {1, 2}) == names + shards[1:3]

    cfg = load_config("tiny")
    torch.manual_seed(0)
    saved = build_engine(cfg, GPT(cfg.model), world_size=1)
    run_uri = f"{s3_bucket}/download-{time.time_ns()}"
    pending = checkpoint.begin_save(saved, run_uri, 5, run_record(cfg))
    assert checkpoint.written(pending, wait=True)
    # What rank 1 of a two-rank run would have written beside rank 0's shard (here, junk it must not fetch).
    storage.write_bytes(f"{pending.uri}/zero_pp_rank_1_mp_rank_00_optim_states.pt", b"rank 1" * 1000)
    checkpoint.finish_save(pending, keep_last=2, tokenizer=ByteTokenizer())
    latest = checkpoint.latest_complete(run_uri)

    torch.manual_seed(1)
    resumed = build_engine(cfg, GPT(cfg.model), world_size=1)
    with caplog.at_level(logging.INFO, logger="train.checkpoint"):
        checkpoint.load(resumed, latest, universal=False)
    assert f"downloaded {len(latest.files) - 1} files of {latest.uri} " in caplog.text
    for before, after in zip(saved.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(before, after)
    assert not Path(checkpoint.download_dir(latest.uri)).exists()


def test_a_resize_downloads_the_universal_state_of_this_machines_optimizer_partition_only(
    process_group, s3_bucket, caplog
):
    """At ZeRO-1/2 a rank's optimizer partition holds pieces of some parameters; a universal load reads the
    state of those alone, so a machine fetches theirs and the shared files, not every parameter's."""
    files = ["mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/a.weight/fp32.pt", "zero/b.bias/fp32.pt"]
    assert checkpoint.universal_files_for_params(files, {"a.weight"}) == files[:3]

    cfg = load_config("tiny")  # ZeRO-2
    torch.manual_seed(0)
    saved = build_engine(cfg, GPT(cfg.model), world_size=1)
    run_uri = f"{s3_bucket}/universal-download-{time.time_ns()}"
    pending = checkpoint.begin_save(saved, run_uri, 5, run_record(cfg))
    assert checkpoint.written(pending, wait=True)
    checkpoint.finish_save(pending, keep_last=2, tokenizer=ByteTokenizer())
    latest = checkpoint.latest_complete(run_uri)
    checkpoint.convert_to_universal(latest)
    universal = f"{latest.uri}/{checkpoint.UNIVERSAL}"
    # The state of a parameter that no rank of this machine has a piece of (here, junk it must not fetch).
    storage.write_bytes(f"{universal}/zero/not.in.this.partition/fp32.pt", b"other" * 1000)
    total = len(checkpoint._file_sizes(universal))

    torch.manual_seed(1)
    resumed = build_engine(cfg, GPT(cfg.model), world_size=1, load_universal=True)
    with caplog.at_level(logging.INFO, logger="train.checkpoint"):
        checkpoint.load(resumed, latest, universal=True)
    assert f"downloaded {total - 1} files of {universal} " in caplog.text
    for before, after in zip(saved.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_checkpoint_from_before_biases_and_layer_norms_were_exempt_from_decay_resumes_as_it_was_saved(
    process_group, tmp_path, stage
):
    """Its optimizer state is in one group, which DeepSpeed refuses to load into two ("a different number of
    parameter groups"): a run or an export resuming from it builds one, every parameter decayed as before."""
    cfg = load_config("tiny", [f"deepspeed.zero_stage={stage}"])
    saved = build_engine(cfg, GPT(cfg.model), world_size=1, exempt_norms_and_biases=False)
    pending = checkpoint.begin_save(saved, str(tmp_path), 5, run_record(cfg))
    assert checkpoint.written(pending, wait=True)
    checkpoint.finish_save(pending, keep_last=1, tokenizer=ByteTokenizer())
    metadata = f"{pending.uri}/{checkpoint.METADATA}"  # as raywright wrote it then: without the keys of 2026-11-25
    then = {**storage.read_json(metadata)}
    for key in ("norms_and_biases_undecayed", "data_source_sha256", "code_version"):
        del then[key]
    storage.write_json(metadata, then)
    before = checkpoint.latest_complete(str(tmp_path))

    exempt = checkpoint.exempts_norms_and_biases(before)
    assert not exempt and checkpoint.exempts_norms_and_biases(None)  # a new run exempts them
    resumed = build_engine(cfg, GPT(cfg.model), world_size=1, exempt_norms_and_biases=exempt)
    checkpoint.load(resumed, before, universal=False)
    assert [group["weight_decay"] for group in resumed.optimizer.param_groups] == [cfg.optim.weight_decay]


def test_the_checkpoint_to_export_is_chosen_by_run_step_or_directory_and_a_bad_choice_is_named(tmp_path):
    run = tmp_path / "run"
    _step(run, 10, complete=True)
    newest = _step(run, 20, complete=True)
    _step(run, 30, complete=False)  # being written, or cut short
    assert find_checkpoint(str(run), None).uri == newest
    assert find_checkpoint(f"{newest}/", None).uri == newest
    assert default_out(find_checkpoint(str(run), 10)) == f"{run}/exports/step_00000010"
    with pytest.raises(ConfigError, match=r"no checkpoint of step 15 \(it has \['step_00000010', 'step_00000020', 'st"):
        find_checkpoint(str(run), 15)
    with pytest.raises(ConfigError, match="incomplete checkpoint .*step_00000030: no metadata.json"):
        find_checkpoint(str(run), 30)
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        find_checkpoint(str(tmp_path / "elsewhere"), None)

    storage.write_bytes(f"{tmp_path}/mine/notes.txt", b"not ours")
    with pytest.raises(ConfigError, match="holds files that are not a raywright export"):
        check_out(f"{tmp_path}/mine")
    check_out(f"{tmp_path}/new")


def test_a_run_without_its_export_is_served_from_the_export_of_a_checkpoint_it_names(tmp_path):
    """Serving a run that has not ended points to ``export_checkpoint``, then to what that wrote (which serving
    does not pick by itself: a run's end replaces its export/)."""
    run = tmp_path / "run"
    _step(run, 10, complete=True)
    with pytest.raises(FileNotFoundError, match=r"first \(python -m train.export_checkpoint .*run\) and give the dir"):
        resolve_export(str(run))
    for step in (10, 20):
        storage.write_json(f"{run}/exports/step_{step:08d}/config.json", {})
    storage.write_bytes(f"{run}/exports/step_00000030/model.safetensors", b"")  # being written: no config.json yet
    with pytest.raises(FileNotFoundError, match=f"the newest: {run}/exports/step_00000020\\) or make one"):
        resolve_export(str(run))
    assert resolve_export(f"{run}/exports/step_00000020") == f"{run}/exports/step_00000020"
