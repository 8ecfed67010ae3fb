"""P2: activation memory with ``deepspeed.activation_checkpointing`` ÷ without, and what the recompute costs.

    python bench/p2_activations.py [--config small] [--micro-batch 2] [--rounds 2] [--set K=V ...]

For the recipe's model (the ``small`` shape, bf16, by default) on the CPU: the activation bytes one forward and
backward of a micro-batch hold at their peak, from torch's memory tracker on fake tensors
(``measured_activation_bytes``), each beside the memory plan's estimate; then the seconds of a forward and backward,
the two alternating over rounds.
The time ratio is an upper bound for a training step's, which adds the optimizer step to both sides.
"""

import argparse
import json
import statistics
import time

from train.config import load_config
from train.memory import activation_bytes, measured_activation_bytes, model_and_batch
from train.model import GPT


def forward_backward_seconds(cfg, micro_batch: int) -> float:
    model, tokens = model_and_batch(cfg, micro_batch)
    start = time.perf_counter()
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="a training config override")
    args = parser.parse_args()
    plain, checkpointed = (
        load_config(args.config, [*args.set, f"deepspeed.activation_checkpointing={on}"]) for on in ("false", "true")
    )
    variants = {"plain": plain, "checkpointed": checkpointed}
    held = {name: measured_activation_bytes(cfg, args.micro_batch) for name, cfg in variants.items()}
    estimate = {name: activation_bytes(cfg, args.micro_batch) for name, cfg in variants.items()}
    forward_backward_seconds(plain, args.micro_batch)  # warm-up: the first pass allocates what the others reuse
    seconds = {"plain": [], "checkpointed": []}
    for _ in range(args.rounds):
        seconds["plain"].append(forward_backward_seconds(plain, args.micro_batch))
        seconds["checkpointed"].append(forward_backward_seconds(checkpointed, args.micro_batch))
    ratios = [c / p for p, c in zip(seconds["plain"], seconds["checkpointed"], strict=True)]
    figures = {
        "P2_activations_checkpointed_over_plain": held["checkpointed"] / held["plain"],
        "held_bytes": held,
        "estimate_bytes": estimate,
        "forward_backward_seconds": seconds,
        "time_checkpointed_over_plain": statistics.median(ratios),
        "params": GPT(plain.model).num_params(),
    }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
