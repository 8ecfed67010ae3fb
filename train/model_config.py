"""The GPT's shape: a config section that needs no torch, so that a command line checks it in a second."""

from typing import Literal

from pydantic import Field, model_validator

from train.schema import Section


class ModelConfig(Section):
    vocab_size: int = Field(257, ge=1)
    """Token ids the embedding holds; raised to the tokenizer's vocabulary (byte-level: 256 bytes + end-of-text)."""
    seq_len: int = Field(256, ge=1)
    """Context length in tokens."""
    n_layer: int = Field(4, ge=1)
    """Transformer blocks."""
    n_head: int = Field(4, ge=1)
    """Attention heads per block; must divide d_model."""
    d_model: int = Field(256, ge=1)
    """Width of the residual stream."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on attention, MLP and embeddings while training."""
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    """Exact GELU, or the tanh approximation of OpenAI's GPT-2."""
    init_from: str = ""
    """A Hugging Face GPT-2 directory (local or URI) to start from: its shape and tokenizer replace the fields
    above and data.tokenizer (train/hf_gpt2.py)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self
