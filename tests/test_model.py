import pytest
import torch

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
