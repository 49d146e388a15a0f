"""Tiny Gemma4 configs and a cache-free greedy decoder, shared by the Gemma4 tests."""

from __future__ import annotations

import torch
from transformers import Gemma4Config

from helpers.drafters import VOCAB

CAP = 5.0  # small softcap so that it visibly bends the tiny model's logits


def tiny_gemma4_text(**overrides) -> dict:
    """A dense Gemma4 text config with distinct sliding / full-attention head shapes."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=CAP,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        max_position_embeddings=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1_000_000.0,
            },
        },
    )
    kw.update(overrides)
    return kw


def tiny_gemma4_target_config(**overrides) -> Gemma4Config:
    """The multimodal wrapper a Gemma4 checkpoint's config.json describes (text only here)."""
    return Gemma4Config(text_config=tiny_gemma4_text(**overrides))


def greedy_without_cache(target, input_ids: torch.Tensor, max_new_tokens: int, stops: set[int]):
    """Plain greedy decoding with a full forward per token: no KV cache to get wrong."""
    ids = input_ids
    for _ in range(max_new_tokens):
        nxt = target(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        if int(nxt) in stops:
            break
    return ids
