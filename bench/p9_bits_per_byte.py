"""P9: validation bits per byte of the tiny model trained on the same number of tokens, byte-level vs BPE.

    python bench/p9_bits_per_byte.py [--steps 1000] [--vocab-size 4096] [--set section.key=value ...]

Both runs use the `tiny` recipe (same width, depth, context in tokens, batch and schedule)
on the default corpus (the Python standard library): only `data.tokenizer` differs, so the
BPE model sees ~3x more text per token and carries a larger embedding. Each export is then
scored on its whole validation split, which holds the same documents for both tokenizers
(the split is by a hash of each document): bits per byte = summed cross-entropy / ln 2 /
the bytes its target tokens decode to. Bits per byte compares across tokenizers; loss per
token does not.
"""

import argparse
import json
import math
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from train.config import load_config
from train.data import dataset_path
from train.export import load_exported
from train.launch import init_ray, run_training
from train.node_copy import load_split


@torch.no_grad()
def bits_per_byte(export: str, rows: np.ndarray, batch: int = 64) -> tuple[float, int]:
    """Bits per byte of ``export`` on every row of ``rows``, and the bytes scored."""
    exported = load_exported(export)
    byte_lengths = torch.tensor([len(b) for b in exported.tokenizer.token_bytes])
    nats, scored = 0.0, 0
    for start in range(0, len(rows), batch):
        tokens = torch.from_numpy(rows[start : start + batch].astype(np.int64))
        logits = exported.model(tokens[:, :-1])
        nats += F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").item()
        scored += int(byte_lengths[tokens[:, 1:]].sum())
    return nats / math.log(2) / scored, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--set", action="append", default=[], help="override applied to both runs")
    args = parser.parse_args()
    storage_path = tempfile.mkdtemp(prefix="rw-p9-")
    results = {}
    for tokenizer in ("byte", "bpe"):
        cfg = load_config(
            "tiny",
            [
                f"data.tokenizer={tokenizer}",
                f"data.vocab_size={args.vocab_size}",
                f"run.storage_path={storage_path}",
                f"run.name=p9-{tokenizer}",
                f"optim.max_steps={args.steps}",
                f"run.eval_every={args.steps}",
                f"checkpoint.every_steps={args.steps}",
                *args.set,
            ],
        )
        init_ray(cfg)
        summary = run_training(cfg)
        bpb, scored = bits_per_byte(summary.export, load_split(dataset_path(cfg), "val"))
        tokens = args.steps * cfg.optim.global_batch_size * cfg.model.seq_len
        results[tokenizer] = {"val_bits_per_byte": bpb, "bytes_scored": scored, "tokens_trained": tokens}
        print(json.dumps({tokenizer: results[tokenizer]}), flush=True)
    ratio = results["bpe"]["val_bits_per_byte"] / results["byte"]["val_bits_per_byte"]
    print(json.dumps({"P9": results, "bpe_over_byte": ratio}, indent=2))


if __name__ == "__main__":
    main()
