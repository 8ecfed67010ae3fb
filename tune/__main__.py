"""python -m tune --config configs/sweep-<name>.yaml [--set key=value ...]  |  python -m tune --resume SWEEP_DIR"""

import argparse
import sys

from train.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tune", description="Optuna + ASHA sweeps of the training job.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="sweep YAML (see tune/config.py)")
    what.add_argument("--resume", metavar="SWEEP_DIR", help="finish an interrupted sweep from its directory")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a sweep setting")
    args = parser.parse_args(argv)
    try:
        from tune.config import load_sweep_config

        sweep = load_sweep_config(args.config, args.set) if args.config else None
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    from tune.sweep import resume_sweep, run_sweep_config

    try:
        result = resume_sweep(args.resume) if args.resume else run_sweep_config(sweep)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.trials.to_string(index=False))
    print(f"\nbest: trial {result.best['trial_id']}, val_loss {result.best['val_loss']:.4f}")
    print(f"best recipe: {result.best_recipe}   (python -m train --config {result.best_recipe})")
    print(f"sweep directory: {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
