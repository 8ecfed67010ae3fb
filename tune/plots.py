"""PNG plots of a finished sweep: optimization history, the anytime curve, parameter importances, ASHA rungs."""

import io

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes or in CI

import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
import pandas as pd  # noqa: E402

from train import storage  # noqa: E402
from tune.config import SweepConfig  # noqa: E402


def _distribution(spec: dict) -> optuna.distributions.BaseDistribution:
    ((kind, args),) = spec.items()
    if kind == "choice":
        return optuna.distributions.CategoricalDistribution(args)
    if kind == "int":
        return optuna.distributions.IntDistribution(*args)
    return optuna.distributions.FloatDistribution(*args, log=kind == "loguniform")


def parameter_importances(sweep: SweepConfig, trials: pd.DataFrame) -> dict[str, float]:
    """Optuna's importance estimate (PED-ANOVA) from the trials' final validation losses."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize")
    distributions = {key: _distribution(spec) for key, spec in sweep.space.items()}
    for _, row in trials.iterrows():
        # numpy scalars from the DataFrame back to Python values, as Optuna's distributions hold them
        params = {key: row[key].item() if hasattr(row[key], "item") else row[key] for key in sweep.space}
        study.add_trial(
            optuna.trial.create_trial(params=params, distributions=distributions, value=float(row["val_loss"]))
        )
    return optuna.importance.get_param_importances(study)


def anytime_curve(curves: dict[str, pd.DataFrame], metric: str) -> pd.DataFrame:
    """The best ``metric`` so far against the training steps all trials had spent so far, at every
    evaluation of the sweep in time order (``curves``: trial id -> its evaluations: step, metric, time)."""
    evaluations = pd.concat([curve.assign(trial=trial_id) for trial_id, curve in curves.items()])
    evaluations = evaluations.sort_values("time", kind="stable")
    # Steps of each trial counted once: those a trial resumed from its checkpoint redoes are not added again.
    spent = evaluations.groupby("trial")["step"].cummax().groupby(evaluations["trial"]).diff()
    spent = spent.fillna(evaluations["step"])
    return pd.DataFrame({"steps": spent.cumsum().to_numpy(), "best": evaluations[metric].cummin().to_numpy()})


def save_plots(sweep: SweepConfig, trials: pd.DataFrame, curves: dict[str, pd.DataFrame], path: str) -> list[str]:
    """Write the plots into ``path`` (local or URI); their paths."""
    trials = trials[trials["val_loss"].notna()]  # trials that failed before reporting have nothing to plot
    figures = {}

    fig, ax = plt.subplots(figsize=(6, 4))
    ordered = trials.sort_values("ended")
    ax.scatter(range(len(ordered)), ordered["val_loss"], label="trial (final or when stopped)")
    ax.plot(range(len(ordered)), ordered["val_loss"].cummin(), color="C1", label="best so far")
    ax.set(xlabel="trials, in order of completion", ylabel=sweep.metric, title=f"{sweep.name}: optimization history")
    ax.legend()
    figures["optimization_history.png"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    anytime = anytime_curve(curves, sweep.metric)
    ax.step(anytime["steps"], anytime["best"], where="post")
    ax.set(xlabel="training steps spent by all trials", ylabel=f"best {sweep.metric}", title=f"{sweep.name}: anytime")
    figures["anytime.png"] = fig

    if len(trials) >= 2:
        importances = parameter_importances(sweep, trials)
        fig, ax = plt.subplots(figsize=(6, 1 + 0.5 * len(importances)))
        ax.barh(list(importances), list(importances.values()))
        ax.set(xlabel="importance (PED-ANOVA)", title=f"{sweep.name}: parameter importances")
        figures["parameter_importances.png"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    for trial_id, curve in curves.items():
        ax.plot(curve["step"], curve[sweep.metric], marker=".", alpha=0.7, label=trial_id)
    rung = sweep.grace_period
    while rung < trials["steps"].max():
        ax.axvline(rung, color="grey", linestyle=":", linewidth=1)
        rung *= sweep.reduction_factor
    ax.set(xlabel="step (dotted: ASHA rungs)", ylabel=sweep.metric, title=f"{sweep.name}: trials and ASHA rungs")
    figures["asha_rungs.png"] = fig

    written = []
    for name, fig in figures.items():
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=100)
        plt.close(fig)
        target = storage.join(path, name)
        storage.write_bytes(target, image.getvalue())
        written.append(target)
    return written
