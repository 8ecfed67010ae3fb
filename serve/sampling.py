"""Choosing the next token from a sequence's logits: greedy, or temperature and nucleus (top-p).

Each request samples with its own ``torch.Generator``, seeded from the request's ``seed``, so a
seeded request draws the same tokens whatever else is in the batch.
"""

import torch


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token from ``logits`` (vocab,); temperature 0 means greedy."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of most likely tokens whose probability reaches top_p.
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
