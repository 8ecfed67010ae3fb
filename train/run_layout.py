"""Where a training run keeps its checkpoints and its export, and which directory holds a model to serve.

Neither torch nor DeepSpeed: `python -m serve` answers a wrong checkpoint path in about a second.
"""

from train import storage
from train.hf_gpt2 import CONFIG

CHECKPOINTS = "checkpoints"


def export_uri(run_uri: str) -> str:
    return storage.join(run_uri, "export")


def resolve_export(checkpoint: str) -> str:
    """A model directory (a training export or any GPT-2 HF directory), given itself or the run dir holding it."""
    if storage.exists(storage.join(checkpoint, CONFIG)):
        return checkpoint
    export = export_uri(checkpoint)
    if storage.exists(storage.join(export, CONFIG)):
        return export
    hint = ""
    if storage.exists(storage.join(checkpoint, CHECKPOINTS)):  # a run that has not ended (or did not export)
        hint = f"; export one of its checkpoints first: python -m train.export_checkpoint {checkpoint}"
    raise FileNotFoundError(f"checkpoint: no {CONFIG} in {checkpoint} or in its export/ directory{hint}")
