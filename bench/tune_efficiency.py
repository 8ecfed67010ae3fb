"""P5: training steps a search method needs to reach random search's result ÷ those random search needs.

    python bench/tune_efficiency.py [--seeds 5] [--trials 32] [--steps 60] [--plot bench/p5_anytime.png]
                                    [--methods random tpe_asha]

Four methods sweep the same space on the tiny recipe, each ``--seeds`` times with ``--trials``
single-worker trials of ``--steps`` steps, 2 at a time: random search without early stopping,
random search with ASHA, TPE without early stopping, TPE with ASHA (the sweep file's defaults:
multivariate TPE with a constant liar, stopped trials told to TPE as pruned, grace period = the
longest warm-up). Each sweep gives an anytime curve: the best validation loss so far against the
training steps all its trials had spent so far (``tune.plots.anytime_curve``). The target is the
median over seeds of random search's final best. A method's cost in a seed is the steps spent when
its curve first reaches the target; a sweep that never does is charged its whole budget.
P5 = the median cost of TPE + ASHA ÷ the median cost of random search. Step counts, not seconds:
the figure does not depend on the machine's load. The curves go to ``--plot``. The tiny recipe is
cut to 64-token sequences and 64 validation samples so that 5 × 32 trials of each method fit in a
few hours of two cores; ``--methods random tpe_asha`` runs only the two that P5 compares.
"""

import argparse
import json
import statistics
import tempfile

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
    return int(curve.loc[reached[0], "steps"]) if len(reached) else budget


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plot", default="bench/p5_anytime.png")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    args = parser.parse_args()
    if not {"random", "tpe_asha"} <= set(args.methods):
        parser.error("--methods must include random and tpe_asha, the two P5 compares")
    root = tempfile.mkdtemp(prefix="rw-p5-")
    print("sweeps and curves in", root, flush=True)
    common = {
        "set": [
            f"optim.max_steps={args.steps}",
            "model.seq_len=64",
            "run.eval_every=10",
            "run.eval_samples=64",
            "checkpoint.every_steps=0",
        ],
        "num_trials": args.trials,
        "max_concurrent_trials": 2,
        "grace_period": 10,
        "reduction_factor": 3,
        "trial_resources": {"CPU": 1},
        "storage_path": root,
    }
    curves, random_trials = {}, {}
    for seed in range(args.seeds):
        for method in args.methods:
            options = METHODS[method]
            result = run_sweep("tiny", SPACE, name=f"{method}-{seed}", seed=seed, **common, **options)
            curves[(method, seed)] = anytime_curve(result.curves, "val_loss")
            if method == "random":
                random_trials[seed] = result.curves
            curves[(method, seed)].to_csv(f"{root}/{method}-{seed}.csv")  # kept as they come, for a cut-short run
            print(method, seed, "best", round(curves[(method, seed)]["best"].iloc[-1], 4), flush=True)
    target = statistics.median(curves[("random", seed)]["best"].iloc[-1] for seed in range(args.seeds))
    budget = args.trials * args.steps
    costs = {
        method: [steps_to_target(curves[(method, seed)], target, budget) for seed in range(args.seeds)]
        for method in args.methods
    }
    median_cost = {method: statistics.median(steps) for method, steps in costs.items()}
    replayed = {
        f"grace {grace}, factor {factor}": statistics.median(
            replay_asha(random_trials[seed], target, grace, factor, args.steps) for seed in range(args.seeds)
        )
        / median_cost["random"]
        for grace, factor in ((10, 2), (10, 3), (10, 4), (20, 3))
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
                "asha_replayed_on_random_trials_ratio_to_random": replayed,
                "plot": args.plot,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
