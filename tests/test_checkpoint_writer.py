"""The background checkpoint writer: what it writes is the state at save time, and failures surface."""

import threading

import pytest
import torch

from train.checkpoint_writer import BackgroundWriter

pytestmark = pytest.mark.unit


def test_files_hold_the_state_at_save_time_though_training_moved_on(tmp_path):
    weights = torch.zeros(4)
    scale = {"loss_scale": [2.0**16]}  # a mutable value, as a loss scaler's state is
    writer = BackgroundWriter()
    writer.save({"module": {"w": weights}, "scaler": scale}, str(tmp_path / "model.pt"))
    weights.add_(1.0)  # the next optimizer step, before the files are written
    scale["loss_scale"][0] = 1.0
    assert not (tmp_path / "model.pt").exists()  # nothing is written before start

    writer.start()
    assert writer.done(wait=True) and writer.error is None
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(saved["module"]["w"], torch.zeros(4)) and saved["scaler"]["loss_scale"] == [2.0**16]


def test_the_upload_runs_after_the_files_and_training_does_not_wait_for_it(tmp_path):
    release, order = threading.Event(), []
    writer = BackgroundWriter()
    writer.save({"w": torch.ones(2)}, str(tmp_path / "a.pt"))

    def upload() -> None:
        order.append((tmp_path / "a.pt").exists())
        release.wait(10)

    writer.start(then=upload)
    assert not writer.done()  # the upload is still going
    with pytest.raises(RuntimeError, match="still being written"):
        writer.save({"w": torch.ones(2)}, str(tmp_path / "b.pt"))  # at most one checkpoint in flight
    release.set()
    assert writer.done(wait=True) and order == [True]


def test_a_failed_write_is_reported_not_lost(tmp_path):
    writer = BackgroundWriter()
    writer.save({"w": torch.ones(2)}, str(tmp_path / "missing-dir" / "a.pt"))
    writer.start()
    assert writer.done(wait=True)
    assert isinstance(writer.error, (FileNotFoundError, RuntimeError))
