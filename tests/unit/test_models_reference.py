"""The batched, masked training forward against a naive one-block-at-a-time reference."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_ds.drafters.dspark.block_attention import dense_block_mask
from dspark_ds.drafters.dspark.blocks import (
    build_eval_mask,
    build_label_indices,
    sample_anchor_positions,
)

from helpers.drafters import DFLASH, checked_blocks, parity_rounds, random_batch, tiny_drafter

HEADS = [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated"),
    dict(markov_head_type="rnn"),
    dict(markov_head_type="vanilla", confidence_head_with_markov=False),
    DFLASH,
    dict(DFLASH, sample_from_anchor=False),
    dict(markov_head_type="vanilla", sample_from_anchor=False),
]
IDS = [
    "vanilla",
    "gated",
    "rnn",
    "conf-without-markov",
    "dflash",
    "dflash-layout",
    "vanilla-dflash-layout",
]


def _rope(x, pos, inv_freq):
    angles = pos.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_block(model, input_ids, feats, anchor: int, labels: torch.Tensor):
    """One sample, one block: explicit context slice [0, anchor), no masks, loops for heads.
    The block is [anchor, MASK...] of γ slots, or γ + 1 without `sample_from_anchor`, whose
    anchor slot's output is then dropped."""
    G = model.block_size
    Q = G if model.config.sample_from_anchor else G + 1
    ctx = model.hidden_norm(model.fc(feats[:anchor]))  # [p, H]
    ids = torch.full((Q,), model.mask_token_id)
    ids[0] = input_ids[anchor]
    h = model.embed_tokens(ids)
    pos_ctx = torch.arange(anchor)
    pos_draft = torch.arange(anchor, anchor + Q)
    inv_freq = model.rotary_emb.inv_freq
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        hd, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        q = attn.q_norm(attn.q_proj(x).view(Q, nh, hd))
        src = torch.cat([ctx, x])
        k = attn.k_norm(attn.k_proj(src).view(-1, nkv, hd))
        v = attn.v_proj(src).view(-1, nkv, hd)
        pos_k = torch.cat([pos_ctx, pos_draft])
        heads = []
        for head in range(nh):
            kv = head // (nh // nkv)
            qh = _rope(q[:, head], pos_draft, inv_freq)
            kh = _rope(k[:, kv], pos_k, inv_freq)
            w = torch.softmax(qh @ kh.T / math.sqrt(hd), dim=-1)
            heads.append(w @ v[:, kv])
        h = h + attn.o_proj(torch.cat(heads, dim=-1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.norm(h)[Q - G :]
    logits = model.lm_head(h)
    prev = torch.cat([input_ids[anchor : anchor + 1], labels[:-1]])
    head = model.markov_head
    if head is not None:
        kind = model.config.markov_head_type
        state = torch.zeros(model.config.markov_rank)
        rows = []
        for k in range(G):
            e = head.markov_w1.weight[prev[k]]
            if kind == "vanilla":
                bias = head.markov_w2.weight @ e
            elif kind == "gated":
                g = torch.sigmoid(head.gate_proj(torch.cat([h[k], e])))
                bias = head.markov_w2.weight @ (g * e)
            else:
                z = head.joint_proj(torch.cat([state, e, h[k]]))
                r = model.config.markov_rank
                gate, cand, out = torch.sigmoid(z[:r]), torch.tanh(z[r : 2 * r]), z[2 * r :]
                state = gate * state + (1 - gate) * cand
                bias = head.markov_w2.weight @ torch.tanh(out)
            rows.append(logits[k] + bias)
        logits = torch.stack(rows)
    conf = None
    if model.confidence_head is not None:
        feat = h
        if model.confidence_head_with_markov:
            feat = torch.cat([h, head.markov_w1.weight[prev]], dim=-1)
        conf = model.confidence_head.proj(feat).squeeze(-1)
    return logits, conf


@pytest.mark.parametrize("heads", HEADS, ids=IDS)
def test_batched_forward_equals_naive_blocks(heads):
    model = tiny_drafter(**heads)
    batch = random_batch(model)
    with torch.no_grad():
        out = model(**batch, generator=torch.Generator().manual_seed(3))
        assert (out.block_keep_mask.sum(1) > 0).all()
        for b, a, conf in checked_blocks(naive_block, model, batch, out):
            if conf is None:
                assert out.confidence_pred is None
            else:
                torch.testing.assert_close(out.confidence_pred[b, a], conf, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out.draft_logits).all()


@pytest.mark.parametrize("heads", HEADS, ids=IDS)
def test_teacher_forcing_equals_forced_sampling(heads):
    """Training's teacher-forced block logits == inference's left-to-right logits forced to labels."""
    model = tiny_drafter(**heads)
    with torch.no_grad():
        for out, batch, ids, a, p, cache in parity_rounds(model):
            block = torch.full((1, model.query_block), model.mask_token_id)
            block[0, 0] = ids[p]
            hidden = model.forward_draft_block(
                context_features=batch["target_hidden_states"][:, :p],
                block_input_ids=block,
                start=p,
                cache=cache,
            )[:, model.query_block - model.block_size :]
            labels = out.target_ids[0, a].unsqueeze(0)
            _, logits = model.sample_draft_tokens(
                model.compute_logits(hidden),
                first_prev_token_ids=ids[p : p + 1],
                hidden_states=hidden,
                forced_tokens=labels,
            )
            # Train/serve parity too: inference round at start=p == training block at anchor p.
            torch.testing.assert_close(logits[0], out.draft_logits[0, a], atol=1e-4, rtol=1e-4)
            assert cache.seq_length == p


def test_dense_mask_equals_flex_forward():
    model = tiny_drafter(markov_head_type="rnn")
    batch = random_batch(model)
    g = torch.Generator().manual_seed(1)
    anchors, keep = sample_anchor_positions(batch["loss_mask"], model.num_anchors, generator=g)
    keep[0, -1] = False  # a dummy block that sees nothing
    anchors[0, -1] = 0
    with torch.no_grad():
        model.attn_implementation = "dense"
        dense = model(**batch, anchor_positions=anchors, block_keep_mask=keep)
        model.attn_implementation = "flex"
        flex = model(**batch, anchor_positions=anchors, block_keep_mask=keep)
    assert torch.isfinite(dense.draft_logits).all() and torch.isfinite(flex.draft_logits).all()
    torch.testing.assert_close(
        dense.draft_logits[keep], flex.draft_logits[keep], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        dense.confidence_pred[keep], flex.confidence_pred[keep], atol=1e-4, rtol=1e-4
    )


def test_dense_mask_visibility_matches_spec():
    anchors = torch.tensor([[3, 7, 0]])
    keep = torch.tensor([[True, True, False]])
    S, G = 10, 2
    m = dense_block_mask(anchors, keep, seq_len=S, block_size=G)[0, 0]
    for q in range(6):
        qb = q // G
        for kv in range(S + 6):
            expect = (kv < S and kv < anchors[0, qb]) or (kv >= S and (kv - S) // G == qb)
            assert bool(m[q, kv]) == (expect and bool(keep[0, qb])), (q, kv)


def test_anchor_sampling_and_eval_mask():
    loss_mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]]
    ).float()
    anchors, keep = sample_anchor_positions(
        loss_mask, 5, generator=torch.Generator().manual_seed(0)
    )
    # candidates: p and p+1 supervised -> sample 0: {2,3,6,7,8}, sample 1: {1,2}
    assert sorted(anchors[0].tolist()) == [2, 3, 6, 7, 8] and keep[0].all()
    assert anchors[1, :2].tolist() == [1, 2] and keep[1].tolist() == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert anchors[1, 2:].tolist() == [0, 0, 0]
    label, safe = build_label_indices(anchors, keep, block_size=3, seq_len=10)
    eval_mask = build_eval_mask(
        seq_len=10,
        loss_mask=loss_mask,
        label_indices=label,
        safe_label_indices=safe,
        block_keep_mask=keep,
    )
    # anchor 3 -> labels 4, 5(unsupervised), 6: prefix stops at 5 even though 6 is supervised.
    assert eval_mask[0, 1].tolist() == [True, False, False]
    # anchor 8 -> labels 9, 10 (outside), 11 (outside).
    assert eval_mask[0, 4].tolist() == [True, False, False]
    assert not eval_mask[1, 2:].any()
    assert eval_mask.dtype == torch.bool


def test_anchor_sampling_is_uniform():
    loss_mask = torch.ones(1, 12)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(11)
    for _ in range(2000):
        anchors, keep = sample_anchor_positions(loss_mask, 3, generator=g)
        assert keep.all() and (anchors[0, 1:] > anchors[0, :-1]).all()
        counts[anchors[0]] += 1
    # each of 11 candidates is picked with probability 3/11
    assert torch.allclose(counts / 2000, torch.full((11,), 3 / 11), atol=0.04)
