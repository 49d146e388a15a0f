"""Tiny drafters and targets for tests (random weights, no downloads)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from dspark_ds.drafters import build_draft_config, build_draft_model
from dspark_ds.drafters.presets import preset

from helpers.tiny_models import tiny_widths

VOCAB = 97
MASK_ID = VOCAB - 1


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    kw = tiny_widths(
        VOCAB, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False
    )
    return Qwen3Config(**{**kw, **overrides})


# DFlash's heads (build_draft_config / tiny_drafter keywords), from its preset
DFLASH = {
    k: getattr(preset("dflash"), k)
    for k in ("markov_rank", "confidence_head_alpha", "confidence_head_with_markov")
}


def tiny_dspark_config(target_config, layer_ids, *, num_anchors: int = 8, markov_rank: int = 8):
    """A one-layer DSpark config (blocks of 4) for a target that uses the tiny tokenizer (its
    `<|mask|>` is id 3)."""
    return build_draft_config(
        target_config,
        target_layer_ids=list(layer_ids),
        mask_token_id=3,
        num_draft_layers=1,
        block_size=4,
        num_anchors=num_anchors,
        markov_rank=markov_rank,
    )


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


def spread_weights(model) -> None:
    """In place: norm weights around 1 (std 0.3) and matrices N(0, 0.2), larger than the default
    init, so that a mix-up between two norms or two projections cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0.0, 0.2)


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


def checked_blocks(naive_block, model, batch: dict, out):
    """Each block `model`'s batched forward kept in `out` (on `batch`), its draft logits checked
    against `naive_block(model, input_ids, target_features, anchor, target_ids)`'s, one row at a
    time; yields (row, block, the rest of what `naive_block` returned)."""
    for b in range(batch["input_ids"].shape[0]):
        for a in range(out.anchor_positions.shape[1]):
            if not out.block_keep_mask[b, a]:
                continue
            logits, rest = naive_block(
                model,
                batch["input_ids"][b],
                batch["target_hidden_states"][b],
                int(out.anchor_positions[b, a]),
                out.target_ids[b, a],
            )
            torch.testing.assert_close(out.draft_logits[b, a], logits, atol=1e-4, rtol=1e-4)
            yield b, a, rest


def parity_rounds(model):
    """The training forward of `model` on one random row, then, for each anchor block, what an
    inference round from it starts from: yields (the forward's output, the batch, the row's
    ids, the anchor's index and position, a fresh cache). Run under no_grad."""
    batch = random_batch(model, batch=1)
    out = model(**batch)
    ids = batch["input_ids"][0]
    for a in range(out.anchor_positions.shape[1]):
        yield out, batch, ids, a, int(out.anchor_positions[0, a]), model.new_cache()


def with_target_weights(drafter, target, std: float = 0.2):
    """`drafter` (freshly built, seeded by the caller) with larger random weights than the
    default init (matrices N(0, std)), so that drafts vary, and the target's embedding and
    lm_head; in eval mode."""
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    return drafter.eval()
