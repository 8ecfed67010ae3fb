"""Export from a live DeepSpeed engine (one process, gloo) and reload, in raywright and in transformers."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import MEMORIZED_TEXT
from train.config import load_config
from train.ds_config import build_engine
from train.evaluation import Evaluation
from train.export import PROVENANCE, ExportProvenance, export_model, load_exported, read_provenance, save_export
from train.export_checkpoint import check_out
from train.hf_gpt2 import CONFIG, WEIGHTS
from train.model import GPT
from train.schema import ConfigError
from train.tokenizer import TOKENIZER_FILE, ByteTokenizer, train_bpe

SAMPLES = [MEMORIZED_TEXT, "def f(x):\n\treturn  x  # 日本語\n", "naïve café, 中文 and   spaces\r\n"]


@pytest.mark.parametrize("stage, tokenizer_kind", [(0, "byte"), (3, "bpe")])
def test_export_loads_in_raywright_and_transformers_with_the_same_logits_and_tokens(
    process_group, tmp_path, monkeypatch, stage, tokenizer_kind
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything from the directory, nothing from a hub
    tokenizer = ByteTokenizer() if tokenizer_kind == "byte" else train_bpe(SAMPLES * 20, vocab_size=320)
    cfg = load_config(
        "tiny",
        [f"deepspeed.zero_stage={stage}", "scaling.num_workers=1", f"model.vocab_size={tokenizer.vocab_size}"],
    )
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = build_engine(cfg, model, 1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    for _ in range(2):  # move the weights away from their initial values
        for _ in range(engine.gradient_accumulation_steps()):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
    engine.eval()
    with torch.no_grad():
        expected = engine(tokens[:, :-1])

    evaluation = Evaluation.of_loss(step=2, val_loss=loss.item(), tokens_per_byte=0.5)
    provenance = ExportProvenance(data_manifest_sha256="0" * 64, step=2, config=cfg.to_dict(), evaluation=evaluation)
    export_model(engine, cfg.model, tokenizer, str(tmp_path), provenance)
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "raywright.json",
    }
    reloaded = load_exported(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(reloaded.model(tokens[:, :-1]), expected)
    assert reloaded.provenance == provenance and reloaded.name == cfg.run.name
    assert reloaded.tokenizer.spec() == tokenizer.spec()

    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    with torch.no_grad():
        hf_logits = hf_model(tokens[:, :-1]).logits
    # The same math in another implementation: equal up to float32 reordering.
    assert torch.allclose(hf_logits, expected, atol=1e-5, rtol=0)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in SAMPLES:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == tokenizer.encode(text).tolist()
        assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token_id == hf_model.config.eos_token_id == tokenizer.eot_id


@pytest.mark.unit
def test_a_training_record_that_is_none_reads_as_none_and_a_damaged_one_is_named(tmp_path):
    """A model raywright did not train has no record (or, from older exports, an empty one); a record this version
    cannot read is an error naming the file and why, never a traceback from the JSON parser."""
    assert read_provenance(str(tmp_path)) is None
    record = tmp_path / PROVENANCE
    for empty in [{"provenance": {}}, {"model": {}, "provenance": None}]:
        record.write_text(json.dumps(empty))
        assert read_provenance(str(tmp_path)) is None
    stale = json.dumps({"provenance": {"data_manifest_sha256": "0"}})
    for damaged, why in [("{cut", "not JSON: "), (stale, "provenance.step: required")]:
        record.write_text(damaged)
        with pytest.raises(ConfigError, match=rf"^{record} is not a training record this raywright reads \({why}"):
            read_provenance(str(tmp_path))


@pytest.mark.unit
def test_an_export_over_an_earlier_one_that_fails_after_its_weights_is_no_longer_a_model(tmp_path):
    """The weights are replaced whole, then the files beside them: where one of those fails (storage down, a full
    disk), the earlier export's config.json goes, so the directory does not load as a model of the new weights with
    the earlier record and tokenizer."""
    tokenizer = ByteTokenizer()
    cfg = load_config("tiny", [f"model.vocab_size={tokenizer.vocab_size}"])
    save_export(GPT(cfg.model).state_dict(), cfg.model, tokenizer, str(tmp_path), None)
    assert load_exported(str(tmp_path)).provenance is None
    (tmp_path / PROVENANCE).unlink()
    (tmp_path / PROVENANCE).mkdir()  # what a write after the weights' cannot replace
    with pytest.raises(IsADirectoryError):
        save_export(GPT(cfg.model).state_dict(), cfg.model, tokenizer, str(tmp_path), None)
    assert not (tmp_path / CONFIG).exists() and (tmp_path / WEIGHTS).exists()


@pytest.mark.unit
def test_an_export_to_a_new_directory_stopped_after_its_weights_can_be_run_again(tmp_path):
    """Stopped between its weights and its training record (Ctrl-C, a full disk), an export to a new directory left
    one that export_checkpoint refused to replace, as not a raywright export; the record is now written first."""
    tokenizer = ByteTokenizer()
    cfg = load_config("tiny", [f"model.vocab_size={tokenizer.vocab_size}"])
    out = tmp_path / "new"
    (out / TOKENIZER_FILE).mkdir(parents=True)  # what a write after the weights' cannot replace
    with pytest.raises(IsADirectoryError):
        save_export(GPT(cfg.model).state_dict(), cfg.model, tokenizer, str(out), None)
    assert (out / WEIGHTS).exists() and not (out / CONFIG).exists()
    (out / TOKENIZER_FILE).rmdir()
    check_out(str(out))
    save_export(GPT(cfg.model).state_dict(), cfg.model, tokenizer, str(out), None)
    assert load_exported(str(out)).tokenizer.spec() == tokenizer.spec()
