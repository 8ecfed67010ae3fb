"""P8 (prepare): the driver of `prepare` does not grow with the number of documents.

    python bench/prepare_memory.py [--documents 2000000]

Writes a Parquet corpus of ``--documents`` short documents (12 random words each, ~60 bytes) and one of a
quarter as many, and prepares each (byte tokenizer, seq_len 128) in a fresh process on a local Ray of 2 CPUs.
It reports how much the driver's peak RSS (VmHWM, reset once Ray has started; Linux) grew during ``prepare``
for each, and the difference: what a driver holding a value per document would show, ~250 B each.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

PER_FILE = 500_000
MEASURE = """
import json, sys, time
import ray
from train.data import prepare

def peak_mb():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
before = peak_mb()
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on (Linux)
start = time.time()
manifest = prepare(sys.argv[1], sys.argv[2], seq_len=128)
growth = peak_mb() - before
print(json.dumps({"documents": manifest["documents"], "growth_mb": growth, "seconds": time.time() - start}))
"""


def write_corpus(folder: str, documents: int) -> None:
    rng = random.Random(0)
    words = [f"{rng.choice('bcdfglmnprst')}{rng.choice('aeiou')}{rng.choice('klmnrst')}{i}" for i in range(5000)]
    os.makedirs(folder)
    for part, start in enumerate(range(0, documents, PER_FILE)):
        texts = [" ".join(rng.choices(words, k=12)) for _ in range(min(PER_FILE, documents - start))]
        pq.write_table(pa.table({"text": texts}), f"{folder}/docs{part:03}.parquet", row_group_size=50_000)


def measure(folder: str, out: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, f"{folder}/*.parquet", out], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for documents in (args.documents // 4, args.documents):
            write_corpus(f"{tmp}/corpus-{documents}", documents)
            results[documents] = measure(f"{tmp}/corpus-{documents}", f"{tmp}/prepared-{documents}")
            print(json.dumps(results[documents]), flush=True)
    small, large = results.values()
    print(
        f"P8 prepare: the driver grew {large['growth_mb']:.0f} MB for {large['documents']:,} documents, "
        f"{small['growth_mb']:.0f} MB for {small['documents']:,}: {large['growth_mb'] - small['growth_mb']:+.0f} MB"
    )


if __name__ == "__main__":
    main()
