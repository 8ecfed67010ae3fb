"""A torch.distributed group of this one process, for a DeepSpeed engine outside Ray Train (a one-worker sweep
trial, the export of a checkpoint): Ray Train sets up the group of its workers itself. Also the free ports
and the environment that a Ray started here needs."""

import contextlib
import itertools
import os
import random
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

# Where a chosen port is looked for: above Ray's worker ports (10002-19999 by default) and below the ports the kernel
# gives outgoing connections (its ephemeral range), so that no connection takes it between its choice here and its
# bind seconds later in another process. One chosen from the ephemeral range (a bind to port 0) was taken so: a Ray
# starting up makes many connections, and HAProxy, started 14 s after its port was chosen, could not bind it.
CHOSEN_PORTS_FROM = 20000
LINUX_EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_ports_start() -> int:
    try:
        with open(LINUX_EPHEMERAL_PORTS) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, below macOS's and IANA's 49152


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports on 127.0.0.1 that nothing listens on now and that outgoing connections are not
    given meanwhile (where the machine leaves no such port, any free ones)."""
    candidates = range(CHOSEN_PORTS_FROM, _ephemeral_ports_start())
    # Not the random module's shared state, which a run seeds: two processes seeded alike would pick alike.
    drawn = random.SystemRandom().sample(candidates, min(len(candidates), 100 + count))
    ports = list(itertools.islice(filter(_can_bind, drawn), count))
    with contextlib.ExitStack() as held:  # each held until all are chosen, so that the kernel gives different ones
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


def free_port(prefer: int = 0) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: ``prefer`` where it is free, else one of ``free_ports``."""
    if prefer and _can_bind(prefer):
        return prefer
    return free_ports(1)[0]


def own_state_api_env(dashboard_port: int) -> dict[str, str]:
    """The environment, for the processes of a Ray whose dashboard is at ``dashboard_port``, in which they
    ask Ray's state API of that Ray.

    Ray finds "the" Ray of this machine where `ray start` last wrote its address, else among the running
    ones: beside another Ray (a user's `ray start`, a local twin), that Ray or none. Ray Train's
    placement-group cleaner, asking there, found no controller of a run and removed the run's placement
    group, killing its workers, or failed and left the run without one. A Ray's processes inherit the
    environment of the process that starts it.
    """
    return {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}"}


@contextlib.contextmanager
def one_process_group(use_gpu: bool) -> Iterator[None]:
    """Rank 0 of 1 (NCCL where ``use_gpu`` and a GPU is here, else gloo) inside the block.

    The launcher's variables that DeepSpeed reads are set inside it only: left behind, the next group that this
    process (a notebook, a reused trial actor) made from its environment would join a port no one listens on.
    """
    group_env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    before = {name: os.environ.get(name) for name in group_env}
    os.environ.update(group_env)
    try:
        dist.init_process_group("nccl" if use_gpu and torch.cuda.is_available() else "gloo", rank=0, world_size=1)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
