"""run.profile_steps: torch.profiler over the chosen optimizer steps, a trace per rank and a summary on rank 0."""

import json

import pytest
import torch
from torch.profiler import record_function

from train import storage
from train.config import load_config
from train.model import GPT
from train.profiling import StepProfiler
from train.schema import ConfigError


def _train(profiler: StepProfiler, steps: int) -> None:
    cfg = load_config("tiny")
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    for step in range(1, steps + 1):
        with profiler.step(step):
            with record_function("forward"):
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
            with record_function("backward"):
                loss.backward()
            optimizer.step()


@pytest.mark.unit
def test_only_the_chosen_steps_are_traced_and_rank_0_prints_where_the_time_went(tmp_path, capsys):
    run = str(tmp_path / "run")
    _train(StepProfiler([2, 3], run, rank=0, device=torch.device("cpu")), steps=4)
    assert storage.list_dir(storage.join(run, "profile")) == ["steps2-3-rank0.json"]
    trace = json.loads(storage.read_bytes(storage.join(run, "profile", "steps2-3-rank0.json")))
    annotations = [event["name"] for event in trace["traceEvents"] if event.get("cat") == "user_annotation"]
    assert [name for name in annotations if name in ("forward", "backward")] == ["forward", "backward"] * 2
    assert annotations.count("Optimizer.step#AdamW.step") == 2  # steps 2 and 3, not 1 or 4
    printed = capsys.readouterr().out
    assert printed.startswith("profile of steps 2-3: ") and "ms per step" in printed
    assert "aten::" in printed and "backward" in printed and f"{run}/profile/" in printed


@pytest.mark.unit
def test_other_ranks_write_their_trace_and_print_nothing(tmp_path, capsys):
    run = str(tmp_path / "run")
    _train(StepProfiler([1, 1], run, rank=1, device=torch.device("cpu")), steps=1)
    assert storage.list_dir(storage.join(run, "profile")) == ["steps1-1-rank1.json"]
    assert capsys.readouterr().out == ""


@pytest.mark.unit
def test_no_profile_steps_profile_nothing(tmp_path):
    run = str(tmp_path / "run")
    _train(StepProfiler([], run, rank=0, device=torch.device("cpu")), steps=2)
    assert not storage.exists(storage.join(run, "profile"))


@pytest.mark.unit
@pytest.mark.parametrize("steps", ["[0,2]", "[5,3]", "[4]", "[1,2,3]"])
def test_a_bad_step_range_names_the_key(steps):
    with pytest.raises(ConfigError, match=r"run.profile_steps: must be \[\] or \[first, last\]"):
        load_config("tiny", [f"run.profile_steps={steps}"])
