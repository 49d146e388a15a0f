"""Eagle3 through the shared decoding loop: lossless greedy output, and every round's drafter
inputs aligned with the target's features of the committed sequence."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark_ds.drafters import load_draft_model, save_draft_model
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.eagle3.qwen3 import Qwen3Eagle3Model
from dspark_ds.drafters.io import build_draft_model
from dspark_ds.drafters.registry import kind_of
from dspark_ds.eval.decoding import speculative_generate, target_generate
from dspark_ds.eval.target_step import tap_layers

from helpers.drafters import with_target_weights
from helpers.evaluation import cpu_eval
from helpers.tiny_models import build_tiny_target

LAYER_IDS = [0, 1, 2]


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_target):
    path = tiny_target
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_drafter(target, seed: int = 0, ttt_length: int = 4) -> Qwen3Eagle3Model:
    cfg = build_eagle3_config(target.config, target_layer_ids=LAYER_IDS, ttt_length=ttt_length)
    torch.manual_seed(seed)
    return with_target_weights(build_draft_model(cfg), target)


def prompt(n: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (1, n), generator=g)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_eagle3_speculative_decoding_equals_greedy_target(target, seed, tmp_path):
    # Through the interchange directory, as `dspark-ds eval` loads it.
    save_draft_model(make_drafter(target, seed=seed), tmp_path / "eagle3")
    drafter = load_draft_model(tmp_path / "eagle3")
    ids = prompt(seed=seed)
    out, stats = speculative_generate(target, drafter, ids, max_new_tokens=24, temperature=0.0)
    ref = target_generate(target, ids, max_new_tokens=24, temperature=0.0)
    assert torch.equal(out, ref)
    assert stats.new_tokens == 24 and stats.rounds >= 1
    assert all(0 <= p <= 4 for p in stats.proposed_per_round)
    assert sum(stats.committed_per_round) + 1 == stats.new_tokens


def test_rounds_feed_the_drafter_the_committed_features_and_tokens(target, monkeypatch):
    """Every round's cache extension (the kind's `decode.extend`) gets the features of exactly
    the newly verified positions, paired with the following committed token, and a cache
    holding everything before them."""
    drafter = make_drafter(target, seed=3)
    calls = []
    decode = kind_of(drafter).decode
    extend = decode.extend

    def recording_extend(model, context):
        calls.append(
            (
                context.cache.seq_length,
                int(context.positions[0, -1]) + 1,  # the round's start: x_start's position
                context.features.clone(),
                context.next_ids.clone(),
            )
        )
        return extend(model, context)

    monkeypatch.setattr(decode, "extend", recording_extend)
    ids = prompt(n=7, seed=5)
    out, stats = speculative_generate(target, drafter, ids, max_new_tokens=20, temperature=0.0)
    with torch.no_grad():
        hs = target(out, output_hidden_states=True).hidden_states
    feats = tap_layers(hs, LAYER_IDS)
    expected_cached = 0
    for cached, start, context, next_ids in calls:
        assert cached == expected_cached  # the cache was cropped back to verified context
        torch.testing.assert_close(context, feats[:, cached:start], rtol=1e-4, atol=1e-5)
        assert torch.equal(next_ids, out[:, cached + 1 : start + 1])
        expected_cached = start
    assert len(calls) == stats.rounds


def test_sampled_eagle3_decoding_runs_and_respects_the_budget(target):
    drafter = make_drafter(target, seed=4)
    g = torch.Generator().manual_seed(0)
    out, stats = speculative_generate(
        target, drafter, prompt(seed=2), max_new_tokens=15, temperature=1.0, generator=g
    )
    assert out.shape[1] == 9 + 15 and stats.new_tokens == 15
    assert all(a <= p for a, p in zip(stats.accepted_per_round, stats.proposed_per_round))


def test_dspark_ds_eval_reports_an_eagle3_drafter(target, tmp_path):
    """`dspark-ds eval` end to end on an Eagle3 directory: τ table, no calibration, results."""
    target_dir = build_tiny_target(tmp_path / "target")  # same seed: the fixture's weights
    save_draft_model(make_drafter(target, seed=6), tmp_path / "eagle3")
    payload = cpu_eval(
        target_dir,
        tmp_path / "eagle3",
        tmp_path / "runs",
        benchmarks=["gsm8k"],
        max_samples=2,
        max_new_tokens=8,
    )
    (row,) = payload["benchmarks"]
    assert row["benchmark"] == "gsm8k" and row["num_prompts"] == 2
    assert len(row["accept_rate_by_position"]) == 4  # γ = ttt_length
    # τ is what the rounds committed: every new token but each prompt's prefill token
    assert row["tau"] == pytest.approx((row["new_tokens"] - 2) / row["rounds"])
    assert not payload["calibration"]  # no confidence head, nothing to calibrate
    saved = json.loads((tmp_path / "runs" / "eval" / "results.json").read_text())
    assert saved["benchmarks"][0]["rounds"] == row["rounds"]
