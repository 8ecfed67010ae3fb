"""Spot-notice drainer: EC2's interruption notice becomes a Ray drain of this node.

    python -m cluster.spot_drainer [--imds-url http://169.254.169.254] [--poll-s 1]

cluster.yaml starts it on every worker. It asks the instance metadata service (IMDSv2: a session
token first, then every read with it) whether the instance is spot, and exits at once if not.
Then it polls ``spot/instance-action`` (the two-minute interruption notice, with its time) and
``events/recommendations/rebalance`` (an earlier warning that the instance is at elevated risk)
and, on either, drains its own Ray node with reason PREEMPTION and a deadline: the notice's time,
or ``--rebalance-deadline-s`` after a rebalance recommendation. Ray Train then reports the
pre-emption to the workers, which take their just-in-time checkpoint; Ray schedules nothing new
on the node.
"""

import argparse
import json
import logging
import time
import urllib.error
import urllib.request
from datetime import datetime

from cluster.drain import drain_node

log = logging.getLogger("raywright.spot_drainer")
TOKEN_TTL_S = 21600


class Imds:
    """A minimal IMDSv2 client: a session token, refreshed when it expires or is refused."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._token, self._token_expires = "", 0.0

    def _refresh_token(self) -> None:
        request = urllib.request.Request(
            f"{self.url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            self._token = reply.read().decode()
        self._token_expires = time.time() + TOKEN_TTL_S - 60

    def get(self, path: str) -> str | None:
        """The text at ``/latest/meta-data/<path>``, or None where there is nothing (404)."""
        for attempt in range(2):
            if not self._token or time.time() > self._token_expires:
                self._refresh_token()
            request = urllib.request.Request(
                f"{self.url}/latest/meta-data/{path}", headers={"X-aws-ec2-metadata-token": self._token}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    return reply.read().decode()
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                if exc.code == 401 and attempt == 0:
                    self._token = ""  # expired or revoked: get a new one and try once more
                    continue
                raise
        return None


def notice_deadline(imds: Imds, rebalance_deadline_s: float) -> tuple[float, str] | None:
    """(deadline as a UNIX time, what was noticed) if the instance is about to go, else None."""
    action = imds.get("spot/instance-action")
    if action:
        notice = json.loads(action)
        deadline = datetime.fromisoformat(notice["time"].replace("Z", "+00:00")).timestamp()
        return deadline, f"spot interruption notice: {notice['action']} at {notice['time']}"
    rebalance = imds.get("events/recommendations/rebalance")
    if rebalance:
        return time.time() + rebalance_deadline_s, f"rebalance recommendation at {json.loads(rebalance)['noticeTime']}"
    return None


def watch(imds: Imds, node_id: str, poll_s: float, rebalance_deadline_s: float, stop=lambda: False) -> bool:
    """Poll until a notice, then drain ``node_id``; True if it drained (False if ``stop()`` said so first)."""
    while not stop():
        try:
            found = notice_deadline(imds, rebalance_deadline_s)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            log.warning("instance metadata unreadable (%s); retrying", exc)
            found = None
        if found:
            deadline, what = found
            remaining = max(1.0, deadline - time.time())
            log.warning("%s: draining Ray node %s, deadline in %.0f s", what, node_id, remaining)
            drain_node(node_id, remaining, message=what)
            return True
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.spot_drainer", description=__doc__.split("\n")[0])
    parser.add_argument("--imds-url", default="http://169.254.169.254")
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--rebalance-deadline-s", type=float, default=120.0)
    parser.add_argument("--address", default="auto", help="the local Ray node to drain is this machine's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    imds = Imds(args.imds_url)
    lifecycle = imds.get("instance-life-cycle")
    if lifecycle != "spot":
        log.info("instance life cycle is %r, not spot: nothing to watch", lifecycle)
        return 0

    import ray

    ray.init(address=args.address, log_to_driver=False)
    node_id = ray.get_runtime_context().get_node_id()
    log.info("watching for spot interruption notices for Ray node %s", node_id)
    watch(imds, node_id, args.poll_s, args.rebalance_deadline_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
