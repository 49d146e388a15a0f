"""The acceptance-by-position figures against a hand count, and the plot that shows both."""

from __future__ import annotations

import pytest

from dspark_ds.eval.report import plot_acceptance_by_position, summarize_benchmark
from dspark_ds.eval.rounds import DecodeStats

# (proposed, accepted) per verification round, γ = 4
ROUNDS = [(4, 0), (4, 2), (4, 4), (2, 2), (3, 1)]


def test_acceptance_by_position_by_hand(tmp_path):
    """By hand: draft k was proposed in 5, 5, 4, 3 rounds; drafts 0..k were all accepted in 4,
    3, 1, 1 of them; draft k was proposed with drafts 0..k-1 accepted in 5, 4, 2, 1 rounds
    ((2, 2) proposed no draft 2; (3, 1) reached draft 1 only)."""
    stats = DecodeStats(
        proposed_per_round=[p for p, _ in ROUNDS],
        accepted_per_round=[a for _, a in ROUNDS],
        committed_per_round=[a + 1 for _, a in ROUNDS],
    )
    row = summarize_benchmark("hand", [stats], block_size=4)
    assert row.accept_rate_by_position == pytest.approx([4 / 5, 3 / 5, 1 / 4, 1 / 3])
    assert row.conditional_accept_rate == pytest.approx([4 / 5, 3 / 4, 2 / 4, 1 / 1])
    path = plot_acceptance_by_position(tmp_path / "acc.png", [row])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
