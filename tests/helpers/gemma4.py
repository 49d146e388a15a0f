"""Tiny Gemma4 configs and a cache-free greedy decoder, shared by the Gemma4 tests."""

from __future__ import annotations

import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from dspark_ds.drafters import build_draft_config, build_draft_model

from helpers.drafters import MASK_ID, VOCAB
from helpers.tiny_models import tiny_widths

CAP = 5.0  # small softcap so that it visibly bends the tiny model's logits


def tiny_gemma4_text(**overrides) -> dict:
    """A dense Gemma4 text config with distinct sliding / full-attention head shapes."""
    kw = tiny_widths(
        VOCAB,
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


def repeating_gemma4_pair():
    """A Gemma4 target whose sliding windows (6) are shorter than the text, and a DSpark drafter
    for it that proposes repeats: what greedy decoding on it mostly produces (seeded with 0)."""
    torch.manual_seed(0)
    target_cfg = tiny_gemma4_target_config(final_logit_softcapping=30.0, sliding_window=6)
    target = Gemma4ForConditionalGeneration(target_cfg).eval()
    with torch.no_grad():
        # Weak layer outputs: the residual stream keeps the token, so greedy decoding runs in
        # long repeats that a drafter can predict (a random target is otherwise unpredictable).
        for layer in target.model.language_model.layers:
            layer.post_attention_layernorm.weight.fill_(0.1)
            layer.post_feedforward_layernorm.weight.fill_(0.1)
    cfg = build_draft_config(
        target_cfg,
        target_layer_ids=[0, 1, 2],
        mask_token_id=MASK_ID,
        num_draft_layers=2,
        block_size=4,
        markov_rank=VOCAB,
    )
    drafter = build_draft_model(cfg).eval()
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    with torch.no_grad():
        # A bigram "repeat the previous token" Markov head: every slot proposes the anchor.
        drafter.markov_head.markov_w1.weight.copy_(50.0 * torch.eye(VOCAB))
        drafter.markov_head.markov_w2.weight.copy_(torch.eye(VOCAB))
    return target, drafter


def greedy_without_cache(target, input_ids: torch.Tensor, max_new_tokens: int, stops: set[int]):
    """Plain greedy decoding with a full forward per token: no KV cache to get wrong."""
    ids = input_ids
    for _ in range(max_new_tokens):
        nxt = target(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        if int(nxt) in stops:
            break
    return ids
