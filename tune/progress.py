"""Live progress of a sweep in a notebook: one table of the trials, redrawn in place while Tune runs."""

import sys
import time
from typing import Any

import pandas as pd
from ray.tune import Callback


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (a notebook, or nbclient running one headless)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return type(shell).__name__ == "ZMQInteractiveShell"


class NotebookProgress(Callback):
    """Every ``every_s`` seconds, and at the end: each trial's status, parameters, latest step and metric."""

    def __init__(self, metric: str, params: list[str], every_s: float = 2.0):
        self.metric, self.params, self.every_s = metric, params, every_s
        self._shown_at = 0.0
        self._handle = None

    def table(self, trials: list) -> pd.DataFrame:
        rows = []
        for trial in trials:
            last: dict[str, Any] = trial.last_result or {}
            rows.append(
                {
                    "trial": trial.trial_id,
                    "status": trial.status,
                    **{key: trial.config.get(key) for key in self.params},
                    "step": last.get("step"),
                    self.metric: last.get(self.metric),
                }
            )
        return pd.DataFrame(rows)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if time.monotonic() - self._shown_at >= self.every_s:
            self._show(trials)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self._show(trials)

    def _show(self, trials: list) -> None:
        from IPython.display import display  # only in a notebook, where IPython is there

        self._shown_at = time.monotonic()
        table = self.table(trials)
        if self._handle is None:
            self._handle = display(table, display_id=True)
        else:
            self._handle.update(table)
