"""What stands between HTTP clients and the replicas: Serve's Python proxy (the default), or Ray's HAProxy.

HAProxy (Ray 2.56+; ``ray[serve]`` brings the binary on Linux) sends each request straight to an ingress
replica's own HTTP server, where Serve's proxy is a Python process that relays it through actor calls: on a
2-core CPU 1.4-1.6x the requests/s at 64 clients (BENCHMARKS.md, P7). Serve's processes read this
environment when they start: a local Ray gets it from ``python -m serve --ingress haproxy``, a cluster from
its ``ray start`` commands. That mode turns the replicas' own log files off; their log goes to stderr instead
(the worker's .err file), so that a replica's errors stay visible.
"""

HAPROXY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_LOG_TO_STDERR": "1"}
# Ray binds these on all interfaces, at fixed ports unless these variables say otherwise.
HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}
