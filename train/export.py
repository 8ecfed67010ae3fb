"""The handoff to serving: model weights as safetensors plus a JSON config.

``<run>/export/model.safetensors`` and ``<run>/export/config.json`` (model shape,
tokenizer, provenance: data manifest hash, resolved training config, code version).
Nothing in an export is unpickled when it is loaded.
"""

from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from train import storage
from train.model import GPT, ModelConfig

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def export_uri(run_uri: str) -> str:
    return storage.join(run_uri, "export")


def export_model(engine, model_config: ModelConfig, uri: str, info: dict[str, Any]) -> None:
    """Write the engine's full weights (gathered under ZeRO-3) from rank 0; a collective call."""
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        state = {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}
    if dist.get_rank() == 0:
        save_export(state, model_config, uri, info)
    dist.barrier()


def save_export(state: dict[str, torch.Tensor], model_config: ModelConfig, uri: str, info: dict[str, Any]) -> None:
    """Write weights, then the config that makes the export loadable."""
    storage.write_bytes(storage.join(uri, WEIGHTS), save_safetensors(state))
    storage.write_json(storage.join(uri, CONFIG), {"model": vars(model_config), **info})


def load_exported(uri: str, dtype: torch.dtype | None = None) -> tuple[GPT, dict[str, Any]]:
    """The exported model (in eval mode) and its config.json contents."""
    info = storage.read_json(storage.join(uri, CONFIG))
    model = GPT(ModelConfig(**info["model"]))
    state = load_safetensors(storage.read_bytes(storage.join(uri, WEIGHTS)))
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        model.to(dtype)
    return model.eval(), info
