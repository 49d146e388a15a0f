"""Drawing a draft token from logits, the same way in every drafter kind."""

from __future__ import annotations

import torch


def sample_from_logits(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """[..., V] -> [...]: argmax at T = 0, else a draw from softmax(logits / T)."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
