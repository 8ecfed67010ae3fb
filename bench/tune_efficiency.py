"""P5: training steps a search method needs to reach random search's result ÷ those random search needs.

    python bench/tune_efficiency.py [--seeds 5] [--trials 32] [--steps 180] [--plot bench/p5_anytime.png]
                                    [--methods random tpe_asha] [--root DIR]

Four methods sweep the same space on the tiny recipe, each ``--seeds`` times, 2 trials at a time: random
search without early stopping (``--trials`` single-worker trials of ``--steps`` steps), random search
with ASHA, TPE without early stopping, TPE with ASHA (the sweep file's defaults: multivariate TPE with
a constant liar and a third of its proposals random, stopped trials told to TPE as pruned, ASHA's
first rung after the longest warm-up). Every method gets the same compute, random search's
``--trials`` × ``--steps`` training steps: ASHA stops most trials early, so its sweeps run more trials
until that budget is spent (``step_budget``). Each sweep gives an anytime curve: the best validation
loss so far against the training steps all its trials had spent so far (``tune.plots.anytime_curve``).
Random search runs first; the target is the median over seeds of its final best. A method's cost in a
seed is the steps spent when its curve first reaches the target (its sweep ends there: what follows
changes no figure); a sweep that never does is charged the whole budget. P5 = the median cost of
TPE + ASHA ÷ the median cost of random search (printed also for targets up to 0.2 looser, and ASHA
replayed over random search's own trials). Step counts, not seconds: the figure does not depend on
the machine's load. The curves go to ``--plot``. The tiny recipe is cut to 64-token sequences and 64
validation samples so that the sweeps fit in hours of two cores; ``--methods random tpe_asha`` runs
only the two that P5 compares. A finished sweep already in ``--root`` (from an earlier run with the
same settings) is read, not run again: a run cut short goes on where it stopped.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from tune.plots import anytime_curve
from tune.sweep import run_sweep

SPACE = {
    "optim.lr": {"loguniform": [1e-4, 1e-1]},
    "optim.warmup_steps": {"int": [0, 10]},
    "optim.weight_decay": {"loguniform": [1e-3, 0.3]},
    "optim.global_batch_size": {"choice": [8, 16, 32]},
    "model.d_model": {"choice": [32, 64, 128]},
    "model.n_layer": {"choice": [1, 2, 3]},
}
METHODS = {
    "random": {"search": "random", "early_stopping": "none"},
    "random_asha": {"search": "random", "early_stopping": "asha"},
    "tpe": {"search": "tpe", "early_stopping": "none"},
    "tpe_asha": {"search": "tpe", "early_stopping": "asha"},
}


def steps_to_target(curve: pd.DataFrame, target: float, budget: int) -> int:
    reached = curve.index[curve["best"] <= target]
    return min(int(curve.loc[reached[0], "steps"]), budget) if len(reached) else budget


def replay_asha(curves: dict[str, pd.DataFrame], target: float, grace: int, factor: int, max_steps: int) -> int:
    """Steps random search's own trials would have spent to reach ``target`` had ASHA (``grace``,
    ``factor``) judged them at its rungs, one trial after another in the order they started: the most
    early stopping can save on these trials, whatever sampler proposes them."""
    rungs = [grace]
    while rungs[-1] * factor < max_steps:
        rungs.append(rungs[-1] * factor)
    recorded: dict[int, list[float]] = {rung: [] for rung in rungs}
    spent = 0
    for curve in sorted(curves.values(), key=lambda curve: curve["time"].min()):
        losses = curve.dropna().set_index("step")["val_loss"]
        steps = max_steps
        for rung in rungs:
            # Ray's ASHA: stopped when worse than the best 1/factor of the losses recorded at this rung.
            stop = bool(recorded[rung]) and losses[rung] > np.percentile(recorded[rung], 100 / factor)
            recorded[rung].append(losses[rung])
            if stop:
                steps = rung
                break
        spent += steps
        if steps == max_steps and losses[max_steps] <= target:
            return spent
    return len(curves) * max_steps


def plot(curves: dict[tuple[str, int], pd.DataFrame], target: float, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {method: f"C{index}" for index, method in enumerate(METHODS)}  # the same colour whichever ran
    for (method, _), curve in curves.items():
        ax.step(curve["steps"], curve["best"], where="post", color=colors[method], alpha=0.5, linewidth=1)
    for method in dict.fromkeys(method for method, _ in curves):
        ax.plot([], [], color=colors[method], label=method)
    ax.axhline(target, color="black", linestyle=":", linewidth=1, label="target (random's median final best)")
    ax.set(xlabel="training steps spent by all trials", ylabel="best val_loss so far", title="P5: anytime curves")
    ax.set_xscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def finished_sweep_curves(path: Path) -> dict[str, pd.DataFrame]:
    """The evaluations of each trial of the finished sweep in ``path``, as ``SweepResult.curves`` has them."""
    if not (path / "trials.csv").exists():
        raise SystemExit(f"{path} holds an unfinished sweep: remove it, or give another --root")
    return {
        progress.parent.name: pd.read_csv(progress)[["step", "val_loss", "time"]].drop_duplicates("step", keep="last")
        for progress in path.glob("run_trial_*/progress.csv")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=32, help="random search's trials; the others get its steps")
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--grace-period", type=int, default=20, help="ASHA's first rung, in steps")
    parser.add_argument("--reduction-factor", type=int, default=3, help="ASHA keeps the best 1/this at each rung")
    parser.add_argument("--plot", default="bench/p5_anytime.png")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--root", help="where the sweeps go (default: a new temporary directory)")
    args = parser.parse_args()
    if not {"random", "tpe_asha"} <= set(args.methods):
        parser.error("--methods must include random and tpe_asha, the two P5 compares")
    root = args.root or tempfile.mkdtemp(prefix="rw-p5-")
    print("sweeps and curves in", root, flush=True)
    budget = args.trials * args.steps
    common = {
        "set": [
            f"optim.max_steps={args.steps}",
            "model.seq_len=64",
            "run.eval_every=10",
            "run.eval_samples=64",
            "checkpoint.every_steps=0",
        ],
        "max_concurrent_trials": 2,
        "grace_period": args.grace_period,
        "reduction_factor": args.reduction_factor,
        "trial_resources": {"CPU": 1},
        "storage_path": root,
    }

    curves = {}

    def sweep(method: str, seed: int, **options) -> dict[str, pd.DataFrame]:
        name = f"{method}-{seed}"
        path = Path(root, "sweeps", name)
        trials = (
            finished_sweep_curves(path)
            if path.exists()
            else run_sweep("tiny", SPACE, name=name, seed=seed, **common, **METHODS[method], **options).curves
        )
        curves[(method, seed)] = anytime_curve(trials, "val_loss")
        print(method, seed, "best", round(curves[(method, seed)]["best"].iloc[-1], 4), flush=True)
        return trials

    random_trials = {seed: sweep("random", seed, num_trials=args.trials) for seed in range(args.seeds)}
    target = statistics.median(curves[("random", seed)]["best"].iloc[-1] for seed in range(args.seeds))
    for method in (method for method in args.methods if method != "random"):
        # ASHA's sweeps: as many trials as the budget pays for, every one stopped at the first rung at most.
        trials = budget // args.grace_period if METHODS[method]["early_stopping"] == "asha" else args.trials
        for seed in range(args.seeds):
            sweep(method, seed, num_trials=trials, step_budget=budget, target=target)

    def costs_to(loss: float) -> dict[str, list[int]]:
        return {
            method: [steps_to_target(curves[(method, seed)], loss, budget) for seed in range(args.seeds)]
            for method in args.methods
        }

    def p5_at(loss: float) -> float:
        costs = costs_to(loss)
        return statistics.median(costs["tpe_asha"]) / statistics.median(costs["random"])

    costs = costs_to(target)
    median_cost = {method: statistics.median(steps) for method, steps in costs.items()}
    replayed = {
        f"grace {grace}, factor {factor}": statistics.median(
            replay_asha(random_trials[seed], target, grace, factor, args.steps) for seed in range(args.seeds)
        )
        / median_cost["random"]
        for grace, factor in ((10, 2), (10, 3), (20, 2), (20, 3), (20, 4))
    }
    plot(curves, target, args.plot)
    print(
        json.dumps(
            {
                "target_val_loss": target,
                "budget_steps_per_sweep": budget,
                "steps_to_target": costs,
                "median_steps_to_target": median_cost,
                "ratio_to_random": {method: cost / median_cost["random"] for method, cost in median_cost.items()},
                "P5": median_cost["tpe_asha"] / median_cost["random"],
                # How much of the figure hangs on the target's exact value: a few hundredths above it.
                "P5_at_looser_targets": {f"+{delta}": p5_at(target + delta) for delta in (0.02, 0.05, 0.1, 0.2)},
                "asha_replayed_on_random_trials_ratio_to_random": replayed,
                "plot": args.plot,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
