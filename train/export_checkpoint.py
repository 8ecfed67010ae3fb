"""``python -m train.export_checkpoint RUN [--step N] [--out DIR]``: any complete checkpoint of a run as the
Hugging Face directory a finished run exports (train/export.py), to serve or evaluate a run part-way, one that
was stopped or diverged, or an earlier step than its last.

The checkpoint is loaded as a resumed run loads it, into a one-process DeepSpeed engine on this machine: at
the world size it was saved at, or else through DeepSpeed's universal conversion, made in a scratch folder (the
run's storage is only read). Its export is therefore the one the run writes when it ends at that step.
"""

import os
import sys
import tempfile

import torch

from train import checkpoint, storage
from train.cli import OneLineParser, one_line_errors, take_sigterm_as_ctrl_c
from train.config import config_from_dict
from train.export import PROVENANCE, ExportProvenance, export_model
from train.provenance import Provenance
from train.run_layout import EXPORTS
from train.schema import ConfigError, error_reason, replace
from train.tokenizer import load_tokenizer

# What an export's provenance takes from the checkpoint's metadata: its origin, step and config.
ORIGIN = {*Provenance.model_fields, "step", "config"}


def find_checkpoint(location: str, step: int | None) -> checkpoint.Checkpoint:
    """The checkpoint at ``location`` (a checkpoint directory), or a run's newest complete one or the one of
    ``step``; ConfigError naming what is missing."""
    location = storage.absolute(location.rstrip("/"))
    try:
        if storage.exists(storage.join(location, checkpoint.METADATA)):
            return checkpoint.read_complete(location)
        if step is None:
            found = checkpoint.latest_complete(location)
        else:
            held = checkpoint.step_dirs(location)
            uri = checkpoint.checkpoint_uri(location, step)
            found = checkpoint.read_complete(uri) if uri in held else None
    except OSError as exc:  # storage that cannot be reached
        raise ConfigError(f"location: cannot read {location}: {error_reason(exc)}") from None
    except checkpoint.IncompleteCheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if found is not None:
        return found
    if step is None:
        raise ConfigError(f"{location} holds no complete checkpoint (a run directory or one of its checkpoints)")
    names = [uri.rsplit("/", 1)[1] for uri in held]
    raise ConfigError(f"--step: {location} has no checkpoint of step {step} (it has {names or 'none'})")


def default_out(ckpt: checkpoint.Checkpoint) -> str:
    """``<run>/exports/step_NNNNNNNN``: beside the run's own ``export/``, which its end replaces."""
    run, _, name = ckpt.uri.rsplit("/", 2)
    return storage.join(run, EXPORTS, name)


def check_out(out: str) -> None:
    """``out`` is new, empty, or an earlier export (replaced): nothing raywright did not write is overwritten."""
    names = storage.list_dir(out)
    if names and PROVENANCE not in names:
        raise ConfigError(f"--out: {out} holds files that are not a raywright export; give a new directory")


def export_checkpoint(ckpt: checkpoint.Checkpoint, out: str) -> None:
    """Load ``ckpt`` into a one-process engine here and export its weights to ``out``."""
    if not torch.cuda.is_available():  # else DeepSpeed looks for a GPU as it loads, and warns that it found none
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator  # DeepSpeed: after the arguments are checked

    from train.ds_config import build_engine
    from train.model import GPT
    from train.process_group import one_process_group

    on_gpu = get_accelerator().device_name() == "cuda"
    cfg = config_from_dict(ckpt.config)
    cfg = replace(
        cfg,
        scaling=replace(cfg.scaling, use_gpu=on_gpu),  # this machine's device, whatever the run trained on
        run=replace(cfg.run, compile=False),  # nothing to train: compiling would only cost
    )
    universal = checkpoint.needs_universal(ckpt, world_size=1)
    with one_process_group(use_gpu=on_gpu), tempfile.TemporaryDirectory(prefix="raywright-export-") as scratch:
        source = ckpt
        if universal:
            checkpoint.universal_conversion(ckpt, scratch)
            source = ckpt.model_copy(update={"uri": scratch})  # holds universal/, which the load reads
        engine = build_engine(cfg, GPT(cfg.model), 1, universal, checkpoint.exempts_norms_and_biases(ckpt))
        checkpoint.load(engine, source, universal)
        provenance = ExportProvenance(**ckpt.model_dump(include=ORIGIN), checkpoint=ckpt.uri)
        export_model(engine, cfg.model, load_tokenizer(ckpt.uri), out, provenance)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m train.export_checkpoint",
        description="Export a complete checkpoint of a run as a Hugging Face model directory (what the run writes "
        "to <run>/export when it ends), to serve or evaluate it.",
    )
    parser.add_argument("location", help="a run directory or one of its checkpoints (local path or URI)")
    parser.add_argument("--step", type=int, help="the run's checkpoint of this step (default: its newest)")
    parser.add_argument("--out", help="where to write the export (default: <run>/exports/step_NNNNNNNN)")
    args = parser.parse_args(argv)
    ckpt = find_checkpoint(args.location, args.step)
    out = storage.absolute(args.out) if args.out else default_out(ckpt)
    check_out(out)
    take_sigterm_as_ctrl_c()  # stopped, it leaves neither a half-written export nor its scratch copy of the state
    export_checkpoint(ckpt, out)
    print(f"exported {ckpt.uri} (step {ckpt.step}) to {out} (to serve it: python -m serve --checkpoint {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
