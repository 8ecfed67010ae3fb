"""The anytime curve of a sweep: best loss so far against the training steps spent so far."""

import pandas as pd
import pytest

from tune.plots import anytime_curve

pytestmark = pytest.mark.unit


def test_anytime_curve_counts_each_trials_steps_once_in_time_order():
    full = pd.DataFrame({"step": [10, 20, 30], "val_loss": [3.0, 2.5, 2.0], "time": [1, 3, 6]})
    # Evaluated at 10 and 20, resumed from its step-10 checkpoint, evaluated at 10 and 20 again.
    resumed = pd.DataFrame({"step": [10, 20, 10, 20], "val_loss": [2.8, 2.6, 2.7, 2.2], "time": [2, 4, 5, 7]})
    curve = anytime_curve({"full": full, "resumed": resumed}, "val_loss")
    assert curve["steps"].tolist() == [10, 20, 30, 40, 40, 50, 50]
    assert curve["best"].tolist() == [3.0, 2.8, 2.5, 2.5, 2.5, 2.0, 2.0]
