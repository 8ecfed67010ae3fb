"""P5: training steps a search method needs to reach random search's result ÷ those random search needs.

    python bench/tune_efficiency.py [--seeds 5] [--trials 32] [--steps 60] [--plot bench/p5_anytime.png]

Four methods sweep the same space on the tiny recipe, each ``--seeds`` times with ``--trials``
single-worker trials of ``--steps`` steps, 2 at a time: random search without early stopping,
random search with ASHA, TPE without early stopping, TPE with ASHA (the sweep file's defaults:
multivariate TPE with a constant liar, stopped trials told to TPE as pruned, grace period = the
longest warm-up). Each sweep gives an anytime curve: the best validation loss so far against the
training steps all its trials had spent so far (``tune.plots.anytime_curve``). The target is the
median over seeds of random search's final best. A method's cost in a seed is the steps spent when
its curve first reaches the target; a sweep that never does is charged its whole budget.
P5 = the median cost of TPE + ASHA ÷ the median cost of random search. Step counts, not seconds:
the figure does not depend on the machine's load. The curves go to ``--plot``.
"""

import argparse
import json
import statistics
import tempfile

import matplotlib.pyplot as plt
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


def plot(curves: dict[tuple[str, int], pd.DataFrame], target: float, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, method in enumerate(METHODS):
        for (name, _), curve in curves.items():
            if name == method:
                ax.step(curve["steps"], curve["best"], where="post", color=f"C{index}", alpha=0.5, linewidth=1)
        ax.plot([], [], color=f"C{index}", label=method)
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
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="rw-p5-")
    common = {
        "set": [f"optim.max_steps={args.steps}", "run.eval_every=10", "checkpoint.every_steps=0"],
        "num_trials": args.trials,
        "max_concurrent_trials": 2,
        "grace_period": 10,
        "reduction_factor": 3,
        "trial_resources": {"CPU": 1},
        "storage_path": root,
    }
    curves = {}
    for seed in range(args.seeds):
        for method, options in METHODS.items():
            result = run_sweep("tiny", SPACE, name=f"{method}-{seed}", seed=seed, **common, **options)
            curves[(method, seed)] = anytime_curve(result.curves, "val_loss")
            print(method, seed, "best", round(curves[(method, seed)]["best"].iloc[-1], 4), flush=True)
    target = statistics.median(curves[("random", seed)]["best"].iloc[-1] for seed in range(args.seeds))
    budget = args.trials * args.steps
    costs = {
        method: [steps_to_target(curves[(method, seed)], target, budget) for seed in range(args.seeds)]
        for method in METHODS
    }
    median_cost = {method: statistics.median(steps) for method, steps in costs.items()}
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
                "plot": args.plot,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
