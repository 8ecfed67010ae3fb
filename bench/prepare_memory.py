"""P8 (prepare): the memory of `prepare` does not grow with the number of documents, nor with a file's size.

    python bench/prepare_memory.py [--documents 2000000]
    python bench/prepare_memory.py --text-file-gb 2.3

Writes a Parquet corpus of ``--documents`` short documents (12 random words each, ~60 bytes) and one of a
quarter as many, and prepares each (byte tokenizer, seq_len 128) in a fresh process on a local Ray of 2 CPUs.
It reports how much the driver's peak RSS (VmHWM, reset once Ray has started; Linux) grew during ``prepare``
for each, and the difference: what a driver holding a value per document would show, ~250 B each.

``--text-file-gb`` instead writes one text file of that size (the stdlib's ``json`` package over and over, each
copy numbered) and prepares it the same way, reporting its last line, the machine's peak memory in use (MemTotal
- MemAvailable, sampled every 0.5 s: Ray's object store, in /dev/shm, and every task) above what it was before,
and the wall time.
"""

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
from p8_loader_memory import peak_rss_mb  # bench/, this script's folder

PER_FILE = 500_000


def write_corpus(folder: str, documents: int) -> None:
    rng = random.Random(0)
    words = [f"{rng.choice('bcdfglmnprst')}{rng.choice('aeiou')}{rng.choice('klmnrst')}{i}" for i in range(5000)]
    os.makedirs(folder)
    for part, start in enumerate(range(0, documents, PER_FILE)):
        texts = [" ".join(rng.choices(words, k=12)) for _ in range(min(PER_FILE, documents - start))]
        pq.write_table(pa.table({"text": texts}), f"{folder}/docs{part:03}.parquet", row_group_size=50_000)


def driver(source: str, out: str) -> None:
    """Prepare ``source`` on a local Ray; print the growth of this process's peak RSS meanwhile and the time."""
    import ray

    from train.config import DataConfig
    from train.data import prepare

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here on: what Ray's start took is not counted (Linux)
    before, start = peak_rss_mb(), time.time()
    manifest = prepare(DataConfig(source=source), out, seq_len=128)
    growth = peak_rss_mb() - before
    print(json.dumps({"documents": manifest.documents, "growth_mb": growth, "seconds": time.time() - start}))


def measure(folder: str, out: str) -> dict:
    command = [sys.executable, __file__, "--driver", f"{folder}/*.parquet", out]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_in_use_gb() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return (info["MemTotal"] - info["MemAvailable"]) / 2**20


def measure_text_file(gb: float) -> None:
    json_package = glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"))
    text = b"".join(open(path, "rb").read() for path in sorted(json_package))
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/big.txt", "wb") as f:
            for copy in range(int(gb * 1e9) // len(text) + 1):
                f.write(b"# copy %d\n" % copy + text)  # numbered: pieces of the file differ, as a real one's do
        before, start = memory_in_use_gb(), time.time()
        prepare = subprocess.Popen(
            [sys.executable, "-m", "train.data", "prepare", "--source", f"{tmp}/big.txt", "--out", f"{tmp}/out"]
            + ["--seq-len", "128"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        peak = before
        while prepare.poll() is None:
            peak = max(peak, memory_in_use_gb())
            time.sleep(0.5)
        print(prepare.stdout.read().strip().splitlines()[-1])
        print(
            f"P8 prepare: one {os.path.getsize(f'{tmp}/big.txt') / 1e9:.2f} GB text file, exit {prepare.returncode}, "
            f"{time.time() - start:.0f} s, peak memory in use +{peak - before:.1f} GB (from {before:.1f} GB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2_000_000)
    parser.add_argument("--text-file-gb", type=float, help="one text file of this size instead")
    parser.add_argument("--driver", nargs=2, metavar=("SOURCE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        driver(*args.driver)
        return
    if args.text_file_gb:
        measure_text_file(args.text_file_gb)
        return
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
