"""The handoff to serving and to other tools: a Hugging Face GPT-2 model directory.

``<run>/export/`` holds what ``transformers`` loads offline (``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(export)``): ``config.json``, ``model.safetensors`` under
GPT-2's tensor names, ``tokenizer.json`` with its configs and ``generation_config.json``;
plus ``raywright.json``, our provenance (data manifest hash, resolved training config, code
version). ``load_exported`` reads any GPT-2 directory, ours or not. Nothing is unpickled.
"""

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save as save_safetensors

from train import storage
from train.hf_gpt2 import CONFIG, WEIGHTS, hf_config, load_weights, read_model_config, to_hf_state
from train.model import GPT
from train.model_config import ModelConfig
from train.run_layout import export_uri
from train.tokenizer import EOT, BPETokenizer, load_tokenizer, save_tokenizer

PROVENANCE = "raywright.json"


@dataclass
class Exported:
    model: GPT  # in eval mode
    tokenizer: BPETokenizer
    name: str  # the training run's name, or the directory's name for a model raywright did not train
    provenance: dict[str, Any]  # empty for a model raywright did not train


def export_model(engine, model_config: ModelConfig, tokenizer: BPETokenizer, uri: str, provenance: dict) -> None:
    """Write the engine's full weights (gathered under ZeRO-3) from rank 0; a collective call."""
    import deepspeed  # here, not at the top: serving reads exports without DeepSpeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        state = {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}
    if dist.get_rank() == 0:
        save_export(state, model_config, tokenizer, uri, provenance)
    dist.barrier()


def save_export(
    state: dict[str, torch.Tensor], model_config: ModelConfig, tokenizer: BPETokenizer, uri: str, provenance: dict
) -> None:
    """Write the model directory; ``config.json`` goes last, as it is what makes the directory a model."""
    weights = save_safetensors(to_hf_state(state), metadata={"format": "pt"})  # transformers checks the format
    storage.write_bytes(storage.join(uri, WEIGHTS), weights)
    save_tokenizer(tokenizer, uri)
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    storage.write_json(
        storage.join(uri, "tokenizer_config.json"),
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_config.seq_len, **special},
    )
    storage.write_json(storage.join(uri, "special_tokens_map.json"), special)
    eot = tokenizer.eot_id
    storage.write_json(storage.join(uri, "generation_config.json"), {"bos_token_id": eot, "eos_token_id": eot})
    storage.write_json(
        storage.join(uri, PROVENANCE),
        {
            "model": model_config.model_dump(mode="json"),
            "tokenizer": tokenizer.spec().model_dump(),
            "provenance": provenance,
        },
    )
    storage.write_json(storage.join(uri, CONFIG), hf_config(model_config, eot))


def _provenance(uri: str) -> dict[str, Any]:
    """What ``raywright.json`` in the model directory ``uri`` says of its training; empty where there is none."""
    return (storage.read_json_if_exists(storage.join(uri, PROVENANCE)) or {}).get("provenance", {})


def final_evaluation(run_uri: str) -> dict[str, Any] | None:
    """The last step's evaluation of a run that finished (its export is complete: ``config.json`` is written
    last); None for a run that has not, or whose export predates the record."""
    uri = export_uri(run_uri)
    return _provenance(uri).get("evaluation") if storage.exists(storage.join(uri, CONFIG)) else None


def load_exported(uri: str, dtype: torch.dtype | None = None) -> Exported:
    """The model (in eval mode), tokenizer and provenance of a GPT-2 directory: our export or any other."""
    model = GPT(read_model_config(uri))
    load_weights(model, uri)
    if dtype is not None:
        model.to(dtype)
    return Exported(model.eval(), load_tokenizer(uri), export_name(uri), _provenance(uri))


def export_name(uri: str) -> str:
    """The training run's name, or the directory's name for a model raywright did not train."""
    run_name = _provenance(uri).get("config", {}).get("run", {}).get("name")
    return run_name or PurePosixPath(uri.rstrip("/")).name
