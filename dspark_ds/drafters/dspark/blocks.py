"""DSpark's anchor blocks: the anchors sampled per sequence, each block's input ids, positions,
labels and supervised prefix (docs/algorithm.md#anchors), and what a training forward returns.
They do not depend on the target family.

Shape legend: B batch, S sequence length, A anchors (blocks) per sample, G = γ block size,
V vocab, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DSparkForwardOutput:
    """Everything the loss needs from one training forward."""

    draft_logits: torch.Tensor  # [B, A, G, V], Markov bias included
    target_ids: torch.Tensor  # [B, A, G] token each slot must predict
    eval_mask: torch.Tensor  # [B, A, G] bool, a contiguous valid prefix per block
    block_keep_mask: torch.Tensor  # [B, A] bool, False for padding (dummy) blocks
    confidence_pred: torch.Tensor | None = None  # [B, A, G] fp32 logits
    aligned_target_logits: torch.Tensor | None = None  # [B, A, G, V]
    anchor_positions: torch.Tensor | None = None  # [B, A] the anchors used
    label_in_vocab: torch.Tensor | None = None  # [B, A, G] bool; None: no draft vocabulary


def build_anchor_candidate_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S-1] bool: position p may anchor a block when p and p+1 are both supervised."""
    m = loss_mask > 0.5
    return m[:, :-1] & m[:, 1:]


def sample_anchor_positions(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly samples up to `num_anchors` candidates per sample, sorted ascending.

    `keys` [B, S-1]: the uniform random draws to rank the candidates by (default: drawn here from
    `generator`). Returns `anchor_positions [B, A]` (long, 0 for padding) and
    `block_keep_mask [B, A]`.
    """
    bsz, seq_len = loss_mask.shape
    device = loss_mask.device
    valid = build_anchor_candidate_mask(loss_mask)
    num_candidates = valid.shape[1]
    if num_candidates == 0:
        zeros = torch.zeros(bsz, num_anchors, dtype=torch.long, device=device)
        return zeros, zeros.bool()
    # Random keys, invalid candidates pushed to the end; the first A of the shuffle win.
    if keys is None:
        keys = torch.rand(bsz, num_candidates, device=device, generator=generator)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))
    order = keys.argsort(dim=1)
    positions = torch.arange(num_candidates, device=device).expand(bsz, -1)
    positions = torch.where(valid, positions, torch.full_like(positions, seq_len + 1))
    picked = positions.gather(1, order)
    if num_candidates < num_anchors:
        pad = torch.full((bsz, num_anchors - num_candidates), seq_len + 1, device=device)
        picked = torch.cat([picked, pad.to(picked.dtype)], dim=1)
    anchors = picked[:, :num_anchors].sort(dim=1).values
    counts = valid.sum(dim=1).clamp(max=num_anchors)
    keep = torch.arange(num_anchors, device=device).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def build_noise_input_ids(
    input_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_keep_mask: torch.Tensor,
    *,
    mask_token_id: int,
    block_size: int,
) -> torch.Tensor:
    """[B, A*G]: each block is [x[anchor], MASK, ..., MASK]; dummy blocks are all MASK."""
    bsz, num_blocks = anchor_positions.shape
    ids = torch.full(
        (bsz, num_blocks, block_size), mask_token_id, dtype=torch.long, device=input_ids.device
    )
    anchor_tokens = input_ids.gather(1, anchor_positions)
    ids[:, :, 0] = torch.where(
        block_keep_mask, anchor_tokens, torch.full_like(anchor_tokens, mask_token_id)
    )
    return ids.view(bsz, num_blocks * block_size)


def create_position_ids(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A*G]: slot j of the block at anchor p sits at position p + j."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return (anchor_positions.unsqueeze(-1) + offsets).flatten(1)


def build_label_indices(
    anchor_positions: torch.Tensor, block_keep_mask: torch.Tensor, *, block_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot j predicts token p + j + 1. Returns (label_indices, safe_label_indices) [B, A, G]."""
    offsets = torch.arange(1, block_size + 1, device=anchor_positions.device)
    label = anchor_positions.unsqueeze(-1) + offsets
    safe = label.clamp(max=seq_len - 1)
    safe = torch.where(block_keep_mask.unsqueeze(-1), safe, torch.zeros_like(safe))
    return label, safe


def build_eval_mask(
    *,
    seq_len: int,
    loss_mask: torch.Tensor,
    label_indices: torch.Tensor,
    safe_label_indices: torch.Tensor,
    block_keep_mask: torch.Tensor,
) -> torch.Tensor:
    """[B, A, G] bool: label inside the sequence and supervised, as a contiguous prefix."""
    label_supervised = loss_mask.gather(1, safe_label_indices.flatten(1)).view_as(label_indices)
    valid = (label_indices < seq_len) & (label_supervised > 0.5) & block_keep_mask.unsqueeze(-1)
    # NOTE: cumprod in int32; bf16 cannot represent the running product reliably.
    return valid.to(torch.int32).cumprod(dim=-1).bool()


def block_labels(
    loss_mask: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_keep_mask: torch.Tensor,
    *,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe_label_indices, eval_mask) [B, A, G] of the anchors' blocks: where each slot's label
    is read (`build_label_indices`) and which slots are supervised (`build_eval_mask`)."""
    seq_len = loss_mask.shape[1]
    label_idx, safe_idx = build_label_indices(
        anchor_positions, block_keep_mask, block_size=block_size, seq_len=seq_len
    )
    eval_mask = build_eval_mask(
        seq_len=seq_len,
        loss_mask=loss_mask,
        label_indices=label_idx,
        safe_label_indices=safe_idx,
        block_keep_mask=block_keep_mask,
    )
    return safe_idx, eval_mask


def gather_blocks(x_BSD: torch.Tensor, index_BAG: torch.Tensor) -> torch.Tensor:
    """x[b, index[b, a, g], :] -> [B, A, G, D]."""
    bsz, num_blocks, block_size = index_BAG.shape
    flat = index_BAG.reshape(bsz, -1, 1).expand(-1, -1, x_BSD.shape[-1])
    return x_BSD.gather(1, flat).view(bsz, num_blocks, block_size, -1)
