"""At T > 0 speculative decoding must sample from the target's own distribution.

Chi-square goodness-of-fit tests against the *exact* distribution of the target (enumerated over
a tiny vocabulary), and the same tests run with deliberately broken verifiers to prove they can
fail. Every generator is seeded, so each test is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from dspark_ds.eval import speculative_generate, verify

from helpers.evaluation import (
    chi_square_pvalue,
    exact_continuation_probs,
    random_drafter,
    tiny_target,
)

ALPHA = 1e-3


# ---- the verifier alone ---------------------------------------------------------------------

P_TARGET = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
P_DRAFT = torch.tensor([0.05, 0.10, 0.10, 0.20, 0.25, 0.30])


def _first_tokens(num_samples: int, num_drafts: int, seed: int = 0) -> torch.Tensor:
    """The first committed token of `num_samples` verifications of drafts sampled from P_DRAFT."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P_TARGET))
    target_probs = P_TARGET.expand(num_drafts + 1, -1)
    draft_probs = P_DRAFT.expand(num_drafts, -1)
    for _ in range(num_samples):
        drafts = torch.multinomial(draft_probs, 1, generator=g).view(-1)
        accepted, nxt = verify.verify_sampled(drafts, draft_probs, target_probs, g)
        counts[drafts[0] if accepted else nxt] += 1
    return counts


def test_rejection_sampling_first_token_has_target_distribution():
    for num_drafts in (1, 3):
        assert chi_square_pvalue(_first_tokens(1500, num_drafts), P_TARGET) > ALPHA


def test_rejection_sampling_bonus_token_has_target_distribution():
    """When every draft is accepted, the bonus token is drawn from the target's last row."""
    g = torch.Generator().manual_seed(1)
    bonus_probs = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.5])
    target_probs = torch.stack([torch.tensor([1.0, 0, 0, 0, 0, 0]), bonus_probs])
    draft_probs = torch.tensor([[1.0, 0, 0, 0, 0, 0]])
    counts = torch.zeros(6)
    for _ in range(1500):
        accepted, nxt = verify.verify_sampled(torch.tensor([0]), draft_probs, target_probs, g)
        assert accepted == 1
        counts[nxt] += 1
    assert chi_square_pvalue(counts, bonus_probs) > ALPHA


def test_greedy_drafts_verified_as_one_hot_proposals_keep_the_target_distribution():
    """Draft temperature 0: the draft is the drafter's argmax, a certain proposal (p_d one-hot):
    kept with probability p_t(d), else the next token comes from p_t without d."""
    g = torch.Generator().manual_seed(2)
    logits = torch.log(P_DRAFT).expand(2, -1)  # argmax: token 5, p_t 0.05 (mostly rejected)
    drafts = logits.argmax(-1)
    probs = verify.draft_probs(drafts.view(1, -1), logits[None], 0.0)[0]
    assert torch.equal(probs, torch.nn.functional.one_hot(drafts, len(P_TARGET)).float())
    counts = torch.zeros(len(P_TARGET))
    for _ in range(1500):
        accepted, nxt = verify.verify_sampled(drafts, probs, P_TARGET.expand(3, -1), g)
        counts[drafts[0] if accepted else nxt] += 1
    assert chi_square_pvalue(counts, P_TARGET) > ALPHA


def test_resampling_from_the_target_instead_of_the_residual_is_caught(monkeypatch):
    monkeypatch.setattr(verify, "residual_distribution", lambda p_target, p_draft: p_target)
    assert chi_square_pvalue(_first_tokens(1500, 1), P_TARGET) < ALPHA


def test_greedy_verification():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 4.0]])
    assert verify.verify_greedy(torch.tensor([1, 0]), logits) == (2, 2)  # both accepted + bonus
    assert verify.verify_greedy(torch.tensor([1, 2]), logits) == (1, 0)  # correction at slot 1
    assert verify.verify_greedy(torch.tensor([2, 0]), logits) == (0, 1)  # later match ignored
    assert verify.verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 1)


# ---- the whole loop -------------------------------------------------------------------------

NUM_NEW = 4  # x1 from the prefill, then a round of 2 drafts (budget-capped) and more


@pytest.fixture(scope="module")
def models():
    target = tiny_target(vocab_size=8, hidden_size=16, num_layers=2, logit_scale=4.0)
    drafter = random_drafter(target, layer_ids=(0,), block_size=3, markov_rank=4, markov_std=1.0)
    prompt = torch.tensor([[1, 2, 3]])
    return target, drafter, prompt, exact_continuation_probs(target, prompt, NUM_NEW)


def _sample_counts(
    models, num_samples: int, draft_temperature: float | None = None
) -> tuple[torch.Tensor, int]:
    target, drafter, prompt, _ = models
    counts = torch.zeros([8] * NUM_NEW)
    accepted = 0
    for seed in range(num_samples):
        g = torch.Generator().manual_seed(seed)
        out, stats = speculative_generate(
            target,
            drafter,
            prompt,
            max_new_tokens=NUM_NEW,
            temperature=1.0,
            generator=g,
            draft_temperature=draft_temperature,
        )
        counts[tuple(out[0, prompt.shape[1] :].tolist())] += 1
        accepted += sum(stats.accepted_per_round)
    return counts, accepted


def _pvalues(counts: torch.Tensor, exact: torch.Tensor) -> list[float]:
    # x1 comes from the prefill alone; (x2, x3) and x4 come out of verification rounds.
    return [
        chi_square_pvalue(counts.sum(dim=(0, 3)), exact.sum(dim=(0, 3))),
        chi_square_pvalue(counts.sum(dim=(0, 1, 2)), exact.sum(dim=(0, 1, 2))),
    ]


NUM_SAMPLES = 400


@pytest.mark.parametrize("draft_temperature", [None, 0.0, 0.5], ids=["T", "greedy", "0.5"])
def test_sampled_speculative_decoding_matches_the_target_distribution(models, draft_temperature):
    """At the request's temperature, with greedy drafts and with drafts sampled at another
    temperature: the output has the target's distribution."""
    counts, accepted = _sample_counts(models, NUM_SAMPLES, draft_temperature)
    # Both verification outcomes must be common, or the test would only see one code path.
    assert 0.2 * NUM_SAMPLES < accepted < 1.6 * NUM_SAMPLES
    assert min(_pvalues(counts, models[3])) > ALPHA


def test_a_verifier_that_resamples_from_the_target_fails_the_same_test(models, monkeypatch):
    """The subtle bug: after a rejection, drawing from p_t instead of norm(max(0, p_t - p_d))."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p_target, p_draft: p_target)
    counts, _ = _sample_counts(models, NUM_SAMPLES)
    assert min(_pvalues(counts, models[3])) < ALPHA


def test_greedy_drafts_judged_by_their_softmax_fail_the_same_test(models, monkeypatch):
    """The bug a draft temperature invites: argmax drafts verified against the drafter's
    softmax (as if sampled from it) over-accept them."""
    monkeypatch.setattr(
        verify, "draft_probs", lambda d, logits, t: verify.logits_to_probs(logits, 1)
    )
    counts, _ = _sample_counts(models, NUM_SAMPLES, draft_temperature=0.0)
    assert min(_pvalues(counts, models[3])) < ALPHA
