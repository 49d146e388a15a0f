"""Qwen3 backend of the DSpark drafter (docs/algorithm.md#the-drafter)."""

from __future__ import annotations

from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from dspark_ds.drafters.common.qwen3 import Qwen3AttentionProjections, Qwen3Backend
from dspark_ds.drafters.dspark.model import DraftAttention, DSparkDraftModel


class Qwen3DSparkAttention(DraftAttention, Qwen3AttentionProjections):
    """Draft attention over [context ; draft] with Qwen3 projections."""


class Qwen3DSparkDecoderLayer(nn.Module):
    """Pre-norm: h += attn(input_layernorm(h), ctx); h += mlp(post_attention_layernorm(h))."""

    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen3DSparkAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx, rope_ctx, rope_draft, mask, cache, layer_idx):
        h = h + self.self_attn(
            self.input_layernorm(h), ctx, rope_ctx, rope_draft, mask, cache, layer_idx
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3DSparkModel(Qwen3Backend, DSparkDraftModel):
    architecture = "Qwen3DSparkModel"

    def make_layer(self, layer_idx):
        return Qwen3DSparkDecoderLayer(self.config)
