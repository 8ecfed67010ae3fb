"""Hugging Face at both ends: any GPT-2 directory is served and fine-tuned, with transformers as the reference.

The GPT-2 here is made by transformers itself (from a config, trained in-process to recite a
text, saved locally): a checkpoint raywright did not write, with OpenAI's tanh GELU and a BPE.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from serve.app import chat_template
from serve.decoder import Decoder
from serve.engine import Engine, GenerationParams, Sequence
from tests.conftest import MEMORIZED_TEXT
from train import storage
from train.config import load_config
from train.data import dataset_path
from train.ds_config import build_engine
from train.export import load_exported
from train.hf_gpt2 import (
    from_hf_state,
    hf_config,
    load_weights,
    model_config_from_hf,
    read_model_config,
    to_hf_state,
    weight_files,
)
from train.launch import run_training
from train.model import GPT
from train.model_config import ModelConfig
from train.node_copy import load_split
from train.schema import ConfigError
from train.tokenizer import EOT, load_tokenizer, train_bpe

PROMPTS = ["Grüße", "3 € für", "und 🚀. Grüße aus", "Köln:"]


@pytest.fixture(scope="module")
def hf_gpt2(corpus_dir, tmp_path_factory) -> str:
    """A transformers GPT-2 (tanh GELU, BPE of 512 tokens) that recites MEMORIZED_TEXT, saved with its tokenizer."""
    texts = [p.read_text(errors="replace") for p in sorted(corpus_dir.rglob("*.py"))[:40]] + [MEMORIZED_TEXT] * 50
    bpe = train_bpe(texts, vocab_size=512)
    config = GPT2Config(
        vocab_size=bpe.vocab_size,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=bpe.eot_id,
        eos_token_id=bpe.eot_id,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    tokens = torch.from_numpy(bpe.encode(MEMORIZED_TEXT * 40).astype("int64"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        starts = torch.randint(0, len(tokens) - 65, (16,))
        window = torch.stack([tokens[s : s + 65] for s in starts])
        loss = F.cross_entropy(model(window[:, :-1]).logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"the test GPT-2 did not learn its text (loss {loss.item():.3f})"
    out = tmp_path_factory.mktemp("hf") / "gpt2-recite"
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=bpe.hf, bos_token=EOT, eos_token=EOT).save_pretrained(out)
    return str(out)


def _hf_model(path: str) -> GPT2LMHeadModel:
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


@pytest.mark.unit
def test_names_and_config_round_trip_and_what_gpt2_cannot_be_is_one_clear_line():
    cfg = ModelConfig(vocab_size=300, seq_len=16, n_layer=2, n_head=2, d_model=32, activation="gelu_tanh")
    model = GPT(cfg)
    state = model.state_dict()
    hf = to_hf_state(state)
    assert hf["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: (in, out)
    assert all(torch.equal(a, state[name]) for name, a in from_hf_state(hf, state, "x").items())
    # OpenAI's original checkpoints: no "transformer." prefix, attention-mask buffers, a tied lm_head.
    legacy = {name.removeprefix("transformer."): t for name, t in hf.items()} | {
        "h.0.attn.bias": torch.ones(1),
        "lm_head.weight": state["tok_emb.weight"],
    }
    assert from_hf_state(legacy, state, "x").keys() == state.keys()
    assert model_config_from_hf(hf_config(cfg, eot_id=0), "x") == cfg

    def error(**changes) -> str:
        with pytest.raises(ValueError) as exc:
            model_config_from_hf({**hf_config(cfg, 0), **changes}, "cfg.json")
        return str(exc.value)

    assert (
        error(model_type="llama")
        == "cfg.json: model_type is 'llama', not 'gpt2'; only GPT-2's architecture is supported"
    )
    assert "activation_function 'relu'" in error(activation_function="relu")
    assert "n_inner 100 is not 4 x n_embd" in error(n_inner=100)
    assert "not tied" in error(tie_word_embeddings=False)
    with pytest.raises(ValueError, match="x: transformer.h.0.mlp.c_fc.weight has shape"):
        from_hf_state({**hf, "transformer.h.0.mlp.c_fc.weight": torch.zeros(3, 3)}, state, "x")


@pytest.mark.unit
def test_a_checkpoint_sharded_into_several_files_loads_as_the_whole_one(hf_gpt2, tmp_path):
    sharded = tmp_path / "sharded"
    _hf_model(hf_gpt2).save_pretrained(sharded, max_shard_size="200KB")  # ~0.6 MB of weights
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) > 1
    whole, parts = GPT(read_model_config(hf_gpt2)), GPT(read_model_config(str(sharded)))
    load_weights(whole, hf_gpt2)
    load_weights(parts, str(sharded))
    assert all(torch.equal(tensor, whole.state_dict()[name]) for name, tensor in parts.state_dict().items())
    # An index that does not say which file holds which tensor is one line naming it.
    index = sharded / "model.safetensors.index.json"
    for damaged, why in [("{cut", "not valid JSON"), ('{"metadata": {}}', "no weight_map")]:
        index.write_text(damaged)
        with pytest.raises(ConfigError, match=f"^model.init_from: {index}: {why}"):
            load_config("tiny", [f"model.init_from={sharded}"])


@pytest.mark.unit
def test_weights_cut_short_are_named_before_anything_loads_them(hf_gpt2, tmp_path, s3_bucket):
    """An interrupted copy or upload: the safetensors header (a ranged read, also of object storage) gives the
    length the file must have, and a file of another length is one line naming it."""
    whole = (Path(hf_gpt2) / "model.safetensors").read_bytes()
    header = len(b'[{"dtype": "F32"}]').to_bytes(8, "little") + b'[{"dtype": "F32"}]'
    for root in (str(tmp_path), f"{s3_bucket}/cut-{time.time_ns()}"):
        storage.copy_dir(hf_gpt2, root)
        assert weight_files(root) == ["model.safetensors"]
        weights = storage.join(root, "model.safetensors")
        for damaged, why in [
            (whole[: len(whole) // 2], f"{len(whole) // 2} bytes, where its header describes {len(whole)}"),
            (whole + b"\0", f"{len(whole) + 1} bytes, where its header describes {len(whole)}"),
            (whole[:5], "not a safetensors file (5 bytes, no header)"),
            (header, "not a safetensors file (its header is not a table of tensors)"),
        ]:
            storage.write_bytes(weights, damaged)
            with pytest.raises(ConfigError, match=f"^model.init_from: {re.escape(weights)}: {re.escape(why)}"):
                load_config("tiny", [f"model.init_from={root}"])


@pytest.mark.unit
def test_a_tokenizer_config_that_is_not_json_is_one_line_naming_it(tmp_path):
    assert chat_template(str(tmp_path)) is None  # a model directory without one has no chat template
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ mess')
    with pytest.raises(ValueError, match=f"^{tmp_path}/tokenizer_config.json: not valid JSON"):
        chat_template(str(tmp_path))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_any_gpt2_directory_is_served_with_transformers_greedy_output(hf_gpt2, precision):
    exported = load_exported(hf_gpt2)
    assert exported.name == "gpt2-recite" and exported.provenance is None
    assert exported.model.cfg.activation == "gelu_tanh"
    engine = Engine(Decoder(exported.model, max_batch=4, precision=precision), exported.tokenizer)
    greedy = GenerationParams(max_tokens=24, temperature=0.0)
    prompts = [[int(t) for t in exported.tokenizer.encode(p)] for p in PROMPTS]
    texts = engine.run_batch([Sequence(prompt, greedy) for prompt in prompts])
    reference = _hf_model(hf_gpt2)
    for prompt, text in zip(prompts, texts, strict=True):
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
        assert text == exported.tokenizer.decode(generated.tolist()).decode()
        assert len(text) > 10 and text in MEMORIZED_TEXT * 3  # it recites, so the comparison is not of noise


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_from_loads_the_gpt2_weights_and_fine_tunes_with_every_zero_stage(process_group, hf_gpt2, stage):
    cfg = load_config("tiny", [f"model.init_from={hf_gpt2}", f"deepspeed.zero_stage={stage}", "scaling.num_workers=1"])
    assert (cfg.model.vocab_size, cfg.model.seq_len, cfg.model.d_model, cfg.model.activation) == (
        512,
        128,
        64,
        "gelu_tanh",
    )
    assert cfg.data.tokenizer == hf_gpt2
    model = GPT(cfg.model)
    load_weights(model, hf_gpt2)
    engine = build_engine(cfg, model, 1)
    tokenizer = load_tokenizer(hf_gpt2)
    text = "class Fine(Tuned):\n    def step(self):\n        return self.loss\n" * 8
    tokens = torch.from_numpy(tokenizer.encode(text)[: 2 * 65].astype("int64")).view(2, 65)
    engine.eval()
    with torch.no_grad():
        assert torch.allclose(engine(tokens[:, :-1]), _hf_model(hf_gpt2)(tokens[:, :-1]).logits, atol=1e-5, rtol=0)
    engine.train()
    losses = []
    for _ in range(6):
        for _ in range(engine.gradient_accumulation_steps()):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_a_run_from_a_gpt2_checkpoint_starts_at_its_loss_and_exports_it_back(
    ray_session, hf_gpt2, corpus_dir, tmp_path
):
    cfg = load_config(
        "tiny",
        [
            f"model.init_from={hf_gpt2}",
            f"data.source={corpus_dir}/**/*.py",
            "data.val_fraction=0.1",
            f"run.storage_path={tmp_path}",
            "run.name=finetune",
            "optim.max_steps=10",
            "optim.warmup_steps=2",
            "run.eval_every=10",
            "run.eval_samples=32",
        ],
    )
    summary = run_training(cfg)
    # The dataset was tokenized with the checkpoint's own tokenizer.
    assert load_tokenizer(dataset_path(cfg)).spec() == load_tokenizer(hf_gpt2).spec()
    # The first evaluation is the GPT-2's own loss on those rows: its weights were loaded, not re-initialized.
    rows = torch.from_numpy(load_split(dataset_path(cfg), "val")[: cfg.run.eval_samples].astype(np.int64))
    with torch.no_grad():
        logits = _hf_model(hf_gpt2)(rows[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert summary.initial_val_loss == pytest.approx(hf_loss, abs=1e-4)
    assert summary.final_val_loss < summary.initial_val_loss
    # The fine-tuned model goes back out as a GPT-2 that transformers loads, with the same tokenizer.
    assert _hf_model(summary.export).config.activation_function == "gelu_pytorch_tanh"
    assert load_tokenizer(summary.export).spec() == load_tokenizer(hf_gpt2).spec()


@pytest.mark.unit
def test_init_from_what_raywright_cannot_start_from_is_one_line(hf_gpt2, tmp_path, monkeypatch):
    # A relative path is made absolute on the driver: the workers read it from another directory.
    monkeypatch.chdir(os.path.dirname(hf_gpt2))
    assert load_config("tiny", ["model.init_from=gpt2-recite"]).model.init_from == hf_gpt2
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="^model.init_from: .*model_type is 'llama', not 'gpt2'"):
        load_config("tiny", [f"model.init_from={llama}"])
    pickled = tmp_path / "pickled"
    shutil.copytree(hf_gpt2, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="no model.safetensors; raywright reads safetensors only"):
        load_config("tiny", [f"model.init_from={pickled}"])
    with pytest.raises(ConfigError, match="^data.tokenizer: a run from model.init_from uses that model's tokenizer"):
        load_config("tiny", [f"model.init_from={hf_gpt2}", "data.tokenizer=bpe"])
