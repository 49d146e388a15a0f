"""Gemma4 backend of the DSpark drafter: the shared Gemma4 backbone (drafters/common/gemma4.py)
around the DSpark draft attention. See docs/algorithm.md#gemma4 for what differs from Qwen3."""

from __future__ import annotations

from dspark_ds.drafters.common.gemma4 import (
    Gemma4AttentionProjections,
    Gemma4Backend,
    Gemma4SandwichLayer,
)
from dspark_ds.drafters.dspark.model import DraftAttention, DSparkDraftModel


class Gemma4DSparkAttention(DraftAttention, Gemma4AttentionProjections):
    """Draft attention over [context ; draft] with Gemma4 full-attention projections."""


class Gemma4DSparkDecoderLayer(Gemma4SandwichLayer):
    """h += post_attn_norm(attn(input_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)));
    h *= layer_scalar."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, Gemma4DSparkAttention(config))

    def forward(self, h, ctx, rope_ctx, rope_draft, mask, cache, layer_idx):
        attn = self.self_attn(
            self.input_layernorm(h), ctx, rope_ctx, rope_draft, mask, cache, layer_idx
        )
        return self.finish(h, attn)


class Gemma4DSparkModel(Gemma4Backend, DSparkDraftModel):
    architecture = "Gemma4DSparkModel"

    def make_layer(self, layer_idx):
        return Gemma4DSparkDecoderLayer(self.config, layer_idx)
