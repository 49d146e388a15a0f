"""One function for the training step: forward + loss through the configured path."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from dspark_ds.drafters.common.blocks import sample_anchor_positions
from dspark_ds.drafters.dspark.loss import compute_dspark_loss
from dspark_ds.drafters.dspark.loss_chunked import (
    DEFAULT_CHUNK_ANCHORS,
    chunked_dspark_loss,
    recompute_dspark_loss,
)
from dspark_ds.perf.config import LOSS_IMPLEMENTATIONS

BATCH_KEYS = ("input_ids", "target_hidden_states", "loss_mask")
OPTIONAL_BATCH_KEYS = ("target_last_hidden_states", "anchor_positions", "block_keep_mask")


def loss_impl_for(impl: str, zero3: bool) -> str:
    """perf.loss_impl -> the path a step takes: "auto" -> "chunked"; "chunked" -> "recompute"
    under ZeRO-3 (partitioned parameters).

    NOTE: the fused chunked loss hands autograd full-shape gradients for the head parameters
    it differentiates itself; ZeRO-3 partitions parameters (they carry `ds_id`) and gathers /
    reduce-scatters them only around module calls and their backward, which the recompute
    form (plain autograd under activation checkpointing) keeps to.
    """
    if impl not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"perf.loss_impl: expected one of {LOSS_IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        impl = "chunked"
    return "recompute" if impl == "chunked" and zero3 else impl


def resolve_loss_impl(model: nn.Module, impl: str) -> str:
    """`loss_impl_for` with ZeRO-3 read off the model (its parameters carry `ds_id`)."""
    return loss_impl_for(impl, zero3=any(hasattr(p, "ds_id") for p in model.parameters()))


def sample_anchors(
    loss_mask: torch.Tensor, sample_ids: torch.Tensor, num_anchors: int, seed: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors of each row drawn from its own (seed, epoch, sample id) generator, so a step sees
    the same blocks whatever the world size or a resume."""
    rows = []
    for b in range(loss_mask.shape[0]):
        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + epoch) * 1_000_000_007 + int(sample_ids[b])
        )
        rows.append(sample_anchor_positions(loss_mask[b : b + 1].cpu(), num_anchors, generator=g))
    anchors = torch.cat([r[0] for r in rows]).to(loss_mask.device)
    keep = torch.cat([r[1] for r in rows]).to(loss_mask.device)
    return anchors, keep


def drop_empty_blocks(
    anchors: torch.Tensor, keep: torch.Tensor, agree: Callable[[int], int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, A] anchors and keep mask cut to the busiest row's kept blocks (at least one), or to
    what `agree` makes of that count (every rank's maximum: each rank then runs the same
    modules the same number of times, as ZeRO-3's parameter gathers require).

    A row's kept blocks come first (`sample_anchor_positions`), so the columns cut are dummies
    in every row: they supervise nothing and, attending only to their own block, change no
    other block's output."""
    used = max(int(keep.sum(dim=1).max()), 1) if keep.numel() else 1
    if agree is not None:
        used = agree(used)
    return anchors[:, :used], keep[:, :used]


def forward_and_loss(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    loss_args: Mapping[str, float | None],
    impl: str = "auto",
    chunk_anchors: int = DEFAULT_CHUNK_ANCHORS,
    generator: torch.Generator | None = None,
    forward=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss to backpropagate, metrics) for one micro-batch, as `compute_dspark_loss(model(..))`.

    batch: the target-features dict (input_ids, loss_mask, target_hidden_states,
    target_last_hidden_states; anchor_positions / block_keep_mask optional). loss_args: the
    keyword arguments of `compute_dspark_loss` (loss_decay_gamma, ce_loss_alpha,
    l1_loss_alpha, confidence_head_alpha). impl: "reference" | "chunked" | "recompute" |
    "auto" (see `resolve_loss_impl`). forward: what runs the model (a
    DeepSpeed engine, called with keyword arguments); None = `model` itself, whose heads the
    chunked loss reads either way.
    """
    impl = resolve_loss_impl(model, impl)
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch: missing {missing} (needs {BATCH_KEYS})")
    forward = forward if forward is not None else model
    kwargs = {k: batch[k] for k in (*BATCH_KEYS, *OPTIONAL_BATCH_KEYS) if batch.get(k) is not None}
    if impl == "reference":
        out = forward(**kwargs, generator=generator)
        return compute_dspark_loss(out, **loss_args)
    loss_fn = chunked_dspark_loss if impl == "chunked" else recompute_dspark_loss

    def heads(drafter: nn.Module, feats) -> tuple[torch.Tensor, dict[str, float]]:
        # runs inside the model's forward (see DSparkDraftModel.forward's head_fn)
        conf = drafter.predict_confidence(feats.hidden, feats.prev_token_ids)
        return loss_fn(drafter, feats, conf, chunk_anchors=chunk_anchors, **loss_args)

    return forward(**kwargs, generator=generator, head_fn=heads)
