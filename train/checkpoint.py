"""Sharded DeepSpeed checkpoints in the run's storage, complete or ignored.

Layout: ``<run>/checkpoints/step_00000120/`` holds DeepSpeed's shards and, written last
by rank 0 once every rank has finished, ``metadata.json`` (``CheckpointMetadata``): the step, samples seen, world
size, global batch, config, tokenizer and the size of every file, ``tokenizer.json`` included. A checkpoint
counts only when its metadata exists and every file it lists is there at that size; a
half-written one is skipped with a warning, so a crash mid-save never becomes "latest". A complete one whose
metadata this version cannot read is an error naming the field, never skipped: skipping it would resume an
older one and prune the newer.
"""

import argparse
import contextlib
import functools
import io
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from train import storage
from train.provenance import Provenance
from train.run_layout import CHECKPOINTS
from train.schema import ConfigError, read_record
from train.tokenizer import BPETokenizer, TokenizerSpec, save_tokenizer

if TYPE_CHECKING:  # DeepSpeed loads where an engine is in hand: finding and reading checkpoints needs none of it
    from train.checkpoint_writer import BackgroundWriter

logger = logging.getLogger(__name__)

METADATA = "metadata.json"
UNIVERSAL = "universal"
# DeepSpeed's files of one data-parallel rank: its ZeRO optimizer shard, and at stage 3 its model states.
RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


class RunRecord(Provenance):
    """What a checkpoint records of the run that saves it, as the run starts the save."""

    world_size: int  # data-parallel ranks: a resume at another size goes through the universal format
    global_batch_size: int
    samples_seen: int
    reason: str  # why it was taken: "steps", "minutes", "requested", "preemption", "deadline" or "final"
    config: dict[str, Any]  # the run's resolved TrainConfig (``to_dict``)
    tokenizer: TokenizerSpec  # its file is the checkpoint's tokenizer.json
    # Two optimizer parameter groups (train/ds_config.py); a checkpoint from before 2026-11-25 has one.
    norms_and_biases_undecayed: bool = False

    @property
    def zero_stage(self) -> int:
        return self.config["deepspeed"]["zero_stage"]


class CheckpointMetadata(RunRecord):
    """``metadata.json``: written last, by rank 0, once every rank has written its files."""

    step: int
    time: float  # when its save started
    files: dict[str, int]  # the size of every file, by its path in the checkpoint


class Checkpoint(CheckpointMetadata):
    """A checkpoint's metadata, and where it is (complete, where ``read_complete`` or ``latest_complete`` gives it)."""

    uri: str


class IncompleteCheckpointError(ValueError):
    """A checkpoint whose metadata is missing or whose files are not all there at their sizes."""


class UnreadableMetadataError(ConfigError):
    """A checkpoint's metadata that this version cannot read (another version's, or edited): such a checkpoint is
    neither resumed from, nor skipped for an older one, nor deleted."""


def checkpoint_uri(run_uri: str, step: int) -> str:
    return storage.join(run_uri, CHECKPOINTS, f"step_{step:08d}")


def _file_sizes(uri: str) -> dict[str, int]:
    fs, root = storage.resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {os.path.relpath(i.path, root): i.size for i in infos if i.type == pafs.FileType.File}


def _read_metadata(uri: str) -> Checkpoint | None:
    """The checkpoint at ``uri`` as its metadata says, complete or not; None where it has no metadata (yet).
    UnreadableMetadataError naming the field where it is not metadata this version reads."""
    try:
        metadata = read_record(CheckpointMetadata, storage.join(uri, METADATA), "checkpoint metadata")
    except ConfigError as unreadable:
        raise UnreadableMetadataError(str(unreadable)) from None
    return None if metadata is None else Checkpoint(**dict(metadata), uri=uri)


def _incompleteness(uri: str, metadata: Checkpoint | None) -> str | None:
    """Why the checkpoint at ``uri`` with ``metadata`` is incomplete, or None if it is complete."""
    if metadata is None:
        return f"no {METADATA}"
    present = _file_sizes(uri)
    for name, size in metadata.files.items():
        if present.get(name) != size:
            return f"{name} is missing or has {present.get(name)} bytes instead of {size}"
    return None


def step_dirs(run_uri: str) -> list[str]:
    """URIs of the run's checkpoint directories, oldest first (DeepSpeed also leaves scripts there)."""
    root = storage.join(run_uri, CHECKPOINTS)
    return [storage.join(root, name) for name in storage.list_dir(root) if name.startswith("step_")]


def read_complete(uri: str) -> Checkpoint:
    """The checkpoint at ``uri``; IncompleteCheckpointError saying why where it is incomplete."""
    found = _read_metadata(uri)
    reason = _incompleteness(uri, found)
    if reason is not None:
        raise IncompleteCheckpointError(f"incomplete checkpoint {uri}: {reason}")
    return found


def latest_complete(run_uri: str) -> Checkpoint | None:
    """The newest complete checkpoint of a run, or None."""
    for uri in reversed(step_dirs(run_uri)):
        try:
            return read_complete(uri)
        except IncompleteCheckpointError as exc:
            logger.warning("skipping %s", exc)
    return None


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (raised on every rank alike); it does not count. ``full_disk``: the disk a
    rank found full (a folder on it), where one did."""

    def __init__(self, message: str, full_disk: str | None = None):
        super().__init__(message)
        self.full_disk = full_disk


@dataclass(frozen=True)
class RankWriteFailure:
    """One rank's failure to write its part of a checkpoint, and the disk it wrote to where that disk is full."""

    error: str
    full_disk: str | None = None  # the nearest existing folder of what it wrote
    free_bytes: int = 0

    def __str__(self) -> str:
        if self.full_disk is None:
            return self.error
        return f"{self.error}; the disk holding {self.full_disk} is full: {self.free_bytes / 2**20:.1f} MiB free"


@dataclass
class PendingCheckpoint:
    """A checkpoint whose files are being written; it counts once ``finish_save`` has written its metadata."""

    run_uri: str
    uri: str
    step: int
    record: RunRecord
    started: float
    writer: "BackgroundWriter | None"  # None: the files were written before ``begin_save`` returned
    device: torch.device
    error: BaseException | None = None  # this rank's failure outside the writer: it fails the checkpoint


def begin_save(engine, run_uri: str, step: int, record: RunRecord) -> PendingCheckpoint:
    """Start a checkpoint of this step from every rank (a collective call).

    The step directory is written fresh (what an earlier, interrupted attempt left there is cleared
    first). Where the engine's checkpoint engine is a ``BackgroundWriter``, the files are written, and
    uploaded from a local staging directory where the run is remote, after this returns.
    """
    started = time.time()
    uri = checkpoint_uri(run_uri, step)
    tag = os.path.basename(uri)
    remote = not storage.is_local(run_uri)
    error = None
    if dist.get_rank() == 0:
        try:
            if storage.exists(uri):
                storage.delete_dir(uri)  # shards of another world size must not be listed, or converted, as this one's
        except OSError as exc:  # storage unreachable: the files are still written (DeepSpeed's save is collective)
            error = exc
    staging_dirs = staging_root(run_uri) if remote else None
    if staging_dirs and _first_on_node():
        # What a worker killed mid-upload left here; the run's previous checkpoint is written on every rank.
        shutil.rmtree(staging_dirs, ignore_errors=True)
    dist.barrier()
    from train.checkpoint_writer import BackgroundWriter

    writer = engine.checkpoint_engine if isinstance(engine.checkpoint_engine, BackgroundWriter) else None
    staging = None
    if staging_dirs:
        os.makedirs(staging_dirs, exist_ok=True)
        staging = tempfile.mkdtemp(dir=staging_dirs)
    engine.save_checkpoint(staging or storage.resolve(os.path.dirname(uri))[1], tag=tag, save_latest=False)
    upload = functools.partial(_upload_staged, staging, tag, uri) if staging else lambda: None
    if writer:
        writer.start(then=upload)
    else:
        try:
            upload()
        except OSError as exc:
            error = error or exc
    return PendingCheckpoint(run_uri, uri, step, record, started, writer, engine.device, error)


def staging_root(run_uri: str) -> str:
    """Where the ranks on this node stage their shards of a checkpoint of a run on object storage to upload."""
    return storage.node_local_dir("ckpt-staging", run_uri)


def remove_staging(run_uri: str) -> None:
    """At the run's end, once its last checkpoint counts (no rank stages one any more): its staging folder on this
    node, which would otherwise stay behind, empty, for every run."""
    if _first_on_node():
        shutil.rmtree(staging_root(run_uri), ignore_errors=True)  # not there: the run is local


def _first_on_node() -> bool:
    """Whether this rank does a node's share of the work (Ray Train sets LOCAL_RANK; a lone process has none)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def _upload_staged(staging: str, tag: str, uri: str) -> None:
    """Each rank uploads the shards it staged locally."""
    try:
        storage.copy_dir(os.path.join(staging, tag), uri)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def written(pending: PendingCheckpoint, wait: bool) -> bool:
    """Whether every rank has written its files (a collective; waits for this rank's if ``wait``).

    Once no rank is still writing, raises ``CheckpointWriteError`` on every rank if one rank's write
    failed, naming each failure, so all leave their collectives together.
    """
    writer = pending.writer
    writing = 0 if writer is None or writer.done(wait) else 1
    error = pending.error or (writer.error if writer else None)  # a writer's, once set, is final
    counts = torch.tensor([writing, 1 if error else 0], device=pending.device)
    dist.all_reduce(counts)
    still_writing, failed = counts.tolist()
    if still_writing:
        return False
    if failed:
        failures: list[RankWriteFailure | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, _describe(error, pending))
        _fail(pending, failures, error)
    return True


# A write that fails with less free space than this on its disk failed for want of space: torch.save says only
# "unexpected pos" (its stream's error), where the full disk of a long run is the usual cause.
FULL_DISK_BYTES = 64 * 2**20


def _describe(error: BaseException | None, pending: PendingCheckpoint) -> RankWriteFailure | None:
    """This rank's failure, and whether the disk it wrote to on this node is full."""
    if error is None:
        return None
    written_to = storage.resolve(pending.uri)[1] if storage.is_local(pending.uri) else staging_root(pending.run_uri)
    where, free = storage.free_space(written_to)
    failure = f"{type(error).__name__}: {error}"
    return RankWriteFailure(failure, where, free) if free < FULL_DISK_BYTES else RankWriteFailure(failure)


def _fail(pending: PendingCheckpoint, failures: list[RankWriteFailure | None], cause: BaseException | None) -> None:
    """Raise ``CheckpointWriteError`` on every rank, once rank 0 has deleted what the failed attempt wrote to a local
    disk: on a full one, the space the next attempt needs. Object storage does not fill up, and a delete there would
    wait out the outage that failed the attempt: ``prune`` deletes it after the next checkpoint that counts."""
    if dist.get_rank() == 0 and storage.is_local(pending.uri):
        with contextlib.suppress(OSError):
            storage.delete_dir(pending.uri)
    causes = "; ".join(f"rank {rank}: {failure}" for rank, failure in enumerate(failures) if failure)
    full_disk = next((failure.full_disk for failure in failures if failure and failure.full_disk), None)
    raise CheckpointWriteError(f"checkpoint {pending.uri} could not be written ({causes[:2000]})", full_disk) from cause


def finish_save(pending: PendingCheckpoint, keep_last: int, tokenizer: BPETokenizer) -> None:
    """Make a written checkpoint count (every rank, once ``written``): rank 0 adds the tokenizer and
    writes ``metadata.json`` listing every file's size, then keeps the newest ``keep_last``.

    Raises ``CheckpointWriteError`` on every rank if rank 0 could not write the metadata (storage
    unreachable); the checkpoint then does not count. Old checkpoints that could not be deleted are
    deleted after the next one.
    """
    error = None
    if dist.get_rank() == 0:
        try:
            save_tokenizer(tokenizer, pending.uri)
            files = _file_sizes(pending.uri)
            metadata = CheckpointMetadata(
                **pending.record.model_dump(), step=pending.step, time=pending.started, files=files
            )
            storage.write_json(storage.join(pending.uri, METADATA), metadata.model_dump())
        except OSError as exc:
            error = exc
        else:
            try:
                prune(pending.run_uri, keep_last)
            except OSError as exc:
                logger.warning("could not delete old checkpoints (retried after the next one): %s", exc)
    outcome = [_describe(error, pending)]
    dist.broadcast_object_list(outcome)  # also what the other ranks wait for
    if outcome[0]:
        _fail(pending, outcome, error)


def prune(run_uri: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (0: none); delete older ones and every incomplete one.

    Called right after a save completes, when no other save is in flight (one at a time): an incomplete directory is
    then an interrupted attempt, never one still being written, and never counts toward ``keep_last``. One whose
    metadata this version cannot read is left as it is.
    """
    complete, incomplete = [], []
    for uri in step_dirs(run_uri):
        try:
            reason = _incompleteness(uri, _read_metadata(uri))
        except UnreadableMetadataError as exc:
            logger.warning("left as it is: %s", exc)
            continue
        (complete if reason is None else incomplete).append(uri)
    for uri in incomplete + (complete[:-keep_last] if keep_last else complete):
        storage.delete_dir(uri)


def download_dir(uri: str) -> str:
    """Where a node downloads the checkpoint at ``uri`` (on object storage) to load it."""
    return storage.node_local_dir("ckpt", uri)


def files_for_ranks(files: Iterable[str], ranks: Collection[int]) -> list[str]:
    """Of a checkpoint's files, those that ``ranks`` read to load it at the world size it was saved at:
    their own per-rank files and the files every rank reads (model states below ZeRO-3, the tokenizer).
    DeepSpeed opens no other rank's shard there (unless ``elastic_checkpoint`` is set)."""
    owners = {name: RANK_FILE.search(os.path.basename(name)) for name in files}
    return [name for name, owner in owners.items() if owner is None or int(owner[1]) in ranks]


def universal_files_for_params(files: Iterable[str], params: Collection[str]) -> list[str]:
    """Of a universal conversion's files, those that ranks reading the state of ``params`` read: the
    ``zero/<param>/`` files of those parameters and every file outside a parameter's folder."""

    def read(name: str) -> bool:
        parts = name.split("/")
        return not (len(parts) == 3 and parts[0] == "zero") or parts[1] in params

    return [name for name in files if read(name)]


def _params_with_optimizer_state_here(engine) -> set[str] | None:
    """The parameters of which this rank's optimizer partition holds a piece (ZeRO-1/2, bf16): a universal
    load reads only their state. None where every rank reads every parameter's (ZeRO-3, a plain optimizer)."""
    names = getattr(engine.optimizer, "param_names", None)
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3 or names is None or not all(hasattr(p, "_hp_mapping") for p in params):
        return None
    return {names[p] for p in params if p._hp_mapping is not None}


def _ranks_on_this_machine() -> list[int]:
    """The ranks that share this machine's download folder, lowest first (a collective)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return [rank for rank, host in enumerate(hosts) if host == hosts[dist.get_rank()]]


@contextlib.contextmanager
def _local_dir(uri: str, files_for: Callable[[list[int]], list[str] | None] | None = None) -> Iterator[str]:
    """A local directory holding the checkpoint at ``uri`` while in use (a collective): itself, or a download
    per machine of ``files_for(its ranks)`` (None: every file), removed once every rank has loaded from it; a
    node that outlives many resumes would otherwise keep a whole checkpoint from each."""
    if storage.is_local(uri):
        yield storage.resolve(uri)[1]
        return
    local = download_dir(uri)
    ranks = _ranks_on_this_machine()
    downloads = dist.get_rank() == ranks[0]  # one download per machine
    if downloads:
        shutil.rmtree(local, ignore_errors=True)
        needed = None if files_for is None else files_for(ranks)
        storage.copy_dir(uri, local, needed)
        if needed is not None:
            logger.info("downloaded %d files of %s for ranks %s", len(needed), uri, ranks)
    dist.barrier()
    yield local
    # Not reached when the load raised: the ranks would not meet here, and the group restarts anyway;
    # the next download of this checkpoint replaces what is left.
    dist.barrier()
    if downloads:
        shutil.rmtree(local, ignore_errors=True)


def _universal_files_for(engine, uri: str) -> Callable[[list[int]], list[str] | None] | None:
    """What a machine's ranks read of the universal conversion at ``uri`` (a collective where the engine
    partitions its optimizer state, to learn every rank's parameters)."""
    mine = _params_with_optimizer_state_here(engine)
    if mine is None or storage.is_local(uri):  # the same on every rank: the engine's config, the uri
        return None
    every_rank: list[set[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    return lambda ranks: universal_files_for_params(_file_sizes(uri), set().union(*(every_rank[r] for r in ranks)))


def _mend_zero3_universal_load(optimizer, decays: list[float]) -> None:
    """Undo what DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    gets wrong where the optimizer has more than one sub-group: two parameter groups (the decayed and the rest),
    or one group whose partition exceeds ``sub_group_size``. It gives every sub-group's state one shared ``step``
    tensor, which torch's AdamW then advances once per sub-group each step (the bias corrections run ahead), and
    every group the first group's hyperparameters (the undecayed group decayed)."""
    for state in optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        group["weight_decay"] = decay


def exempts_norms_and_biases(ckpt: Checkpoint | None) -> bool:
    """Whether a run that resumes from ``ckpt`` (None: a new run) exempts biases and LayerNorms from weight decay:
    its optimizer must have the parameter groups the checkpoint's state was saved in (DeepSpeed refuses another
    count), and checkpoints raywright wrote before the exemption have one group and no such metadata."""
    return ckpt is None or ckpt.norms_and_biases_undecayed


def needs_universal(checkpoint: Checkpoint, world_size: int) -> bool:
    """Whether loading at ``world_size`` goes through the universal format: DeepSpeed refuses ZeRO shards
    (stages 1-3) of another data-parallel size. A stage-0 checkpoint has none: its one model-states file holds
    the whole model and optimizer state (fp32 masters included), which loads at any size as it is."""
    sharded = any(RANK_FILE.search(os.path.basename(name)) for name in checkpoint.files)
    return sharded and checkpoint.world_size != world_size


def convert_to_universal(checkpoint: Checkpoint) -> None:
    """Rank 0 converts the checkpoint to DeepSpeed's universal format, once; the others wait.

    The result lives inside the checkpoint (``<ckpt>/universal/``), so it is pruned with it,
    and counts only once ``universal/done.json`` is written.
    """
    uri = checkpoint.uri
    done = storage.join(uri, UNIVERSAL, "done.json")
    if dist.get_rank() == 0 and not storage.exists(done):
        started = time.time()
        with tempfile.TemporaryDirectory(prefix="raywright-universal-") as scratch:
            output = universal_conversion(checkpoint, scratch)
            target = storage.join(uri, UNIVERSAL)
            if storage.exists(target):
                storage.delete_dir(target)  # a conversion cut short earlier: redone, never loaded
            if storage.is_local(uri):  # staged beside its place and renamed, so it appears whole
                staged = f"{target}.{os.getpid()}.tmp"
                storage.copy_dir(output, staged)
                os.replace(storage.resolve(staged)[1], storage.resolve(target)[1])
            else:
                storage.copy_dir(output, target)
        storage.write_json(done, {"seconds": time.time() - started})  # last: the conversion counts from here
        logger.info("converted %s to universal format in %.1f s", uri, time.time() - started)
    dist.barrier()


def universal_conversion(checkpoint: Checkpoint, scratch: str) -> str:
    """Convert the checkpoint into ``<scratch>/universal`` (downloading it into ``scratch`` first where it is
    remote); returns that folder."""
    uri = checkpoint.uri
    source = storage.resolve(uri)[1] if storage.is_local(uri) else os.path.join(scratch, "source")
    if not storage.is_local(uri):
        storage.copy_dir(uri, source)
    output = os.path.join(scratch, UNIVERSAL)
    _run_ds_to_universal(source, output, inject_missing_state=checkpoint.zero_stage < 3)
    return output


def _run_ds_to_universal(source: str, output: str, inject_missing_state: bool) -> None:
    """DeepSpeed's converter, in this process (a subprocess would spend seconds re-importing torch)."""
    from deepspeed.checkpoint import ds_to_universal

    converter_args = argparse.Namespace(
        input_folder=source,
        output_folder=output,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=inject_missing_state,  # ZeRO-1/2 checkpoints lack state it expects
    )
    chatter = io.StringIO()  # it prints progress bars and every file it writes
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(converter_args)
    except Exception as exc:
        raise RuntimeError(
            f"converting {source} to universal format failed: {exc}\n{chatter.getvalue()[-3000:]}"
        ) from exc


@contextlib.contextmanager
def _without_tensor_parallel_note() -> Iterator[None]:
    """DeepSpeed's universal load warns on every rank that no model-parallel unit was given, so it takes tensor
    parallelism as 1: that is what raywright trains with, and the warning read as a fault in each resize's log
    and in the export of a 2-worker run."""
    from deepspeed.utils import logger as deepspeed_logger

    def not_the_note(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MPU is not provided")

    deepspeed_logger.addFilter(not_the_note)
    try:
        yield
    finally:
        deepspeed_logger.removeFilter(not_the_note)


def load(engine, checkpoint: Checkpoint, universal: bool) -> None:
    """Load model and optimizer state on every rank (a collective call).

    ``universal``: load the universal conversion (the engine must have been built with
    ``load_universal``); this restores model and optimizer state at any world size. From object
    storage, each machine downloads what its ranks read: for a universal load, the conversion's shared files
    and the state of the parameters their optimizer partitions hold pieces of (every parameter's at ZeRO-3),
    not the shards beside it; at the saved size, the shards of the ranks there and the files all ranks read.
    """
    if universal:
        uri = storage.join(checkpoint.uri, UNIVERSAL)
        files_for = _universal_files_for(engine, uri)
    elif engine.zero_elastic_checkpoint():  # every rank reads every shard
        uri, files_for = checkpoint.uri, None
    else:
        uri = checkpoint.uri
        files_for = functools.partial(files_for_ranks, list(checkpoint.files))
    decays = [group["weight_decay"] for group in engine.optimizer.param_groups]  # see _mend_zero3_universal_load
    with _local_dir(uri, files_for) as local, _without_tensor_parallel_note():
        load_path, _ = engine.load_checkpoint(
            os.path.dirname(local), tag=os.path.basename(local), load_lr_scheduler_states=False
        )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint.uri}")
    if universal and engine.zero_optimization_stage() == 3:
        _mend_zero3_universal_load(engine.optimizer, decays)
