"""Right-padded batches of the feature contract (padding: pad id, loss_mask 0, zero features)."""

from __future__ import annotations

import torch

FEATURE_KEYS = ("target_hidden_states", "target_last_hidden_states")


class Collator:
    """List of samples (``input_ids [L]``, ``loss_mask [L]``, optional features ``[L, D]``) →
    batch dict with ``input_ids``, ``loss_mask``, ``attention_mask`` (long, ``[B, S]``),
    ``sample_ids [B]`` and the features ``[B, S, D]`` when the samples carry them."""

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict]) -> dict:
        bsz, seq = len(samples), max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((bsz, seq), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(bsz, seq, dtype=torch.long)
        attention_mask = torch.zeros(bsz, seq, dtype=torch.long)
        batch = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "attention_mask": attention_mask,
            "sample_ids": torch.tensor([int(s["sample_id"]) for s in samples]),
        }
        for key in FEATURE_KEYS:
            if key in samples[0]:
                f = samples[0][key]
                batch[key] = f.new_zeros(bsz, seq, f.shape[-1])
        for b, s in enumerate(samples):
            n = len(s["input_ids"])
            input_ids[b, :n] = s["input_ids"]
            loss_mask[b, :n] = s["loss_mask"]
            attention_mask[b, :n] = 1
            for key in FEATURE_KEYS:
                if key in batch:
                    batch[key][b, :n] = s[key]
        return batch


def split_batch(batch: dict) -> list[dict]:
    """Inverse of the collator for feature batches: per-sample unpadded tensors on the CPU."""
    out = []
    for b, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
        s = {
            "sample_id": int(batch["sample_ids"][b]),
            "input_ids": batch["input_ids"][b, :n].cpu(),
            "loss_mask": batch["loss_mask"][b, :n].cpu(),
        }
        for key in FEATURE_KEYS:
            s[key] = batch[key][b, :n].cpu()
        out.append(s)
    return out
