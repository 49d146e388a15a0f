"""Gemma4 backend of the Eagle3 baseline: the Gemma4 layer around the shared TTT unroll.

As for the DSpark drafter (spec §12, drafters/dspark/gemma4.py): full-attention head shape
(`global_head_dim`; with `attention_k_eq_v` the `num_global_key_value_heads` K/V heads, no
`v_proj`, V = the raw K projection), a scale-free `v_norm`, attention scaling 1.0, sandwich
norms around attention and MLP, a `layer_scalar` buffer, the sqrt(H)-scaled embedding, the
`full_attention` RoPE and `final_logit_softcapping` on every logit (draft and target). The
Eagle3 part is unchanged: q/k/v read `[input_layernorm(embed) ; hidden_norm(h)]` (2H wide).
Parameter names follow the reference's `Gemma4Eagle3Model`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextMLP,
    Gemma4TextScaledWordEmbedding,
)

from dspark_ds.drafters.dspark.gemma4 import (
    Gemma4DSparkModel,
    Gemma4FullAttentionRotary,
    _raw_attr,
    check_supported,
    full_attention_dims,
    to_interchange_dict,
)
from dspark_ds.drafters.dspark.model import apply_rope
from dspark_ds.drafters.eagle3.model import AttendFn, Eagle3DraftModel


class Gemma4Eagle3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = int(config.hidden_size)
        self.head_dim, self.num_kv_heads = full_attention_dims(config)
        self.num_heads = int(config.num_attention_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads: {self.num_heads} is not a multiple of the "
                f"{self.num_kv_heads} full-attention key/value heads"
            )
        self.scaling = 1.0  # NOTE: Gemma4 folds 1/sqrt(d) into q_norm / k_norm.
        bias, eps = bool(config.attention_bias), config.rms_norm_eps
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = (
            None
            if bool(config.attention_k_eq_v)
            else nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=bias)
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps=eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps=eps, with_scale=False)

    def _heads(self, x, num_heads):
        return x.view(*x.shape[:2], num_heads, self.head_dim)

    def project(self, x: torch.Tensor, rope):
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        k_raw = self._heads(self.k_proj(x), self.num_kv_heads)
        # NOTE: with k_eq_v, V is the raw K projection (before k_norm), then v_norm.
        v_raw = k_raw if self.v_proj is None else self._heads(self.v_proj(x), self.num_kv_heads)
        k = self.k_norm(k_raw).transpose(1, 2)
        v = self.v_norm(v_raw).transpose(1, 2)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def forward(self, x: torch.Tensor, rope, attend_fn: AttendFn) -> torch.Tensor:
        bsz, length, _ = x.shape
        out = attend_fn(*self.project(x, rope))
        return self.o_proj(out.transpose(1, 2).reshape(bsz, length, -1))


class Gemma4Eagle3DecoderLayer(nn.Module):
    """x = [input_layernorm(emb) ; hidden_norm(h)]; h += post_attn_norm(attn(x));
    h += post_ff_norm(mlp(pre_ff_norm(h))); h *= layer_scalar."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden, eps = int(config.hidden_size), config.rms_norm_eps
        self.self_attn = Gemma4Eagle3Attention(config)
        self.mlp = Gemma4TextMLP(config, layer_idx)
        self.hidden_norm = Gemma4RMSNorm(hidden, eps=eps)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # saved: `layers.{i}.layer_scalar`

    def forward(self, embeds, h, rope, attend_fn: AttendFn) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        h = h + self.post_attention_layernorm(self.self_attn(x, rope, attend_fn))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class Gemma4Eagle3Model(Eagle3DraftModel):
    architecture = "Gemma4Eagle3Model"

    def __init__(self, config):
        check_supported(config)
        super().__init__(config)

    def make_embedding(self):
        hidden, vocab = int(self.config.hidden_size), int(self.config.vocab_size)
        pad = _raw_attr(self.config, "pad_token_id")
        return Gemma4TextScaledWordEmbedding(
            vocab,
            hidden,
            pad if pad is not None and 0 <= int(pad) < vocab else None,
            embed_scale=float(hidden) ** 0.5,
        )

    def make_layer(self, layer_idx):
        return Gemma4Eagle3DecoderLayer(self.config, layer_idx)

    def make_norm(self, dim):
        return Gemma4RMSNorm(dim, eps=self.config.rms_norm_eps)

    def make_rotary(self):
        return Gemma4FullAttentionRotary(self.config)

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(normed)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    # ---- config hooks (the same as the DSpark Gemma4 backend's) ---------------------------
    finalize_draft_config = staticmethod(Gemma4DSparkModel.finalize_draft_config)

    @staticmethod
    def interchange_config_dict(data: dict, config) -> dict:
        """The reference layout (global_head_dim, num_global_key_value_heads), no runtime
        `block_size` alias."""
        head_dim, kv_heads = full_attention_dims(config)
        data = to_interchange_dict(data, head_dim, kv_heads)
        data.pop("block_size", None)
        return data
