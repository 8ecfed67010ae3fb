import deepspeed
import pytest
import torch

from train.config import load_config
from train.ds_config import build_engine
from train.model import GPT, flops_per_token
from train.model_config import ModelConfig

pytestmark = pytest.mark.unit

CFG = ModelConfig(vocab_size=257, seq_len=32, n_layer=2, n_head=4, d_model=64)


def test_shapes_and_loss():
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens, targets = torch.randint(0, 257, (2, 3, 32))
    logits, loss = model(tokens, targets)
    assert logits.shape == (3, 32, 257)
    # An untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.5


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    tokens = torch.randint(0, 257, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 257
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :20], b[0, :20])
    assert not torch.allclose(a[0, 20:], b[0, 20:])


def test_output_projection_is_tied_to_embedding():
    model = GPT(CFG)
    names = set(model.state_dict())
    assert "tok_emb.weight" in names and not any("lm_head" in n for n in names)


def test_context_length_is_enforced():
    model = GPT(CFG)
    try:
        model(torch.zeros(1, 33, dtype=torch.long))
    except ValueError as exc:
        assert "exceeds the context length 32" in str(exc)
    else:
        raise AssertionError("a too-long sequence was accepted")


def test_flops_per_token_is_about_six_per_parameter():
    model = GPT(CFG)
    ratio = flops_per_token(CFG) / model.num_params()
    assert 6 <= ratio < 8


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpointing_trains_the_same_numbers_through_deepspeed(process_group, stage):
    """Recomputing each block in the backward gives the same losses and weights, dropout included (the recompute
    replays the forward's random state) and at ZeRO-3, whose weights are gathered again for the recompute."""
    trained = []
    for checkpointing in (False, True):
        cfg = load_config("tiny", [f"deepspeed.zero_stage={stage}", "model.dropout=0.1"])
        torch.manual_seed(0)
        engine = build_engine(cfg, GPT(cfg.model, checkpoint_activations=checkpointing), world_size=1)
        data = torch.Generator().manual_seed(1)
        losses = []
        for step in range(3):
            torch.manual_seed(step)  # the dropout masks of each step
            for _ in range(engine.gradient_accumulation_steps()):
                tokens = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len + 1), generator=data)
                _, loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            trained.append((losses, [p.detach().clone() for p in engine.module.parameters()]))
    (plain_losses, plain_weights), (recomputed_losses, recomputed_weights) = trained
    assert recomputed_losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, recomputed_weights, strict=True))
