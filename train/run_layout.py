"""Where a training run keeps its checkpoints and its export, and which directory holds a model to serve.

Neither torch nor DeepSpeed: `python -m serve` answers a wrong checkpoint path in about a second.
"""

from train import storage
from train.hf_gpt2 import CONFIG

CHECKPOINTS = "checkpoints"
EXPORTS = "exports"  # of checkpoints by hand (python -m train.export_checkpoint), beside the run's end's export/


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
        exports = storage.join(checkpoint, EXPORTS)
        # step_NNNNNNNN, zero-padded: sorted by name, by step
        exported = [name for name in storage.list_dir(exports) if storage.exists(storage.join(exports, name, CONFIG))]
        command = f"python -m train.export_checkpoint {checkpoint}"
        if exported:  # made that way: serving looks no further, a run's end replaces its export/
            newest = f"{exports}/{exported[-1]}"
            hint = f"; give one of its checkpoints' exports (the newest: {newest}) or make one: {command}"
        else:
            hint = f"; export one of its checkpoints first ({command}) and give the directory it writes"
    raise FileNotFoundError(f"checkpoint: no {CONFIG} in {checkpoint} or in its export/ directory{hint}")
