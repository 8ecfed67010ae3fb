"""P5: trial-steps TPE + ASHA needs to reach a target validation loss ÷ those random search needs.

    python bench/tune_efficiency.py [--seeds 3] [--trials 10] [--steps 60]

For each seed, two sweeps of the same space and budget (--trials single-worker trials of the
tiny recipe, 2 at a time): Optuna TPE with ASHA early stopping, and random search without early
stopping. The target is the 20th percentile of the final validation losses of all full-length
trials of the run (both methods, all seeds), so both are judged against the same bar. The cost
of a method in a seed is the number of training steps all its trials had trained when one of
them first reported a validation loss at or below the target (time order of the reports); a
sweep that never reaches it is charged its whole budget. P5 = sum of TPE+ASHA costs ÷ sum of
random-search costs. Step counts, not seconds: the figure does not depend on the machine's load.
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from tune.sweep import run_sweep

SPACE = {
    "optim.lr": {"loguniform": [1e-4, 1e-1]},
    "optim.warmup_steps": {"int": [0, 20]},
    "model.d_model": {"choice": [32, 64, 128]},
}


def reports(sweep_dir: Path) -> pd.DataFrame:
    """Every evaluation of every trial: trial, step, val_loss, time."""
    frames = []
    for progress in sweep_dir.glob("run_trial*/progress.csv"):
        frame = pd.read_csv(progress)[["step", "val_loss", "time"]]
        frame["trial"] = progress.parent.name
        frames.append(frame)
    return pd.concat(frames).sort_values("time").reset_index(drop=True)


def steps_to_target(history: pd.DataFrame, target: float, budget: int) -> tuple[int, bool]:
    """Training steps spent by all trials when the first report reached ``target``; (budget, False) if none did."""
    reached = history.index[history["val_loss"] <= target]
    if len(reached) == 0:
        return budget, False
    upto = history.loc[: reached[0]]
    return int(upto.groupby("trial")["step"].max().sum()), True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="rw-p5-")
    common = {
        "set": [f"optim.max_steps={args.steps}", "optim.warmup_steps=0", "run.eval_every=10"],
        "num_trials": args.trials,
        "max_concurrent_trials": 2,
        "grace_period": 20,
        "reduction_factor": 2,
        "trial_resources": {"CPU": 1},
        "storage_path": root,
    }
    methods = {
        "tpe_asha": {"search": "tpe", "early_stopping": "asha"},
        "random": {"search": "random", "early_stopping": "none"},
    }
    histories, finals = {}, []
    for seed in range(args.seeds):
        for method, options in methods.items():
            name = f"{method}-{seed}"
            result = run_sweep("tiny", SPACE, name=name, seed=seed, **common, **options)
            histories[(method, seed)] = reports(Path(result.path))
            finals += result.trials.loc[result.trials["steps"] == args.steps, "val_loss"].tolist()
            print(name, "best", round(result.best["val_loss"], 4), flush=True)
    target = float(np.percentile(finals, 20))
    budget = args.trials * args.steps
    costs = {
        f"{method}/{seed}": steps_to_target(history, target, budget) for (method, seed), history in histories.items()
    }
    total = {m: sum(steps for key, (steps, _) in costs.items() if key.startswith(m)) for m in methods}
    print(
        json.dumps(
            {
                "target_val_loss": target,
                "budget_steps_per_sweep": budget,
                "steps_to_target": costs,
                "total": total,
                "P5": total["tpe_asha"] / total["random"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
