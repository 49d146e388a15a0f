"""The speculative decoding loop: lossless greedy output, stop tokens, budget, train/serve parity,
and the reference-format golden drafter decoding against a matching target."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.drafters import load_draft_model
from dspark_ds.eval import speculative_generate, target_generate
from dspark_ds.eval.target_step import TargetDecoder, tap_layers

from helpers.evaluation import counting_forwards, random_drafter, record_proposals, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=64, hidden_size=32, num_layers=3, logit_scale=4.0)


def _prompt(seed: int, length: int = 9, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab - 1, (1, length), generator=torch.Generator().manual_seed(seed))


def _greedy_acceptances(drafts: list[list[int]], proposed: list[int], new_tokens: list[int]):
    """A naive greedy verifier: per round, the leading proposed drafts that equal the greedy
    continuation `new_tokens` (a round starts after the prefill's token; each commits its
    accepted drafts and one target token)."""
    out, pos = [], 1
    for round_drafts, m in zip(drafts, proposed):
        matches = 0
        while matches < m and round_drafts[matches] == new_tokens[pos + matches]:
            matches += 1
        out.append(matches)
        pos += matches + 1
    return out


def _hf_greedy(target, prompt, n):
    # An independent reference: Hugging Face's own greedy generate (no EOS, exactly n tokens).
    return target.generate(
        prompt,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


@pytest.mark.parametrize(
    "markov_head_type,markov_rank,confidence,threshold",
    [
        ("vanilla", 8, True, 0.0),
        ("gated", 8, True, 0.0),
        ("rnn", 8, True, 0.0),
        ("vanilla", 0, False, 0.0),  # DFlash: no Markov head, no confidence head
        ("vanilla", 8, True, 0.5),  # confidence truncation
        ("rnn", 8, True, 0.45),
    ],
)
def test_greedy_speculative_equals_greedy_target(
    target, markov_head_type, markov_rank, confidence, threshold, monkeypatch
):
    drafter = random_drafter(
        target,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        confidence=confidence,
        block_size=4,
        markov_std=0.5 if markov_rank else None,
    )
    drafts = record_proposals(monkeypatch, drafter)
    rounds_cut = accepted = 0
    for seed in range(3):
        prompt = _prompt(seed)
        drafts.clear()
        with counting_forwards(target) as forwards:
            out, stats = speculative_generate(
                target, drafter, prompt, max_new_tokens=40, confidence_threshold=threshold
            )
        ref = _hf_greedy(target, prompt, 40)
        assert out.tolist() == ref.tolist(), f"seed {seed}: speculative output differs from greedy"
        assert stats.new_tokens == 40
        assert forwards[0] == stats.target_forwards == stats.rounds + 1  # one verify per round
        assert sum(stats.committed_per_round) == 39  # the first token comes from the prefill
        # every round accepted exactly the drafts a naive greedy verifier accepts
        assert all(len(d) == 4 and p <= 4 for d, p in zip(drafts, stats.proposed_per_round))
        assert stats.accepted_per_round == _greedy_acceptances(
            drafts, stats.proposed_per_round, ref[0, prompt.shape[1] :].tolist()
        )
        rounds_cut += sum(p < 4 for p in stats.proposed_per_round[:-1])
        accepted += sum(stats.accepted_per_round)
    assert accepted > 0, "no draft was ever accepted: only the rejection path ran"
    if threshold > 0:
        assert rounds_cut > 0, "the threshold never truncated a proposal: the test proves nothing"


def test_greedy_drafter_that_matches_the_target_is_fully_accepted(target, monkeypatch):
    """A drafter whose proposals are always right must reach τ = γ + 1 (no off-by-one)."""
    drafter = random_drafter(target, markov_rank=8, block_size=4)
    prompt = _prompt(0)
    full = target_generate(target, prompt, max_new_tokens=31)[0].tolist() + [0] * 8
    _oracle(monkeypatch, drafter, full)
    with counting_forwards(target) as forwards:
        out, stats = speculative_generate(target, drafter, prompt, max_new_tokens=31)
    assert out[0].tolist() == full[: prompt.shape[1] + 31]
    assert stats.accepted_per_round == [4] * 6
    assert stats.committed_per_round == [5] * 6
    assert stats.tau == 5.0 and forwards[0] == stats.target_forwards == 7


def test_stop_token_and_budget(target):
    drafter = random_drafter(target, markov_rank=8, block_size=4)
    prompt = _prompt(1)
    ref = target_generate(target, prompt, max_new_tokens=30)[0, prompt.shape[1] :].tolist()
    stop = ref[12]
    first = ref.index(stop)
    out, stats = speculative_generate(
        target, drafter, prompt, max_new_tokens=30, stop_token_ids=[stop]
    )
    assert out[0, prompt.shape[1] :].tolist() == ref[: first + 1]
    assert stats.new_tokens == first + 1
    assert (
        target_generate(target, prompt, max_new_tokens=30, stop_token_ids=[stop]).tolist()
        == out.tolist()
    )
    for budget in (1, 2, 5):
        out, stats = speculative_generate(target, drafter, prompt, max_new_tokens=budget)
        assert out[0, prompt.shape[1] :].tolist() == ref[:budget]
        assert stats.rounds == budget - 1 - sum(stats.accepted_per_round)


def test_bad_arguments_are_refused(target):
    drafter = random_drafter(target, markov_rank=8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, drafter, _prompt(0), max_new_tokens=0)
    with pytest.raises(ValueError, match="confidence_threshold"):
        speculative_generate(
            target, drafter, _prompt(0), max_new_tokens=4, confidence_threshold=2.0
        )
    with pytest.raises(ValueError, match="input_ids"):
        speculative_generate(target, drafter, torch.zeros(2, 3, dtype=torch.long), max_new_tokens=4)
    last_layer = random_drafter(target, layer_ids=(0, 2))
    with pytest.raises(ValueError, match="final layer"):
        speculative_generate(target, last_layer, _prompt(0), max_new_tokens=4)


@pytest.mark.parametrize("markov_head_type", ["vanilla", "rnn"])
def test_train_serve_parity(target, markov_head_type):
    """Draft logits of an inference round at start = p equal the training block at anchor p,
    with the drafter's KV cache filled by an earlier round (so cache appends are exercised)."""
    drafter = random_drafter(
        target,
        markov_rank=8,
        markov_head_type=markov_head_type,
        block_size=4,
        markov_std=0.5,
        num_draft_layers=2,
    )
    prefix = _prompt(3, length=14)
    p1, p = 6, 11
    block = 4
    mask_id = drafter.config.mask_token_id

    def features(ids):
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        return tap_layers(hs, list(drafter.config.target_layer_ids))

    with torch.no_grad():
        cache = drafter.new_cache()
        feats = features(prefix)
        ids = torch.full((1, block), mask_id)
        ids[0, 0] = prefix[0, p1]
        drafter.forward_draft_block(
            context_features=feats[:, :p1], block_input_ids=ids, start=p1, cache=cache
        )
        assert cache.seq_length == p1
        ids[0, 0] = prefix[0, p]
        hidden = drafter.forward_draft_block(
            context_features=feats[:, p1:p], block_input_ids=ids, start=p, cache=cache
        )
        drafts, serve_logits = drafter.sample_draft_tokens(
            drafter.compute_logits(hidden),
            first_prev_token_ids=ids[:, 0],
            hidden_states=hidden,
            temperature=0.0,
        )
        serve_conf = drafter.predict_confidence(hidden, torch.cat([ids[:, :1], drafts[:, :-1]], 1))

        # The training sequence continues with the drafter's own greedy tokens, so teacher forcing
        # feeds the Markov head exactly what inference sampled.
        seq = torch.cat([prefix[:, : p + 1], drafts], dim=1)
        out = drafter(
            seq,
            features(seq),
            torch.ones_like(seq),
            anchor_positions=torch.tensor([[p]]),
            block_keep_mask=torch.tensor([[True]]),
        )
    torch.testing.assert_close(out.draft_logits[0, 0], serve_logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.confidence_pred[0, 0], serve_conf[0], atol=1e-4, rtol=1e-4)
    assert out.target_ids[0, 0].tolist() == drafts[0].tolist()


def test_target_decoder_rollback_matches_fresh_forward(target):
    """Cropping the target cache after a rejected draft leaves it as if the draft never ran."""
    prompt = _prompt(4, length=10)
    dec = TargetDecoder(target, [0, 1])
    dec.forward(prompt[:, :6])
    dec.forward(prompt[:, 6:9])  # pretend 3 tokens were verified...
    dec.keep(7)  # ...and only one was accepted
    step = dec.forward(prompt[:, 7:10])
    with torch.no_grad():
        full = target(prompt[:, :10], output_hidden_states=True)
    torch.testing.assert_close(step.logits_LV, full.logits[0, 7:10], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        step.features_LnH, tap_layers(full.hidden_states, [0, 1])[:, 7:10], atol=1e-5, rtol=1e-5
    )


def test_golden_reference_drafter_decodes(golden_dir):
    """The DeepSpec-written drafter loads and decodes losslessly against a matching target."""
    drafter = load_draft_model(golden_dir / "qwen3_vanilla" / "draft")
    cfg = drafter.config
    target = tiny_target(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_target_layers,
        logit_scale=8.0,
    )
    assert target.config.num_hidden_layers == 6 and target.config.hidden_size == 64
    # The drafter shares the target's embedding and lm_head, as after training.
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(drafter.embed_tokens.weight)
        target.lm_head.weight.copy_(drafter.lm_head.weight)
    prompt = _prompt(5, length=12, vocab=cfg.vocab_size)
    out, stats = speculative_generate(target, drafter, prompt, max_new_tokens=24)
    assert out.tolist() == _hf_greedy(target, prompt, 24).tolist()
    assert stats.rounds >= 1 and stats.proposed_per_round[0] == cfg.block_size
    assert len(stats.confidence_logits_per_round[0]) == cfg.block_size  # its confidence head ran
    # Rejection sampling near T = 0 is greedy: drafts, draft probabilities and the residual
    # draw must line up slot by slot for the output to stay the target's argmax chain.
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        out, stats = speculative_generate(
            target, drafter, prompt, max_new_tokens=24, temperature=1e-3, generator=g
        )
        assert out.tolist() == _hf_greedy(target, prompt, 24).tolist()
    g = torch.Generator().manual_seed(0)
    out, stats = speculative_generate(
        target, drafter, prompt, max_new_tokens=24, temperature=1.0, generator=g
    )
    # at T = 1 its sampled drafts are accepted (this random target's argmax never is its own)
    assert stats.new_tokens == 24 and sum(stats.accepted_per_round) > 0


def _oracle(monkeypatch, drafter, full):
    """Make `drafter` propose exactly the target's greedy continuation `full` after x_start."""
    starts = []
    real_block = drafter.draft_block_from_cache

    def draft_block(block_ids, block_positions, *args, **kwargs):
        starts.append(int(block_positions[0, 0]))  # the position of x_start
        return real_block(block_ids, block_positions, *args, **kwargs)

    def oracle(base_logits, **_):
        start = starts[-1]
        tokens = torch.tensor([full[start + 1 : start + 1 + base_logits.shape[1]]])
        return tokens, torch.nn.functional.one_hot(tokens, base_logits.shape[-1]).float() * 50

    monkeypatch.setattr(drafter, "draft_block_from_cache", draft_block)
    monkeypatch.setattr(drafter, "sample_draft_tokens", oracle)


@pytest.mark.parametrize(
    "budget,exact_rounds,reference_rounds",
    [(10, [5, 4], [5, 5]), (6, [5], [5, 5]), (1, [], [5])],
)
def test_reference_budget_accounting(target, monkeypatch, budget, exact_rounds, reference_rounds):
    """The reference's loop runs while at most `budget` tokens exist, with uncut proposals, and
    counts every round in τ; the output is trimmed to the budget either way."""
    drafter = random_drafter(target, markov_rank=8, block_size=4)
    prompt = _prompt(0)
    full = target_generate(target, prompt, max_new_tokens=40)[0].tolist()
    _oracle(monkeypatch, drafter, full)
    for accounting, rounds in (("exact", exact_rounds), ("reference", reference_rounds)):
        out, stats = speculative_generate(
            target, drafter, prompt, max_new_tokens=budget, budget_accounting=accounting
        )
        assert out[0].tolist() == full[: prompt.shape[1] + budget], accounting
        assert stats.committed_per_round == rounds, accounting
        assert stats.new_tokens == budget
    with pytest.raises(ValueError, match="budget_accounting"):
        speculative_generate(target, drafter, prompt, max_new_tokens=4, budget_accounting="x")


def test_reference_budget_is_lossless_with_a_real_drafter(target):
    drafter = random_drafter(target, markov_rank=8, block_size=4, markov_std=0.5)
    for seed in range(2):
        prompt = _prompt(seed)
        out, stats = speculative_generate(
            target, drafter, prompt, max_new_tokens=23, budget_accounting="reference"
        )
        assert out.tolist() == _hf_greedy(target, prompt, 23).tolist()
        assert sum(stats.committed_per_round) + 1 > 23  # the last round overshoots, then trims
