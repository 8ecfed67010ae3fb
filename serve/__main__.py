"""python -m serve --checkpoint PATH [--config serve.yaml] [--set key=value ...] [--port 8000] [--ingress haproxy]

Serves a training export on a local Ray (or the cluster in RAY_ADDRESS) until interrupted (Ctrl-C, or SIGTERM
as ``kill``, ``docker stop`` and systemd send it), then shuts Serve down.
On a cluster, deploy serve/deploy.yaml with ``serve deploy`` instead.
"""

import argparse
import errno
import ipaddress
import os
import socket
import sys
import time

from serve.config import ServeConfig, load_serve_config
from train.cli import config_parser, one_line_errors, print_config, take_sigterm_as_ctrl_c
from train.schema import ConfigError, error_reason

# How long after a SIGTERM Ray's processes take to show that the same signal reached them (the dashboard's die first).
SIGNAL_REACHES_RAY_S = 0.5


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(text)


def check_can_listen(host: str, port: int, setting: str) -> None:
    """That a server can listen on ``host``:``port`` here. Checked before a local Ray starts: Serve's proxy
    would find the port taken only ~30 s later, print pages of tracebacks and stop the command."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT does not count
            sock.bind(address)
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot resolve {host!r}: {exc.strerror}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{setting}: {host}:{port} is in use (another server?); give another port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host: {host} is not an address of this machine") from None
        raise ConfigError(f"{setting}: cannot listen on {host}:{port}: {exc.strerror}") from None


def check_replicas_here(cfg: ServeConfig) -> str:
    """What a replica on this machine (a local Ray's) would fail on, named before Ray starts rather than in pages
    of Serve's tracebacks: no GPU for ``device: cuda`` (it would wait for one forever), a precision the device
    cannot run, an API key file that cannot be read. Returns the API key the replicas will require ("" for none)."""
    import torch

    from serve.precision import check_precision

    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise ConfigError("device: cuda, but this machine has no GPU for a local Ray's replicas")
    device = cfg.resolved_device(cuda)
    try:
        check_precision(cfg.resolved_precision(device), device)
        return cfg.resolved_api_key()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def open_to_others_warning(host: str, ingress: str, api_key: str) -> str | None:
    """A warning where the model is served beyond this machine to anyone: no API key, and a ``--host`` that is not a
    loopback address, or HAProxy's ingress, under which each replica's own port listens on every interface."""
    if api_key:
        return None
    if ingress == "haproxy":
        where = "under HAProxy's ingress each replica's port listens on all interfaces"
    elif not all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None)):
        where = f"--host {host} listens beyond this machine"
    else:
        return None
    key = "no API key is set (api_key_file or RAYWRIGHT_API_KEY)"
    return f"warning: {where}, and {key}: anyone who can reach it can use the model"


def shut_down_serve(started_ray: bool) -> None:
    """Serve's graceful shutdown, unless the Ray this command started is going down too: a SIGTERM to the whole
    process group (``kill -- -PGID``) or cgroup (systemd's stop) reaches Ray's own processes, and then Serve's
    controller never confirms and the shutdown would wait out its 30 s timeout."""
    import ray
    from ray import serve

    if started_ray:
        node = ray._private.worker._global_node  # the processes ray.init started here
        deadline = time.monotonic() + SIGNAL_REACHES_RAY_S
        while time.monotonic() < deadline:
            if not node.remaining_processes_alive():
                return
            time.sleep(0.05)
    serve.shutdown()


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = config_parser(
        "python -m serve",
        "OpenAI-compatible completions on Ray Serve.",
        ServeConfig,
        "YAML file of serve settings (the settings below)",
    )
    parser.add_argument("--checkpoint", help="training export or run directory (local path or URI)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument(
        "--ingress",
        choices=("proxy", "haproxy"),
        default="proxy",
        help="proxy: Serve's Python proxy (default); haproxy: Ray's HAProxy, 1.4-1.6x the requests/s on a CPU, "
        "which also listens on all interfaces for its stats and metrics (8404, 9101) and on each replica's port "
        "(local Ray only: a cluster sets it when it starts, see the README)",
    )
    args = parser.parse_args(argv)
    started_ray = not os.environ.get("RAY_ADDRESS")  # else the command joins the cluster there
    if args.ingress == "haproxy" and not started_ray:
        raise ConfigError("--ingress haproxy: a running Ray's ingress is set when it starts (unset RAY_ADDRESS)")
    overrides = args.set + ([f"checkpoint={args.checkpoint}"] if args.checkpoint else [])
    cfg = load_serve_config(args.config, overrides)
    if args.print_config:
        print_config(cfg)
        return 0
    if started_ray:  # a Ray started here, whose Serve listens on this machine
        check_can_listen(args.host, args.port, "--port")
        if args.ingress == "haproxy":
            from serve.ingress import HAPROXY_PORTS

            for name, port in HAPROXY_PORTS.items():
                check_can_listen("0.0.0.0", int(os.environ.get(name, port)), name)
    from train.run_layout import resolve_export

    try:
        location = resolve_export(cfg.checkpoint)
    except OSError as exc:  # not there (said naming the setting), or storage that cannot be reached
        message = error_reason(exc)
        if not message.startswith("checkpoint"):
            message = f"checkpoint: cannot read {cfg.checkpoint}: {message}"
        raise ConfigError(message) from None
    from train.export import read_provenance
    from train.hf_gpt2 import check_weights, read_model_config
    from train.tokenizer import load_tokenizer

    # Named here, not in each replica's tracebacks: a training record this version cannot read, a config.json that
    # is not GPT-2's, weights missing or cut short, no tokenizer.
    read_provenance(location)
    try:
        read_model_config(location)
        check_weights(location)
        load_tokenizer(location)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint: {exc}") from None
    if started_ray:  # the replicas of a Ray started here read the key as this command does
        api_key = check_replicas_here(cfg)
        warning = open_to_others_warning(args.host, args.ingress, api_key)
        if warning:
            print(warning, file=sys.stderr)

    import ray
    from ray import serve

    from serve.app import build_app
    from train.shared_storage import check_nodes_share

    if args.ingress == "haproxy":
        from serve.ingress import HAPROXY_ENV, HAPROXY_PORTS

        os.environ.update(HAPROXY_ENV)  # before Ray starts Serve's processes, which inherit it
        ports = ", ".join(os.environ.get(name, str(port)) for name, port in HAPROXY_PORTS.items())
        print(f"warning: HAProxy's stats and metrics listen on all interfaces (ports {ports})", file=sys.stderr)
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"))
    if not started_ray:  # a cluster's replica on another machine would otherwise fail to load it, at every restart
        check_nodes_share([("checkpoint", cfg.checkpoint)])
    node_id = ray.get_runtime_context().get_node_id()  # a local Ray's one node, where HAProxy runs
    # Before Serve starts: /ready answers before serve.run returns, and a stop sent then must stop the server as
    # cleanly as later.
    take_sigterm_as_ctrl_c()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(cfg.to_dict()), name="raywright", route_prefix="/")
        print(f"serving {cfg.checkpoint} at http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        shut_down_serve(started_ray)
        if args.ingress == "haproxy":
            from serve.ingress import stop_haproxy_of

            stop_haproxy_of(node_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
