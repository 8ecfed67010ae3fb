"""Checkpoint bookkeeping that must never lose the last good checkpoint (no Ray, no DeepSpeed engine)."""

import json

import pytest

from train import checkpoint, storage

pytestmark = pytest.mark.unit


def _step(run, step: int, complete: bool) -> str:
    uri = checkpoint.checkpoint_uri(str(run), step)
    shard = f"{uri}/mp_rank_00_model_states.pt"
    storage.write_bytes(shard, b"weights")
    if complete:
        storage.write_json(f"{uri}/{checkpoint.METADATA}", {"step": step, "files": {"mp_rank_00_model_states.pt": 7}})
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
    assert checkpoint.latest_complete(str(tmp_path))["uri"] == kept
    assert storage.list_dir(f"{tmp_path}/{checkpoint.CHECKPOINTS}") == ["step_00000135"]


def test_a_checkpoint_whose_shard_changed_size_is_not_complete(tmp_path, caplog):
    good = _step(tmp_path, 10, complete=True)
    broken = _step(tmp_path, 20, complete=True)
    storage.write_bytes(f"{broken}/mp_rank_00_model_states.pt", b"cut")  # a rewrite cut short
    assert checkpoint.latest_complete(str(tmp_path))["uri"] == good
    assert "skipping incomplete checkpoint" in caplog.text and "has 3 bytes instead of 7" in caplog.text


def test_metadata_is_written_whole_or_not_at_all(tmp_path):
    target = tmp_path / "metadata.json"
    storage.write_json(str(target), {"step": 1})
    storage.write_json(str(target), {"step": 2})
    assert json.loads(target.read_text()) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["metadata.json"]  # no temporary left behind
