"""The DSpark / DFlash drafter kind (DFlash is DSpark without the Markov and confidence heads):
its parts by the subsystem that asks (drafters/kind.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from dspark_ds.drafters.dspark import memory
from dspark_ds.drafters.dspark.build import dspark_config
from dspark_ds.drafters.dspark.config import REGISTRATION, LossWeights
from dspark_ds.drafters.dspark.loss import dspark_metrics
from dspark_ds.drafters.dspark.model import DSparkDraftModel
from dspark_ds.drafters.dspark.sampler_stats import sampler_stat_sums
from dspark_ds.drafters.dspark.step import (
    drop_empty_blocks,
    forward_loss,
    loss_impl_for,
    sample_anchors,
)
from dspark_ds.drafters.kind import (
    TRAIN_KEYS,
    DrafterKind,
    KindCost,
    KindDecode,
    KindReport,
    KindTrain,
    StepContext,
    StepOutput,
    bare,
)
from dspark_ds.drafters.presets import DrafterConfig


class DSparkTrain(KindTrain):
    def loss_impl_for(self, loss_impl: str, zero3: bool) -> str:
        return loss_impl_for(loss_impl, zero3)

    def training_step(
        self, model, batch: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> StepOutput:
        """Anchors drawn per sample from (seed, epoch, sample id), the trailing empty blocks
        dropped (perf.drop_empty_blocks), then `forward_loss`: the forward and the loss."""
        drafter = bare(model)
        loss_mask = batch["loss_mask"]
        device = loss_mask.device
        anchors, keep = sample_anchors(
            loss_mask, batch["sample_ids"], drafter.num_anchors, ctx.seed, ctx.epoch
        )
        sampler = None
        if ctx.training:
            sampler = sampler_stat_sums(
                loss_mask,
                anchors,
                keep,
                num_anchors=drafter.num_anchors,
                block_size=drafter.block_size,
            )
        all_blocks = 0
        if ctx.perf.drops_empty_blocks(device):
            all_blocks = anchors.numel()  # what every rank's chunks pad to (ZeRO-3)
            anchors, keep = drop_empty_blocks(anchors, keep)
        inputs = {k: batch[k] for k in TRAIN_KEYS}
        out = forward_loss(
            model,
            {**inputs, "anchor_positions": anchors, "block_keep_mask": keep},
            LossWeights.of(ctx.model),
            impl=ctx.loss_impl,
            chunk_anchors=ctx.perf.chunk_anchors(device),
            over_ranks=ctx.training,
            pad_to_blocks=all_blocks,
        )
        out.sampler_sums = sampler
        return out

    def metrics(self, sums: Mapping[str, float], model: DrafterConfig) -> dict[str, float]:
        return dspark_metrics(dict(sums), LossWeights.of(model))


class DSparkDecode(KindDecode):
    def tokens_per_round(self, config) -> int:
        return int(config.block_size)  # γ: a block's drafts

    def has_confidence(self, config) -> bool:
        return bool(getattr(config, "enable_confidence_head", False))


class DSparkCost(KindCost):
    def step_part(self, model: DrafterConfig) -> memory.DSparkShape:
        return memory.DSparkShape.of(model)

    def host_scale(self, model: DrafterConfig, seq_len: int) -> int:
        # the blockwise attention and the chunked losses loop over blocks of anchors
        return model.num_anchors

    def host_copy(
        self, model: DrafterConfig, seq_len: int, count: int, longest: int
    ) -> tuple[DrafterConfig, int]:
        return replace(model, num_anchors=count), min(seq_len, 2 * longest + 64)


class DSparkReport(KindReport):
    def describe(self, model: DrafterConfig) -> str:
        heads = f"Markov rank {model.markov_rank}" if model.markov_rank else "no Markov head"
        return (
            f"DSpark {model.num_draft_layers} layers, A={model.num_anchors} "
            f"γ={model.block_size}, {heads}"
        )

    def tags(self, config) -> dict[str, object]:
        return {"markov_rank": int(config.markov_rank), "block_size": int(config.block_size)}


class DSpark(DrafterKind):
    registration = REGISTRATION
    model_class = DSparkDraftModel
    train = DSparkTrain(REGISTRATION)
    decode = DSparkDecode()
    cost = DSparkCost(memory)
    report = DSparkReport()

    def build_config(
        self, target_config, model, *, target_layer_ids, mask_token_id=None, target_path=None
    ):
        return dspark_config(
            target_config, model, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id
        )
