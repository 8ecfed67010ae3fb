"""python -m train [--config RECIPE] [--set section.key=value ...]"""

import argparse
import json
import sys

from train.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description="Train a GPT with Ray Train and DeepSpeed.")
    parser.add_argument("--config", default="tiny", help="recipe name in configs/ or a YAML path (default: tiny)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set optim.lr=3e-4",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0

    from train.launch import init_ray, run_training, stop_gracefully_on_sigterm  # Ray: after the config is valid

    init_ray(cfg)
    stop_gracefully_on_sigterm()  # after ray.init, which installs a SIGTERM handler of its own
    try:
        summary = run_training(cfg)
    except ConfigError as exc:  # found on the driver once Ray is up (a data.path that is not a dataset)
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    elastic = summary.elastic
    lines = {
        "run": summary.run_dir,
        "checkpoint": summary.checkpoint,
        "export": summary.export,
        "steps": summary.steps,
        "val loss": " -> ".join(f"{v:.4f}" for v in (summary.initial_val_loss, summary.final_val_loss) if v),
        "restarts": f"{elastic.get('restarts', 0)} ({elastic.get('steps_redone', 0)} steps redone)",
        "goodput": f"{elastic.get('goodput', 0.0):.1%}",
    }
    if "cost" in elastic:
        lines["cost"] = f"{elastic['cost']:.2f} (on-demand only: {elastic['cost_on_demand_only']:.2f})"
    print("\n".join(f"{key:>10}: {value}" for key, value in lines.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
