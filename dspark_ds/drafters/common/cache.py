"""The drafter's key / value cache of inference: what every kind's decoding rounds extend and
read (drafters/common/rounds.py)."""

from __future__ import annotations

import torch


class DraftKVCache:
    """Per-layer keys / values of the context features already projected (inference only).

    Only verified context stays between rounds (a chain drafter crops its draft keys off
    again). `last_hidden` [B, H] is the drafter's state at each row's last verified position,
    for a kind that drafts on from it (Eagle3); the decoding loops move it with the rows.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.last_hidden: torch.Tensor | None = None

    @property
    def seq_length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[-2])

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, heads, L_new, D]; returns the full cached keys / values."""
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=-2)
            v = torch.cat([self.values[layer_idx], v], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]
