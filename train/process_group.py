"""A torch.distributed group of this one process, for a DeepSpeed engine outside Ray Train (a one-worker sweep
trial, the export of a checkpoint): Ray Train sets up the group of its workers itself. Also the free ports
and the environment that a Ray started here needs."""

import contextlib
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist


def free_port(prefer: int = 0) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: ``prefer`` where it is free, else any."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", prefer))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
