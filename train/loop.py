"""The per-worker training loop that Ray Train runs: DeepSpeed engine, data, metrics, checkpoints.

Each (re)start of the worker group runs ``train_loop`` from the top: a ``Trainer`` restores the
newest complete checkpoint (converting it if the world size changed), then trains optimizer steps
``[restored step, max_steps)`` on the samples that those steps own, whatever the world size.
"""

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch.profiler import record_function

from train import checkpoint, storage
from train.checkpoint_writer import BackgroundWriter
from train.config import TrainConfig
from train.decisions import Notice, Rank0View, StepPolicy, share_rank0_view
from train.ds_config import build_engine, compiles
from train.early_checkpoint import latest_checkpoint_request, latest_restart_request, record_waiting_for_restart
from train.evaluation import Evaluation
from train.export import ExportProvenance, export_model
from train.hf_gpt2 import load_weights
from train.loader import SampleOrder, micro_batch_samples
from train.loop_args import LoopArgs, SharedFolder
from train.memory import plan_memory, worker_capacity_bytes
from train.metrics import (
    HEALTH_CHECK_INTERVAL_ENV,
    format_progress,
    memory_gb,
    peak_tflops,
    report_backlog_warning,
)
from train.model import GPT, IGNORED_TARGET, flops_per_token
from train.node_copy import load_split
from train.profiling import StepProfiler
from train.run_files import JsonlLog
from train.run_layout import export_uri
from train.schedule import lr_at
from train.schema import parse, replace
from train.shared_storage import not_seen
from train.stops import DivergedError, OutOfDiskError, RunStopped, StorageNotSharedError
from train.timeline import CheckpointEvent, Startup, describe_resize
from train.tokenizer import load_tokenizer

SAMPLE_LOG = "samples.jsonl"
# What DeepSpeed's fp16 loss scaler raises (a bare Exception) where a step's gradients overflow at its lowest
# scale: every step since overflowed, and was skipped (deepspeed/runtime/fp16/loss_scaler.py).
LOSS_SCALE_AT_MINIMUM = "loss scale already at minimum"


def _to_batch(rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(rows.astype(np.int64))
    if device.type == "cuda":  # from pinned memory the copy runs beside the GPU's work instead of before it
        tokens = tokens.pin_memory().to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def _mean_over_ranks(total: float | torch.Tensor, count: float, device: torch.device) -> float:
    """The all-ranks mean of ``total / count``; a ``total`` on the device is read only here (one host sync)."""
    pair = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in (total, count)])
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


@torch.no_grad()
def evaluate(engine, val_rows: np.ndarray, micro_batch: int) -> float:
    """Mean validation loss over every row of ``val_rows``: the same at any world size, however few the rows.

    Rank r takes rows r, r + world, ... Every rank runs the same number of forward passes of whole micro-batches
    (ZeRO-3 gathers the weights in each, and a compiled model keeps its shapes): a pass short of rows is filled
    with copies of the first row, whose targets the loss ignores.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = val_rows[rank::world]
    passes = -(-len(val_rows) // (world * micro_batch))
    engine.eval()
    total = torch.zeros((), dtype=torch.float64, device=engine.device)  # read once, not per micro-batch
    for start in range(0, passes * micro_batch, micro_batch):
        rows = mine[start : start + micro_batch]
        filled = np.concatenate([rows, np.repeat(val_rows[:1], micro_batch - len(rows), axis=0)])
        tokens, targets = _to_batch(filled, engine.device)
        targets = targets.clone()  # a view of the tokens, shifted
        targets[len(rows) :] = IGNORED_TARGET
        _, loss = engine(tokens, targets)
        if len(rows):  # a pass of filler alone has no loss (0 / 0)
            total += loss.detach().double() * len(rows)
    engine.train()
    return _mean_over_ranks(total, len(mine), engine.device)


def _log_samples(
    log: JsonlLog | None, step: int, my_rows: np.ndarray, my_loss: torch.Tensor, device: torch.device
) -> None:
    """Append the dataset rows every rank trained on in ``step``, and the step's loss, to the sample log.

    Rank 0 writes it directly (not through Ray's reports, the newest of which a restart can drop),
    so every step that finished is in it.
    """
    mine = torch.from_numpy(my_rows.astype(np.int64)).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    loss = _mean_over_ranks(my_loss, 1.0, device)
    if log is not None:
        log.append({"step": step, "world_size": len(gathered), "loss": loss, "rows": torch.cat(gathered).tolist()})


def train_loop(
    args: dict[str, Any],
    report: Callable[[dict], None] = ray.train.report,
    preemption_info: Callable[[], Any] = ray.train.get_preemption_info,
) -> None:
    """Ray Train worker entry point; also run directly, in one process, by single-worker sweep trials.

    ``args``: ``LoopArgs.to_dict()`` (train/loop_args.py).
    ``report`` and ``preemption_info`` default to Ray Train's; a Tune trial passes Tune's report.
    Where ``args`` names a local folder that every rank must see, a rank that does not ends the run first.
    """
    loop_args = parse(LoopArgs, args)
    unseen = loop_args.shared_folder and _unseen_by_a_rank(loop_args.shared_folder)
    if unseen:
        _end_early(unseen, report, loop_args.timeline)
        return
    Trainer(loop_args, report, preemption_info).run()


def _unseen_by_a_rank(folder: SharedFolder) -> StorageNotSharedError | None:
    """The same on every rank: the end of the run where a rank does not see the driver's file in ``folder``.
    Asked before anything is read or written there, which such a rank would do on a disk of its own."""
    answers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, (ray.util.get_node_ip_address(), os.path.exists(folder.file)))
    blind = sorted({address for address, sees in answers if not sees})
    if not blind:
        return None
    # At step 0: the run's own step is in the checkpoints that such a rank cannot read.
    return StorageNotSharedError(not_seen(folder.setting, folder.path, folder.driver_ip, blind), step=0)


def _end_early(stopped: RunStopped, report: Callable[[dict], None], timeline: str | None) -> None:
    """End this attempt with the report that names ``stopped``, as every rank does (``train/stops.py``)."""
    rank = dist.get_rank()
    if rank == 0:
        print(f"error: {stopped}", flush=True)
        if timeline:
            ray.get(ray.get_actor(timeline).record_stop.remote(stopped))  # before the driver asks
    report(stopped.report(time.time()))


def _held_weights(param: torch.nn.Parameter, rank: int) -> torch.Tensor:
    """The weights of ``param`` this rank holds: under ZeRO-3 its share (``ds_tensor``) without the padding that
    evens out the last shares, which DeepSpeed leaves uninitialized (any bits, NaN included); else ``param``."""
    share = getattr(param, "ds_tensor", None)
    if share is None:
        return param
    return share.narrow(0, 0, min(share.ds_numel, max(0, param.ds_numel - share.ds_numel * rank)))


@dataclass
class LossWindow:
    """Loss and step seconds summed since the last loss report (the loss on the device, read at the report)."""

    loss: float | torch.Tensor = 0.0
    steps: int = 0
    seconds: float = 0.0

    def add(self, loss: torch.Tensor, seconds: float) -> None:
        self.loss, self.steps, self.seconds = self.loss + loss, self.steps + 1, self.seconds + seconds

    def take(self, device: torch.device) -> tuple[float, float]:
        """Mean loss and step seconds over every rank's window (a collective), and a fresh window."""
        loss, seconds = (
            _mean_over_ranks(self.loss, self.steps, device),
            _mean_over_ranks(self.seconds, self.steps, device),
        )
        self.loss, self.steps, self.seconds = 0.0, 0, 0.0
        return loss, seconds


class Trainer:
    """One attempt of a run on this worker: it restores the newest complete checkpoint (converted if the
    world size changed), then trains optimizer steps ``[restored step, max_steps)`` and exports.

    After each step, ``StepPolicy`` decides evaluation, checkpoint and a wait for a restart from inputs that are
    the same on every rank (step counts, Ray's pre-emption notice, rank 0's broadcast view), so every rank
    enters the same collectives.
    """

    def __init__(self, args: LoopArgs, report: Callable[[dict], None], preemption_info: Callable[[], Any]):
        self.args, self._report_fn, self._preemption_info = args, report, preemption_info
        self.cfg = cfg = args.config
        self.run_uri = args.run_uri
        torch.set_num_threads(cfg.scaling.cpus_per_worker)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeline = ray.get_actor(args.timeline) if args.timeline and self.rank == 0 else None
        self.startup = Startup(entered=time.time())  # where a (re)start's seconds go, for the timeline's resize record
        waited = storage.wait_until_reachable([self.run_uri, args.data_path], cfg.run.storage_wait_s)
        if waited:
            self.startup.storage_wait_s = waited
        mark = time.time()
        self.tokenizer = load_tokenizer(args.data_path)
        self.train_rows = load_split(args.data_path, "train")
        self.val_rows = load_split(args.data_path, "val")[: cfg.run.eval_samples]
        self.order = SampleOrder(len(self.train_rows), cfg.run.seed)
        self.startup.data_s = time.time() - mark
        self.evaluation: Evaluation | None = None  # the latest; the export records the last step's
        latest = self._restore()  # sets self.engine, self.grad_accum and self.step

        self.policy = StepPolicy(cfg)
        self.first_step = self.step + 1
        self.loss_window = LossWindow()
        self.peak = peak_tflops(cfg.run.peak_tflops)
        # Every rank gathers the rows; rank 0 writes them, and makes them visible at each checkpoint.
        log = cfg.run.sample_log and self.rank == 0
        self.sample_log = JsonlLog(storage.join(self.run_uri, SAMPLE_LOG)) if log else None
        self.preemption_check_every = 1  # steps between pre-emption checks; set from the step time at each loss report
        # Whether reports may outpace Ray Train's controller: checked once, where the reports go to it.
        self.backlog_unchecked = report is ray.train.report
        self.steps_to_preemption_check = 1
        self.last_save = time.time()  # the time-based schedule starts with the attempt
        # Early-checkpoint requests up to this time are answered (by the checkpoint resumed from, if any).
        self.answered_until = latest.time if latest else self.startup.entered
        self.save_seconds = 0.0  # from the start of the latest checkpoint until it counted
        self.pending: checkpoint.PendingCheckpoint | None = None  # a checkpoint being written, at most one
        self.answered_before_pending = self.answered_until  # what a failure of the pending checkpoint restores
        self.failed_checkpoints = 0  # in a row
        self.stall_seconds = 0.0  # the training thread's time in the pending checkpoint
        self.profiler = StepProfiler(cfg.run.profile_steps, self.run_uri, self.rank, self.engine.device)

    def _restore(self) -> checkpoint.Checkpoint | None:
        """Build the engine and load the newest complete checkpoint into it; returns that checkpoint."""
        cfg, world = self.cfg, self.world
        latest = checkpoint.latest_complete(self.run_uri)
        universal = latest is not None and checkpoint.needs_universal(latest, world)
        mark = time.time()
        if universal:
            checkpoint.convert_to_universal(latest)
        self.startup.convert_s = time.time() - mark

        self.cfg = cfg = self._with_memory_plan(latest)
        mark = time.time()
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        model = GPT(cfg.model, cfg.deepspeed.activation_checkpointing)
        if cfg.model.init_from and latest is None:
            load_weights(model, cfg.model.init_from)
        self.exempt_norms_and_biases = checkpoint.exempts_norms_and_biases(latest)
        self.engine = build_engine(cfg, model, world, universal, self.exempt_norms_and_biases)
        if self.rank == 0 and compiles(cfg):
            print(f"compiling the model with torch.compile (run.compile: {cfg.run.compile})", flush=True)
        if cfg.checkpoint.async_write:
            self.engine.checkpoint_engine = BackgroundWriter()
        self.grad_accum = self.engine.gradient_accumulation_steps()
        self.startup.engine_s = time.time() - mark

        self.step = self.newest_checkpoint_step = 0
        if latest is not None:
            mark = time.time()
            checkpoint.load(self.engine, latest, universal)
            self.startup.load_s = time.time() - mark
            self.step = self.newest_checkpoint_step = latest.step
            if self.rank == 0:
                via = f", converted from {latest.world_size} workers" if universal else ""
                print(f"resumed from {latest.uri} at step {self.step} on {world} workers{via}", flush=True)
        else:
            self._report(self._evaluate())
        node_ids = [None] * world
        dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
        if self.timeline:
            resumed = CheckpointEvent(step=latest.step, reason=latest.reason, time=latest.time) if latest else None
            self.timeline.attempt_started.remote(world, node_ids, self.step, self.startup, resumed)
        return latest

    def _with_memory_plan(self, latest: checkpoint.Checkpoint | None) -> TrainConfig:
        """The config with its autos made values: ``deepspeed.zero_stage`` the checkpoint's when the run resumes
        (a run keeps its stage), and what ``plan_memory`` picks for the smallest worker's memory.

        A run keeps its stage because DeepSpeed 0.19.8's universal checkpoints do not restore across all of
        them: a ZeRO-2 checkpoint of 2 workers resumed at 1 worker with stage 1 gave the stage-2 losses, but
        failed to load with stage 0 (the torch optimizer's state) and with stage 3.
        """
        cfg = self.cfg
        if latest is not None and cfg.deepspeed.zero_stage == "auto":
            cfg = replace(cfg, deepspeed=replace(cfg.deepspeed, zero_stage=latest.zero_stage))
        if cfg.deepspeed.zero_stage != "auto" and cfg.optim.micro_batch_size != "auto":
            return cfg
        device = torch.device(get_accelerator().current_device_name())
        workers_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by Ray Train's torch backend
        capacity = torch.tensor([worker_capacity_bytes(device, workers_on_node)], dtype=torch.float64, device=device)
        # The smallest worker's memory, the same number on every rank: every rank makes the same choice.
        dist.all_reduce(capacity, op=dist.ReduceOp.MIN)
        plan = plan_memory(cfg, int(capacity.item()))
        if self.rank == 0:
            print(plan.describe(), flush=True)
        return replace(
            cfg,
            deepspeed=replace(cfg.deepspeed, zero_stage=plan.stage),
            optim=replace(cfg.optim, micro_batch_size=plan.micro_batch_size),
        )

    def run(self) -> None:
        """Train to ``optim.max_steps``, evaluate and export; or, where training diverges or a disk is full, end
        with a report that says so (``train/stops.py``: every rank, at the same step): raised, Ray Train would
        restart the run from its newest checkpoint, to stop alike."""
        try:
            self._train()
            self._evaluate_and_export()
        except RunStopped as stopped:
            _end_early(stopped, self._report_fn, self.args.timeline)

    def _train(self) -> None:
        try:
            while self.step < self.cfg.optim.max_steps:
                with self.profiler.step(self.step + 1):
                    my_rows, loss, seconds = self._train_step()
                self._after_step(my_rows, loss, seconds)
        finally:
            if self.sample_log:
                self.sample_log.close()

    def _evaluate_and_export(self) -> None:
        """The final evaluation, with the export: a sweep trial resumed after it finished reports it, not trains
        again. The last step's checkpoint counts by now, so a run that stops here resumes from it to export."""
        if self.evaluation is None or self.evaluation.step != self.step:  # resumed from the last step's checkpoint
            self._evaluate()
        provenance = ExportProvenance(
            **self.args.provenance.model_dump(), step=self.step, config=self.cfg.to_dict(), evaluation=self.evaluation
        )
        try:
            export_model(self.engine, self.cfg.model, self.tokenizer, export_uri(self.run_uri), provenance)
        except storage.DiskFullError as full:
            raise OutOfDiskError(
                f"out of disk space: {full}; the checkpoint of step {self.step} counts. "
                "Free space on that disk and run the same command again: it exports from that checkpoint",
                self.step,
            ) from full
        checkpoint.remove_staging(self.run_uri)

    def _train_step(self) -> tuple[np.ndarray, torch.Tensor, float]:
        """One optimizer step over this rank's share of the global batch: its rows, mean loss and seconds.

        The loss stays on the device (reading it would wait for the GPU every micro-step); the loss window
        reads it when it reports. On a GPU the seconds are the host's, which the queue of launched work
        keeps within a step of the device's; their sum over a report window is the window's time.
        """
        optim, engine, step = self.cfg.optim, self.engine, self.step
        start = time.time()
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, optim)
        my_rows, step_loss = [], torch.zeros((), device=engine.device)
        for micro_step in range(self.grad_accum):
            samples = micro_batch_samples(
                step, micro_step, self.rank, self.world, optim.global_batch_size, optim.micro_batch_size
            )
            rows = self.order.rows(samples)
            my_rows.append(rows)
            if self.cfg.model.dropout:  # the step's only random draws
                # Masks depend on (seed, step, rank) only, so a resumed run draws the same ones. Not seeded
                # without dropout: on a machine without CUDA each call queues a CUDA seeding with its stack
                # trace (0.2 ms a call from a Ray worker's deep stack).
                torch.manual_seed(hash((self.cfg.run.seed, step, micro_step, self.rank)) % 2**63)
            # Named phases for run.profile_steps' traces (a no-op when not profiling).
            with record_function("forward"):
                _, loss = engine(*_to_batch(self.train_rows[rows], engine.device))
            with record_function("backward"):
                engine.backward(loss)
            with record_function("optimizer_step"):
                try:
                    engine.step()
                except Exception as exc:  # every rank at once: the overflow it found is all-reduced
                    if LOSS_SCALE_AT_MINIMUM not in str(exc):
                        raise
                    overflowed = f"the fp16 gradients of step {step + 1} overflow at the lowest loss scale"
                    raise self._diverged(overflowed) from None
            step_loss += loss.detach() / self.grad_accum
        self.step += 1
        return np.concatenate(my_rows), step_loss, time.time() - start

    def _after_step(self, my_rows: np.ndarray, loss: torch.Tensor, seconds: float) -> None:
        """Record the step, then evaluate, checkpoint and report as decided for it."""
        cfg, step = self.cfg, self.step
        self.loss_window.add(loss, seconds)
        if self.timeline:
            self.timeline.step_done.remote(step, seconds, time.time())
        if cfg.run.sample_log:
            _log_samples(self.sample_log, step, my_rows, loss, self.engine.device)

        metrics: dict[str, Any] = {}
        if step % cfg.run.log_every == 0 or step == cfg.optim.max_steps or step == self.first_step:
            metrics = self._training_metrics()
        resize = ray.get(self.timeline.latest_resize.remote()) if step == self.first_step and self.timeline else None
        if resize:
            print(describe_resize(resize), flush=True)
            metrics.update({f"resize_{key}": value for key, value in resize.model_dump(exclude_none=True).items()})
        if self.pending:  # the same steps on every rank, as the checkpoint was started at the same step
            metrics.update(self._settle_checkpoint(wait=False))
        notice, view = self._notice_and_view(seconds)
        decision = self.policy.decide(step, notice, view)
        if decision.evaluate:
            metrics.update(self._evaluate())
        if decision.checkpoint:
            metrics.update(self._checkpoint(decision.checkpoint))
        if decision.restart_wait_s and self.pending:  # the restart resumes from the newest checkpoint that counts
            metrics.update(self._settle_checkpoint(wait=True))
        if metrics:
            self._report(metrics)
        if decision.restart_wait_s and self.failed_checkpoints == 0:
            self._await_restart(decision.restart_wait_s, view.restart_requested)

    def _await_restart(self, seconds: float, restart_request: float) -> None:
        """Idle until Ray Train restarts the run from the checkpoint just counted, tearing this worker down: steps
        trained meanwhile would be redone, and one under way when Ray destroys the process group fails with a
        traceback that reads like a crash. Rank 0 tells the scaling policy, if it asked (at ``restart_request``).
        Without a restart within ``seconds``, training goes on."""
        if self.rank == 0:
            if restart_request:
                record_waiting_for_restart(self.run_uri, restart_request)
            print(f"step {self.step} | checkpointed for a restart: waiting for it", flush=True)
        time.sleep(seconds)
        if self.rank == 0:
            print(f"warning: no restart came in {seconds:.0f} s; training goes on", flush=True)

    def _training_metrics(self) -> dict[str, Any]:
        cfg, world = self.cfg, self.world
        # The same on every rank (an all-reduced time), so all ranks join the same checks.
        loss, step_time = self.loss_window.take(self.engine.device)
        if not math.isfinite(loss):
            raise self._diverged(f"the training loss up to step {self.step} is {loss}")
        tokens_per_s = cfg.optim.global_batch_size * cfg.model.seq_len / step_time
        self.preemption_check_every = max(1, round(cfg.checkpoint.preemption_check_s / step_time))
        if self.rank == 0 and self.backlog_unchecked and self.step > self.first_step:  # past the first, slow, step
            self.backlog_unchecked = False
            poll = os.environ.get(HEALTH_CHECK_INTERVAL_ENV, cfg.scaling.health_check_interval_s)
            warning = report_backlog_warning(step_time, cfg.run.log_every, float(poll))
            if warning:
                print(warning, flush=True)
        peak = self.peak
        metrics = {
            "step": self.step,
            "loss": loss,
            "lr": lr_at(self.step - 1, cfg.optim),
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "mfu": flops_per_token(cfg.model) * tokens_per_s / (peak * 1e12 * world) if peak else None,
            "memory_gb": memory_gb(),
            "samples_seen": self.step * cfg.optim.global_batch_size,
            "world_size": world,
        }
        if cfg.deepspeed.precision == "fp16":  # a step whose gradients overflow is skipped, and the scale halved
            metrics["loss_scale"] = float(self.engine.optimizer.loss_scale)
            metrics["skipped_steps"] = self.engine.skipped_steps  # in the run, restored with its checkpoints
        return metrics

    def _notice_and_view(self, step_seconds: float) -> tuple[Notice | None, Rank0View | None]:
        """Every few seconds' worth of steps (the same steps on every rank, which the agreement of Ray's
        notice across workers needs): Ray's pre-emption notice (a round trip) and rank 0's view; rank 0's
        view on the other steps only where the decision needs it (a pre-emption deadline nears)."""
        self.steps_to_preemption_check -= 1
        due = self.steps_to_preemption_check <= 0
        if due:
            self.steps_to_preemption_check = self.preemption_check_every
        notice = None
        if due and not self.policy.notice_seen:
            info = self._preemption_info()
            if info is not None:
                notice = Notice(deadline=info.deadline_ms / 1000 if info.deadline_ms else None)
        if not (due or self.policy.needs_view()):
            return notice, None
        requested = restart = 0.0
        if due and self.rank == 0:
            requested, restart = latest_checkpoint_request(self.run_uri), latest_restart_request(self.run_uri)
            if restart < self.startup.entered:  # asked of an earlier attempt: this attempt is its restart
                restart = 0.0
        mine = Rank0View(
            time.time(), self.last_save, step_seconds, self.save_seconds, requested, self.answered_until, restart
        )
        return notice, share_rank0_view(mine, self.engine.device)

    def _checkpoint(self, reason: str) -> dict[str, Any]:
        """Start a checkpoint of this step (every rank); returns its metrics if it already counts.

        Its files are written in the background (``checkpoint.async_write``) unless a pre-emption is
        near or the run ends: then it counts before training goes on.
        """
        cfg, step = self.cfg, self.step
        if not self._weights_finite():
            raise self._diverged(f"the weights after step {step} are not finite")
        metrics = self._settle_checkpoint(wait=True) if self.pending else {}  # one in flight at a time
        start = time.time()
        record = checkpoint.RunRecord(
            world_size=self.world,
            global_batch_size=cfg.optim.global_batch_size,
            samples_seen=step * cfg.optim.global_batch_size,
            reason=reason,
            config=cfg.to_dict(),
            tokenizer=self.tokenizer.spec(),
            **self.args.provenance.model_dump(),  # the dataset's and the code's: what an export of it names
            norms_and_biases_undecayed=self.exempt_norms_and_biases,
        )
        self.pending = checkpoint.begin_save(self.engine, self.run_uri, step, record)
        self.stall_seconds = time.time() - start
        self.answered_before_pending = self.answered_until
        self.last_save = self.answered_until = start  # requests made before it are answered by it
        if self.timeline and reason == "preemption":
            self.timeline.preemption_notice.remote()
        if reason in ("preemption", "deadline") or step == cfg.optim.max_steps or not cfg.checkpoint.async_write:
            metrics.update(self._settle_checkpoint(wait=True))
        return metrics

    def _settle_checkpoint(self, wait: bool) -> dict[str, Any]:
        """Make the pending checkpoint count once every rank has written it (waiting for that if ``wait``);
        returns its metrics then, else nothing."""
        start, pending = time.time(), self.pending
        try:
            counts = checkpoint.written(pending, wait)
            if counts:
                checkpoint.finish_save(pending, self.cfg.checkpoint.keep_last, self.tokenizer)
        except checkpoint.CheckpointWriteError as failure:
            self.pending = None
            return self._checkpoint_failed(pending, failure)
        finally:
            self.stall_seconds += time.time() - start
        if not counts:
            return {}
        self.pending = None
        self.failed_checkpoints = 0
        self.newest_checkpoint_step = pending.step
        self.save_seconds = time.time() - pending.started
        if self.sample_log:
            self.sample_log.flush()
        if self.timeline:
            self.timeline.checkpoint_saved.remote(pending.step, pending.record.reason)
        return {
            "step": self.step,
            "checkpoint": pending.uri,
            "checkpoint_s": self.save_seconds,
            "checkpoint_stall_s": self.stall_seconds,
        }

    def _weights_finite(self) -> bool:
        """Whether every rank's weights are finite (a collective)."""
        weights = [_held_weights(p, self.rank) for p in self.engine.module.parameters()]
        finite = torch.stack([torch.isfinite(w).all() for w in weights]).all().to(torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def _newest_checkpoint(self) -> str:
        return f"step {self.newest_checkpoint_step}" if self.newest_checkpoint_step else "none"

    def _diverged(self, what: str) -> DivergedError:
        """The run stops before a checkpoint could keep non-finite weights: its newest checkpoints stay good."""
        return DivergedError(
            f"training diverged: {what}; stopped before a checkpoint kept it (newest checkpoint: "
            f"{self._newest_checkpoint()}). "
            "Lower optim.lr or raise optim.warmup_steps and run again: it resumes from that checkpoint",
            self.step,
        )

    def _out_of_disk(self, pending: checkpoint.PendingCheckpoint, failure: Exception) -> OutOfDiskError:
        """A checkpoint that failed on a full disk ends the run: it stays full for a restart."""
        tolerated = self.cfg.checkpoint.failures_tolerated
        why = f"{self.failed_checkpoints} failed in a row with checkpoint.failures_tolerated: {tolerated}"
        if pending.step == self.cfg.optim.max_steps:
            why = "the run's last checkpoint"
        return OutOfDiskError(
            f"out of disk space: {failure}; stopped at step {self.step} ({why}; newest checkpoint: "
            f"{self._newest_checkpoint()}). Free space on that disk and run the same command again: it resumes from "
            "that checkpoint",
            self.step,
        )

    def _checkpoint_failed(
        self, pending: checkpoint.PendingCheckpoint, failure: checkpoint.CheckpointWriteError
    ) -> dict[str, Any]:
        """Train on past a checkpoint that could not be written (storage may be back for the next one), unless it
        was the run's last or ``checkpoint.failures_tolerated`` failed in a row before it: then raise (every rank)."""
        self.failed_checkpoints += 1
        tolerated = self.cfg.checkpoint.failures_tolerated
        if pending.step == self.cfg.optim.max_steps or self.failed_checkpoints > tolerated:
            if failure.full_disk:
                raise self._out_of_disk(pending, failure) from failure
            raise failure
        self.answered_until = self.answered_before_pending  # an early-checkpoint request it answered is asked again
        if self.rank == 0:
            print(
                f"warning: {failure}; training goes on (failed in a row: {self.failed_checkpoints} of "
                f"{tolerated} tolerated by checkpoint.failures_tolerated)",
                flush=True,
            )
        return {"step": self.step, "checkpoint_failed": pending.uri}

    def _evaluate(self) -> dict[str, float]:
        """The step and its validation metrics, kept as the run's latest evaluation (a collective)."""
        val_loss = evaluate(self.engine, self.val_rows, self.cfg.optim.micro_batch_size)
        if not math.isfinite(val_loss):
            raise self._diverged(f"the validation loss after step {self.step} is {val_loss}")
        self.evaluation = Evaluation.of_loss(self.step, val_loss, self.args.tokens_per_byte)
        return self.evaluation.model_dump()

    def _report(self, metrics: dict[str, Any]) -> None:
        """Print a progress line from rank 0 and report (every rank reports, in step)."""
        metrics["time"] = time.time()
        if self.rank == 0:
            print(format_progress(metrics, self.cfg.optim.max_steps), flush=True)
        self._report_fn(metrics)
