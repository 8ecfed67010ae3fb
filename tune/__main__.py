"""python -m tune --config SWEEP [--set key=value ...]  |  python -m tune --resume SWEEP_DIR   (--help: settings)"""

import math
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from train.cli import config_parser, one_line_errors, print_config, use_cpu_deepspeed_unless_gpu_workers
from tune.config import SweepConfig, load_sweep_config, resume_command, saved_sweep_config, sweep_names

if TYPE_CHECKING:  # tune.sweep loads DeepSpeed, which must wait for use_cpu_deepspeed_unless_gpu_workers
    import pandas as pd

    from tune.sweep import SweepResult


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = config_parser(
        "python -m tune",
        "Optuna + ASHA sweeps of the training job.",
        SweepConfig,
        f"a shipped sweep ({', '.join(sweep_names())}) or a sweep YAML path or URI",
    )
    parser.add_argument(
        "--resume",
        metavar="SWEEP_DIR",
        help="finish an interrupted sweep from its directory (its failed trials run again)",
    )
    args = parser.parse_args(argv)
    if bool(args.config) == bool(args.resume):
        parser.error("give one of --config and --resume")
    if args.resume and args.set:  # Tune resumes the searcher and the trials as they were
        parser.error("--set: a resumed sweep keeps the settings it started with (to change them: --config, a new name)")
    sweep = load_sweep_config(args.config, args.set) if args.config else saved_sweep_config(args.resume)
    if args.print_config:
        print_config(sweep)
        return 0

    use_cpu_deepspeed_unless_gpu_workers(sweep.base_config())  # before tune.sweep loads DeepSpeed
    from tune.sweep import resume_sweep, run_sweep_config

    # Ctrl-C or SIGTERM: Tune saves the sweep's state, and the KeyboardInterrupt says how to resume it.
    if args.resume:
        result = resume_sweep(args.resume, sweep, stop_on_sigterm=True)
    else:
        result = run_sweep_config(sweep, stop_on_sigterm=True)
    print_summary(result)
    return 0


def trials_table(trials: "pd.DataFrame") -> str:
    """The trials as a reader wants them: how each ended, how long it ran (H:MM:SS) and on which node (the first 8
    characters of its id), where ``SweepResult.trials`` keeps flags, epoch seconds and whole ids for code."""
    shown = trials.drop(columns=["stopped_early", "error", "started", "ended", "node_id"])
    shown["ended"] = [
        "failed" if error else "stopped early" if stopped else "finished"
        for error, stopped in zip(trials["error"], trials["stopped_early"], strict=True)
    ]
    shown["ran"] = [
        "-" if math.isnan(seconds) else str(timedelta(seconds=round(seconds)))  # NaN: failed before it reported
        for seconds in trials["ended"] - trials["started"]
    ]
    shown["node"] = [node[:8] if isinstance(node, str) else "-" for node in trials["node_id"]]
    return shown.to_string(index=False, na_rep="-")


def print_summary(result: "SweepResult") -> None:
    print(trials_table(result.trials))
    for trial in result.failed:
        print(f"\ntrial {trial.trial_id} failed: {trial.error}\n  (its traceback: {trial.error_file})")
    if result.failed:
        print(f"to run the failed trials again: {resume_command(result.path)}")
    print(f"\nbest: trial {result.best.trial_id}, val_loss {result.best.val_loss:.4f}")
    print(f"best recipe: {result.best_recipe}   (python -m train --config {result.best_recipe})")
    print(f"sweep directory: {result.path}")


if __name__ == "__main__":
    sys.exit(main())
