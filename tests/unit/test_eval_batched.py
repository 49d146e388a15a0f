"""Batched speculative decoding (eval/batched.py): several prompts of different lengths in
flight, ragged acceptance, per-row cache trims; lossless like batch 1 for DSpark, DFlash and
Eagle3 drafters, with and without the confidence scheduler."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.io import build_draft_model
from dspark_ds.eval import speculative_generate, target_generate, verify
from dspark_ds.eval.batched import batched_generate
from dspark_ds.eval.policy import schedule_prefixes

from helpers.drafters import with_target_weights
from helpers.evaluation import (
    chi_square_pvalue,
    exact_continuation_probs,
    random_drafter,
    record_proposals,
    sps_cliff,
    tiny_target,
)

ALPHA = 1e-3


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=64, hidden_size=32, num_layers=3, logit_scale=4.0)


def _prompts(lengths, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (1, n), generator=g) for n in lengths]


def _eagle3(target, seed=0):
    cfg = build_eagle3_config(target.config, target_layer_ids=[0, 1], ttt_length=4)
    torch.manual_seed(seed)
    return with_target_weights(build_draft_model(cfg), target, std=0.3)


def _record_drafts_batched(monkeypatch) -> dict[int, list[list[int]]]:
    from dspark_ds.eval.batched import BatchedDecoder

    seen: dict[int, list[list[int]]] = {}
    original = BatchedDecoder._draft

    def recording(self, active, *args):
        proposal = original(self, active, *args)
        for req, row in zip(active, proposal.tokens.tolist()):
            seen.setdefault(req.index, []).append(row)
        return proposal

    monkeypatch.setattr(BatchedDecoder, "_draft", recording)
    return seen


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_greedy_batched_equals_greedy_target_and_batch_one(target, kind, monkeypatch):
    """Every prompt's output equals the target's greedy generation, and every round drafts what
    the batch-1 loop drafts for that prompt (caches, positions and masks per row are right)."""
    if kind == "eagle3":
        drafter = _eagle3(target)
    else:
        drafter = random_drafter(
            target,
            markov_rank=8 if kind == "dspark" else 0,
            confidence=kind == "dspark",
            block_size=4,
            markov_std=0.5 if kind == "dspark" else None,
        )
    prompts = _prompts([5, 11, 3, 8, 14, 6])
    budget = 24
    single = {}
    with monkeypatch.context() as m:
        seen = record_proposals(m, drafter)
        for i, p in enumerate(prompts):
            seen.clear()
            _, stats = speculative_generate(target, drafter, p, max_new_tokens=budget)
            single[i] = (list(seen), stats)
    batched_drafts = _record_drafts_batched(monkeypatch)
    results = batched_generate(target, drafter, prompts, batch_size=3, max_new_tokens=budget)
    assert [r.index for r in results] == list(range(len(prompts)))
    for r in results:
        want = target_generate(target, prompts[r.index], max_new_tokens=budget)
        assert r.output_ids.tolist() == want.tolist(), f"prompt {r.index}"
        drafts1, stats1 = single[r.index]
        assert r.stats.accepted_per_round == stats1.accepted_per_round
        assert r.stats.committed_per_round == stats1.committed_per_round
        assert len(drafts1) == len(batched_drafts[r.index]) == stats1.rounds  # every round seen
        for a, b in zip(drafts1, batched_drafts[r.index]):
            n = min(len(a), len(b))  # batch 1 shortens Eagle3's last chains to the budget
            assert a[:n] == b[:n]
    accepted = [a for r in results for a in r.stats.accepted_per_round]
    if kind != "eagle3":  # a random Eagle3 chain rarely matches a random target
        assert max(accepted) > 0


def test_sliding_window_target_with_ragged_acceptance():
    """A Gemma4 target whose sliding windows are shorter than the text; rows accept 0..γ drafts
    in the same round, so their caches are trimmed by different amounts."""
    from helpers.gemma4 import VOCAB, greedy_without_cache, repeating_gemma4_pair

    target, drafter = repeating_gemma4_pair()
    prompts = _prompts([12, 5, 9, 14], vocab=VOCAB)
    results = batched_generate(target, drafter, prompts, batch_size=3, max_new_tokens=30)
    for r in results:
        assert (
            r.output_ids.tolist()
            == greedy_without_cache(target, prompts[r.index], 30, set()).tolist()
        )
    accepted = [a for r in results for a in r.stats.accepted_per_round]
    assert max(accepted) == 4 and min(accepted) == 0 and any(0 < a < 4 for a in accepted)


# ---- the prefix scheduler -------------------------------------------------------------------


def test_scheduler_follows_algorithm_one():
    # The paper's appendix example: Θ0 = 1.0 > Θ1 = 0.9, so the search stops before looking at
    # the second slot (whose survival depends on the first token): ℓ = 0, not 2.
    table = {(1, 1): 1.0, (1, 2): 0.5, (1, 3): 0.45}
    assert schedule_prefixes([[0.8, 0.9]], lambda r, n: table[(r, n)]) == [0]
    assert schedule_prefixes([[0.8, 0.9]], lambda r, n: 1.0) == [2]  # free tokens: take all
    # Two rows: a = [[0.9, 0.45], [0.6, 0.54]]; admit 0.9 (Θ 2.32), 0.6 (Θ 2.8), then 0.54 needs
    # a third column per row (Θ 2.02 < 2.8): stop there, even though 0.45 would be "free".
    table = {(2, 1): 1.0, (2, 2): 0.8, (2, 3): 0.5}
    assert schedule_prefixes([[0.9, 0.5], [0.6, 0.9]], lambda r, n: table[(r, n)]) == [1, 1]
    assert schedule_prefixes([[0.0, 0.9]], lambda r, n: 1.0) == [0]  # zero survival: never


def test_scheduler_is_lossless_greedy(target):
    drafter = random_drafter(target, markov_rank=8, block_size=4, markov_std=0.5)
    prompts = _prompts([5, 11, 3, 8])
    results = batched_generate(
        target,
        drafter,
        prompts,
        batch_size=4,
        max_new_tokens=20,
        policy="scheduler",
        sps=sps_cliff,
    )
    for r in results:
        assert (
            r.output_ids.tolist()
            == target_generate(target, prompts[r.index], max_new_tokens=20).tolist()
        )
    proposed = [p for r in results for p in r.stats.proposed_per_round]
    assert 0 in proposed and max(proposed) >= 1  # it cut some rounds and kept others
    with pytest.raises(ValueError, match="confidence head"):
        batched_generate(
            target,
            random_drafter(target, markov_rank=0, confidence=False),
            prompts,
            batch_size=2,
            max_new_tokens=4,
            policy="scheduler",
            sps=sps_cliff,
        )


# ---- T = 1: the target's distribution -------------------------------------------------------

NUM_NEW = 3
PER_PROMPT = 600


@pytest.fixture(scope="module")
def small():
    target = tiny_target(vocab_size=8, hidden_size=16, num_layers=2, logit_scale=4.0)
    drafter = random_drafter(target, layer_ids=(0,), block_size=3, markov_rank=4, markov_std=1.0)
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[5, 4, 6, 7, 1, 2]])]
    exact = [exact_continuation_probs(target, p, NUM_NEW) for p in prompts]
    return target, drafter, prompts, exact


def _pvalues(small, **kwargs) -> tuple[list[float], int]:
    target, drafter, prompts, exact = small
    queue = [prompts[i % 2] for i in range(2 * PER_PROMPT)]
    results = batched_generate(
        target,
        drafter,
        queue,
        batch_size=5,
        max_new_tokens=NUM_NEW,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    pvalues, accepted = [], 0
    for k in range(2):
        counts = torch.zeros([8] * NUM_NEW)
        for r in results[k::2]:
            counts[tuple(r.output_ids[0, prompts[k].shape[1] :].tolist())] += 1
            accepted += sum(r.stats.accepted_per_round)
        # x1 comes from the prefill; (x2, x3) from verification rounds
        pvalues.append(chi_square_pvalue(counts.sum(dim=0), exact[k].sum(dim=0)))
    return pvalues, accepted


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"policy": "scheduler", "sps": sps_cliff}, {"draft_temperature": 0.0}],
    ids=["full", "scheduler", "greedy-drafts"],
)
def test_sampled_batched_decoding_has_the_target_distribution(small, kwargs):
    pvalues, accepted = _pvalues(small, **kwargs)
    assert accepted > 0.2 * PER_PROMPT  # both verification outcomes are common
    assert min(pvalues) > ALPHA


def test_a_batched_verifier_that_resamples_from_the_target_fails(small, monkeypatch):
    monkeypatch.setattr(verify, "residual_distribution", lambda p_target, p_draft: p_target)
    pvalues, _ = _pvalues(small)
    assert min(pvalues) < ALPHA
