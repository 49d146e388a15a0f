"""The DSpark training step's parts: the loss path, the anchors, and forward + loss.

`forward_loss` is the step's core: the drafter's forward, then the loss through the configured
path, returning a `StepOutput` (loss and metric sums on the device). `forward_and_loss` is the
same with the metrics summed over the ranks and read as floats, as
`compute_dspark_loss(model(...))` returns them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace

import torch
from torch import nn

from dspark_ds.drafters.dspark.blocks import sample_anchor_positions
from dspark_ds.drafters.dspark.config import DSPARK_LOSS, LossWeights
from dspark_ds.drafters.dspark.loss import dspark_loss, dspark_metrics
from dspark_ds.drafters.dspark.loss_chunked import chunked_dspark_loss
from dspark_ds.drafters.kind import StepOutput, bare
from dspark_ds.drafters.perf import CHUNK_ANCHORS_CPU, LOSS_IMPLEMENTATIONS
from dspark_ds.errors import ConfigError

BATCH_KEYS = ("input_ids", "target_hidden_states", "loss_mask")
OPTIONAL_BATCH_KEYS = ("target_last_hidden_states", "anchor_positions", "block_keep_mask")


def loss_impl_for(impl: str, zero3: bool) -> str:
    """perf.loss_impl -> the path a step takes: "auto" -> "chunked"; "chunked" -> "recompute"
    under ZeRO-3 (partitioned parameters).

    NOTE: the fused chunked loss hands autograd full-shape gradients for the head parameters
    it differentiates itself; ZeRO-3 partitions parameters and gathers /
    reduce-scatters them only around module calls and their backward, which the recompute
    form (plain autograd under activation checkpointing) keeps to.
    """
    if impl not in LOSS_IMPLEMENTATIONS:
        raise ConfigError(f"perf.loss_impl: expected one of {LOSS_IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        impl = "chunked"
    return "recompute" if impl == "chunked" and zero3 else impl


def sample_anchors(
    loss_mask: torch.Tensor, sample_ids: torch.Tensor, num_anchors: int, seed: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors of each row drawn from its own (seed, epoch, sample id) generator, so a step sees
    the same blocks whatever the world size or a resume.

    Only the random keys are drawn on the host (`sample_ids` is a host tensor); they go to the
    mask's device, where the candidates are chosen: nothing is read back from the device."""
    width = max(loss_mask.shape[1] - 1, 0)
    keys = torch.stack(
        [
            torch.rand(
                width,
                generator=torch.Generator().manual_seed(
                    (seed * 1_000_003 + epoch) * 1_000_000_007 + int(sample_id)
                ),
            )
            for sample_id in sample_ids.tolist()
        ]
    )
    keys = keys.to(loss_mask.device, non_blocking=True)
    return sample_anchor_positions(loss_mask, num_anchors, keys=keys)


def drop_empty_blocks(
    anchors: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, A] anchors and keep mask cut to the busiest row's kept blocks (at least one).

    A row's kept blocks come first (`sample_anchor_positions`), so the columns cut are dummies
    in every row: they supervise nothing and, attending only to their own block, change no
    other block's output. NOTE: the count is read on the host (the shapes depend on it)."""
    used = max(int(keep.sum(dim=1).max()), 1) if keep.numel() else 1
    return anchors[:, :used], keep[:, :used]


def forward_loss(
    model,
    batch: Mapping[str, torch.Tensor],
    weights: LossWeights,
    *,
    impl: str,
    chunk_anchors: int = CHUNK_ANCHORS_CPU,
    generator: torch.Generator | None = None,
    over_ranks: bool = True,
    pad_to_blocks: int = 0,
) -> StepOutput:
    """The drafter's forward on one micro-batch, then its loss through `impl`, a resolved path:
    "reference" (full logits, `dspark_loss`), "chunked" or "recompute" (the forward stops at
    the hidden states; the loss projects them a few anchors at a time).

    model: what runs the forward (a DeepSpeed engine, whose `.module` is the drafter, or the
    drafter itself); the chunked losses call the drafter's heads. batch: input_ids,
    target_hidden_states, loss_mask (+ target_last_hidden_states, anchor_positions,
    block_keep_mask); without anchors the drafter draws them from `generator`. over_ranks,
    pad_to_blocks: see `plan_loss` and `chunked_dspark_loss`.
    """
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch: missing {missing} (needs {BATCH_KEYS})")
    inputs = {k: batch[k] for k in (*BATCH_KEYS, *OPTIONAL_BATCH_KEYS) if batch.get(k) is not None}
    if impl == "reference":
        out = model(**inputs, generator=generator)
        if weights.ce_labels == "target":
            out = _relabel(out, _require(out.aligned_target_logits).argmax(-1))
        return dspark_loss(out, weights, over_ranks=over_ranks)
    drafter = bare(model)
    feats = model(**inputs, generator=generator, return_hidden=True)
    if weights.ce_labels == "target":
        states = _require(feats.target_prev_hidden)
        feats = _relabel(feats, greedy_target_ids(drafter, states, chunk_anchors, pad_to_blocks))
    confidence = drafter.predict_confidence(feats.hidden, feats.prev_token_ids)
    return chunked_dspark_loss(
        drafter,
        feats,
        confidence,
        weights,
        chunk_anchors=chunk_anchors,
        over_ranks=over_ranks,
        recompute=impl != "chunked",
        pad_to_blocks=pad_to_blocks,
    )


@torch.no_grad()
def greedy_target_ids(
    drafter, target_prev_hidden: torch.Tensor, chunk_anchors: int, pad_to_blocks: int = 0
) -> torch.Tensor:
    """[B, A, G, H] -> [B, A, G]: the target's greedy token of every slot, the argmax of its
    aligned logits (draft ids over a draft vocabulary), projected a few anchors at a time as the
    chunked losses do, so that [B, A, G, V] never exists at once.

    `pad_to_blocks`: as many projections as that many blocks take, the last ones empty. NOTE:
    under ZeRO-3 each call of the head gathers its partitioned weight with the other ranks, so
    every rank must call it equally often (`chunked_dspark_loss` pads the same way)."""
    bsz, num_blocks, G, H = target_prev_hidden.shape
    flat = target_prev_hidden.reshape(bsz * num_blocks, G, H)
    step = max(1, int(chunk_anchors))
    ids = [
        drafter.target_logits(flat[i : i + step]).argmax(-1)
        for i in range(0, max(len(flat), pad_to_blocks), step)
    ]
    return torch.cat(ids).view(bsz, num_blocks, G)


def _relabel(out, labels: torch.Tensor):
    """`out` (a forward's output or hidden output) with `labels` as the CE's targets; all of
    them are in the draft vocabulary (the logits are over it)."""
    return replace(out, target_ids=labels, label_in_vocab=None)


def _require(aligned: torch.Tensor | None) -> torch.Tensor:
    if aligned is None:
        raise ValueError(
            "model.ce_labels 'target' needs the target's final hidden states "
            "(target_last_hidden_states) in the batch: its greedy tokens are the labels"
        )
    return aligned


def forward_and_loss(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    loss_args: Mapping[str, float | None],
    impl: str = "auto",
    chunk_anchors: int = CHUNK_ANCHORS_CPU,
    generator: torch.Generator | None = None,
    zero_stage: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss to backpropagate, metrics) for one micro-batch, as `compute_dspark_loss(model(..))`.

    loss_args: the keyword arguments of `compute_dspark_loss` (loss_decay_gamma, ce_loss_alpha,
    l1_loss_alpha, confidence_head_alpha). impl: "reference" | "chunked" | "recompute" | "auto"
    (`loss_impl_for` at `zero_stage`, the ZeRO stage `model` runs under). See `forward_loss` for
    the rest.
    """
    weights = LossWeights(**{**asdict(DSPARK_LOSS), **loss_args})
    out = forward_loss(
        model,
        batch,
        weights,
        impl=loss_impl_for(impl, zero3=zero_stage == 3),
        chunk_anchors=chunk_anchors,
        generator=generator,
    )
    return out.loss, dspark_metrics(out.global_sums(), weights)
