"""Choosing the next token from a sequence's logits: penalties, then greedy or temperature and nucleus (top-p).

Each request samples with its own ``torch.Generator`` on the logits' device, seeded from the
request's ``seed``, so a seeded request draws the same tokens whatever else is in the batch.
Every value the API accepts is safe here: a temperature too small to divide by decodes greedily,
and the most likely token always survives top-p, so no request can make an invalid distribution.
"""

from dataclasses import dataclass

import torch

# Below this temperature decoding is greedy: dividing logits by ~0 overflows to inf and NaN,
# and the sampled distribution is already all on the most likely token.
GREEDY_BELOW = 1e-3


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties: ``logits - frequency * count - presence * (count > 0)`` over the tokens generated so far."""
    if not presence and not frequency:
        return logits
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token from ``logits`` (vocab,); a temperature below ``GREEDY_BELOW`` means greedy.

    The token stays on the logits' device (a 0-d tensor), so that a batch's tokens reach the host in one copy.
    """
    if temperature < GREEDY_BELOW:
        return torch.argmax(logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of most likely tokens whose probability reaches top_p, never an empty one.
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position and their logprobs


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The model's log-probability of ``token`` under ``logits`` (vocab,), and the ``top`` most likely."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = torch.topk(logprobs, top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
    return TokenLogprob(token, float(logprobs[token]), list(zip(indices.tolist(), values.tolist(), strict=True)))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
