"""Spot-notice drainer: EC2's interruption notice becomes a Ray drain of this node.

    python -m cluster.spot_drainer [--imds-url http://169.254.169.254] [--poll-s 1]

cluster.yaml starts it on every worker (and restarts it if it dies). It asks the instance metadata
service (IMDSv2: a session token first, then every read with it) whether the instance is spot,
retrying with backoff while the service cannot be reached, and exits if not. Then it polls
``spot/instance-action`` (the two-minute interruption notice, with its time) and drains its own Ray
node with reason PREEMPTION and the notice's deadline: Ray Train reports the pre-emption to the
workers, which take their just-in-time checkpoint, and Ray schedules nothing new on the node.
An earlier ``events/recommendations/rebalance`` (the instance is at elevated risk) asks every training
run for an early checkpoint instead, and the drainer keeps watching for the notice.
"""

import argparse
import json
import logging
import time
import urllib.error
import urllib.request
from datetime import datetime

from cluster.drain import drain_node
from train.early_checkpoint import request_checkpoint

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


def wait_for_metadata(imds: Imds, stop=lambda: False, first_wait_s: float = 1.0, max_wait_s: float = 30.0) -> str:
    """The instance's life cycle (spot, on-demand), asked until the metadata service answers ("" if stopped)."""
    wait = first_wait_s
    while not stop():
        try:
            return imds.get("instance-life-cycle") or ""
        except (urllib.error.URLError, OSError) as exc:
            log.warning("instance metadata unreachable (%s); retrying in %.0f s", exc, wait)
            time.sleep(wait)
            wait = min(2 * wait, max_wait_s)
    return ""


def interruption_deadline(imds: Imds) -> tuple[float, str] | None:
    """(deadline as a UNIX time, the notice) if the instance is about to be interrupted, else None."""
    action = imds.get("spot/instance-action")
    if not action:
        return None
    notice = json.loads(action)
    deadline = datetime.fromisoformat(notice["time"].replace("Z", "+00:00")).timestamp()
    return deadline, f"spot interruption notice: {notice['action']} at {notice['time']}"


def watch(imds: Imds, node_id: str, poll_s: float, stop=lambda: False) -> bool:
    """Poll until the interruption notice, then drain ``node_id``; True if it drained (False if stopped).

    Each new rebalance recommendation asks the cluster's training runs for an early checkpoint.
    """
    rebalance_seen = None
    while not stop():
        try:
            found = interruption_deadline(imds)
            rebalance = imds.get("events/recommendations/rebalance")
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            log.warning("instance metadata unreadable (%s); retrying", exc)
            found = rebalance = None
        if found:
            deadline, what = found
            remaining = max(1.0, deadline - time.time())
            log.warning("%s: draining Ray node %s, deadline in %.0f s", what, node_id, remaining)
            drain_node(node_id, remaining, message=what)
            return True
        if rebalance and rebalance != rebalance_seen:
            rebalance_seen = rebalance
            log.warning("rebalance recommendation (%s): asking training runs for an early checkpoint", rebalance)
            request_checkpoint()
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.spot_drainer", description=__doc__.split("\n")[0])
    parser.add_argument("--imds-url", default="http://169.254.169.254")
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--address", default="auto", help="the local Ray node to drain is this machine's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    imds = Imds(args.imds_url)
    lifecycle = wait_for_metadata(imds)
    if lifecycle != "spot":
        log.info("instance life cycle is %r, not spot: nothing to watch", lifecycle)
        return 0

    import ray

    ray.init(address=args.address, log_to_driver=False)
    node_id = ray.get_runtime_context().get_node_id()
    log.info("watching for spot interruption notices for Ray node %s", node_id)
    watch(imds, node_id, args.poll_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
