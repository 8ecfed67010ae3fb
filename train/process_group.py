"""A torch.distributed group of this one process, for a DeepSpeed engine outside Ray Train (a one-worker sweep
trial, the export of a checkpoint): Ray Train sets up the group of its workers itself."""

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


@contextlib.contextmanager
def one_process_group(use_gpu: bool) -> Iterator[None]:
    """Rank 0 of 1 (NCCL where ``use_gpu`` and a GPU is here, else gloo) inside the block."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if use_gpu and torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
