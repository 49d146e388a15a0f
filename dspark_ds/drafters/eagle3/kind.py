"""The Eagle3 drafter kind, one autoregressive layer unrolled over training-time-test steps: its
parts by the subsystem that asks (drafters/kind.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dspark_ds.drafters.eagle3 import loss, memory
from dspark_ds.drafters.eagle3.build import eagle3_config
from dspark_ds.drafters.eagle3.config import REGISTRATION
from dspark_ds.drafters.eagle3.model import Eagle3DraftModel
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


class Eagle3Train(KindTrain):
    def loss_impl_for(self, loss_impl: str, zero3: bool) -> str:
        return loss.loss_impl_for(loss_impl, zero3)

    def training_step(
        self, model, batch: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> StepOutput:
        """The unrolled forward and its loss (`loss.forward_loss`); perf.loss_chunk_anchors
        positions per chunk, each of ttt_length rows."""
        # NOTE: an Eagle3 "anchor" is a position, whose T unrolled steps are T rows of the loss
        chunk_rows = ctx.perf.chunk_anchors(batch["input_ids"].device) * bare(model).ttt_length
        return loss.forward_loss(
            model,
            {k: batch[k] for k in TRAIN_KEYS},
            step_loss_decay=ctx.model.step_loss_decay,
            impl=ctx.loss_impl,
            chunk_rows=chunk_rows,
            over_ranks=ctx.training,
            loss_terms=ctx.model.loss_terms,
            lk_eta=ctx.model.lk_eta,
        )

    def metrics(self, sums: Mapping[str, float], model: DrafterConfig) -> dict[str, float]:
        return loss.eagle3_metrics(dict(sums), model.step_loss_decay, model.loss_terms)


class Eagle3Decode(KindDecode):
    def tokens_per_round(self, config) -> int:
        return int(config.ttt_length)  # one draft per unrolled step

    def has_confidence(self, config) -> bool:
        return False


class Eagle3Cost(KindCost):
    def step_part(self, model: DrafterConfig) -> memory.Eagle3Shape:
        return memory.Eagle3Shape.of(model)

    def host_scale(self, model: DrafterConfig, seq_len: int) -> int:
        # the chunked loss loops over chunks of positions (loss_chunk_anchors of them each)
        return seq_len

    def host_copy(
        self, model: DrafterConfig, seq_len: int, count: int, longest: int
    ) -> tuple[DrafterConfig, int]:
        return model, count


class Eagle3Report(KindReport):
    def describe(self, model: DrafterConfig) -> str:
        return f"Eagle3 {model.num_draft_layers} layer(s), T={model.ttt_length}"

    def tags(self, config) -> dict[str, object]:
        return {"ttt_length": getattr(config, "ttt_length", None)}


class Eagle3(DrafterKind):
    registration = REGISTRATION
    model_class = Eagle3DraftModel
    train = Eagle3Train(REGISTRATION)
    decode = Eagle3Decode()
    cost = Eagle3Cost(memory)
    report = Eagle3Report()

    def build_config(
        self, target_config, model, *, target_layer_ids, mask_token_id=None, target_path=None
    ):
        return eagle3_config(
            target_config,
            model,
            target_layer_ids=target_layer_ids,
            target_model_name_or_path=target_path,
        )
