"""One function for the training step: forward + loss through the configured path."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dspark_ds.drafters.dspark.loss import compute_dspark_loss
from dspark_ds.drafters.dspark.loss_chunked import (
    DEFAULT_CHUNK_ANCHORS,
    chunked_dspark_loss,
    recompute_dspark_loss,
)
from dspark_ds.perf.config import LOSS_IMPLEMENTATIONS, PerfConfig

BATCH_KEYS = ("input_ids", "target_hidden_states", "loss_mask")
OPTIONAL_BATCH_KEYS = ("target_last_hidden_states", "anchor_positions", "block_keep_mask")


def apply_perf_config(
    model: nn.Module, cfg: PerfConfig, device: torch.device | str | None = None
) -> nn.Module:
    """Sets the model's attention implementation ("auto" is resolved per device by it) and,
    given the run's device, compiles it per `perf.compile` (dspark_ds/perf/compile.py)."""
    model.attn_implementation = cfg.attn_implementation
    if device is not None and cfg.compile_mode(device) != "off":
        from dspark_ds.perf.compile import compile_drafter

        compile_drafter(model, cfg.compile_mode(device))
    return model


def resolve_loss_impl(model: nn.Module, impl: str) -> str:
    """ "auto" -> "chunked"; "chunked" -> "recompute" under ZeRO-3 (partitioned parameters).

    NOTE: the fused chunked loss hands autograd full-shape gradients for the head parameters
    it differentiates itself; ZeRO-3 partitions parameters (they carry `ds_id`) and gathers /
    reduce-scatters them only around module calls and their backward, which the recompute
    form (plain autograd under activation checkpointing) keeps to.
    """
    if impl not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"perf.loss_impl: expected one of {LOSS_IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        impl = "chunked"
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    return "recompute" if impl == "chunked" and zero3 else impl


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
