"""What stands between HTTP clients and the replicas: Serve's Python proxy (the default), or Ray's HAProxy.

HAProxy (Ray 2.56+; ``ray[serve]`` brings the binary on Linux) sends each request straight to an ingress
replica's own HTTP server, where Serve's proxy is a Python process that relays it through actor calls: on a
2-core CPU 1.4-1.6x the requests/s at 64 clients (BENCHMARKS.md, P7). Serve's processes read this
environment when they start: a local Ray gets it from ``python -m serve --ingress haproxy``, a cluster from
its ``ray start`` commands. That mode turns the replicas' own log files off; their log goes to stderr instead
(the worker's .err file), so that a replica's errors stay visible.
"""

import contextlib
from pathlib import Path

import psutil

HAPROXY_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    # A replica that Serve stops stays reachable this long, so that whatever routes to it can deregister it first:
    # Ray's 30 s suits load balancers in the cloud, but on a local Ray only its own HAProxy does, which reloads
    # in under a second; at 30 s every stop of `python -m serve --ingress haproxy` took 33 s.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}
# Ray binds these on all interfaces, at fixed ports unless these variables say otherwise.
HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}


def stop_haproxy_of(node_id: str) -> None:
    """Stop the HAProxy processes Serve started on the node ``node_id`` that are still running. Ray's actors run in
    process groups of their own, and HAProxy in that of the actor managing it: a signal to the group of
    ``python -m serve`` (``kill -- -PGID``) brings its local Ray down, actors included, but leaves HAProxy running,
    holding the HTTP port. After Serve's own shutdown none is left."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC

    config = Path(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC)
    ours = str(config.parent / node_id / config.name)  # Ray keeps each node's HAProxy files under the node's id
    processes = psutil.process_iter(["name", "cmdline"])
    left = [p for p in processes if p.info["name"] == "haproxy" and ours in (p.info["cmdline"] or [])]
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):  # it may be exiting as well
            process.terminate()
    _, alive = psutil.wait_procs(left, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
