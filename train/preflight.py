"""Checks on the driver, before Ray starts, of everything a worker would otherwise trip on.

A mistake found by a worker is retried ``scaling.max_failures`` times and then ends in a traceback;
found here it is one ConfigError line naming the key.
"""

import json
import os
from pathlib import Path

import torch

from train import storage
from train.config import TrainConfig
from train.data import dataset_path, default_source, list_source, refuse_foreign
from train.ds_config import build_ds_config
from train.manifest import Manifest, check_shards, load_manifest
from train.schema import ConfigError, error_reason, replace
from train.tokenizer import load_tokenizer


def cluster_address(cfg: TrainConfig) -> str:
    """The Ray cluster to join: ``run.ray_address``, else a Ray job's cluster (RAY_ADDRESS); "" = a private Ray.

    An http(s) RAY_ADDRESS is a job API URL (for the job CLI), not a cluster to join.
    """
    job_cluster = os.environ.get("RAY_ADDRESS", "")
    return cfg.run.ray_address or ("" if job_cluster.startswith(("http://", "https://")) else job_cluster)


def check_before_ray(cfg: TrainConfig) -> None:
    """Raise ConfigError for the first setting that would fail training once Ray has started it.

    A run of ``run.name`` also calls ``check_resume`` (a sweep's trials are runs of their own names).
    """
    check_gpus(cfg)
    check_deepspeed_file(cfg)
    check_storage(cfg.run.storage_path, "run.storage_path")
    check_dataset(cfg)


def check_deepspeed_file(cfg: TrainConfig) -> None:
    """``deepspeed.config_file`` parses, and its merge keeps the batch consistent at every world size."""
    path = cfg.deepspeed.config_file
    if not path:
        return
    try:
        with open(path) as f:
            override = json.load(f)
    except OSError as exc:
        raise ConfigError(f"deepspeed.config_file: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"deepspeed.config_file: {path} is not valid JSON: {exc}") from None
    if not isinstance(override, dict):
        raise ConfigError(f"deepspeed.config_file: {path} must hold a JSON object")
    # Autos are chosen on the workers; the batch keys' consistency depends on neither.
    cfg = replace(
        cfg,
        deepspeed=replace(
            cfg.deepspeed, zero_stage=0 if cfg.deepspeed.zero_stage == "auto" else cfg.deepspeed.zero_stage
        ),
        optim=replace(cfg.optim, micro_batch_size=cfg.optim.smallest_micro_batch),
    )
    for world in range(cfg.scaling.min_workers, cfg.scaling.max_workers + 1):
        merged = build_ds_config(cfg, world)
        per_step = merged["train_micro_batch_size_per_gpu"] * merged["gradient_accumulation_steps"] * world
        if merged["train_batch_size"] != per_step:
            raise ConfigError(
                f"deepspeed.config_file: {path} sets the batch (train_batch_size, train_micro_batch_size_per_gpu, "
                f"gradient_accumulation_steps) inconsistently for {world} workers; leave them out and set "
                "optim.global_batch_size and optim.micro_batch_size"
            )


def check_storage(uri: str, key: str) -> None:
    """``uri`` can be reached with the credentials at hand; a local directory can be written (nothing is created)."""
    try:
        fs, path = storage.resolve(uri)
        if storage.is_local(uri):
            existing = Path(storage.nearest_existing(path))
            if not existing.is_dir() or not os.access(existing, os.W_OK):
                raise PermissionError(f"{existing} is not a directory this user can write")
        else:
            fs.get_file_info(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot use {uri}: {error_reason(exc)}") from None


def check_dataset(cfg: TrainConfig) -> None:
    """A prepared dataset matches the model and its shards are whole; otherwise its source exists and its directory
    is ours to write."""
    path = dataset_path(cfg)
    manifest = load_manifest(path)
    if manifest is not None:
        check_dataset_matches(cfg, path, manifest)
        check_shards(path, manifest)
        return
    refuse_foreign(path)
    list_source(cfg.data.source or default_source())


def check_dataset_matches(cfg: TrainConfig, path: str, manifest: Manifest) -> None:
    """The prepared dataset at ``path`` has the model's sequence length, tokenizer and at most its vocabulary."""
    data = cfg.data
    if manifest.seq_len != cfg.model.seq_len:
        raise ConfigError(
            f"data.path {path} holds sequences of {manifest.seq_len} tokens, model.seq_len is {cfg.model.seq_len}"
        )
    tokenizer = manifest.tokenizer
    if data.tokenizer in ("byte", "bpe"):
        same_tokenizer = tokenizer.type == data.tokenizer
    else:
        same_tokenizer = tokenizer.sha256 == load_tokenizer(data.tokenizer).spec().sha256
    if not same_tokenizer:
        raise ConfigError(f"data.path {path} was tokenized with another tokenizer than data.tokenizer {data.tokenizer}")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.path {path} was tokenized with {tokenizer.vocab_size} tokens, "
            f"model.vocab_size is {cfg.model.vocab_size}"
        )


# What a run cannot change when it resumes: the checkpoint's tensors, its ZeRO layout and its sample order.
RESUME_MUST_MATCH = (
    "model.vocab_size",
    "model.seq_len",
    "model.n_layer",
    "model.n_head",
    "model.d_model",
    "optim.global_batch_size",
    "deepspeed.zero_stage",
    "run.seed",
)
# Where a run is and runs, not what it trains: a resume may spell or place them otherwise without a note.
RESUME_PLACE = ("run.name", "run.storage_path", "run.ray_address")


def _settings(config: dict) -> dict[str, object]:
    """A resolved config's settings by ``section.key``."""
    return {f"{section}.{key}": value for section, fields in config.items() for key, value in fields.items()}


def check_resume(cfg: TrainConfig) -> list[str]:
    """A run that resumes (its name has a checkpoint) keeps the settings and the dataset the checkpoint needs,
    and its drivers' record of it is one this version continues.

    Returns the settings that the steps it has left train with otherwise (``key old -> new``), for the driver to
    show: a longer ``optim.max_steps``, say, stretches the learning-rate schedule, which rises again from there.
    """
    run_uri = storage.join(cfg.run.storage_path, cfg.run.name)
    if not storage.exists(run_uri):
        return []
    from train import checkpoint  # imports DeepSpeed: only for a run that may resume
    from train.timeline import read_saved_state, read_summary

    read_saved_state(run_uri)
    read_summary(run_uri)

    latest = checkpoint.latest_complete(run_uri)
    if latest is None:
        return []
    saved, current = _settings(latest.config), _settings(cfg.to_dict())
    # A checkpoint records what its run's autos became; an auto here picks again (and says what) as the run starts,
    # but an auto stage keeps the checkpoint's.
    differ = {
        key: f"{key} {saved[key]!r} -> {current[key]!r}"
        for key in saved.keys() & current.keys()  # a setting newer than the checkpoint's version is no change
        if saved[key] != current[key] and current[key] != "auto"
    }
    refused = [differ[key] for key in RESUME_MUST_MATCH if key in differ]
    data_path = dataset_path(cfg)
    manifest = load_manifest(data_path)
    if manifest is not None and manifest.sha256 != latest.data_manifest_sha256:
        refused.append(f"the dataset ({data_path} is not the one it trained on)")
    if refused:
        raise ConfigError(
            f"run.name: {cfg.run.name!r} resumes from {latest.uri}, which cannot take {'; '.join(refused)}; "
            "give a new run.name to start afresh"
        )
    if latest.step >= cfg.optim.max_steps:  # nothing left to train with them
        return []
    return [line for key, line in sorted(differ.items()) if key not in RESUME_PLACE]


def check_gpus(cfg: TrainConfig) -> None:
    """A private Ray on this machine can never offer GPUs it does not have (no autoscaler adds any)."""
    if not cfg.scaling.use_gpu or cluster_address(cfg):
        return
    gpus = torch.cuda.device_count()
    if gpus < cfg.scaling.min_workers:
        have = f"only {gpus} GPUs" if gpus else "no GPU"
        raise ConfigError(
            f"scaling.use_gpu: {cfg.scaling.min_workers} GPU workers, but this machine has {have} and a local Ray "
            "cannot add any; set scaling.use_gpu=false (and a CPU-sized recipe such as tiny), fewer "
            "scaling.num_workers, or run on a cluster (run.ray_address, or python -m cluster submit)"
        )
