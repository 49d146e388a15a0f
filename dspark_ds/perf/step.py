"""One function for the training step: forward + loss through the configured path."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dspark_ds.loss import compute_dspark_loss

from .chunked_loss import DEFAULT_CHUNK_ANCHORS, chunked_dspark_loss
from .config import LOSS_IMPLEMENTATIONS, PerfConfig

BATCH_KEYS = ("input_ids", "target_hidden_states", "loss_mask")
OPTIONAL_BATCH_KEYS = ("target_last_hidden_states", "anchor_positions", "block_keep_mask")


def apply_perf_config(model: nn.Module, cfg: PerfConfig) -> nn.Module:
    """Sets the model's attention implementation ("auto" is resolved per device by it)."""
    model.attn_implementation = cfg.attn_implementation
    return model


def resolve_loss_impl(model: nn.Module, impl: str) -> str:
    """ "auto" -> "chunked", except under ZeRO-3 (partitioned parameters), where "reference".

    NOTE: the chunked loss hands autograd full-shape gradients for the head parameters it
    differentiates itself; ZeRO-3 partitions parameters (they carry `ds_id`) and expects
    its own gather / reduce-scatter hooks around every use, so it keeps the plain path.
    """
    if impl not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"perf.loss_impl: expected one of {LOSS_IMPLEMENTATIONS}, got {impl!r}")
    if impl != "auto":
        return impl
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    return "reference" if zero3 else "chunked"


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
    l1_loss_alpha, confidence_head_alpha). impl: "reference" | "chunked" | "auto" (chunked,
    or reference under ZeRO-3: see `resolve_loss_impl`). forward: what runs the model (a
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
    feats = forward(**kwargs, generator=generator, return_hidden=True)
    conf = model.predict_confidence(feats.hidden, feats.prev_token_ids)
    return chunked_dspark_loss(model, feats, conf, chunk_anchors=chunk_anchors, **loss_args)
