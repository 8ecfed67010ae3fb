"""P8: a worker's peak memory does not grow with the dataset; the loader outruns the GPU `small` recipe.

    python bench/p8_loader_memory.py [--large-gb 2] [--steps 300]

Writes two prepared datasets of random tokens at the `small` recipe's sequence length (1024): ~20 MB
and ~``--large-gb`` GB. For each, a fresh process does what a training worker does with its data:
``load_split``, the sample order, and the rows of ``--steps`` optimizer steps of one of the recipe's 4
workers (120 sequences a step) turned into torch batches. It reports the process's peak RSS and the rows
per second of that loop.

P8 = peak RSS with the large dataset - peak RSS with the small one (goal < 200 MB). The loader's rows/s
goal is 10x what `small` consumes per worker: 4 H100s at 40 % MFU train ~520k tokens/s each (989 dense
bf16 TFLOP/s x 0.4 / (6 x 127M + attention) FLOPs per token), ~510 rows of 1025 tokens/s, so 5,100 rows/s.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from train.manifest import Manifest, SplitShards, write_manifest
from train.tokenizer import ByteTokenizer, save_tokenizer

SEQ_LEN = 1024
ROWS_PER_WORKER_STEP = 120  # the small recipe: 480 sequences a step over 4 workers
GOAL_ROWS_PER_S = 5100


def write_dataset(out: str, rows: int, seq_len: int = SEQ_LEN) -> None:
    """A prepared dataset of ``rows`` random byte-level sequences, laid out as ``prepare`` writes it (tokenizer
    and manifest included, so ``python -m train`` trains on it too)."""
    os.makedirs(f"{out}/train", exist_ok=True)
    os.makedirs(f"{out}/val", exist_ok=True)
    rng = np.random.default_rng(0)
    shards, per_shard = [], 65536
    for start in range(0, rows, per_shard):
        count = min(per_shard, rows - start)
        tokens = rng.integers(0, 257, size=count * (seq_len + 1), dtype=np.uint16)
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens), seq_len + 1)
        name = f"train/{len(shards):05d}.parquet"
        pq.write_table(pa.table({"tokens": column}), f"{out}/{name}", row_group_size=8192)  # ~prepare's groups
        shards.append(name)
    val = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(64 * (seq_len + 1), np.uint16)), seq_len + 1)
    pq.write_table(pa.table({"tokens": val}), f"{out}/val/00000.parquet")
    tokenizer = ByteTokenizer()
    save_tokenizer(tokenizer, out)
    manifest = Manifest(
        source="random",
        source_sha256="random",
        documents=rows,
        val_fraction=64 / (rows + 64),
        tokenizer=tokenizer.spec(),
        tokens_per_byte=1.0,
        seq_len=seq_len,
        train=SplitShards(shards=shards, sequences=rows),
        val=SplitShards(shards=["val/00000.parquet"], sequences=64),
    )
    write_manifest(out, manifest)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        (kb,) = [line.split()[1] for line in f if line.startswith("VmHWM:")]
    return int(kb) / 1024


def worker(path: str, steps: int) -> None:
    """What a training worker does with its data; prints peak RSS (MB) and rows/s as JSON."""
    import torch

    from train.loader import SampleOrder, micro_batch_samples
    from train.node_copy import load_split

    rows = load_split(path, "train")
    order = SampleOrder(len(rows), seed=0)
    start, gathered = time.perf_counter(), 0
    for step in range(steps):
        for micro_step in range(ROWS_PER_WORKER_STEP // 8):
            batch = rows[order.rows(micro_batch_samples(step, micro_step, 0, 4, 480, 8))]
            torch.from_numpy(batch.astype(np.int64))
            gathered += len(batch)
    seconds = time.perf_counter() - start
    peak_mb = peak_rss_mb()
    print(json.dumps({"peak_rss_mb": peak_mb, "rows_per_s": gathered / seconds, "rows": len(rows)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large-gb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    row_bytes = 2 * (SEQ_LEN + 1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="rw-p8-") as root:
        for name, size in (("small", 20e6), ("large", args.large_gb * 1e9)):
            path = f"{root}/{name}"
            write_dataset(path, int(size // row_bytes))
            runs = []
            for _ in ("builds the node-local copy", "finds it"):
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", path, str(args.steps)],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "TMPDIR": root},  # the node-local copies go with the datasets
                )
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            # The worker that builds the copy and one that finds it: the higher peak, the cached speed.
            results[name] = {**runs[1], "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
            print(f"{name}: {results[name]}", flush=True)
    growth = results["large"]["peak_rss_mb"] - results["small"]["peak_rss_mb"]
    slowest = min(r["rows_per_s"] for r in results.values())
    print(f"P8 worker peak RSS growth, {args.large_gb:.0f} GB vs 20 MB dataset: {growth:.0f} MB (goal < 200)")
    print(f"loader rows/s (slower of the two): {slowest:,.0f} (goal >= {GOAL_ROWS_PER_S:,})")


if __name__ == "__main__":
    main()
