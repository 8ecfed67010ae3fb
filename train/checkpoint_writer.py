"""Checkpoint files written on a thread of their own, so training goes on while they reach storage.

DeepSpeed's ``save_checkpoint`` hands every state dict it would write to the engine's checkpoint
engine. ``BackgroundWriter`` takes a host copy of each (the only part training waits for; on a GPU,
the device-to-host copy) and, once ``start`` is called, writes them with ``torch.save`` and then runs
the given upload, on a thread. A checkpoint still counts only when rank 0 writes its metadata after
every rank's files are written (train/checkpoint.py), so a run that dies meanwhile leaves an incomplete
directory that is never loaded.
"""

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def host_copy(item: Any) -> Any:
    """A copy of a (nested) state dict that later training steps cannot change: tensors copied to
    the host, plain containers rebuilt, anything else deep-copied (a loss scaler is an object that moves on)."""
    if torch.is_tensor(item):
        return item.detach().to("cpu", copy=True)
    if type(item) in (dict, OrderedDict):
        return type(item)((key, host_copy(value)) for key, value in item.items())
    if type(item) in (list, tuple):
        return type(item)(host_copy(value) for value in item)
    return copy.deepcopy(item)


class BackgroundWriter(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine whose writes happen after ``save_checkpoint`` returns.

    One checkpoint at a time: ``start`` writes what was saved since the last ``start``; the caller
    waits for ``done`` before the next ``save_checkpoint``.
    """

    def __init__(self):
        super().__init__(None)
        self._copies: list[tuple[Any, str]] = []
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed then skips its own clone: ``save`` copies once, to the host

    def save(self, state_dict: Any, path: str) -> None:
        if self._thread is not None:
            raise RuntimeError("a checkpoint is still being written; wait for it before saving another")
        self._copies.append((host_copy(state_dict), path))

    def start(self, then: Callable[[], None] = lambda: None) -> None:
        """Write the saved copies, then call ``then`` (an upload), on a background thread."""
        copies, self._copies = self._copies, []

        def write() -> None:
            try:
                for state, path in copies:
                    torch.save(state, path)
                then()
            except BaseException as exc:  # handed to the training thread, which raises it
                self.error = exc

        self.error = None
        self._thread = threading.Thread(target=write, name="raywright-checkpoint-writer", daemon=True)
        self._thread.start()

    def done(self, wait: bool = False) -> bool:
        """Whether the last started write has ended (waiting for it if ``wait``); see ``error``."""
        if self._thread is None:
            return True
        if wait:
            self._thread.join()
        if self._thread.is_alive():
            return False
        self._thread = None
        return True
