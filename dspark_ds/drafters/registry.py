"""The drafter kinds, one spec each: what the trainer, tuner, evaluation and demo look up.

In the spirit of torchtitan's `ModelSpec`: a kind ("dspark", which covers DFlash, or "eagle3")
is one `DrafterSpec` holding how its config is built from a target, its training forward and
loss (with the `perf` section), how its loss path is resolved, its two decoding steps (extend
its cache with verified context, propose a round), its activation memory for the tuner and the
architectures it exports. Code outside drafters/ asks `get_spec(cfg.model.kind)` or
`spec_of(model)` instead of branching on the kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dspark_ds.drafters import io
from dspark_ds.drafters.common.attention import ATTN_IMPLEMENTATIONS
from dspark_ds.drafters.common.memory import StepShapes
from dspark_ds.drafters.common.rounds import DraftRound, Proposal, VerifiedContext
from dspark_ds.drafters.dspark import memory as dspark_memory
from dspark_ds.drafters.dspark import step as dspark_step
from dspark_ds.drafters.dspark.model import DSparkDraftModel
from dspark_ds.drafters.eagle3 import loss as eagle3_loss
from dspark_ds.drafters.eagle3 import memory as eagle3_memory
from dspark_ds.drafters.eagle3.model import TTT_ATTN_IMPLEMENTATIONS, Eagle3DraftModel
from dspark_ds.drafters.presets import DrafterConfig
from dspark_ds.perf.config import LOSS_IMPLEMENTATIONS, PerfConfig

Batch = Mapping[str, torch.Tensor]
LossAndMetrics = tuple[torch.Tensor, dict[str, float]]
# The tensors of a training batch a step reads (features from the target or its cache).
TRAIN_KEYS = ("input_ids", "target_hidden_states", "loss_mask", "target_last_hidden_states")


@dataclass(frozen=True)
class StepArgs:
    """What one training forward + loss needs besides the drafter and its batch."""

    model: DrafterConfig
    """The run's `model` section (loss weights, decays)."""
    perf: PerfConfig
    """The run's `perf` section (chunk sizes)."""
    loss_impl: str
    """The loss path, as `DrafterSpec.resolve_loss_impl` resolved it."""
    seed: int = 0
    epoch: int = 0
    """Seed and epoch of the anchor draws (DSpark)."""
    forward: Callable[..., Any] | None = None
    """What runs the drafter's forward (the DeepSpeed engine); None = the drafter itself."""
    on_anchors: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    """Called with (loss_mask, anchor_positions, block_keep_mask) of each micro-batch by kinds
    that sample anchor blocks (the trainer's sampler statistics)."""
    agree_blocks: Callable[[int], int] | None = None
    """With `perf.drop_empty_blocks`: given this rank's busiest block count, the count every rank
    runs (the trainer's maximum over ranks, so ZeRO-3's per-module gathers stay in step across
    ranks); None = this rank's own."""


@dataclass(frozen=True)
class DrafterSpec:
    kind: str
    label: str
    model_class: type[nn.Module]
    """The base class of every backend of this kind."""
    architectures: Mapping[str, str]
    """Target model_type -> the interchange architecture built and exported for it."""
    uses_mask_token: bool
    """Its config needs the MASK token id."""
    anchor_blocks: bool
    """It trains on `num_anchors` anchor blocks sampled per sequence (the block-shape warnings,
    the sampler statistics and the demo's anchor count apply)."""
    build_config: Callable[..., Any]
    """(target_config, model section, *, target_layer_ids, mask_token_id, target_path) ->
    the drafter's transformers config; ValueError names the field."""
    loss_impls: tuple[str, ...]
    """perf.loss_impl values it honours."""
    attn_impls: tuple[str, ...]
    """perf.attn_implementation values it honours."""
    resolve_loss_impl: Callable[[nn.Module, str], str]
    """(bare drafter, perf.loss_impl) -> the path a step takes (ZeRO-3 read off the drafter)."""
    forward_and_loss: Callable[[nn.Module, Batch, StepArgs], LossAndMetrics]
    """(bare drafter, batch (TRAIN_KEYS on the device, sample_ids), args) -> (loss, metrics)."""
    extend: Callable[[nn.Module, VerifiedContext], None]
    """Appends positions the target verified to the drafter's cache (both decoding loops;
    drafters/common/rounds.py)."""
    propose: Callable[[nn.Module, DraftRound], Proposal]
    """One drafting round of speculative decoding for every row in flight, against the cache."""
    activation_bytes: Callable[[StepShapes, DrafterConfig, PerfConfig, str, int], dict]
    """(shapes, model section, perf, device, ZeRO stage) -> activation bytes by component."""
    step_flops: Callable[[StepShapes, DrafterConfig, PerfConfig, str, int], dict]
    """(shapes, model section, perf, device, ZeRO stage) -> one micro-batch's matmul FLOPs
    (forward + backward) by component, for the tuner's step time."""
    describe: Callable[[DrafterConfig], str]
    """A one-line summary of a model section (reports)."""

    def check_perf(self, perf: PerfConfig) -> None:
        """Refuses, by name, a perf option this kind cannot honour."""
        for option, value, allowed in (
            ("loss_impl", perf.loss_impl, self.loss_impls),
            ("attn_implementation", perf.attn_implementation, self.attn_impls),
        ):
            if value not in allowed:
                raise ValueError(
                    f"perf.{option}: {value!r} is not available for {self.kind} drafters; "
                    f"choose one of {allowed}"
                )

    def apply_perf(
        self, model: nn.Module, perf: PerfConfig, device: torch.device | str | None = None
    ) -> str:
        """Sets the drafter's attention implementation and, given the run's device, compiles
        it per `perf.compile`; returns the resolved loss path."""
        self.check_perf(perf)
        model.attn_implementation = perf.attn_implementation
        if device is not None and perf.compile_mode(device) != "off":
            from dspark_ds.perf.compile import compile_drafter

            compile_drafter(model, perf.compile_mode(device))
        return self.resolve_loss_impl(model, perf.loss_impl)


# ---- DSpark / DFlash -----------------------------------------------------------------------
def _dspark_config(target_config, model, *, target_layer_ids, mask_token_id, target_path=None):
    return io.dspark_config(
        target_config, model, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id
    )


def _dspark_forward_and_loss(model: nn.Module, batch: Batch, args: StepArgs) -> LossAndMetrics:
    anchors, keep = dspark_step.sample_anchors(
        batch["loss_mask"], batch["sample_ids"], model.num_anchors, args.seed, args.epoch
    )
    if args.on_anchors is not None:
        args.on_anchors(batch["loss_mask"], anchors, keep)
    if args.perf.drops_empty_blocks(batch["input_ids"].device):
        anchors, keep = dspark_step.drop_empty_blocks(anchors, keep, args.agree_blocks)
    inputs = {k: batch[k] for k in TRAIN_KEYS}
    inputs.update(anchor_positions=anchors, block_keep_mask=keep)
    return dspark_step.forward_and_loss(
        model,
        inputs,
        asdict(args.model.loss_weights),
        impl=args.loss_impl,
        chunk_anchors=args.perf.chunk_anchors(batch["input_ids"].device),
        forward=args.forward,
    )


def _describe_dspark(m: DrafterConfig) -> str:
    heads = f"Markov rank {m.markov_rank}" if m.markov_rank else "no Markov head"
    return f"DSpark {m.num_draft_layers} layers, A={m.num_anchors} γ={m.block_size}, {heads}"


# ---- Eagle3 --------------------------------------------------------------------------------
def _eagle3_config(target_config, model, *, target_layer_ids, mask_token_id=None, target_path=None):
    return io.eagle3_config(
        target_config,
        model,
        target_layer_ids=target_layer_ids,
        target_model_name_or_path=target_path,
    )


def _eagle3_forward_and_loss(model: nn.Module, batch: Batch, args: StepArgs) -> LossAndMetrics:
    # NOTE: an Eagle3 "anchor" is a position, whose T unrolled steps are T rows of the loss
    return eagle3_loss.eagle3_forward_and_loss(
        model,
        {k: batch[k] for k in TRAIN_KEYS},
        step_loss_decay=args.model.step_loss_decay,
        impl=args.loss_impl,
        chunk_rows=args.perf.chunk_anchors(batch["input_ids"].device) * model.ttt_length,
        forward=args.forward,
    )


def _describe_eagle3(m: DrafterConfig) -> str:
    return f"Eagle3 {m.num_draft_layers} layer(s), T={m.ttt_length}"


SPECS: dict[str, DrafterSpec] = {
    "dspark": DrafterSpec(
        kind="dspark",
        label="DSpark / DFlash",
        model_class=DSparkDraftModel,
        architectures=io.ARCHITECTURES["dspark"],
        uses_mask_token=True,
        anchor_blocks=True,
        build_config=_dspark_config,
        loss_impls=LOSS_IMPLEMENTATIONS,
        attn_impls=("auto", *ATTN_IMPLEMENTATIONS),
        resolve_loss_impl=dspark_step.resolve_loss_impl,
        forward_and_loss=_dspark_forward_and_loss,
        extend=DSparkDraftModel.extend_context,
        propose=DSparkDraftModel.propose_round,
        activation_bytes=dspark_memory.activation_bytes,
        step_flops=dspark_memory.step_flops,
        describe=_describe_dspark,
    ),
    "eagle3": DrafterSpec(
        kind="eagle3",
        label="Eagle3",
        model_class=Eagle3DraftModel,
        architectures=io.ARCHITECTURES["eagle3"],
        uses_mask_token=False,
        anchor_blocks=False,
        build_config=_eagle3_config,
        loss_impls=eagle3_loss.LOSS_IMPLEMENTATIONS,
        attn_impls=("auto", *TTT_ATTN_IMPLEMENTATIONS),
        resolve_loss_impl=eagle3_loss.resolve_loss_impl,
        forward_and_loss=_eagle3_forward_and_loss,
        extend=Eagle3DraftModel.extend_context,
        propose=Eagle3DraftModel.propose_round,
        activation_bytes=eagle3_memory.activation_bytes,
        step_flops=eagle3_memory.step_flops,
        describe=_describe_eagle3,
    ),
}


def get_spec(kind: str) -> DrafterSpec:
    if kind not in SPECS:
        raise ValueError(f"model.kind: unknown drafter kind {kind!r}; choose from {list(SPECS)}")
    return SPECS[kind]


def spec_of(model: nn.Module) -> DrafterSpec:
    """The spec of a drafter (a DeepSpeed / DDP wrapper's `.module` is looked through)."""
    model = getattr(model, "module", model)
    for spec in SPECS.values():
        if isinstance(model, spec.model_class):
            return spec
    raise ValueError(f"drafter: {type(model).__name__} is not a drafter of a known kind")
