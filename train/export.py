"""The handoff to serving and to other tools: a Hugging Face GPT-2 model directory.

``<run>/export/`` holds what ``transformers`` loads offline (``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(export)``): ``config.json``, ``model.safetensors`` under
GPT-2's tensor names, ``tokenizer.json`` with its configs and ``generation_config.json``;
plus ``raywright.json``, our provenance (data manifest hash, resolved training config, code
version). ``load_exported`` reads any GPT-2 directory, ours or not. Nothing is unpickled.
"""

import contextlib
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import BeforeValidator, ConfigDict
from safetensors.torch import save as save_safetensors

from train import storage
from train.evaluation import Evaluation
from train.hf_gpt2 import CONFIG, WEIGHTS, hf_config, load_weights, read_model_config, to_hf_state
from train.model import GPT
from train.model_config import ModelConfig
from train.provenance import Provenance
from train.run_layout import export_uri
from train.schema import ConfigError, Section, read_record
from train.tokenizer import EOT, BPETokenizer, load_tokenizer, save_tokenizer

PROVENANCE = "raywright.json"


class ExportProvenance(Provenance):
    """What ``raywright.json`` records of the training behind an export."""

    step: int
    config: dict[str, Any]  # the run's resolved TrainConfig (``to_dict``), in the schema of its day
    evaluation: Evaluation | None = None  # the step's, where the run's end exported it
    checkpoint: str | None = None  # the checkpoint exported, where ``python -m train.export_checkpoint`` did

    @property
    def run_name(self) -> str:
        return self.config["run"]["name"]


class _ExportRecord(Section):
    """What is read back of ``raywright.json``: its model and tokenizer are for people (``config.json`` and
    ``tokenizer.json`` are what load)."""

    model_config = ConfigDict(extra="ignore")
    # None for a model raywright did not train; exports once wrote {} for it.
    provenance: Annotated[ExportProvenance | None, BeforeValidator(lambda record: record or None)] = None


@dataclass
class Exported:
    model: GPT  # in eval mode
    tokenizer: BPETokenizer
    name: str  # the training run's name, or the directory's name for a model raywright did not train
    provenance: ExportProvenance | None  # None for a model raywright did not train


def export_model(
    engine, model_config: ModelConfig, tokenizer: BPETokenizer, uri: str, provenance: ExportProvenance
) -> None:
    """Write the engine's full weights (gathered under ZeRO-3) from rank 0; a collective call. Where rank 0 could
    not write them, every rank raises its error: ``storage.DiskFullError`` where a local disk is full."""
    import deepspeed  # here, not at the top: serving reads exports without DeepSpeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        state = {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}
    outcome: list[OSError | None] = [None]
    if dist.get_rank() == 0:
        try:
            save_export(state, model_config, tokenizer, uri, provenance)
        except OSError as exc:
            what = f"exporting {uri}"
            full = storage.disk_full(exc, what, storage.resolve(uri)[1]) if storage.is_local(uri) else None
            outcome = [full or OSError(f"{what}: {exc}")]
    dist.broadcast_object_list(outcome)  # also what the other ranks wait for
    if outcome[0] is not None:
        raise outcome[0]


def save_export(
    state: dict[str, torch.Tensor],
    model_config: ModelConfig,
    tokenizer: BPETokenizer,
    uri: str,
    provenance: ExportProvenance | None,
) -> None:
    """Write the model directory; ``config.json`` goes last, as it is what makes the directory a model. Where a write
    after the weights' fails or is interrupted, an earlier export's ``config.json`` goes: its files are no longer of
    one model. A new directory gets ``raywright.json`` first: stopped before its end, however, it is still one that
    an export may replace (``export_checkpoint`` replaces nothing else)."""
    if not storage.exists(storage.join(uri, PROVENANCE)):
        _save_provenance(model_config, tokenizer, uri, provenance)
    weights = save_safetensors(to_hf_state(state), metadata={"format": "pt"})  # transformers checks the format
    storage.write_bytes(storage.join(uri, WEIGHTS), weights)  # whole or not at all: an earlier export stays whole
    try:
        _save_beside_weights(model_config, tokenizer, uri, provenance)
    except BaseException:
        with contextlib.suppress(OSError):
            storage.delete_file(storage.join(uri, CONFIG))
        raise


def _save_beside_weights(
    model_config: ModelConfig, tokenizer: BPETokenizer, uri: str, provenance: ExportProvenance | None
) -> None:
    save_tokenizer(tokenizer, uri)
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    storage.write_json(
        storage.join(uri, "tokenizer_config.json"),
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_config.seq_len, **special},
    )
    storage.write_json(storage.join(uri, "special_tokens_map.json"), special)
    eot = tokenizer.eot_id
    storage.write_json(storage.join(uri, "generation_config.json"), {"bos_token_id": eot, "eos_token_id": eot})
    _save_provenance(model_config, tokenizer, uri, provenance)
    storage.write_json(storage.join(uri, CONFIG), hf_config(model_config, eot))


def _save_provenance(
    model_config: ModelConfig, tokenizer: BPETokenizer, uri: str, provenance: ExportProvenance | None
) -> None:
    storage.write_json(
        storage.join(uri, PROVENANCE),
        {
            "model": model_config.model_dump(mode="json"),
            "tokenizer": tokenizer.spec().model_dump(),
            "provenance": provenance.model_dump() if provenance else None,
        },
    )


def read_provenance(uri: str) -> ExportProvenance | None:
    """What ``raywright.json`` in the model directory ``uri`` records of its training; None where there is none.
    ConfigError naming the file and field where it is not a record this version reads."""
    try:
        record = read_record(_ExportRecord, storage.join(uri, PROVENANCE), "a training record")
    except ConfigError as unreadable:
        raise ConfigError(f"{unreadable}; without it the model serves as any GPT-2 directory") from None
    return record.provenance if record else None


def final_evaluation(run_uri: str) -> Evaluation | None:
    """The last step's evaluation of a run that finished (its export is complete: ``config.json`` is written
    last); None for a run that has not, or whose export predates the record."""
    uri = export_uri(run_uri)
    provenance = read_provenance(uri) if storage.exists(storage.join(uri, CONFIG)) else None
    return provenance.evaluation if provenance else None


def load_exported(uri: str, dtype: torch.dtype | None = None) -> Exported:
    """The model (in eval mode), tokenizer and provenance of a GPT-2 directory: our export or any other."""
    model = GPT(read_model_config(uri))
    load_weights(model, uri)
    if dtype is not None:
        model.to(dtype)
    provenance = read_provenance(uri)
    return Exported(model.eval(), load_tokenizer(uri), export_name(uri, provenance), provenance)


def export_name(uri: str, provenance: ExportProvenance | None) -> str:
    """The training run's name, or the directory's name for a model raywright did not train."""
    return provenance.run_name if provenance else PurePosixPath(uri.rstrip("/")).name
