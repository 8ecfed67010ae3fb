"""python -m serve --checkpoint PATH [--config serve.yaml] [--set key=value ...] [--port 8000]

Serves a training export on a local Ray (or the cluster in RAY_ADDRESS) until interrupted.
On a cluster, deploy configs/serve.yaml with ``serve deploy`` instead.
"""

import argparse
import os
import sys
import time

from serve.config import load_serve_config
from train.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve", description="OpenAI-compatible completions on Ray Serve.")
    parser.add_argument("--checkpoint", help="training export or run directory (local path or URI)")
    parser.add_argument("--config", help="YAML file of serve settings (fields of serve.config.ServeConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    overrides = args.set + ([f"checkpoint={args.checkpoint}"] if args.checkpoint else [])
    try:
        cfg = load_serve_config(args.config, overrides)
        from serve.app import resolve_export  # imports Ray Serve: only after the config is valid

        resolve_export(cfg.checkpoint)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from serve.app import build_app

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"))
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(cfg.to_dict()), name="raywright", route_prefix="/")
    print(f"serving {cfg.checkpoint} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
