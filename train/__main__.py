"""python -m train [--config RECIPE] [--set section.key=value ...]   (--help lists every setting)"""

import sys

from train.cli import config_parser, one_line_errors, print_config, use_cpu_deepspeed_unless_gpu_workers
from train.config import TrainConfig, load_config, recipe_names


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = config_parser(
        "python -m train",
        "Train a GPT with Ray Train and DeepSpeed.",
        TrainConfig,
        f"a shipped recipe ({', '.join(recipe_names())}) or a YAML path or URI (default: tiny)",
    )
    args = parser.parse_args(argv)
    cfg = load_config(args.config or "tiny", args.set)
    if args.print_config:
        print_config(cfg)
        return 0
    # torch, DeepSpeed and Ray load only now: a typo in the config is answered in about a second.
    use_cpu_deepspeed_unless_gpu_workers(cfg)
    from train.preflight import check_before_ray, check_resume

    check_before_ray(cfg)
    changed = check_resume(cfg)
    if changed:
        changes = "; ".join(changed)
        print(f"note: {cfg.run.name!r} resumes with settings its newest checkpoint did not have: {changes}", flush=True)
    from train.launch import run_training
    from train.lease import RunOwnedError

    try:
        summary = run_training(cfg, stop_on_sigterm=True)
    except RunOwnedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit:  # Ray Train's graceful abort of the run on Ctrl-C or SIGTERM ends in Ray's SystemExit
        raise KeyboardInterrupt from None
    elastic = summary.elastic
    lines = {
        "run": summary.run_dir,
        "checkpoint": summary.checkpoint,
        "export": summary.export,
        "steps": summary.steps,
        "val loss": " -> ".join(f"{v:.4f}" for v in (summary.initial_val_loss, summary.final_val_loss) if v),
    }
    if summary.final_val_bpb is not None:  # what compares runs of different tokenizers
        lines["bits/byte"] = f"{summary.final_val_bpb:.3f}"
    if elastic:  # none where the run's drivers left no record of its attempts
        lines["restarts"] = f"{elastic.restarts} ({elastic.steps_redone} steps redone)"
        lines["goodput"] = f"{elastic.goodput:.1%}"
    if elastic and elastic.cost is not None:
        lines["cost"] = f"{elastic.cost:.2f} (on-demand only: {elastic.cost_on_demand_only:.2f})"
    print("\n".join(f"{key:>10}: {value}" for key, value in lines.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
