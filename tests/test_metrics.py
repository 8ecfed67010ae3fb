"""A run's metrics: its progress lines, and reading them back for the step time the benchmarks take."""

import pytest

from train.metrics import METRICS, format_progress, report_backlog_warning, steady_step_seconds
from train.run_files import JsonlLog

pytestmark = pytest.mark.unit


def write_reports(run, steps: list[int]) -> None:
    """Training reports as the run's metrics log holds them: one second per step, the first report's window
    slower (start-up), as in a real run."""
    log = JsonlLog(str(run / METRICS))
    for step in steps:
        log.append({"step": step, "loss": 1.0, "time": 100.0 + step + (0 if step > 1 else -30)})
    log.close()


def test_the_steady_step_time_leaves_out_the_first_and_last_windows(tmp_path):
    write_reports(tmp_path / "run", [1, 5, 10, 15, 20])
    assert steady_step_seconds(str(tmp_path / "run")) == pytest.approx(1.0)


def test_a_run_too_short_for_a_steady_step_time_is_told_what_to_change(tmp_path):
    write_reports(tmp_path / "run", [1, 5, 10])  # 10 steps, a report every 5: one window between first and last
    with pytest.raises(ValueError, match=r"optim.max_steps of at least 3 x run.log_every"):
        steady_step_seconds(str(tmp_path / "run"))


def test_reports_faster_than_ray_train_takes_them_are_warned_of_with_the_log_every_that_keeps_up():
    warning = report_backlog_warning(step_seconds=0.15, log_every=1, poll_seconds=0.5)
    assert "run.log_every=1" in warning and "scaling.health_check_interval_s" in warning
    assert warning.endswith("run.log_every=4 or more does not")
    assert report_backlog_warning(step_seconds=0.15, log_every=4, poll_seconds=0.5) is None


def test_a_report_of_a_checkpoint_written_in_the_background_says_which_one_counted():
    """It arrives with a later step's report, or alone: never a bare step count."""
    saved = {"step": 51, "checkpoint": "runs/tiny/checkpoints/step_00000050", "checkpoint_s": 0.236}
    assert format_progress(saved, 100) == "step 51/100 | checkpoint step_00000050 saved (0.2 s)"
    failed = {"step": 12, "checkpoint_failed": "s3://bucket/run/checkpoints/step_00000010"}
    assert format_progress(failed, 100) == "step 12/100 | checkpoint step_00000010 failed"


def test_an_fp16_report_says_its_loss_scale_and_the_steps_skipped_for_overflowing():
    report = {"step": 40, "loss": 3.25, "lr": 3e-4, "tokens_per_s": 1000.0, "mfu": None, "memory_gb": 1.0}
    line = "step 40/100 | loss 3.2500 | lr 3.00e-04 | 1,000 tok/s | mfu n/a | mem 1.00 GB"
    assert format_progress(report, 100) == line
    fp16 = {**report, "loss_scale": 16384.0, "skipped_steps": 3}
    assert format_progress(fp16, 100) == f"{line} | loss scale 16384, 3 steps skipped"
