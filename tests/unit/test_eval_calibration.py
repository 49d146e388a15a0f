"""Confidence calibration: metrics against naive references, STS fitting, the threshold sweep,
and the STS temperatures stored in config.json and applied by the decoding loop."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_ds.drafters import load_draft_model, save_draft_model
from dspark_ds.eval import calibration as cal
from dspark_ds.eval import speculative_generate

from helpers.evaluation import random_drafter, tiny_target


def _naive_ece(p, y, bins):
    total = 0.0
    for b in range(bins):
        sel = [i for i in range(len(p)) if min(int(p[i] * bins), bins - 1) == b]
        if sel:
            total += (
                len(sel)
                / len(p)
                * abs(sum(p[i] for i in sel) / len(sel) - sum(y[i] for i in sel) / len(sel))
            )
    return total


def _naive_auroc(p, y):
    pos = [a for a, b in zip(p, y) if b == 1]
    neg = [a for a, b in zip(p, y) if b == 0]
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def test_metrics_match_naive_references():
    g = torch.Generator().manual_seed(0)
    p = (torch.rand(300, generator=g) * 10).round() / 10  # ties on purpose
    y = (torch.rand(300, generator=g) < p).double()
    pl, yl = p.tolist(), y.tolist()
    assert cal.expected_calibration_error(p, y, 10) == pytest.approx(
        _naive_ece(pl, yl, 10), abs=1e-12
    )
    assert cal.auroc(p, y) == pytest.approx(_naive_auroc(pl, yl), abs=1e-12)
    assert cal.brier_score(p, y) == pytest.approx(sum((a - b) ** 2 for a, b in zip(pl, yl)) / 300)
    assert math.isnan(cal.auroc(p, torch.ones(300)))
    perfect = torch.tensor([0.1, 0.2, 0.8, 0.9])
    assert cal.auroc(perfect, torch.tensor([0.0, 0.0, 1.0, 1.0])) == 1.0


def _synthetic_records(num_rounds: int, scale: float, seed: int) -> cal.ConfidenceRecords:
    """Rounds whose true per-slot acceptance is σ(z) but whose head reports z * scale."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(num_rounds, 4, generator=g) * 1.5 + 0.8
    accept = torch.rand(num_rounds, 4, generator=g) < torch.sigmoid(z)
    accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)
    return cal.ConfidenceRecords.from_rounds(
        (z * scale).tolist(), accepted.tolist(), (accepted + 1).tolist(), block_size=4
    )


def test_sts_recovers_the_miscalibration_and_lowers_held_out_ece():
    fit, held = _synthetic_records(6000, 3.0, seed=0), _synthetic_records(6000, 3.0, seed=1)
    temps = cal.fit_sequential_temperatures(fit, num_bins=15)
    assert temps[0] == pytest.approx(3.0, rel=0.15)  # the first slot has no prefix to absorb
    before = cal.confidence_report(held, None, 15)
    after = cal.confidence_report(held, torch.tensor(temps, dtype=torch.float64), 15)
    assert after["pooled"]["ece"] < 0.5 * before["pooled"]["ece"]
    for k in range(4):
        assert after["per_position"][k]["ece"] < before["per_position"][k]["ece"]
    # Temperature scaling is monotone per slot, so the first slot's ranking cannot change.
    assert after["per_position"][0]["auroc"] == pytest.approx(before["per_position"][0]["auroc"])
    # The per-slot (conditional) prediction of the first slot is the cumulative one.
    assert before["conditional"]["count"] > before["per_position"][0]["count"]
    assert after["conditional"]["ece"] < before["conditional"]["ece"]
    # A calibrated head is left (almost) alone.
    calibrated = cal.fit_sequential_temperatures(_synthetic_records(6000, 1.0, seed=2), num_bins=15)
    assert calibrated[0] == pytest.approx(1.0, rel=0.15)


def test_threshold_sweep_matches_a_naive_replay():
    logits = [[2.0, -1.0, 3.0], [0.5, 0.2], [-3.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    accepted = [1, 2, 0, 3]
    committed = [2, 3, 1, 4]
    records = cal.ConfidenceRecords.from_rounds(logits, accepted, committed, block_size=3)
    rows = cal.threshold_sweep(records, [0.0, 0.4, 0.6, 0.9])
    for row in rows:
        thr = row["threshold"]
        tokens, kept, verify = [], [], []
        for lg, a, c in zip(logits, accepted, committed):
            cut = next((k for k, v in enumerate(lg) if 1 / (1 + math.exp(-v)) < thr), len(lg))
            tokens.append(c if cut > a or cut == len(lg) else cut + 1)
            kept.append(min(a, cut))
            verify.append(cut + 1)
        assert row["tau"] == pytest.approx(sum(tokens) / 4)
        assert row["accepted_fraction"] == pytest.approx(sum(kept) / sum(accepted))
        assert row["verify_tokens_saved"] == pytest.approx(
            1 - sum(verify) / sum(len(lg) + 1 for lg in logits)
        )
    assert (
        rows[0]["tau"] == pytest.approx(sum(committed) / 4) and rows[0]["verify_tokens_saved"] == 0
    )


def test_temperatures_in_config_json_are_applied_by_the_decoding_loop(tmp_path):
    target = tiny_target(vocab_size=64, hidden_size=32, num_layers=3, logit_scale=4.0)
    drafter = random_drafter(target, block_size=4, markov_std=0.5)
    with torch.no_grad():  # spread the confidence logits so the threshold bites
        drafter.confidence_head.proj.weight.normal_(0.0, 2.0)
    save_draft_model(drafter, tmp_path / "d")
    prompt = torch.randint(0, 63, (1, 9), generator=torch.Generator().manual_seed(0))
    _, raw = speculative_generate(target, drafter, prompt, max_new_tokens=12)
    first_round_logits = torch.tensor(raw.confidence_logits_per_round[0])
    assert len(first_round_logits) == 4

    temps = [0.5, 2.0, 4.0, 8.0]
    cal.write_confidence_temperatures(tmp_path / "d", temps)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["block_size"] == 4  # kept
    loaded = load_draft_model(tmp_path / "d")
    assert list(loaded.config.confidence_temperatures) == temps
    save_draft_model(loaded, tmp_path / "resaved")  # survives export / re-save
    assert (
        json.loads((tmp_path / "resaved" / "config.json").read_text())["confidence_temperatures"]
        == temps
    )
    for thr in (0.3, 0.5, 0.7):
        _, stats = speculative_generate(
            target, loaded, prompt, max_new_tokens=12, confidence_threshold=thr
        )
        scaled = torch.sigmoid(first_round_logits / torch.tensor(temps))
        below = (scaled < thr).nonzero()
        expected = int(below[0]) if below.numel() else 4
        assert stats.proposed_per_round[0] == expected
        # Recorded logits stay raw (so calibration can be refitted from any run).
        torch.testing.assert_close(
            torch.tensor(stats.confidence_logits_per_round[0]), first_round_logits[:expected]
        )

    cal.write_confidence_temperatures(tmp_path / "d", [1.0, -1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="confidence_temperatures"):
        speculative_generate(target, load_draft_model(tmp_path / "d"), prompt, max_new_tokens=4)
