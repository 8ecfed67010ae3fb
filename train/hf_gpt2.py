"""raywright's GPT <-> Hugging Face GPT-2: config.json and tensor names, both ways.

Our GPT is GPT-2's architecture (pre-norm, learned positions, biases, 4x GELU MLP, tied
embeddings); only the names differ, and GPT-2 stores its four projection weights as Conv1D
(in, out) where we use Linear (out, in). The activation is the one free choice: exact GELU
(``gelu``, ours by default) or the tanh approximation (``gelu_new`` in OpenAI's GPT-2).
Reading needs neither ``transformers`` nor pickle: JSON and safetensors only.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from train import storage
from train.model_config import ModelConfig

if TYPE_CHECKING:  # the config half of this module (read_model_config, weight_files) needs no torch
    import torch

    from train.model import GPT

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# HF activation_function -> ModelConfig.activation, and back.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}

_TOP_NAMES = {"tok_emb": "wte", "pos_emb": "wpe", "ln_out": "ln_f"}
_BLOCK_NAMES = {
    "ln_attn": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "ln_mlp": "ln_2",
    "mlp.up": "mlp.c_fc",
    "mlp.down": "mlp.c_proj",
}
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Tensors a GPT-2 checkpoint may hold that carry no weights of their own.
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias)$|^lm_head\.weight$")


def hf_name(name: str) -> str:
    """GPT-2's name of one of our tensors: ``blocks.3.attn.qkv.weight`` -> ``transformer.h.3.attn.c_attn.weight``."""
    module, param = name.rsplit(".", 1)
    if module in _TOP_NAMES:
        return f"transformer.{_TOP_NAMES[module]}.{param}"
    block = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
    if block is None or block.group(2) not in _BLOCK_NAMES:
        raise KeyError(f"no GPT-2 name for {name}")
    return f"transformer.h.{block.group(1)}.{_BLOCK_NAMES[block.group(2)]}.{param}"


def to_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under GPT-2's names and layouts (the tied output projection is the embedding)."""
    hf = {}
    for name, tensor in state.items():
        target = hf_name(name)
        hf[target] = tensor.t().contiguous() if target.endswith(_CONV1D) else tensor.contiguous()
    return hf


def from_hf_state(
    hf: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """GPT-2 tensors renamed to ours; ``expected`` (our model's state dict) gives the names and shapes.

    Accepts names with or without the ``transformer.`` prefix (OpenAI's original checkpoints lack it).
    """
    hf = {name.removeprefix("transformer."): tensor for name, tensor in hf.items() if not _IGNORED.search(name)}
    state = {}
    for name, reference in expected.items():
        full_name = hf_name(name)
        conv1d = full_name.endswith(_CONV1D)
        tensor = hf.pop(full_name.removeprefix("transformer."), None)
        if tensor is None:
            raise ValueError(f"{source}: no tensor {full_name}; not a GPT-2 checkpoint of this shape")
        needed = reference.shape[::-1] if conv1d else reference.shape
        if tensor.shape != needed:
            raise ValueError(
                f"{source}: {full_name} has shape {tuple(tensor.shape)}, this config.json implies {tuple(needed)}"
            )
        state[name] = (tensor.t() if conv1d else tensor).contiguous()
    if hf:
        raise ValueError(f"{source}: unexpected tensors {sorted(hf)[:4]}; not a GPT-2 checkpoint")
    return state


def hf_config(cfg: ModelConfig, eot_id: int) -> dict[str, Any]:
    """GPT-2's config.json for ``cfg``; ``eot_id`` is the tokenizer's ``<|endoftext|>``."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": 4 * cfg.d_model,
        "activation_function": HF_ACTIVATION[cfg.activation],
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,  # torch.nn.LayerNorm's default, which our GPT uses
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "dtype": "float32",
    }


def model_config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of a GPT-2 config.json; anything our GPT cannot express is one clear error."""

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{source}: {what}; only GPT-2's architecture is supported")

    require(hf.get("model_type") == "gpt2", f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
    activation = hf.get("activation_function", "gelu_new")
    require(activation in ACTIVATIONS, f"activation_function {activation!r} is not one of {sorted(ACTIVATIONS)}")
    d_model = hf.get("n_embd", 768)
    require(hf.get("n_inner") in (None, 4 * d_model), f"n_inner {hf.get('n_inner')} is not 4 x n_embd")
    require(math.isclose(hf.get("layer_norm_epsilon", 1e-5), 1e-5), "layer_norm_epsilon is not 1e-5")
    require(hf.get("tie_word_embeddings", True), "the output projection is not tied to the embedding")
    require(hf.get("scale_attn_weights", True), "scale_attn_weights is off")
    require(not hf.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx is on")
    require(not hf.get("add_cross_attention", False), "it has cross-attention")
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50257),
        seq_len=hf.get("n_positions", 1024),
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        d_model=d_model,
        activation=ACTIVATIONS[activation],
    )


def read_model_config(location: str) -> ModelConfig:
    """The ModelConfig of the GPT-2 directory ``location`` (local or URI)."""
    uri = storage.join(location, CONFIG)
    hf = read_json_object(uri)
    if hf is None:
        raise FileNotFoundError(f"{location}: no {CONFIG}; not a Hugging Face model directory")
    return model_config_from_hf(hf, uri)


def read_json_object(uri: str) -> dict[str, Any] | None:
    """The JSON object in the file ``uri`` (a model directory's config); None where there is no file. ValueError
    naming the file where it is not a JSON object."""
    data = storage.read_if_exists(uri)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{uri}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{uri}: not a JSON object")
    return value


def weight_files(location: str) -> list[str]:
    """The safetensors files of the directory ``location``: one, or the shards its index lists."""
    if storage.exists(storage.join(location, WEIGHTS)):
        return [WEIGHTS]
    index = storage.join(location, WEIGHTS_INDEX)
    index_object = read_json_object(index)
    if index_object is not None:
        weight_map = index_object.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map (tensor name -> the safetensors file that holds it)")
        return sorted(set(weight_map.values()))
    # Pickled weights (pytorch_model.bin) could run code when loaded: never read them.
    raise FileNotFoundError(
        f"{location}: no {WEIGHTS}; raywright reads safetensors only "
        "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
    )


def check_weights(location: str) -> None:
    """That the directory ``location`` holds its safetensors files whole (``check_safetensors``): what a driver
    checks before Ray starts, without reading the weights."""
    for name in weight_files(location):
        check_safetensors(storage.join(location, name))


def check_safetensors(uri: str) -> None:
    """That ``uri`` is a whole safetensors file, from its header alone (ranged reads): its tensors' bytes end
    where the file does. One cut short (a copy or upload interrupted) is a ValueError naming it, before a
    replica or a training worker loads it."""
    with storage.open_input_file(uri) as f:
        size = f.size()
        header_bytes = int.from_bytes(f.read_at(8, 0), "little") if size >= 8 else -1
        if not 0 < header_bytes <= size - 8:
            raise ValueError(f"{uri}: not a safetensors file ({size} bytes, no header)")
        header_text = f.read_at(header_bytes, 8)
    try:
        header = json.loads(header_text)
        data_bytes = max(t["data_offsets"][1] for name, t in header.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ValueError(f"{uri}: not a safetensors file (its header is not a table of tensors)") from None
    described = 8 + header_bytes + data_bytes
    if described != size:
        raise ValueError(f"{uri}: {size} bytes, where its header describes {described}: cut short, or altered")


def load_weights(model: GPT, location: str) -> None:
    """Load the GPT-2 weights of the directory ``location`` into ``model`` (shapes must agree)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors  # torch: imported where weights are loaded

    hf = {}
    for name in weight_files(location):
        uri = storage.join(location, name)
        try:
            hf.update(load_safetensors(storage.read_bytes(uri)))
        except SafetensorError as exc:  # which names no file
            raise ValueError(f"{uri}: not a whole safetensors file ({exc})") from None
    model.load_state_dict(from_hf_state(hf, model.state_dict(), location), strict=True)
