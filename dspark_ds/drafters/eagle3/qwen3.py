"""Qwen3 backend of the Eagle3 baseline: Qwen3 projections and MLP around the shared TTT unroll.
Parameter names follow the reference's `Qwen3Eagle3Model`."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from dspark_ds.drafters.common.qwen3 import Qwen3AttentionProjections, Qwen3Backend
from dspark_ds.drafters.eagle3.model import AttendFn, Eagle3Attention, Eagle3DraftModel


class Qwen3Eagle3Attention(Eagle3Attention, Qwen3AttentionProjections):
    def __init__(self, config):
        super().__init__(config, in_features=2 * int(config.hidden_size))


class Qwen3Eagle3DecoderLayer(nn.Module):
    """x = [input_layernorm(emb) ; hidden_norm(h)]; h += attn(x); h += mlp(post_norm(h))."""

    def __init__(self, config):
        super().__init__()
        hidden, eps = int(config.hidden_size), config.rms_norm_eps
        self.self_attn = Qwen3Eagle3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=eps)
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=eps)

    def forward(self, embeds, h, rope, attend_fn: AttendFn) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        h = h + self.self_attn(x, rope, attend_fn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Eagle3Model(Qwen3Backend, Eagle3DraftModel):
    architecture = "Qwen3Eagle3Model"

    def make_layer(self, layer_idx):
        return Qwen3Eagle3DecoderLayer(self.config)
