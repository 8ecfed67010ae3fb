"""A run's early end, as its workers report it and as the driver and a sweep trial read it back."""

import math
import pickle

import pytest

from train.cli import one_line_errors
from train.stops import DivergedError, OutOfDiskError, StorageNotSharedError, stop_in
from tune.trial import _trial_evaluation

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", [DivergedError, OutOfDiskError, StorageNotSharedError])
def test_a_stop_reads_back_from_its_report_and_its_pickle_as_the_same_kind_message_and_step(kind):
    report = kind("why it stopped", 7).report(time=1.0)
    stopped = stop_in(report)
    assert type(stopped) is kind and str(stopped) == "why it stopped" and stopped.step == 7
    again = pickle.loads(pickle.dumps(stopped))  # as Ray hands an error from one process to another
    assert type(again) is kind and str(again) == "why it stopped" and again.step == 7
    assert stop_in({"step": 7, "loss": 2.5, "time": 1.0}) is None


def test_a_sweep_trial_takes_divergence_as_the_worst_result_and_fails_on_a_full_disk():
    """A full disk is no fault of the trial's parameters: Optuna must not learn from it as from a result."""
    diverged = _trial_evaluation(DivergedError("training diverged: ...", 10).report(time=1.0))
    assert diverged.step == 10 and diverged.val_loss == math.inf
    with pytest.raises(OutOfDiskError, match="out of disk space: exporting"):
        _trial_evaluation(OutOfDiskError("out of disk space: exporting ...", 40).report(time=1.0))


def test_a_run_folder_that_a_worker_cannot_see_is_said_as_a_config_error_with_exit_code_2(capsys):
    """As the driver's own check says it, before the workers start."""

    @one_line_errors
    def main(argv: list[str] | None = None) -> int:
        raise StorageNotSharedError("run.storage_path: /runs is a folder of this machine ...", 0)

    assert main() == 2
    assert capsys.readouterr().err == "config error: run.storage_path: /runs is a folder of this machine ...\n"
