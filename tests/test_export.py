"""Export from a live DeepSpeed engine (one process, gloo) and reload: identical logits."""

import socket

import deepspeed
import pytest
import torch
import torch.distributed as dist

from train.config import load_config
from train.ds_config import build_ds_config
from train.export import export_model, load_exported
from train.model import GPT


@pytest.fixture(scope="module")
def process_group():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed reads it; Ray Train sets it on real workers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    monkeypatch.undo()


@pytest.mark.parametrize("stage", [0, 3])
def test_export_then_reload_gives_identical_logits(process_group, tmp_path, stage):
    cfg = load_config("tiny", [f"deepspeed.zero_stage={stage}", "scaling.num_workers=1"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=build_ds_config(cfg, 1), dist_init_required=False
    )
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    for _ in range(2):  # move the weights away from their initial values
        for _ in range(engine.gradient_accumulation_steps()):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
    engine.eval()
    with torch.no_grad():
        expected = engine(tokens[:, :-1])

    export_model(engine, cfg.model, str(tmp_path), {"provenance": {"test": True}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    reloaded, info = load_exported(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens[:, :-1]), expected)
    assert info["model"]["d_model"] == cfg.model.d_model and info["provenance"] == {"test": True}
