"""The Gemma4 backbone both drafter kinds share (docs/algorithm.md#gemma4).

Differences from Qwen3: full-attention head shape (`global_head_dim`, and with
`attention_k_eq_v` the `num_global_key_value_heads` K/V heads, no `v_proj`, V = the K
projection before `k_norm`), a scale-free `v_norm` on V, attention scaling 1.0, sandwich norms
around attention and MLP, a `layer_scalar` buffer, a sqrt(H)-scaled embedding, the
`full_attention` RoPE parameters, and `final_logit_softcapping` on the logits.

Config compatibility: transformers 5.10 wrote `global_head_dim` / `num_global_key_value_heads`
into config.json; newer releases (5.2x) fold them into `per_layer_config`. Both load through
`Gemma4TextConfig`, and `full_attention_dims` reads either. Interchange directories are written
in the 5.10 layout (what the reference implementation reads), which newer releases also read.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextMLP,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
)

from dspark_ds.drafters.common.target_config import global_attr
from dspark_ds.errors import ConfigError

DRAFT_LAYER_TYPE = "full_attention"


def raw_attr(config, name: str):
    """`config.name` or None; never trips the per-layer-attribute guard of newer configs."""
    return global_attr(config, name)


def full_attention_dims(config) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of a Gemma4 `full_attention` layer, any config layout."""
    k_eq_v = bool(raw_attr(config, "attention_k_eq_v"))
    global_head_dim = raw_attr(config, "global_head_dim")
    if global_head_dim is not None:  # transformers 5.10 layout: raw fields on the config
        kv = raw_attr(config, "num_global_key_value_heads") if k_eq_v else None
        kv = kv if kv is not None else raw_attr(config, "num_key_value_heads")
        return int(global_head_dim), int(kv)
    per_layer = raw_attr(config, "per_layer_config")
    layer_types = list(raw_attr(config, "layer_types") or [])
    if per_layer is None or DRAFT_LAYER_TYPE not in layer_types:
        raise ConfigError(
            "global_head_dim: the Gemma4 config has neither `global_head_dim` nor a "
            "`per_layer_config` for a full_attention layer"
        )
    layer = per_layer[DRAFT_LAYER_TYPE]
    return int(layer.head_dim), int(layer.num_key_value_heads)


def check_supported(config) -> None:
    """Refuses Gemma4 features the drafters do not implement, naming the field."""
    if bool(raw_attr(config, "enable_moe_block")):
        raise ConfigError(
            "enable_moe_block: Gemma4 targets with MoE blocks are not supported by the "
            "drafters (their layers are dense); use a dense Gemma4 target"
        )
    if int(raw_attr(config, "hidden_size_per_layer_input") or 0) != 0:
        raise ConfigError(
            "hidden_size_per_layer_input: Gemma4 targets with per-layer input gates (PLE) are "
            "not supported by the drafters; expected 0, got "
            f"{raw_attr(config, 'hidden_size_per_layer_input')}"
        )
    if int(raw_attr(config, "num_kv_shared_layers") or 0) and raw_attr(
        config, "use_double_wide_mlp"
    ):
        raise ConfigError(
            "use_double_wide_mlp: Gemma4 targets whose KV-sharing layers use double-wide MLPs "
            "are not supported by the drafters (their layers never share K/V)"
        )
    cap = raw_attr(config, "final_logit_softcapping")
    if cap is not None and float(cap) <= 0:
        raise ConfigError(f"final_logit_softcapping: must be > 0 or null, got {cap!r}")


def to_interchange_dict(data: dict, head_dim: int, kv_heads: int) -> dict:
    data = {k: v for k, v in data.items() if k != "per_layer_config"}
    data["global_head_dim"] = head_dim
    data["num_global_key_value_heads"] = kv_heads
    return data


class Gemma4AttentionProjections(nn.Module):
    """q / k / (v) / o projections of a full-attention layer with q_norm, k_norm and the
    scale-free v_norm, reading `in_features`-wide inputs (hidden size by default)."""

    def __init__(self, config, in_features: int | None = None):
        super().__init__()
        hidden = int(config.hidden_size)
        in_features = in_features or hidden
        self.head_dim, self.num_kv_heads = full_attention_dims(config)
        self.num_heads = int(config.num_attention_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads: {self.num_heads} is not a multiple of the "
                f"{self.num_kv_heads} full-attention key/value heads"
            )
        self.k_eq_v = bool(config.attention_k_eq_v)
        # NOTE: no 1/sqrt(d): q_norm / k_norm fix the scale of the scores (learned norm weights
        # play its role), exactly as in the Gemma4 target.
        self.scaling = 1.0
        bias, eps = bool(config.attention_bias), config.rms_norm_eps
        width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, width, bias=bias)
        self.v_proj = None if self.k_eq_v else nn.Linear(in_features, width, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps=eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps=eps, with_scale=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], num_heads, self.head_dim)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, in] -> [B, Hq, L, D], normed, before RoPE."""
        return self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, in] -> (k, v), each [B, Hkv, L, D], normed, before RoPE."""
        k_raw = self._heads(self.k_proj(x), self.num_kv_heads)
        # NOTE: with k_eq_v, V is the raw K projection (before k_norm), then v_norm.
        v_raw = k_raw if self.v_proj is None else self._heads(self.v_proj(x), self.num_kv_heads)
        return self.k_norm(k_raw).transpose(1, 2), self.v_norm(v_raw).transpose(1, 2)


class Gemma4SandwichLayer(nn.Module):
    """The Gemma4 decoder-layer frame around a kind's attention: the MLP, the sandwich norms
    and `layer_scalar`. `finish(h, attn)` is the residual part:
    h += post_attn_norm(attn); h += post_ff_norm(mlp(pre_ff_norm(h))); h *= layer_scalar."""

    def __init__(self, config, layer_idx: int, self_attn: nn.Module):
        super().__init__()
        hidden, eps = int(config.hidden_size), config.rms_norm_eps
        # NOTE: registered first: the init draws of the projections come before the MLP's.
        self.self_attn = self_attn
        # NOTE: draft layers never share K/V, so the MLP is never the KV-sharing (double-wide)
        # kind, whatever num_kv_shared_layers the target's config carried.
        mlp_config = copy.copy(config)
        mlp_config.num_kv_shared_layers = 0
        self.mlp = Gemma4TextMLP(mlp_config, layer_idx)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps=eps)
        # A persistent buffer: interchange checkpoints carry `layers.{i}.layer_scalar`.
        self.register_buffer("layer_scalar", torch.ones(1))

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        # NOTE: in h's dtype, as the target's in-place `*=` keeps it: DeepSpeed's bf16 casts
        # parameters only, and an fp32 buffer here would turn the residual stream fp32
        return h * self.layer_scalar.to(h.dtype)


class Gemma4FullAttentionRotary(Gemma4TextRotaryEmbedding):
    """The drafters call `rotary(x, position_ids)`; every draft layer is full_attention."""

    def forward(self, x, position_ids):
        return super().forward(x, position_ids, DRAFT_LAYER_TYPE)


class Gemma4Backend:
    """The hooks of `TargetSharedWeights` and the config fix-ups a Gemma4 drafter shares
    across kinds (the kind's model class adds `make_layer`). Put it first in the bases."""

    def __init__(self, config):
        check_supported(config)
        super().__init__(config)

    def make_embedding(self) -> nn.Module:
        hidden = int(self.config.hidden_size)
        pad = raw_attr(self.config, "pad_token_id")
        vocab = int(self.config.vocab_size)
        return Gemma4TextScaledWordEmbedding(
            vocab,
            hidden,
            pad if pad is not None and 0 <= int(pad) < vocab else None,
            embed_scale=float(hidden) ** 0.5,
        )

    def make_norm(self, dim: int) -> nn.Module:
        return Gemma4RMSNorm(dim, eps=self.config.rms_norm_eps)

    def make_rotary(self) -> nn.Module:
        return Gemma4FullAttentionRotary(self.config)

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The shared lm_head's logits soft-capped by `final_logit_softcapping` (before any
        Markov bias: a DSpark drafter adds it afterwards)."""
        logits = self.lm_head(normed)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / float(cap)) * float(cap)

    @staticmethod
    def finalize_draft_config(cfg, target_text_config):
        """Rebuilds the drafter config so per-layer attributes match the drafter's layers.

        The deep copy of the target's text config still carries per-layer overrides indexed by
        the *target's* layers; rebuilding from the 5.10 layout (`global_head_dim`,
        `num_global_key_value_heads`) lets `Gemma4TextConfig` derive them for the drafter.
        """
        check_supported(target_text_config)
        head_dim, kv_heads = full_attention_dims(target_text_config)
        data = to_interchange_dict(cfg.to_dict(), head_dim, kv_heads)
        data.pop("use_sliding_window", None)  # not a Gemma4 field
        data["num_kv_shared_layers"] = 0  # the target's K/V sharing has no drafter meaning
        return Gemma4TextConfig.from_dict(data)

    @staticmethod
    def interchange_config_dict(data: dict, config) -> dict:
        """config.json in the layout every transformers release and the reference read."""
        head_dim, kv_heads = full_attention_dims(config)
        return to_interchange_dict(data, head_dim, kv_heads)
