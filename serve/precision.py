"""Numeric precision of a served model, chosen at load time: fp32, bf16, int8 or fp8.

On CPU, ``int8`` swaps every Linear layer for ``Int8Linear``: int8 weights with one scale per
output channel, activations quantized per row (per token) at run time, and an exact integer
matmul. Because each row has its own scale and integer sums are exact, a row's result never
depends on the other rows of the batch: a request decodes to the same tokens alone or inside
any batch. (PyTorch's ``quantize_dynamic`` picks one activation scale for the whole batch, so
a request's output would change with its neighbours.)

The integer matmul runs on the float units: a float32 sum of int8 products is exact while it stays
below 2**24, whatever order the BLAS adds in. ``torch._int_mm`` gives the same integers but on a
CPU without VNNI (AVX2 only) it was 18x slower than this at a batch of 32.

On a GPU, ``int8`` (weight-only) and ``fp8`` (float8 weights and activations, rowwise scales) go through
torchao, the usual route there.
"""

from typing import get_args

import torch
from torch import nn

from serve.config import Precision

PRECISIONS: tuple[str, ...] = get_args(Precision)


# The longest reduction whose float32 sum of int8 x int8 products is exact: 127 * 127 * K < 2**24.
EXACT_FLOAT32_K = 2**24 // 127**2


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 matrices, exactly, as float32 (rounded once, like int32 -> float32)."""
    # ``b`` (the weights) is converted on each call: a cached float copy would be fp32's size, and the
    # conversion cost ~12% of the product at a batch of 32.
    k = a.shape[1]
    if k <= EXACT_FLOAT32_K:
        return a.float() @ b.float()
    # Longer reductions: exact float32 partial products over slices of K, summed in float64 (exact).
    total = sum(
        (a[:, i : i + EXACT_FLOAT32_K].float() @ b[i : i + EXACT_FLOAT32_K].float()).double()
        for i in range(0, k, EXACT_FLOAT32_K)
    )
    return total.float()


class Int8Linear(nn.Module):
    """A Linear layer computed as int8 x int8 -> int32, rescaled per row and per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        # Stored transposed, (in, out): the matmul's second operand.
        self.register_buffer("weight_t", torch.round(weight / scale[:, None]).to(torch.int8).t().contiguous())
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        quantized = torch.round(rows / row_scale).to(torch.int8)
        out = int8_matmul(quantized, self.weight_t) * row_scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _swap_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            _swap_linears(child)


def _torchao_quantize(module: nn.Module, precision: str) -> None:
    """int8: weight-only (half of bf16's memory); fp8: weights and activations in float8 with a scale per row
    (per output channel, per token), the mode that runs the matmuls on the GPU's float8 units."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Int8WeightOnlyConfig,
            PerRow,
            quantize_,
        )
    except ImportError:
        raise ValueError(f"precision {precision!r} on a GPU needs torchao: pip install torchao") from None
    if precision == "int8":
        quantize_(module, Int8WeightOnlyConfig())
    else:
        quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))


def apply_precision(module: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """``module`` on ``device`` at ``precision``, modified in place and returned."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    if precision == "fp8" and device.type != "cuda":
        raise ValueError("precision 'fp8' needs a GPU; on CPU use 'int8'")
    module.to(device)
    if precision == "bf16":
        module.to(torch.bfloat16)
    elif precision == "int8" and device.type == "cpu":
        _swap_linears(module)
    elif precision in ("int8", "fp8"):
        module.to(torch.bfloat16)
        _torchao_quantize(module, precision)
    return module.eval()
