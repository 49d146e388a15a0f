"""A reduced draft vocabulary (`model.draft_vocab_size`, drafters/common/vocab.py): the maps'
convention, the loss over it against hand computations, lossless decoding (greedy equal to the
target's, T = 1 with the target's distribution), export and load."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from dspark_ds.drafters import (
    build_draft_config,
    build_draft_model,
    load_draft_model,
    save_draft_model,
)
from dspark_ds.drafters.common.vocab import top_tokens, vocab_maps
from dspark_ds.drafters.dspark.config import DSPARK_LOSS, LossWeights
from dspark_ds.drafters.dspark.loss import dspark_loss
from dspark_ds.drafters.dspark.loss_chunked import chunked_dspark_loss
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.eagle3.loss import chunked_eagle3_loss, eagle3_loss
from dspark_ds.errors import ConfigError

from helpers.drafters import random_batch, tiny_drafter, tiny_qwen3_config
from helpers.evaluation import (
    check_greedy_rounds,
    continuation_pvalues,
    decoding_prompts,
    exact_continuation_probs,
    greedy_reference,
    sampled_continuations,
    tiny_target,
)

N = 40  # of the tiny targets' 64 / 97 tokens


def draft_ids(vocab: int, n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n]


def test_maps_follow_the_eagle3_convention():
    ids = torch.tensor([7, 2, 11, 3])
    d2t, t2d = vocab_maps(ids, 16)
    # draft id i is target id i + d2t[i], ascending (vLLM: `base + draft_id_to_target_id`)
    assert (torch.arange(4) + d2t).tolist() == [2, 3, 7, 11]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [2, 3, 7, 11]
    with pytest.raises(ConfigError, match="d2t"):
        vocab_maps(torch.tensor([1, 1]), 16)
    with pytest.raises(ConfigError, match="d2t"):
        vocab_maps(torch.tensor([16]), 16)


def test_top_tokens_against_a_naive_count():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (2000,), generator=g) % 37  # ids 37.. never appear
    counts = torch.bincount(tokens, minlength=50)
    naive: dict[int, int] = {}
    for t in tokens.tolist():
        naive[t] = naive.get(t, 0) + 1
    ranked = sorted(range(50), key=lambda t: (-naive.get(t, 0), t))
    for n in (1, 10, 37, 45):
        assert top_tokens(counts, n).tolist() == sorted(ranked[:n])
    # the unseen ids fill the rest in id order
    assert top_tokens(counts, 40).tolist() == list(range(40))


def reduced_dspark(ids: torch.Tensor, seed: int = 0, **kw):
    model = tiny_drafter(seed=seed, draft_vocab_size=len(ids), **kw)
    full_head = torch.randn(model.config.vocab_size, model.config.hidden_size)
    model.set_draft_vocab(vocab_maps(ids, model.config.vocab_size)[0])
    model.initialize_embeddings_and_head(model.embed_tokens.weight.detach().clone(), full_head)
    return model, full_head


def test_the_head_is_the_target_rows_frozen_and_the_config_says_so():
    cfg = tiny_qwen3_config()
    ids = draft_ids(cfg.vocab_size)
    model, full_head = reduced_dspark(ids)
    torch.testing.assert_close(model.lm_head.weight, full_head[ids.sort().values])
    assert not model.lm_head.weight.requires_grad
    assert model.markov_head.markov_w2.weight.shape[0] == N
    assert model.markov_head.markov_w1.weight.shape[0] == cfg.vocab_size
    assert model.config.draft_vocab_size == N
    assert "draft_vocab_size" not in tiny_drafter().config.to_dict()
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        tiny_drafter(draft_vocab_size=cfg.vocab_size + 1)


def test_dspark_loss_over_the_draft_vocabulary_by_hand():
    cfg = tiny_qwen3_config()
    ids = draft_ids(cfg.vocab_size)
    model, full_head = reduced_dspark(
        ids, confidence_head_alpha=0.0, confidence_head_with_markov=False
    )
    batch = random_batch(model, seed=1)
    out = model(**batch)
    step = dspark_loss(out, over_ranks=False)
    sums = dict(zip(step.names, step.sums.tolist()))

    # by hand: labels in target ids, logits over the draft vocabulary
    feats = model.forward_hidden(
        **batch, anchor_positions=out.anchor_positions, block_keep_mask=out.block_keep_mask
    )
    sorted_ids = ids.sort().values
    labels = sorted_ids[feats.target_ids]  # draft id -> target id where inside
    inside = torch.isin(batch["input_ids"].gather(1, _label_positions(out, batch)), sorted_ids)
    assert torch.equal(out.label_in_vocab, inside.view_as(out.label_in_vocab))
    assert bool((~inside).any()) and bool(inside.any())
    w = out.eval_mask.float() * torch.exp(-torch.arange(4.0) / DSPARK_LOSS.loss_decay_gamma)
    logits = out.draft_logits.float()
    ce = F.cross_entropy(logits.reshape(-1, N), feats.target_ids.reshape(-1), reduction="none")
    w_ce = w * out.label_in_vocab.float()
    assert sums["den_ce"] == pytest.approx(float(w_ce.sum()), rel=1e-5)
    assert sums["num_ce"] == pytest.approx(float((ce.view_as(w) * w_ce).sum().detach()), rel=1e-4)
    # the target's distribution restricted to the draft vocabulary, renormalised
    state = out.aligned_target_logits.float()
    assert state.shape[-1] == N
    p_t = torch.softmax(state, -1)
    l1 = (torch.softmax(logits, -1) - p_t).abs().sum(-1)
    assert sums["num_l1"] == pytest.approx(float((l1 * w).sum().detach()), rel=1e-4)
    # a label outside is a greedy miss, inside a hit when the argmax maps to it
    hit = (sorted_ids[logits.argmax(-1)] == labels) & out.label_in_vocab & out.eval_mask
    assert sums["greedy@0"] + sums["greedy@1"] + sums["greedy@2"] + sums["greedy@3"] == float(
        hit.sum()
    )
    # the chunked paths agree
    for recompute in (False, True):
        chunked = chunked_dspark_loss(
            model, feats, None, chunk_anchors=3, over_ranks=False, recompute=recompute
        )
        torch.testing.assert_close(chunked.sums, step.sums, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked.loss, step.loss, rtol=1e-4, atol=1e-5)


def test_distribution_terms_and_dpace_over_the_draft_vocabulary_by_hand():
    """The distribution terms compare the draft with the target's distribution restricted to the
    draft vocabulary and renormalised, on every supervised slot (a label outside counts for them,
    not for the CE); D-PACE counts such a slot as never accepted (s = a)."""
    ids = draft_ids(tiny_qwen3_config().vocab_size)
    model, full_head = reduced_dspark(
        ids, confidence_head_alpha=0.0, confidence_head_with_markov=False
    )
    batch = random_batch(model, seed=2)
    out = model(**batch)
    alpha = 0.3
    weights = LossWeights(
        4.0, 1.0, 0.0, 0.0, loss_terms={"kl": 0.5, "tv": 0.2}, loss_schedule="dpace",
        dpace_alpha=alpha,
    )  # fmt: skip
    step = dspark_loss(out, weights, over_ranks=False)
    sums = dict(zip(step.names, step.sums.tolist()))

    feats = model.forward_hidden(
        **batch, anchor_positions=out.anchor_positions, block_keep_mask=out.block_keep_mask
    )
    valid, inside = out.eval_mask.float(), out.label_in_vocab
    assert bool((~inside & out.eval_mask).any())
    # the target's full logits over V, restricted to the draft tokens, renormalised
    full = feats.target_prev_hidden.float() @ full_head.T
    log_p = torch.log_softmax(full[..., ids.sort().values], -1)
    log_q = torch.log_softmax(out.draft_logits.detach().float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    tv = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    ce = F.cross_entropy(
        out.draft_logits.detach().reshape(-1, N).float(),
        out.target_ids.reshape(-1),
        reduction="none",
    ).view_as(valid)
    s_j = torch.where(inside, (1 - alpha) * torch.exp(-ce) + alpha, torch.full_like(ce, alpha))
    s_j = torch.where(out.eval_mask, s_j, torch.ones_like(s_j))
    prefix = torch.cumprod(s_j, -1) * valid
    w = (prefix.flip(-1).cumsum(-1).flip(-1) * valid).detach()
    assert sums["den_terms"] == float(valid.sum())
    assert sums["den_ce"] == float((valid * inside).sum())
    assert sums["num_kl"] == pytest.approx(float((kl * w).sum()), rel=1e-4)
    assert sums["num_tv"] == pytest.approx(float((tv * w).sum()), rel=1e-4)
    assert sums["num_ce"] == pytest.approx(float((ce * w * inside).sum()), rel=1e-4)
    for recompute in (False, True):
        chunked = chunked_dspark_loss(
            model, feats, None, weights, chunk_anchors=3, over_ranks=False, recompute=recompute
        )
        torch.testing.assert_close(chunked.sums, step.sums, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked.loss, step.loss, rtol=1e-4, atol=1e-5)


def _label_positions(out, batch):
    """[B, A*G] the position of each slot's label (anchor + 1 + j, clamped)."""
    G = out.target_ids.shape[-1]
    pos = out.anchor_positions.unsqueeze(-1) + 1 + torch.arange(G)
    return pos.clamp(max=batch["input_ids"].shape[1] - 1).flatten(1)


def eagle3_pair(target, ids, seed: int = 0, ttt_length: int = 3):
    torch.manual_seed(seed)
    cfg = build_eagle3_config(
        target.config, target_layer_ids=[0, 1], ttt_length=ttt_length, draft_vocab_size=len(ids)
    )
    drafter = build_draft_model(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    drafter.set_draft_vocab(vocab_maps(ids, target.config.vocab_size)[0])
    drafter.initialize_embeddings_and_head(target.model.embed_tokens.weight, target.lm_head.weight)
    return drafter.eval()


def test_eagle3_loss_over_the_draft_vocabulary():
    target = tiny_target()
    ids = draft_ids(64)
    drafter = eagle3_pair(target, ids)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 64, (2, 12), generator=g)
    feats = torch.randn(2, 12, 64, generator=g)
    last = torch.randn(2, 12, 32, generator=g)
    out = drafter(input_ids, feats, torch.ones(2, 12), last)
    assert out.draft_logits.shape[-1] == N and out.target_logits.shape[-1] == N
    # the target's logits of the draft tokens: its full logits restricted
    full = last @ target.lm_head.weight.T
    torch.testing.assert_close(
        out.target_logits, full[..., ids.sort().values], rtol=1e-5, atol=1e-5
    )
    inside = torch.isin(input_ids, ids)
    assert bool((out.target_ids == -1).any())
    assert torch.equal(out.target_ids[:, :-2, 0] >= 0, inside[:, 2:])
    step = eagle3_loss(out, over_ranks=False)
    assert torch.isfinite(step.loss)
    # a label outside the vocabulary is a greedy miss; the chunked loss agrees
    sums = dict(zip(step.names, step.sums.tolist()))
    feats = drafter.forward_hidden(input_ids, feats, torch.ones(2, 12), last)
    chunked = chunked_eagle3_loss(drafter, feats, chunk_rows=7, over_ranks=False)
    torch.testing.assert_close(chunked.sums, step.sums, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked.loss, step.loss, rtol=1e-4, atol=1e-5)
    draft_arg = out.draft_logits.argmax(-1)
    hits = ((draft_arg == out.target_ids) & out.eval_mask).sum(dim=(0, 1))
    for k in range(3):
        names = [n for n in sums if n.startswith("greedy") and n.endswith(f"@{k}")]
        assert names and sums[names[0]] == float(hits[k]), names
    # the distribution terms against the target's restricted distribution (step 0: the target's
    # logits of the next position), on both paths
    terms = {"kl": 0.5, "tv": 0.2}
    step = eagle3_loss(out, over_ranks=False, loss_terms=terms)
    sums = dict(zip(step.names, step.sums.tolist()))
    log_p = torch.log_softmax(full[:, 1:, ids.sort().values].detach(), -1)
    log_q = torch.log_softmax(out.draft_logits[:, :-1, 0].detach().float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = out.eval_mask[:, :-1, 0].float()
    assert sums["num_kl@0"] == pytest.approx(float((kl * mask).sum()), rel=1e-4)
    chunked = chunked_eagle3_loss(drafter, feats, chunk_rows=7, over_ranks=False, loss_terms=terms)
    torch.testing.assert_close(chunked.sums, step.sums, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked.loss, step.loss, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def target():
    return tiny_target(logit_scale=3.0)


# the decoding tests' DSpark: its Markov and confidence heads on
HEADS = dict(
    block_size=4, markov_rank=8, confidence_head_alpha=1.0, confidence_head_with_markov=True
)


def dspark_for(target, ids, seed: int = 1, std: float | None = 0.3, fields: dict = HEADS):
    """A one-layer DSpark over the draft vocabulary `ids` of `target` (its last token the mask),
    with the target's embedding and head; its matrices N(0, std) when std is set."""
    from helpers.evaluation import random_drafter

    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    cfg = build_draft_config(
        target.config,
        target_layer_ids=[0, 1],
        mask_token_id=vocab - 1,
        num_draft_layers=1,
        num_anchors=8,
        draft_vocab_size=len(ids),
        **fields,
    )
    drafter = build_draft_model(cfg).eval()
    if std is not None:
        with torch.no_grad():
            for p in drafter.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, std)
    drafter.set_draft_vocab(vocab_maps(ids, vocab)[0])
    drafter.initialize_embeddings_and_head(target.model.embed_tokens.weight, target.lm_head.weight)
    assert random_drafter  # the full-vocabulary counterpart of this helper
    return drafter


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_greedy_decoding_with_a_draft_vocabulary_equals_the_target(target, kind, monkeypatch):
    # the target's greedy tokens: most of them inside the draft vocabulary, some outside
    prompts = decoding_prompts(64)
    want = [greedy_reference(target, p, 12) for p in prompts]
    produced = torch.cat([w[0, p.shape[1] :] for w, p in zip(want, prompts)]).unique()
    keep = [int(t) for t in produced[:-2]] + [int(t) for t in draft_ids(64, 64)]
    ids = torch.tensor(list(dict.fromkeys(t for t in keep if t not in produced[-2:].tolist()))[:N])
    drafter = dspark_for(target, ids) if kind == "dspark" else eagle3_pair(target, ids)
    outside = set(range(64)) - set(ids.tolist())
    proposed_tokens: list[int] = []
    from dspark_ds.drafters.registry import kind_of

    decode = kind_of(drafter).decode
    propose = decode.propose

    def recording(model, draft_round):
        proposal = propose(model, draft_round)
        proposed_tokens.extend(proposal.tokens.flatten().tolist())
        assert torch.isinf(proposal.logits[..., sorted(outside)]).all()
        return proposal

    monkeypatch.setattr(decode, "propose", recording)
    policies = ({"policy": "full"},)
    proposed, _ = check_greedy_rounds(target, drafter, prompts, want, 12, policies)
    assert proposed > 0
    assert not outside & set(proposed_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_sampled_decoding_with_a_draft_vocabulary_keeps_the_target_distribution(target, kind):
    target = tiny_target(vocab_size=16, hidden_size=32, logit_scale=1.0)
    ids = torch.tensor([0, 2, 3, 5, 7, 8, 11, 14])
    if kind == "dspark":
        drafter = dspark_for(target, ids, std=None, fields=dict(block_size=3, markov_rank=4))
    else:
        drafter = eagle3_pair(target, ids, ttt_length=3)
    prompt = torch.tensor([[1, 4, 9, 2]])
    counts, accepted = sampled_continuations(target, drafter, prompt, samples=3000, batch_size=100)
    exact = exact_continuation_probs(target, prompt, 3)
    assert accepted > 0
    assert min(continuation_pvalues(counts, exact)) > 1e-3


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_export_carries_d2t_and_loads_back(target, kind, tmp_path):
    ids = draft_ids(64)
    drafter = dspark_for(target, ids) if kind == "dspark" else eagle3_pair(target, ids)
    out = save_draft_model(drafter, tmp_path / kind)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == N and config["vocab_size"] == 64
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert tuple(f.get_tensor("lm_head.weight").shape) == (N, 32)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(N) + d2t).tolist() == sorted(ids.tolist())
    loaded = load_draft_model(out, dtype=torch.bfloat16)
    assert loaded.d2t.dtype == torch.int64 and torch.equal(loaded.d2t, drafter.d2t)
    assert torch.equal(loaded.t2d, drafter.t2d)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(
            loaded.state_dict()[name].to(tensor.dtype), tensor, atol=1e-2, rtol=1e-2
        )


def test_a_published_reduced_checkpoint_without_its_head_or_t2d_reads(target, tmp_path):
    """A checkpoint that leaves the lm_head to the target (its rows of d2t's tokens are taken)
    and carries d2t alone (t2d, which vLLM skips, is derived)."""
    from safetensors.torch import load_file, save_file

    ids = draft_ids(64)
    drafter = eagle3_pair(target, ids)
    out = save_draft_model(drafter, tmp_path / "e")
    state = load_file(out / "model.safetensors")
    shared = state.pop("embed_tokens.weight"), target.lm_head.weight.detach().clone()
    del state["lm_head.weight"], state["t2d"]
    save_file(state, out / "model.safetensors")
    back = load_draft_model(out, shared_weights=shared)
    assert torch.equal(back.t2d, drafter.t2d) and torch.equal(back.d2t, drafter.d2t)
    torch.testing.assert_close(back.lm_head.weight, drafter.lm_head.weight)


def test_what_serves_a_draft_vocabulary_is_said_by_name():
    from dspark_ds.drafters.io import draft_config_dict
    from dspark_ds.drafters.serving import serving_format

    from helpers.drafters import DFLASH

    def native(model) -> dict:
        return {**draft_config_dict(model.config), "architectures": [model.architecture]}

    dspark = serving_format(native(tiny_drafter(draft_vocab_size=N)))
    assert dspark.vllm_method is None and "draft_vocab_size: 40" in dspark.warnings[0]
    dflash = tiny_drafter(draft_vocab_size=N, sample_from_anchor=False, **DFLASH)
    assert serving_format(native(dflash)).vllm_method == "dflash"
    eagle3 = build_draft_model(
        build_eagle3_config(tiny_qwen3_config(), target_layer_ids=[0, 1], draft_vocab_size=N)
    )
    assert serving_format(native(eagle3)).vllm_method == "eagle3"
