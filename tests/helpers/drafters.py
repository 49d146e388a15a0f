"""Tiny drafters and targets for tests (random weights, no downloads)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from dspark_ds.drafters import build_draft_config, build_draft_model
from dspark_ds.drafters.presets import preset

VOCAB = 97
MASK_ID = VOCAB - 1


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


# DFlash's heads (build_draft_config / tiny_drafter keywords), from its preset
DFLASH = {
    k: getattr(preset("dflash"), k)
    for k in ("markov_rank", "confidence_head_alpha", "confidence_head_with_markov")
}


def tiny_drafter(seed: int = 0, target_config=None, **draft_kw):
    """A random drafter over a tiny Qwen3 target config; `draft_kw` go to build_draft_config."""
    kw = dict(
        target_layer_ids=[-1, 1, 2],
        mask_token_id=MASK_ID,
        num_draft_layers=2,
        block_size=4,
        num_anchors=6,
        markov_rank=8,
        markov_head_type="vanilla",
        confidence_head_alpha=1.0,
        confidence_head_with_markov=True,
    )
    kw.update(draft_kw)
    torch.manual_seed(seed)
    cfg = build_draft_config(target_config or tiny_qwen3_config(), **kw)
    model = build_draft_model(cfg)
    # Larger random weights than the default init so that the heads matter in comparisons.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.freeze_shared()
    return model


def random_batch(model, batch: int = 2, seq_len: int = 24, seed: int = 0, masked_prefix: int = 5):
    """input_ids, target features and a loss mask with an unsupervised prompt and right padding."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    n_feat = len(cfg.target_layer_ids) * cfg.hidden_size
    input_ids = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len), generator=g)
    loss_mask = torch.ones(batch, seq_len)
    loss_mask[:, :masked_prefix] = 0
    if batch > 1:
        loss_mask[1, seq_len - 6 :] = 0  # right padding on the second sample
    return dict(
        input_ids=input_ids,
        target_hidden_states=torch.randn(batch, seq_len, n_feat, generator=g),
        target_last_hidden_states=torch.randn(batch, seq_len, cfg.hidden_size, generator=g),
        loss_mask=loss_mask,
    )


def with_target_weights(drafter, target):
    """`drafter` (freshly built, seeded by the caller) with larger random weights than the
    default init, so that drafts vary, and the target's embedding and lm_head; in eval mode."""
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    return drafter.eval()
