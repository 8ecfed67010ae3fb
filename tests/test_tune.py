"""Sweeps of the real training loop on a real Ray: ASHA, concurrency, best recipe, resume, pre-emption, notebook."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbclient
import nbformat
import pandas as pd
import pytest
import yaml
from ray.tune import ExperimentAnalysis, Result, ResultGrid
from ray.util.state import list_actors

from cluster.drain import drain_node
from tests.conftest import REPO, interrupt_when
from train.config import load_config
from train.export import save_export
from train.launch import run_training
from train.model import GPT
from train.schema import ConfigError
from train.tokenizer import ByteTokenizer
from tune.__main__ import main as tune_main
from tune.__main__ import print_summary
from tune.config import SWEEP_DIR, SWEEP_FILE, load_sweep_config, saved_sweep_config, sweep_config_from_dict
from tune.sweep import (
    TRIALS_FILE,
    BestTrial,
    SweepResult,
    _nothing_to_resume,
    _ran_to_its_end,
    _ran_with,
    check_best_recipe_path,
    resume_sweep,
    run_sweep,
    run_sweep_config,
    summarize,
    trial_cpus,
    write_best_recipe,
)
from tune.trial import ENDED, ended_evaluation

SPACE = {
    "optim.lr": {"loguniform": [1e-4, 3e-2]},
    "optim.warmup_steps": {"int": [0, 10]},
    "model.d_model": {"choice": [64, 128]},
}
# A trial's complete checkpoints, under the sweep's trials directory.
METADATA_GLOB = "*/checkpoints/step_*/metadata.json"
SHORT = ["optim.max_steps=40", "optim.warmup_steps=5", "run.eval_every=10", "checkpoint.every_steps=10"]


def max_overlap(trials: pd.DataFrame) -> int:
    """The most trials that were running at one moment."""
    events = sorted([(t, 1) for t in trials["started"]] + [(t, -1) for t in trials["ended"]])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def assert_ended_trials_left_no_checkpoints(sweep: Path) -> None:
    """Every trial of a sweep that ran to its end has ended, so none of their checkpoints is left."""
    assert list(sweep.glob("trials/*/checkpoints"))  # the trials checkpointed here
    assert not list(sweep.glob("trials/*/checkpoints/step_*"))


# SHORT trials without early stopping, two at a time on one CPU each.
SHORT_SWEEP = {"set": SHORT, "max_concurrent_trials": 2, "early_stopping": "none", "trial_resources": {"CPU": 1}}


def short_sweep(tmp_path: Path, name: str, space: dict, **options) -> SweepResult:
    """A SHORT_SWEEP of the tiny recipe, stored in tmp_path."""
    return run_sweep("tiny", space, name=name, storage_path=str(tmp_path), **SHORT_SWEEP, **options)


BAD_SPACES = [
    ({"optim.lr": {"loguniform": [0, 1e-2]}}, "space.optim.lr"),
    ({"optim.lrate": {"choice": [1e-3]}}, "optim.lrate"),
    ({"model.d_model": {"normal": [64, 128]}}, "space.model.d_model"),
    ({"optim.warmup_steps": {"int": [0.5, 3]}}, "space.optim.warmup_steps"),
    ({"optim.micro_batch_size": {"choice": [8, 3]}}, "optim.micro_batch_size"),  # 3 does not divide 16
    ({"deepspeed.zero_stage": {"choice": [2, 4]}}, "deepspeed.zero_stage"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("space", "named"), BAD_SPACES, ids=[named for _, named in BAD_SPACES])
def test_bad_search_space_gets_an_error_naming_the_parameter(space, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        sweep_config_from_dict({"base": "tiny", "space": space})


@pytest.mark.unit
def test_more_trials_than_a_space_of_choices_holds_are_refused_but_a_saved_sweep_resumes_as_it_started(tmp_path):
    discrete = {"model.d_model": {"choice": [64, 128]}, "optim.warmup_steps": {"int": [0, 2]}}
    settings = {"base": "tiny", "space": discrete, "num_trials": 7}
    with pytest.raises(
        ConfigError, match=r"^num_trials: 7 trials of a space of 6 distinct settings \(model\.d_model: 2 "
    ):
        sweep_config_from_dict(settings)
    assert sweep_config_from_dict({**settings, "num_trials": 6}).num_trials == 6
    assert sweep_config_from_dict({**settings, "space": {**discrete, "optim.lr": SPACE["optim.lr"]}}).num_trials == 7
    (tmp_path / SWEEP_FILE).write_text(yaml.safe_dump(settings))
    assert saved_sweep_config(str(tmp_path)).num_trials == 7


@pytest.mark.unit
@pytest.mark.parametrize("sweep", sorted(p.stem for p in SWEEP_DIR.glob("*.yaml")))
def test_every_shipped_sweep_loads(sweep):
    load_sweep_config(sweep)


@pytest.mark.unit
def test_cli_rejects_a_bad_sweep_file_before_starting_ray(tmp_path, capsys):
    bad = tmp_path / "sweep-bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "space": {"optim.lr": {"choice": []}}}))
    assert tune_main(["--config", str(bad)]) == 2
    assert "space.optim.lr" in capsys.readouterr().err
    assert tune_main(["--config", "tiny", "--set", "num_trials=0"]) == 2
    assert "num_trials" in capsys.readouterr().err
    assert tune_main(["--resume", str(tmp_path)]) == 2


@pytest.mark.unit
@pytest.mark.parametrize(
    ("settings", "cpus"),
    [
        ([], 1),  # the tiny sweep's one-worker trials: its process is the worker
        (["trial_workers=2"], 2.01),  # 2 workers of trial_resources' CPU each, beside the trial's sliver
        (["trial_workers=2", "trial_resources={spot: 0.01}"], 2.01),  # the recipe's cpus_per_worker, then
    ],
)
def test_a_private_ray_is_sized_for_a_trial_and_its_workers(settings, cpus):
    """A private Ray sized by the workers alone held 2 CPUs on a 2-core laptop, 0.01 short of a 2-worker trial:
    its Train workers waited for CPUs forever."""
    sweep = load_sweep_config("tiny", settings)
    assert trial_cpus(sweep, sweep.base_config()) == pytest.approx(cpus)


@pytest.mark.unit
def test_resume_runs_on_the_settings_the_sweep_started_with(tmp_path, capsys):
    (tmp_path / SWEEP_FILE).write_text(yaml.safe_dump(load_sweep_config("tiny", ["num_trials=3"]).to_dict()))
    assert tune_main(["--resume", str(tmp_path), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["num_trials"] == 3
    with pytest.raises(SystemExit) as refused:  # the saved settings are what the resumed searcher has
        tune_main(["--resume", str(tmp_path), "--set", "num_trials=5"])
    assert refused.value.code == 2
    assert "--set: a resumed sweep keeps the settings it started with" in capsys.readouterr().err


@pytest.mark.unit
def test_only_a_sweep_that_finished_with_no_failed_trial_has_nothing_to_resume(tmp_path):
    assert not _nothing_to_resume(str(tmp_path))  # interrupted: no summary yet
    (tmp_path / TRIALS_FILE).write_text("trial_id,val_loss,error\na1,3.5,False\nb2,nan,True\n")
    assert not _nothing_to_resume(str(tmp_path))  # --resume runs the failed trial again
    (tmp_path / TRIALS_FILE).write_text("trial_id,val_loss,error\na1,3.5,False\nb2,3.1,False\n")
    assert _nothing_to_resume(str(tmp_path))


@pytest.mark.unit
def test_a_trial_the_sweep_ended_before_it_reported_is_not_in_the_summary(tmp_path):
    """Tune's own results give such a trial its config (the sweep's summary), its files do not (the summary made
    again from them): both leave it out, so the two are the same table."""
    sweep = sweep_config_from_dict({"base": "tiny", "space": SPACE, "storage_path": str(tmp_path), "name": "ended"})
    config = {"optim.lr": 1e-3, "optim.warmup_steps": 0, "model.d_model": 64}
    history = pd.DataFrame({"step": [0, 40], "val_loss": [5.0, 3.0], "trial_start": [1.0, 1.0], "time": [2.0, 9.0]})
    reported = Result({"config": config, "trial_id": "a1", "node_id": "n"}, None, None, "x/run_trial_a1_1", history)
    started = Result({"config": config, "trial_id": "b2"}, None, None, "x/run_trial_b2_2", pd.DataFrame())
    proposed = Result({}, None, None, "x/run_trial_c3_3", None)
    data_path = str(tmp_path / "data")
    live = summarize(sweep, [reported, started, proposed], data_path).trials
    from_files = summarize(sweep, [reported, Result({}, None, None, "x/run_trial_b2_2", pd.DataFrame())], data_path)
    assert live["trial_id"].tolist() == ["a1"] and live.loc[0, "steps"] == 40
    pd.testing.assert_frame_equal(from_files.trials, live)
    assert from_files.best == BestTrial("a1", 3.0, 40, config)  # its last evaluation, and its parameters
    # A trial that failed before it reported stays: --resume runs it again.
    failed = Result({"config": config}, None, RuntimeError("boom"), "x/run_trial_d4_4", pd.DataFrame())
    assert summarize(sweep, [reported, failed], data_path).trials["trial_id"].tolist() == ["a1", "d4"]


@pytest.mark.unit
def test_the_best_trial_trained_to_the_end_or_else_did_not_fail(tmp_path):
    """A trial that failed, or that ASHA or the step budget stopped, may have the lowest loss at the step where it
    ended, but a trial that trained to the last step is the better recipe; where none did, one that did not fail."""
    sweep = sweep_config_from_dict(
        {"base": "tiny", "set": ["optim.max_steps=40"], "space": SPACE, "storage_path": str(tmp_path)}
    )

    def trial(trial_id: str, lr: float, steps: int, val_loss: float, error: Exception | None = None) -> Result:
        history = pd.DataFrame(
            {"step": [0, steps], "val_loss": [5.0, val_loss], "trial_start": [1.0, 1.0], "time": [2.0, 9.0]}
        )
        config = {"optim.lr": lr, "optim.warmup_steps": 0, "model.d_model": 64}
        return Result({"config": config, "trial_id": trial_id}, None, error, f"x/run_trial_{trial_id}_1", history)

    failed = trial("f1", 1e-2, 30, 2.0, RuntimeError("out of disk space"))
    stopped = trial("s1", 3e-3, 20, 2.5)
    finished = trial("d1", 1e-3, 40, 3.0)
    data_path = str(tmp_path / "data")
    assert summarize(sweep, [failed, stopped, finished], data_path).best.trial_id == "d1"
    assert summarize(sweep, [failed, stopped], data_path).best.trial_id == "s1"
    assert summarize(sweep, [failed], data_path).best == BestTrial("f1", 2.0, 30, failed.config)


@pytest.mark.unit
def test_the_printed_summary_says_how_each_trial_ended_and_how_long_it_ran(tmp_path, capsys):
    sweep = sweep_config_from_dict(
        {"base": "tiny", "set": ["optim.max_steps=40"], "space": SPACE, "storage_path": str(tmp_path)}
    )
    config = {"optim.lr": 1e-3, "optim.warmup_steps": 0, "model.d_model": 64}
    node = "735396d3bdc66761dc0803677f9116567e0ad53b646fa56029ce78e9"

    def reported(trial_id: str, lr: float, steps: int, seconds: float) -> Result:
        start = 1796667469.7
        history = pd.DataFrame(
            {"step": [0, steps], "val_loss": [5.0, 1e3 * lr], "trial_start": start, "time": [start, start + seconds]}
        )
        trial = {"config": {**config, "optim.lr": lr}, "trial_id": trial_id, "node_id": node}
        return Result(trial, None, None, f"x/run_trial_{trial_id}_1", history)

    failed = Result({"config": config}, None, RuntimeError("boom"), "x/run_trial_f1_3", pd.DataFrame())
    trials = [reported("d1", 3e-3, 40, 3725.4), reported("s1", 4e-3, 20, 12.0), failed]
    print_summary(summarize(sweep, trials, str(tmp_path / "d")))
    table = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert table[0].split() == [
        "trial_id",
        "optim.lr",
        "optim.warmup_steps",
        "model.d_model",
        "val_loss",
        "steps",
        "ended",
        "ran",
        "node",
    ]
    assert table[1].split()[0] == "d1" and table[1].split()[-3:] == ["finished", "1:02:05", "735396d3"]
    assert table[2].split()[0] == "s1" and table[2].split()[-4:] == ["stopped", "early", "0:00:12", "735396d3"]
    assert table[3].split()[0] == "f1" and table[3].split()[-5:] == ["-", "0", "failed", "-", "-"]


@pytest.mark.unit
def test_best_recipe_path_takes_a_new_file_or_a_best_recipe_and_nothing_else(tmp_path):
    target = tmp_path / "recipes" / "best.yaml"
    sweep = sweep_config_from_dict(
        {"base": "tiny", "space": SPACE, "storage_path": str(tmp_path), "best_recipe_path": str(target)}
    )
    check_best_recipe_path(sweep)  # a new file, in a directory made when it is written
    best = BestTrial("a1", 3.0, 40, {"optim.lr": 1e-3, "optim.warmup_steps": 0, "model.d_model": 64})
    assert write_best_recipe(sweep, best, str(tmp_path / "data")) == str(target)
    check_best_recipe_path(sweep)  # a best recipe: the next sweep may overwrite it
    target.write_text("mine: true\n")
    with pytest.raises(ConfigError, match=f"^best_recipe_path: {target} is a file that no sweep wrote"):
        check_best_recipe_path(sweep)
    assert target.read_text() == "mine: true\n"


@pytest.mark.cluster
def test_notebook_sweep_stops_trials_early_runs_them_concurrently_and_its_best_recipe_trains(
    ray_session, tiny_dataset, tmp_path
):
    """The notebook, executed headless against this session's Ray, is the small sweep under test."""
    notebook = nbformat.read(REPO / "notebooks" / "sweep.ipynb", as_version=4)
    env = {"RAY_ADDRESS": ray_session.address, "SWEEP_STORAGE": str(tmp_path)}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(notebook, timeout=900, resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        for key in env:
            os.environ.pop(key)
    outputs = [o for c in notebook.cells for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    # raywright's live table of the running sweep (Tune shows tables of its own), as its last update left it.
    tables = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    (progress,) = [html for html in tables if "<th>trial</th>" in html and "<th>status</th>" in html]
    assert progress.count("TERMINATED") == 6  # every trial ended
    assert len(images) == 4  # history, anytime, importances, rungs

    sweep = tmp_path / "sweeps" / "notebook"
    trials = pd.read_csv(sweep / "trials.csv")
    assert len(trials) == 6 and not trials["error"].any()
    assert trials["stopped_early"].any() and not trials["stopped_early"].all()  # ASHA stopped some, not all
    assert max_overlap(trials) == 2  # max_concurrent_trials reached
    for plot in ("optimization_history.png", "anytime.png", "parameter_importances.png", "asha_rungs.png"):
        assert (sweep / plot).stat().st_size > 1000
    assert_ended_trials_left_no_checkpoints(sweep)
    # Each trial, stopped by ASHA or not, recorded the evaluation it ended with: one that a resumed sweep's
    # state (saved up to ~10 s earlier) still has running reports it rather than train again from scratch.
    for trial in trials.to_dict("records"):
        run = str(sweep / "trials" / trial["trial_id"])
        ended = ended_evaluation(run)
        assert ended.step == trial["steps"] and ended.val_loss == pytest.approx(trial["val_loss"])
        if trial["stopped_early"]:
            assert ended.model_dump() == json.loads((Path(run) / ENDED).read_text())  # it has no export to tell it
    # A trial that ASHA let reach its last step finished it: its export is there beside the sweep's results.
    for trial_id in trials[~trials["stopped_early"]]["trial_id"]:
        assert (sweep / "trials" / trial_id / "export" / "model.safetensors").exists()

    # The best recipe is a complete train recipe: it trains as it is.
    recipe = sweep / "best-notebook.yaml"  # the sweep directory keeps it
    cfg = load_config(str(recipe), [f"run.storage_path={tmp_path}/best"])
    best = trials[~trials["stopped_early"]].sort_values("val_loss").iloc[0]
    assert cfg.optim.lr == pytest.approx(best["optim.lr"]) and cfg.model.d_model == best["model.d_model"]
    assert f"best trial {best['trial_id']}: val_loss {best['val_loss']:.4f}" in printed
    summary = run_training(cfg)
    assert summary.steps == 40 and summary.final_val_loss < summary.initial_val_loss


@pytest.mark.cluster
def test_a_sweep_interrupted_or_whose_driver_is_killed_resumes_within_its_step_budget(
    ray_session, tiny_dataset, tmp_path, capsys
):
    """5 trials of 40 steps, a budget of 120. Ctrl-C once a trial has a checkpoint: the sweep saves its state and
    says how to resume it. The same command resumes it, and a SIGTERM (``ray job stop``) once a trial resumed does
    the same. Resumed again, it is killed after two trials (80 steps); the same command again resumes the sweep,
    which counts those and stops at 120 steps in all, not at 80 + 120."""
    sweep_file = tmp_path / "sweep-resume.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                **SHORT_SWEEP,
                "name": "resume",
                "base": "tiny",
                "space": SPACE,
                "num_trials": 5,
                "step_budget": 120,
                "storage_path": str(tmp_path),
                "ray_address": ray_session.address,
            }
        )
    )
    sweep = tmp_path / "sweeps" / "resume"
    command = [sys.executable, "-m", "tune", "--config", str(sweep_file)]
    # Tune takes Ctrl-C while it runs (its handler, whatever the shell left): it saves the state, stops the trials.
    log = tmp_path / "interrupted.log"
    interrupt_when(command, log, lambda: list((sweep / "trials").glob(METADATA_GLOB)), signal.SIGINT)
    assert f"interrupted: sweep 'resume' saved its state in {sweep}: run it again" in log.read_text()
    assert not (sweep / TRIALS_FILE).exists()  # not summarized as if it had ended: nothing would resume it
    # SIGTERM, once Tune runs the resumed sweep, is taken as Ctrl-C (Ray's own handler aborted the driver).
    log = tmp_path / "terminated.log"
    interrupt_when(command, log, lambda: "resumed from" in log.read_text())  # a trial's line, relayed
    assert f"interrupted: sweep 'resume' saved its state in {sweep}: run it again" in log.read_text()
    assert not (sweep / TRIALS_FILE).exists()
    driver = subprocess.Popen(command, cwd=REPO)
    try:
        deadline = time.time() + 600
        # Kill the driver once two trials have finished (their exports exist) and others are under way.
        while len(list(sweep.glob("trials/*/export/config.json"))) < 2:
            assert driver.poll() is None and time.time() < deadline, "the sweep ended or stalled before the kill"
            time.sleep(0.5)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    # Tune saves the sweep's state every ~10 s: the one it resumes from has the last trial to finish still running.
    finished_before = [p.parent for p in sweep.glob("trials/*/export/config.json")]  # written last
    exported_before = {d.parts[-2]: (d / "model.safetensors").stat().st_mtime_ns for d in finished_before}
    result = run_sweep_config(load_sweep_config(str(sweep_file)))
    assert "resuming it" in capsys.readouterr().out
    trials = result.trials
    assert not trials["error"].any()
    assert set(exported_before) <= set(trials[trials["steps"] == 40]["trial_id"])  # kept, not re-run under new ids
    for trial_id, mtime_ns in exported_before.items():  # nor trained again (a finished trial's checkpoints are gone)
        assert (sweep / "trials" / trial_id / "export" / "model.safetensors").stat().st_mtime_ns == mtime_ns
    # Two trials run at once: the one that was not the first to cross the budget may add an evaluation.
    assert 120 <= trials["steps"].sum() <= 120 + 2 * 10, trials
    assert Path(result.best_recipe).exists()
    # Resumed again (`--resume`), the finished sweep gives the same summary from its files, and trains nothing.
    exported = {p: p.stat().st_mtime_ns for p in sweep.glob("trials/*/export/model.safetensors")}
    again = resume_sweep(str(sweep))
    pd.testing.assert_frame_equal(again.trials, trials)
    assert again.best == result.best
    assert {p: p.stat().st_mtime_ns for p in sweep.glob("trials/*/export/model.safetensors")} == exported
    assert_ended_trials_left_no_checkpoints(sweep)  # the trials the budget cut are over too
    exports = {p.parts[-3] for p in sweep.glob("trials/*/export/model.safetensors")}
    assert exports == set(trials[trials["steps"] == 40]["trial_id"])  # what else a trial wrote stays


def _checkpoint_reasons(trials: Path) -> dict[str, str]:
    """Why each complete checkpoint of the trials was taken (one that keep_last prunes meanwhile is left out)."""
    reasons = {}
    for metadata in trials.glob(METADATA_GLOB):
        with contextlib.suppress(FileNotFoundError):
            reasons[metadata.parent.name] = json.loads(metadata.read_text())["reason"]
    return reasons


@pytest.mark.cluster
def test_trial_resumes_from_its_checkpoint_on_another_spot_node(ray_session, tiny_dataset, tmp_path):
    """A spot node gets its pre-emption notice mid-trial, then is removed at the deadline: the trial checkpoints at
    the notice and before the deadline, and Tune restarts it on the other spot node, from its checkpoint."""
    spot_nodes = [ray_session.add_node(num_cpus=1, resources={"spot": 1}) for _ in range(2)]
    ray_session.wait_for_nodes()
    result = []
    options = {
        "name": "preempt",
        "set": [*SHORT, "optim.max_steps=200", "checkpoint.preemption_check_s=1"],
        "space": {"optim.lr": {"choice": [3e-3]}},
        "num_trials": 1,
        "storage_path": str(tmp_path),
        "trial_resources": {"CPU": 1, "spot": 0.01},
        "keep_trial_checkpoints": True,
    }
    sweep_thread = threading.Thread(target=lambda: result.append(run_sweep("tiny", {}, **options)))
    sweep_thread.start()
    try:
        checkpoints = tmp_path / "sweeps" / "preempt" / "trials"
        deadline = time.time() + 300
        saved = []
        while not any(step >= 20 for step in saved):
            assert sweep_thread.is_alive() and time.time() < deadline, "the trial never checkpointed step 20"
            time.sleep(0.2)
            saved = [int(p.parent.name[len("step_") :]) for p in checkpoints.glob(METADATA_GLOB)]
        (trial_actor,) = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "ImplicitFunc" in a.class_name]
        lost = next(n for n in spot_nodes if n.node_id == trial_actor.node_id)
        drain_node(lost.node_id, deadline_s=4)  # far from the trial's end: ~150 steps on
        reasons = {}  # of every checkpoint seen (keep_last prunes them as the trial goes on)
        while "deadline" not in reasons.values():
            assert sweep_thread.is_alive() and time.time() < deadline, f"no checkpoint before the deadline: {reasons}"
            time.sleep(0.1)
            reasons |= _checkpoint_reasons(checkpoints)
        assert "preemption" in reasons.values(), reasons  # the just-in-time one, at the notice
        if lost in ray_session.worker_nodes:
            ray_session.remove_node(lost, allow_graceful=False)  # the instance ends
        sweep_thread.join(timeout=300)
    finally:
        for node in spot_nodes:
            if node in ray_session.worker_nodes:
                ray_session.remove_node(node)
    (trial,) = result[0].trials.to_dict("records")
    assert trial["steps"] == 200 and trial["node_id"] != lost.node_id
    progress = pd.read_csv(next((tmp_path / "sweeps" / "preempt").glob("run_trial*/progress.csv")))
    # Tune keeps the trial's history across the restart: it ran on the lost node, then on the other one,
    # and its evaluations continue from the checkpoint instead of starting again at step 0.
    assert list(progress["node_id"].unique()) == [lost.node_id, trial["node_id"]]
    # (An evaluation between the last checkpoint and the node loss may be reported twice.)
    steps = progress["step"].tolist()
    assert steps.count(0) == 1 and sorted(set(steps)) == list(range(0, 201, 10)), steps
    # keep_trial_checkpoints: the ended trial keeps its newest (keep_last 2 of the tiny recipe).
    kept = sorted(p.parent.name for p in checkpoints.glob(METADATA_GLOB))
    assert kept == ["step_00000190", "step_00000200"], kept


@pytest.mark.cluster
def test_a_sweep_ends_once_its_step_budget_is_spent(ray_session, tiny_dataset, tmp_path):
    """step_budget: 60 steps of 40-step trials -> the sweep stops after two trials' worth, not eight."""
    result = short_sweep(tmp_path, "budget", SPACE, num_trials=8, step_budget=60)
    spent = result.trials["steps"].sum()
    # Two trials run at once: the one that was not the first to cross the budget may add an evaluation.
    assert 60 <= spent <= 60 + 2 * 10, result.trials
    assert len(result.trials) < 8 and result.trials["stopped_early"].any()
    # The trial the budget cut short is over too: nothing resumes it.
    assert_ended_trials_left_no_checkpoints(Path(result.path))
    # The same sweep again is not run again (seeded, it would train the same trials): its summary, from its files.
    entries = sorted(p.name for p in Path(result.path).iterdir())
    again = short_sweep(tmp_path, "budget", SPACE, num_trials=8, step_budget=60)
    pd.testing.assert_frame_equal(again.trials, result.trials)
    assert sorted(p.name for p in Path(result.path).iterdir()) == entries
    # Another setting is another sweep.
    sweep = yaml.safe_load((Path(result.path) / SWEEP_FILE).read_text())
    assert not _ran_with(sweep_config_from_dict({**sweep, "step_budget": 80}), result.path)
    # Its trials all ended, fewer than it has: the budget ended it. Had it none, Tune's saved state would be that of
    # a sweep interrupted between two trials, with trials left to run: to resume, not to summarize as finished.
    saved_state = ResultGrid(ExperimentAnalysis(result.path))
    with pytest.raises(KeyboardInterrupt, match="to resume it"):
        _ran_to_its_end(sweep_config_from_dict({**sweep, "step_budget": 0}), saved_state)


@pytest.mark.cluster
def test_a_sweep_ends_once_a_trial_reaches_its_target(ray_session, tiny_dataset, tmp_path):
    """target: a val_loss of 4.0, which trials reach at their first evaluation (step 10 of 40). The sweep ends
    there, with fewer trials than its 4, and has finished: not taken for a sweep interrupted between trials."""
    result = short_sweep(tmp_path, "target", {"optim.lr": {"uniform": [2.9e-3, 3.1e-3]}}, num_trials=4, target=4.0)
    assert len(result.trials) < 4 and result.trials["stopped_early"].all(), result.trials
    assert result.best.val_loss <= 4.0 and result.trials["steps"].max() < 40


@pytest.mark.cluster
def test_failed_trials_are_named_with_their_error_and_resume_runs_them_again(
    ray_session, tiny_dataset, tmp_path, capsys
):
    """Trials that start from a model directory deleted once the sweep was checked fail (max_failures 0: at once),
    the others run. The summary names each failed trial's error, where its traceback is, and the command that runs
    them again: once the directory is back, that command trains them. Where every trial failed, there is nothing
    to summarize: the command says so in one line, with a trial's error and that command, and exit code 1."""
    cfg = load_config("tiny")
    base, why = tmp_path / "base", "no config.json; not a Hugging Face model directory"

    def write_base() -> None:
        save_export(GPT(cfg.model).state_dict(), cfg.model, ByteTokenizer(), str(base), None)

    write_base()
    settings = {
        "name": "fails",
        "base": "tiny",
        **SHORT_SWEEP,
        "set": ["optim.max_steps=20", *SHORT[1:]],
        "space": {"model.init_from": {"choice": ["", str(base)]}, "optim.lr": SPACE["optim.lr"]},
        "num_trials": 4,
        "max_failures": 0,
        "storage_path": str(tmp_path),
        "ray_address": ray_session.address,
    }
    # Every trial fails, here as none can make its run directory (a file is in the way): nothing to summarize.
    all_fail = tmp_path / "sweeps" / "all-fail"
    all_fail.mkdir(parents=True)
    (all_fail / "trials").write_text("in the way")
    sweep_file = tmp_path / "all-fail.yaml"
    sweep_file.write_text(yaml.safe_dump({**settings, "name": "all-fail", "num_trials": 1}))
    command = [sys.executable, "-m", "tune", "--config", str(sweep_file)]
    failed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    (line,) = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert failed.returncode == 1 and line.startswith("error: sweep 'all-fail': no trial reported val_loss; trial ")
    assert f"failed: NotADirectoryError: [Errno 20] Failed to open local file '{all_fail}/trials/" in line
    assert line.endswith(f"; to run the trials again: python -m tune --resume {all_fail}"), line
    sweep = sweep_config_from_dict(settings)
    shutil.rmtree(base)
    result = run_sweep_config(sweep)
    failed = result.trials[result.trials["error"]]
    assert 0 < len(failed) < 4 and (failed["model.init_from"] == str(base)).all(), result.trials
    assert [trial.trial_id for trial in result.failed] == list(failed["trial_id"])
    print_summary(result)
    printed = capsys.readouterr().out
    for trial in result.failed:
        assert trial.error == f"train.schema.ConfigError: model.init_from: {base}: {why}"
        assert f"trial {trial.trial_id} failed: {trial.error}\n  (its traceback: {trial.error_file})" in printed
        assert trial.error in Path(trial.error_file).read_text()
    assert f"to run the failed trials again: python -m tune --resume {result.path}\n" in printed
    write_base()
    rerun = subprocess.run(
        [sys.executable, "-m", "tune", "--resume", result.path], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 0 and "failed:" not in rerun.stdout, rerun.stdout + rerun.stderr[-3000:]
    assert (pd.read_csv(Path(result.path) / TRIALS_FILE)["steps"] == 20).all()


@pytest.mark.cluster
def test_a_trial_that_diverges_ends_at_once_as_the_worst_result(ray_session, tiny_dataset, tmp_path):
    """Its loss is NaN from step 2; reported as NaN, ASHA would never stop it and Optuna would learn nothing."""
    result = short_sweep(tmp_path, "diverges", {"optim.lr": {"choice": [1e30]}}, num_trials=1)
    (trial,) = result.trials.to_dict("records")
    assert trial["val_loss"] == float("inf") and not trial["error"]  # not retried either: it would diverge again
    assert trial["steps"] == 10  # its first loss report after step 1, not the 40 steps of the recipe
    # What a sweep resumed before Tune saved its end would report of it again, rather than train it again.
    ended = ended_evaluation(str(tmp_path / "sweeps" / "diverges" / "trials" / trial["trial_id"]))
    assert ended.step == 10 and ended.val_loss == float("inf")


@pytest.mark.unit
def test_an_ended_trials_record_cut_short_is_an_error_naming_it(tmp_path):
    (tmp_path / ENDED).write_text('{"step": 40, "val_lo')
    with pytest.raises(ConfigError, match=rf"{tmp_path}/{ENDED} is not an ended trial's record .*\(not JSON"):
        ended_evaluation(str(tmp_path))


@pytest.mark.cluster
def test_multi_worker_trials_run_deepspeed_on_ray_train_inside_tune(ray_session, tiny_dataset, tmp_path):
    """trial_workers: 2 -> every trial is a 2-worker Ray Train DeepSpeed job; two of them run at once."""
    space = {"deepspeed.zero_stage": {"choice": [1, 3]}, "optim.lr": {"loguniform": [1e-3, 1e-2]}}
    result = short_sweep(tmp_path, "multi", space, num_trials=2, trial_workers=2)
    trials = result.trials
    assert len(trials) == 2 and not trials["error"].any() and (trials["steps"] == 40).all()
    assert max_overlap(trials) == 2
    for trial_id in trials["trial_id"]:
        metrics = pd.read_json(tmp_path / "sweeps" / "multi" / "trials" / trial_id / "metrics.jsonl", lines=True)
        assert set(metrics["world_size"].dropna()) == {2}  # trained by two Ray Train workers
    assert load_config(result.best_recipe).scaling.num_workers == 2  # the best recipe trains as it was swept


@pytest.mark.unit
def test_trial_workers_are_set_by_trial_workers_only():
    with pytest.raises(ConfigError, match="scaling.num_workers"):
        sweep_config_from_dict({"base": "tiny", "set": ["scaling.num_workers=2"], "space": SPACE})
