"""What reporting every step costs: Ray Train's controller takes one report per worker each time it polls
the workers (``scaling.health_check_interval_s``), so a run that reports more often waits for each report.

    python bench/report_cadence.py [--steps 100] [--rounds 2] [--set key=value ...]

Trains the tiny recipe on 2 workers for ``--steps`` steps (no checkpoint or evaluation before the last step),
reporting every step and every 10 steps, under polls of 0.5 s (raywright's default) and 0.1 s, interleaved
over ``--rounds``. Prints each run's seconds from its first to its last training step, then the medians.
"""

import argparse
import itertools
import os
import statistics
import tempfile

from train.config import load_config
from train.launch import ensure_dataset, init_ray, run_training, run_uri
from train.metrics import HEALTH_CHECK_INTERVAL_ENV, read_metrics

POLLS_S = (0.5, 0.1)
LOG_EVERY = (1, 10)


def train_seconds(overrides: list[str], name: str, poll_s: float) -> float:
    """Seconds between the run's first and last training reports."""
    os.environ[HEALTH_CHECK_INTERVAL_ENV] = str(poll_s)  # read when the run's controller starts
    cfg = load_config("tiny", [*overrides, f"run.name={name}"])
    run_training(cfg)
    steps = [m for m in read_metrics(run_uri(cfg)) if "loss" in m]
    return steps[-1]["time"] - steps[0]["time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    common = [
        "scaling.num_workers=2",
        f"optim.max_steps={args.steps}",
        f"run.eval_every={args.steps}",
        f"checkpoint.every_steps={args.steps}",
        f"run.storage_path={tempfile.mkdtemp(prefix='rw-cadence-')}",
        *args.set,
    ]
    cfg = load_config("tiny", common)
    init_ray(cfg)
    ensure_dataset(cfg)
    seconds: dict[tuple[float, int], list[float]] = {}
    for round_, (poll_s, every) in itertools.product(range(args.rounds), itertools.product(POLLS_S, LOG_EVERY)):
        overrides = [*common, f"run.log_every={every}"]
        took = train_seconds(overrides, f"poll{poll_s}-every{every}-r{round_}", poll_s)
        seconds.setdefault((poll_s, every), []).append(took)
        print(f"round {round_}: poll {poll_s} s, a report every {every} steps: {took:.1f} s", flush=True)
    for (poll_s, every), runs in seconds.items():
        runs_text = ", ".join(f"{s:.1f}" for s in runs)
        print(f"poll {poll_s} s, a report every {every} steps: median {statistics.median(runs):.1f} s ({runs_text})")


if __name__ == "__main__":
    main()
