"""Targets of any family: the Qwen3-style drafter config sized from a target's text config.

Qwen3 and Gemma4 targets get drafters of their own family (a deep copy of the target's text
config, drafters/<kind>/qwen3.py and gemma4.py). Every other causal LM (Llama, Qwen2, Mistral,
Qwen3-MoE, gpt-oss, DeepSeek-V3, ...) gets the Qwen3 backbone, as DFlash and Eagle3 drafters do
for other families: a `Qwen3Config` (model_type "qwen3", so the reference implementation, SGLang
and vLLM read it as they read a Qwen3 target's drafter) with the target's hidden size, vocabulary,
attention heads, head size, MLP width, RMSNorm epsilon, context length and RoPE (theta and
scaling). What the drafter shares with such a target is only the embedding and the lm_head
matrices (docs/drafters.md#target-families). The drafter's logits are `lm_head(h)`, so a family
whose logits are anything else (soft-capped, scaled) is refused here by the config field that says
so, and by `FrozenTarget.check_head` (target.py) on the real model when it runs in the job.
"""

from __future__ import annotations

from dspark_ds.errors import ConfigError

# Target text model_types whose drafters use their own family's backbone.
NATIVE_FAMILIES = ("qwen3", "gemma4", "gemma4_text")

# Config fields that make a family's logits differ from lm_head(final normed state), with the
# value that leaves them plain.
_LOGIT_FIELDS = {
    "final_logit_softcapping": None,  # Gemma2, Gemma3 when set
    "logit_scale": 1.0,  # Cohere
    "logits_scaling": 1.0,  # Granite
    "lm_head_multiplier": 1.0,  # Falcon-H1
}
# The first of these a config has is the RMSNorm epsilon.
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
# rope_type values transformers' Qwen3 rotary embedding computes.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def family(text_config) -> str:
    """The target's text model_type ("llama", "qwen3_moe", ...)."""
    return str(getattr(text_config, "model_type", None) or "unknown")


def is_native(model_type: str) -> bool:
    return model_type in NATIVE_FAMILIES


def _field(config, name: str):
    try:
        return getattr(config, name, None)
    except (AttributeError, RuntimeError):  # per-layer attribute guards of some configs
        return None


def check_plain_logits(text_config) -> None:
    """Refuses a target whose config says its logits are not lm_head(final normed state)."""
    name = family(text_config)
    for field, plain in _LOGIT_FIELDS.items():
        value = _field(text_config, field)
        if value is not None and value != plain:
            raise ConfigError(
                f"{field}: {name} targets with {field}={value!r} are not supported: their logits "
                "are not lm_head(final hidden state), which the Qwen3-style drafter shares"
            )


def _require(text_config, field: str) -> int:
    value = _field(text_config, field)
    if value is None:
        raise ConfigError(
            f"{field}: the {family(text_config)} target's config has no {field}, which the "
            "Qwen3-style drafter is sized from"
        )
    return int(value)


def draft_rope_parameters(text_config) -> dict:
    """The target's RoPE (theta and scaling) for the drafter's own rotary embedding.

    A per-layer-type dict (Gemma3-style) gives its `full_attention` entry, DeepSeek-V4's
    `{"main", "compress"}` its `main` entry (the RoPE its sliding-window attention gives the
    tokens themselves; `compress` is its compressed branches'); a partial rotary factor is
    dropped (every draft head dimension rotates)."""
    name = family(text_config)
    rope = _field(text_config, "rope_parameters")
    if rope is None:  # configs without transformers 5's standardised field
        theta = _field(text_config, "rope_theta") or 10_000.0
        rope = {"rope_type": "default", "rope_theta": float(theta)}
    rope = dict(rope)
    for entry in ("full_attention", "main"):
        if "rope_type" not in rope and entry in rope:
            rope = dict(rope[entry])
    rope.pop("partial_rotary_factor", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope_parameters: the {name} target's rope_type {rope_type!r} is not one the "
            f"Qwen3-style drafter computes ({', '.join(ROPE_TYPES)})"
        )
    if "rope_theta" not in rope:
        raise ConfigError(f"rope_parameters: the {name} target's RoPE has no rope_theta")
    return rope


def qwen3_style_config(text_config):
    """A `Qwen3Config` with the sizes, norm epsilon and RoPE of `text_config` (any family);
    ConfigError names the field that cannot be used."""
    # lazy: transformers, 0.9 s of import
    from transformers import Qwen3Config

    name = family(text_config)
    if bool(_field(text_config, "is_encoder_decoder")):
        raise ConfigError(
            f"is_encoder_decoder: {name} is an encoder-decoder model; the drafters speculate "
            "for decoder-only causal LMs"
        )
    check_plain_logits(text_config)
    hidden = _require(text_config, "hidden_size")
    heads = _require(text_config, "num_attention_heads")
    kv_heads = int(_field(text_config, "num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(
            f"num_key_value_heads: {kv_heads} does not divide the {name} target's {heads} "
            "attention heads"
        )
    head_dim = int(_field(text_config, "head_dim") or hidden // heads)
    intermediate = _field(text_config, "intermediate_size")
    if intermediate is None and _field(text_config, "moe_intermediate_size") is not None:
        # a MoE config without a dense width (Qwen3.5-MoE): the width a token's MLP runs at,
        # its routed experts and the shared one
        intermediate = int(_field(text_config, "moe_intermediate_size")) * int(
            _field(text_config, "num_experts_per_tok") or 1
        ) + int(_field(text_config, "shared_expert_intermediate_size") or 0)
    if intermediate is None:
        _require(text_config, "intermediate_size")
    eps = next((_field(text_config, f) for f in _EPS_FIELDS if _field(text_config, f)), 1e-6)
    out = Qwen3Config(
        vocab_size=_require(text_config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=int(intermediate),
        num_hidden_layers=_require(text_config, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(_field(text_config, "max_position_embeddings") or 4096),
        initializer_range=float(_field(text_config, "initializer_range") or 0.02),
        rms_norm_eps=float(eps),
        rope_parameters=draft_rope_parameters(text_config),
        attention_bias=False,
        tie_word_embeddings=False,
        pad_token_id=_field(text_config, "pad_token_id"),
        bos_token_id=_field(text_config, "bos_token_id"),
        eos_token_id=_field(text_config, "eos_token_id"),
    )
    dtype = _field(text_config, "dtype")
    if dtype is not None:
        out.dtype = dtype
    return out
