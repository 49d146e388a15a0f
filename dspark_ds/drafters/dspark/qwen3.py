"""Qwen3 backend (spec §2): transformers' Qwen3 RMSNorm, MLP and rotary embedding."""

from __future__ import annotations

from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dspark_ds.drafters.dspark.model import DraftAttention, DSparkDraftModel


class Qwen3DSparkAttention(DraftAttention):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_q(self, h):
        bsz, length, _ = h.shape
        return self.q_norm(
            self.q_proj(h).view(bsz, length, self.num_heads, self.head_dim)
        ).transpose(1, 2)

    def project_kv(self, x):
        bsz, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)


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


class Qwen3DSparkModel(DSparkDraftModel):
    architecture = "Qwen3DSparkModel"

    def make_layer(self, layer_idx):
        return Qwen3DSparkDecoderLayer(self.config)

    def make_norm(self, dim):
        return Qwen3RMSNorm(dim, eps=self.config.rms_norm_eps)

    def make_rotary(self):
        return Qwen3RotaryEmbedding(self.config)
