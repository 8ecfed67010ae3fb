"""The record of one validation of the model: reported as the run trains, kept with its export (the last
step's), and what a sweep trial reports to Tune and keeps when it ends."""

import math
import time

import numpy as np
from pydantic import ConfigDict

from train.schema import Section


class Evaluation(Section):
    """The validation metrics of the model after ``step``."""

    # A sweep trial whose training diverged ends as an infinite loss, the worst result (see tune.trial).
    model_config = ConfigDict(allow_inf_nan=True)

    step: int
    val_loss: float  # nats per token
    val_perplexity: float
    val_bpb: float  # bits per byte, which compares across tokenizers
    time: float  # when, in seconds since the epoch

    @classmethod
    def of_loss(cls, step: int, val_loss: float, tokens_per_byte: float) -> "Evaluation":
        """The evaluation, now, of a model whose mean validation loss after ``step`` is ``val_loss``."""
        return cls(
            step=step,
            val_loss=val_loss,
            val_perplexity=float(np.exp(val_loss)),
            val_bpb=val_loss * tokens_per_byte / math.log(2),
            time=time.time(),
        )

    @classmethod
    def in_report(cls, report: dict) -> "Evaluation | None":
        """The evaluation in a training report (its metrics: a report holds them among others); None where the
        report's step did not evaluate."""
        if "val_loss" not in report:
            return None
        return cls.model_validate({name: report[name] for name in cls.model_fields})
