"""What a checkpoint costs training, written synchronously vs on a background thread.

    python bench/checkpoint_stall.py [--steps 30] [--every 5] [--rounds 2] [--set model.d_model=512 ...]

Runs the same training (2 workers, ZeRO-2, a 3.2M-parameter model: 4 x 256) with a checkpoint every
``--every`` steps, with ``checkpoint.async_write`` false and true, and once without checkpoints,
interleaved over ``--rounds``. Two figures per mode:
- stall: seconds the training thread spends in each checkpoint (``checkpoint_stall_s`` in its
  metrics: the host copy, waiting for the previous one, the collectives that make it count);
- cost: (run time - run time without checkpoints) / checkpoints, from the reports' clocks between the
  first and the last training step, so it includes steps slowed by a writer sharing the CPU.
"""

import argparse
import json
import statistics
import tempfile

from train.config import load_config
from train.launch import ensure_dataset, init_ray, run_training, run_uri
from train.metrics import read_metrics


def measure(overrides: list[str], name: str) -> dict:
    cfg = load_config("tiny", [*overrides, f"run.name={name}"])
    run_training(cfg)
    records = read_metrics(run_uri(cfg))
    steps = [m for m in records if "loss" in m]
    saves = [m for m in records if "checkpoint_stall_s" in m and m["step"] < cfg.optim.max_steps]
    return {
        "seconds": steps[-1]["time"] - steps[0]["time"],
        "checkpoints": len(saves),
        "stall_s": [m["checkpoint_stall_s"] for m in saves],
        "written_s": [m["checkpoint_s"] for m in saves],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    common = [
        "scaling.num_workers=2",
        "deepspeed.zero_stage=2",
        "model.d_model=256",
        "model.n_layer=4",
        f"optim.max_steps={args.steps}",
        "run.log_every=1",
        f"run.eval_every={args.steps}",
        "checkpoint.keep_last=2",
        f"run.storage_path={tempfile.mkdtemp(prefix='rw-stall-')}",
        *args.set,
    ]
    cfg = load_config("tiny", common)
    init_ray(cfg)
    ensure_dataset(cfg)
    modes = {
        "none": ["checkpoint.every_steps=0"],
        "sync": [f"checkpoint.every_steps={args.every}", "checkpoint.async_write=false"],
        "async": [f"checkpoint.every_steps={args.every}", "checkpoint.async_write=true"],
    }
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode, overrides in modes.items():
            runs[mode].append(measure([*common, *overrides], f"stall-{mode}-{round_index}"))
    result = {}
    for mode in ("sync", "async"):
        pairs = zip(runs[mode], runs["none"], strict=True)
        costs = [(run["seconds"] - base["seconds"]) / run["checkpoints"] for run, base in pairs]
        result[mode] = {
            "stall_s_median": statistics.median(s for run in runs[mode] for s in run["stall_s"]),
            "written_s_median": statistics.median(s for run in runs[mode] for s in run["written_s"]),
            "cost_s_per_checkpoint": costs,
        }
    result["runs"] = runs
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
