"""Numeric precision of a served model, chosen at load time: fp32, bf16, int8 or fp8.

On CPU, ``int8`` swaps every Linear layer for ``Int8Linear``: int8 weights with one scale per
output channel, activations quantized per row (per token) at run time, and an exact integer
matmul. Because each row has its own scale and integer sums are exact, a row's result never
depends on the other rows of the batch: a request decodes to the same tokens alone or inside
any batch. (PyTorch's ``quantize_dynamic`` picks one activation scale for the whole batch, so
a request's output would change with its neighbours.)

The integer matmul runs on whichever of two exact kernels is faster on this CPU, timed once per
process: ``torch._int_mm`` on VNNI's integer dot products (3-5x the float units' speed at a batch of
1 to 64 on an EPYC with AVX-512 VNNI; 17-20x slower without VNNI, AVX2 only), or the float units, where a
float32 sum of int8 products is exact while it stays below 2**24, whatever order the BLAS adds in.
Both give the same float32 results, so the choice never changes a token.

On a GPU, ``int8`` (weight-only) and ``fp8`` (float8 weights and activations, rowwise scales) go through
torchao, the usual route there.
"""

import functools
import logging
import time
from collections.abc import Callable
from typing import get_args

import torch
from torch import nn

from serve.config import Precision

PRECISIONS: tuple[str, ...] = get_args(Precision)
logger = logging.getLogger(__name__)


# The longest reduction whose float32 sum of int8 x int8 products is exact: 127 * 127 * K < 2**24.
EXACT_FLOAT32_K = 2**24 // 127**2


def int8_matmul_on_float_units(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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


def int8_matmul_on_integer_units(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 matrices as exact int32 sums (to 133k long), as float32 (rounded once)."""
    return torch._int_mm(a, b).float()


@functools.cache
def int8_matmul_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The faster of the two int8 matmuls on this CPU, timed at a decode step's shape (a batch of 32 through a
    256 -> 1024 layer) with this process's threads; a kernel this build of torch lacks here is left out."""
    a = torch.randint(-127, 128, (32, 256), dtype=torch.int8)
    b = torch.randint(-127, 128, (256, 1024), dtype=torch.int8)
    seconds = {}
    for kernel in (int8_matmul_on_float_units, int8_matmul_on_integer_units):
        try:
            kernel(a, b)  # the first call sets the kernel up: not timed
        except RuntimeError:
            continue
        start = time.perf_counter()
        for _ in range(5):
            kernel(a, b)
        seconds[kernel] = time.perf_counter() - start
    fastest = min(seconds, key=seconds.get)
    timings = ", ".join(f"{kernel.__name__} {s / 5 * 1e3:.2f} ms" for kernel, s in seconds.items())
    logger.info("int8 matmuls run %s on this CPU (%s a product)", fastest.__name__, timings)
    return fastest


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
        self.matmul = int8_matmul_kernel()  # chosen (timed, the first time) as the model loads, not per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        quantized = torch.round(rows / row_scale).to(torch.int8)
        out = self.matmul(quantized, self.weight_t) * row_scale * self.weight_scale
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


def check_precision(precision: str, device_type: str) -> None:
    """That ``precision`` runs on a ``device_type`` device ("cuda" or "cpu"); a ValueError naming it if not."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    if precision == "fp8" and device_type != "cuda":
        raise ValueError("precision 'fp8' needs a GPU; on CPU use 'int8'")


def apply_precision(module: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """``module`` on ``device`` at ``precision``, modified in place and returned."""
    check_precision(precision, device.type)
    module.to(device)
    if precision == "bf16":
        module.to(torch.bfloat16)
    elif precision == "int8" and device.type == "cpu":
        _swap_linears(module)
    elif precision in ("int8", "fp8"):
        module.to(torch.bfloat16)
        _torchao_quantize(module, precision)
    return module.eval()
