"""Validation loss is the mean over every validation row, at any world size, however few the rows; the record
of an evaluation."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.conftest import on_ranks
from train.evaluation import Evaluation
from train.loop import evaluate
from train.model import GPT
from train.model_config import ModelConfig

pytestmark = pytest.mark.unit

MODEL = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0)
MICRO_BATCH = 4


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(MODEL)
    model.device = torch.device("cpu")  # what evaluate reads of a DeepSpeed engine, beside calling it
    return model


def _rows(count: int) -> np.ndarray:
    return np.random.default_rng(count).integers(0, MODEL.vocab_size, (count, MODEL.seq_len + 1), dtype=np.uint16)


COUNTS = (21, 5)  # 21: no world size's whole micro-batches; 5: fewer than 3 workers x 4


def _evaluate_on_rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    for count in COUNTS:
        results[rank, count] = evaluate(_model(), _rows(count), MICRO_BATCH)
    dist.destroy_process_group()


def test_the_validation_loss_is_every_rows_mean_at_any_world_size(process_group):
    losses = {1: {count: [evaluate(_model(), _rows(count), MICRO_BATCH)] for count in COUNTS}}
    for world in (2, 3):
        results = on_ranks(_evaluate_on_rank, world)
        losses[world] = {count: [results[rank, count] for rank in range(world)] for count in COUNTS}
    for count in COUNTS:
        tokens = torch.from_numpy(_rows(count).astype(np.int64))
        with torch.no_grad():
            logits = _model()(tokens[:, :-1])
        every_row = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
        for world, by_count in losses.items():
            assert by_count[count] == [by_count[count][0]] * world  # every rank has the same answer
            assert by_count[count][0] == pytest.approx(every_row, rel=1e-6), f"{count} rows, {world} workers"


def test_an_evaluation_tells_perplexity_and_bits_per_byte():
    # 2 bits per token at 0.5 tokens per byte is 1 bit per byte.
    evaluation = Evaluation.of_loss(step=7, val_loss=math.log(4), tokens_per_byte=0.5)
    assert evaluation.val_perplexity == pytest.approx(4) and evaluation.val_bpb == pytest.approx(1)


def test_a_report_holds_an_evaluation_only_where_its_step_evaluated():
    evaluation = Evaluation.of_loss(step=10, val_loss=2.5, tokens_per_byte=0.3)
    assert Evaluation.in_report({**evaluation.model_dump(), "loss": 2.4, "lr": 1e-3}) == evaluation
    assert Evaluation.in_report({"step": 11, "loss": 2.4, "lr": 1e-3, "time": 1.0}) is None
