"""The training forward every drafter kind shares: its hidden states, then full logits.

A kind's chunked losses project the hidden states to the vocabulary a few rows at a time, so
[.., V] never exists at once; its reference loss reads full logits. A DeepSpeed engine only
calls `forward`, so both go through it: `return_hidden` stops before the projection.
"""

from __future__ import annotations

from typing import Any

import torch


class TrainingForward:
    """`forward` = the kind's `forward_hidden`, then (unless `return_hidden`) its
    `full_logits`. The class using it defines both."""

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
        **options: Any,
    ) -> Any:
        """The training forward of one micro-batch: `full_logits` (the reference loss's input)
        or, with `return_hidden`, the `forward_hidden` result (the chunked losses' input).
        `options`: the kind's own arguments of `forward_hidden`."""
        feats = self.forward_hidden(
            input_ids, target_hidden_states, loss_mask, target_last_hidden_states, **options
        )
        return feats if return_hidden else self.full_logits(feats)
