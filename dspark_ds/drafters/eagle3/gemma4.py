"""Gemma4 backend of the Eagle3 baseline: the shared Gemma4 backbone (drafters/common/gemma4.py)
around the Eagle3 layer, whose q/k/v read `[input_layernorm(embed) ; hidden_norm(h)]` (2H wide).
Soft-capping applies to every logit (draft and target). Parameter names follow the reference's
`Gemma4Eagle3Model`."""

from __future__ import annotations

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from dspark_ds.drafters.common.gemma4 import (
    Gemma4AttentionProjections,
    Gemma4Backend,
    Gemma4SandwichLayer,
)
from dspark_ds.drafters.eagle3.model import AttendFn, Eagle3Attention, Eagle3DraftModel


class Gemma4Eagle3Attention(Eagle3Attention, Gemma4AttentionProjections):
    def __init__(self, config):
        super().__init__(config, in_features=2 * int(config.hidden_size))


class Gemma4Eagle3DecoderLayer(Gemma4SandwichLayer):
    """x = [input_layernorm(emb) ; hidden_norm(h)]; h += post_attn_norm(attn(x));
    h += post_ff_norm(mlp(pre_ff_norm(h))); h *= layer_scalar."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, Gemma4Eagle3Attention(config))
        self.hidden_norm = Gemma4RMSNorm(int(config.hidden_size), eps=config.rms_norm_eps)

    def forward(self, embeds, h, rope, attend_fn: AttendFn) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        return self.finish(h, self.self_attn(x, rope, attend_fn))


class Gemma4Eagle3Model(Gemma4Backend, Eagle3DraftModel):
    architecture = "Gemma4Eagle3Model"

    def make_layer(self, layer_idx):
        return Gemma4Eagle3DecoderLayer(self.config, layer_idx)
