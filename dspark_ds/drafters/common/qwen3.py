"""The Qwen3 pieces both drafter kinds build on: the attention projections and the backend hooks.

Every draft layer uses transformers' Qwen3 RMSNorm, MLP and rotary embedding. The attention
projections read `in_features`-wide inputs: the hidden size for DSpark, twice that for Eagle3
(whose layer input is `[embedding ; hidden]`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding


class Qwen3AttentionProjections(nn.Module):
    """q / k / v / o projections with per-head RMSNorm on q and k (GQA)."""

    def __init__(self, config, in_features: int | None = None):
        super().__init__()
        hidden = int(config.hidden_size)
        in_features = in_features or hidden
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.scaling = self.head_dim**-0.5
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, in] -> [B, Hq, L, D], normed, before RoPE."""
        bsz, length, _ = x.shape
        q = self.q_proj(x).view(bsz, length, self.num_heads, self.head_dim)
        return self.q_norm(q).transpose(1, 2)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, in] -> (k, v), each [B, Hkv, L, D]; k normed, before RoPE."""
        bsz, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)


class Qwen3Backend:
    """The layer hooks of `TargetSharedWeights` a Qwen3 drafter shares across kinds (the kind's
    model class adds `make_layer`)."""

    def make_norm(self, dim: int) -> nn.Module:
        return Qwen3RMSNorm(dim, eps=self.config.rms_norm_eps)

    def make_rotary(self) -> nn.Module:
        return Qwen3RotaryEmbedding(self.config)
