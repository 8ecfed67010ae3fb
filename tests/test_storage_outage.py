"""Training goes on while the run's storage cannot be reached (a moto S3 server taken down), and loses nothing:
checkpoints that fail do not count and are retried, side files are uploaded once storage is back, the lease
is kept; only storage that stays down past ``checkpoint.failures_tolerated`` failed checkpoints stops a run. A local
disk that fills up is named as such, and stops a run without a restart once its checkpoints or export cannot go on."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray._common.test_utils import wait_for_condition

from tests.conftest import fill, training_worker_pids
from train import checkpoint, storage
from train.config import load_config
from train.export import final_evaluation
from train.launch import loop_args, record_trained_run, run_training, run_uri
from train.lease import LEASE
from train.loop import train_loop
from train.manifest import load_manifest
from train.metrics import read_metrics
from train.run_layout import export_uri
from train.stops import OutOfDiskError
from train.timeline import ELASTIC_SUMMARY, TIMELINE, RunTimeline, progress_of, read_summary

pytestmark = pytest.mark.cluster


def _config(dataset: str, bucket: str, *overrides: str):
    where = [f"data.path={dataset}", f"run.storage_path={bucket}/outage-{time.time_ns()}"]
    return load_config("tiny", [*where, "run.eval_every=1000", *overrides])


def test_a_run_trains_through_a_storage_outage_and_loses_nothing(ray_session, s3_server, s3_bucket, tiny_dataset):
    cfg = _config(
        tiny_dataset,
        s3_bucket,
        "run.name=outage",
        "optim.max_steps=150",
        "run.log_every=5",
        "checkpoint.every_steps=10",
        "checkpoint.failures_tolerated=100",
        "checkpoint.keep_last=2",
        "run.side_files_upload_s=2",
        "run.lease_stale_after_s=10",
    )
    run = run_uri(cfg)
    result = []
    thread = threading.Thread(target=lambda: result.append(run_training(cfg)))
    thread.start()
    wait_for_condition(lambda: progress_of(cfg.run.name).step >= 25, timeout=180)  # checkpoints 10 and 20 count
    with s3_server.outage():
        reached = progress_of(cfg.run.name).step
        time.sleep(15)  # metrics uploads, checkpoints and lease renewals fail meanwhile
        assert progress_of(cfg.run.name).step > reached  # training went on
    thread.join(timeout=300)

    assert result and result[0].steps == 150
    assert len(result[0].elastic.world_size_timeline) == 1  # no restart
    reports = read_metrics(run)
    assert [m["step"] for m in reports if "loss" in m] == [1, *range(5, 151, 5)]  # every report, once
    failed = [m["checkpoint_failed"] for m in reports if "checkpoint_failed" in m]
    assert failed, "no checkpoint failed: the outage missed them"
    counted = [m["checkpoint"] for m in reports if "checkpoint" in m]
    kept = [name for name in storage.list_dir(f"{run}/{checkpoint.CHECKPOINTS}") if name.startswith("step_")]
    assert kept == [uri.rsplit("/", 1)[1] for uri in counted[-2:]]  # keep_last 2; the failed ones' files deleted
    assert checkpoint.latest_complete(run).step == 150
    assert storage.exists(f"{run}/{ELASTIC_SUMMARY}") and not storage.exists(f"{run}/{LEASE}")


def test_a_run_whose_storage_stays_down_stops_after_the_failed_checkpoints_it_tolerates(
    ray_session, process_group, s3_server, s3_bucket, tiny_dataset
):
    """The training loop as a one-rank sweep trial runs it: storage goes down after the first checkpoint."""
    cfg = _config(
        tiny_dataset,
        s3_bucket,
        "run.name=down",
        "scaling.num_workers=1",
        "optim.max_steps=100",
        "run.log_every=1",
        "checkpoint.every_steps=5",
        "checkpoint.failures_tolerated=1",
    )
    reports = []

    def report(metrics: dict) -> None:
        reports.append(metrics)
        if "checkpoint" in metrics:
            s3_server.stop()

    try:
        with pytest.raises(checkpoint.CheckpointWriteError, match=r"step_000000\d\d could not be written \(rank 0"):
            args = loop_args(cfg, tiny_dataset, load_manifest(tiny_dataset)).to_dict()
            train_loop(args, report, preemption_info=lambda: None)
    finally:
        s3_server.start()
    failed = [m for m in reports if "checkpoint_failed" in m]
    assert len(failed) == 1 and failed[0]["checkpoint_failed"].endswith("step_00000010")  # tolerated
    assert max(m["step"] for m in reports) > 15  # trained on past it, and past the next attempt
    assert checkpoint.latest_complete(run_uri(cfg)).step == 5


def test_a_run_whose_disk_fills_up_says_so_frees_what_each_failed_checkpoint_wrote_and_is_not_restarted(
    ray_session, small_disk, tiny_dataset
):
    """The disk holds one checkpoint of the tiny model, not two: the first counts, the next ones fail. Before, a
    failure said only torch's "unexpected pos", each failed checkpoint's files stayed, holding the space, and Ray
    Train restarted the run scaling.max_failures times, to redo its steps since that checkpoint and fail alike."""
    settings = ["run.name=fills", "scaling.num_workers=1", "optim.max_steps=100", "run.log_every=1"]
    settings += ["run.eval_every=1000", "checkpoint.every_steps=5", "checkpoint.failures_tolerated=1"]
    cfg = load_config("tiny", [f"data.path={tiny_dataset}", f"run.storage_path={small_disk}", *settings])
    full = r"checkpoint \S+/step_00000015 could not be written \(rank 0: .*; the disk holding \S+ is full: "
    full += r"\d+\.\d MiB free\); stopped at step 1\d \(2 failed in a row with "
    with pytest.raises(OutOfDiskError, match=rf"^out of disk space: {full}"):
        run_training(cfg)
    run = run_uri(cfg)
    assert read_summary(run).restarts == 0
    reports = read_metrics(run)
    failed = [m["checkpoint_failed"] for m in reports if "checkpoint_failed" in m]
    assert len(failed) == 1 and failed[0].endswith("step_00000010")  # tolerated
    assert "checkpoint.failures_tolerated: 1; newest checkpoint: step 5). Free space" in reports[-1]["out_of_disk"]
    assert checkpoint.latest_complete(run).step == 5
    assert checkpoint.step_dirs(run) == [checkpoint.checkpoint_uri(run, 5)]  # the failed ones' files deleted
    assert not list(small_disk.rglob("*.tmp"))


def test_a_run_whose_disk_fills_up_before_its_export_says_so_and_exports_once_there_is_room(
    ray_session, process_group, small_disk, tiny_dataset
):
    """The training loop as a one-rank sweep trial runs it: the disk fills up once the last checkpoint counts."""
    settings = ["run.name=export-fills", "scaling.num_workers=1", "optim.max_steps=5", "optim.warmup_steps=0"]
    settings += ["run.eval_every=1000"]
    cfg = load_config("tiny", [f"data.path={tiny_dataset}", f"run.storage_path={small_disk}", *settings])
    args = loop_args(cfg, tiny_dataset, load_manifest(tiny_dataset)).to_dict()
    reports, filled = [], []

    def report(metrics: dict) -> None:
        reports.append(metrics)
        if "checkpoint" in metrics:
            filled.append(fill(small_disk))

    train_loop(args, report, preemption_info=lambda: None)
    export = export_uri(run_uri(cfg))
    assert reports[-1]["step"] == 5 and reports[-1]["out_of_disk"].startswith(
        f"out of disk space: exporting {export}: no space left on the disk holding "
    )
    assert "the checkpoint of step 5 counts" in reports[-1]["out_of_disk"]
    assert final_evaluation(run_uri(cfg)) is None and not list(small_disk.rglob("*.tmp"))
    # Its checkpoint exported by hand to the same disk, still full: one line and exit code 1, not a traceback.
    command = [sys.executable, "-m", "train.export_checkpoint", run_uri(cfg), "--out", f"{small_disk}/by-hand"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert (
        done.returncode == 1
        and done.stderr.count("\n") == 1
        and done.stderr.startswith(
            f"error: exporting {small_disk}/by-hand: no space left on the disk holding {small_disk}"
        )
    ), done.stderr[-3000:]

    filled[0].unlink()
    train_loop(args, report, preemption_info=lambda: None)  # the same run again: it exports from that checkpoint
    assert final_evaluation(run_uri(cfg)).step == 5


def test_a_run_restarted_while_its_storage_is_down_waits_for_it(ray_session, s3_server, s3_bucket, tiny_dataset, capfd):
    """A worker lost during an outage: the new workers wait for storage to answer, then resume; before, each
    of their attempts failed on its first read of the run and counted against scaling.max_failures."""
    cfg = _config(
        tiny_dataset,
        s3_bucket,
        "run.name=restart-in-outage",
        "optim.max_steps=60",
        "run.log_every=5",
        "checkpoint.every_steps=25",  # none is due in the outage: its report's failed uploads would stall Ray Train
        "scaling.max_failures=1",  # the lost worker's failure; a failed attempt in the outage would end the run
        "run.side_files_upload_s=600",  # the controller's uploads, which stall it through an outage, only at the end
    )
    run = run_uri(cfg)
    result = []
    thread = threading.Thread(target=lambda: result.append(run_training(cfg)))
    thread.start()
    wait_for_condition(lambda: checkpoint.latest_complete(run) is not None, timeout=180)  # step 25's
    written_at = progress_of(cfg.run.name).step
    wait_for_condition(lambda: progress_of(cfg.run.name).step >= written_at + 5)  # and its report is in
    printed = []  # by this driver: its Ray forwards the workers' output

    def a_worker_waits_for_storage() -> bool:
        printed.extend(capfd.readouterr())
        return "storage cannot be reached" in "".join(printed)

    with s3_server.outage():
        os.kill(training_worker_pids()[0], signal.SIGKILL)
        wait_for_condition(a_worker_waits_for_storage, timeout=120)  # the new workers started, and found it down
        time.sleep(8)  # down a while longer than the storage_wait_s > 5 asked below
    thread.join(timeout=300)

    assert result and result[0].steps == 60
    assert len(result[0].elastic.world_size_timeline) == 2  # one restart, the killed worker's
    assert result[0].elastic.resizes[0].storage_wait_s > 5  # it started in the outage, and waited
    assert checkpoint.latest_complete(run).step == 60


def test_a_trained_run_whose_storage_is_down_at_its_end_saves_its_record_once_storage_is_back(
    ray_session, s3_server, s3_bucket
):
    """The driver's last writes, after its workers trained and exported the run, wait out an outage longer than
    pyarrow's own retries (~12 s a write here, of which the driver makes two); before, the command failed at the end
    of a run that had trained to the end, and the record of its last segment was not saved."""
    cfg = _config("data-unused", s3_bucket, "run.name=ends-in-outage", "run.storage_wait_s=120")
    run = run_uri(cfg)
    timeline = RunTimeline.remote(cfg.cost.price_per_hour, cfg.cost.on_demand_type, run, None, 600)
    ray.get(timeline.attempt_started.remote(1, [ray.get_runtime_context().get_node_id()], 0))  # its last segment
    ended = []
    with s3_server.outage():
        driver = threading.Thread(target=lambda: ended.append(record_trained_run(cfg, timeline)))
        driver.start()
        time.sleep(30)
        assert driver.is_alive()  # waiting, not failed
    driver.join(timeout=60)
    assert ended and ended[0].steps == 0  # nothing was trained in this run dir: what it says, read once storage is back
    assert storage.exists(f"{run}/{ELASTIC_SUMMARY}") and storage.exists(f"{run}/{TIMELINE}")
