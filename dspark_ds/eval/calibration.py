"""Confidence-head calibration against what verification actually accepted.

Legend: R = verification rounds, G = block size (γ).

The confidence head predicts, per slot k, P(slot k accepted | slots < k accepted). What a user
truncates on is the cumulative product Π_{i≤k} σ(c_i): the probability that the whole prefix up
to k survives verification. Its label is "the first k+1 drafts were accepted". ECE, AUROC and
Brier are reported per position and pooled over positions for that cumulative prediction.

Sequential temperature scaling (STS, the DSpark paper; not in the reference code) divides slot
k's logit by a temperature t_k, fitted left to right on a held-out split: t_0 minimises the ECE
of σ(c_0 / t_0), then with t_0 fixed t_1 minimises the ECE of σ(c_0/t_0)·σ(c_1/t_1), and so on.
`dspark-ds eval` writes them to its output directory; stored in the drafter's `config.json` as
`confidence_temperatures` (`--calibration.write_to_drafter true`, or
`write_confidence_temperatures`), the decoding loop applies them before the confidence threshold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_ds.errors import ConfigError

CONFIG_KEY = "confidence_temperatures"


@dataclass
class ConfidenceRecords:
    """The confidence logits of verified slots and how many drafts each round accepted."""

    logits_RG: torch.Tensor
    """fp64 raw confidence logits, NaN past each round's proposal."""
    proposed_R: torch.Tensor
    """Verified draft slots per round."""
    accepted_R: torch.Tensor
    """Accepted draft tokens per round (≤ proposed)."""
    committed_R: torch.Tensor
    """Tokens the round appended (accepted + 1, or accepted when an accepted draft was a stop)."""

    @classmethod
    def from_rounds(
        cls,
        logits: list[list[float]],
        accepted: list[int],
        committed: list[int],
        block_size: int,
    ) -> ConfidenceRecords:
        logits_RG = torch.full((len(logits), block_size), math.nan, dtype=torch.float64)
        for r, row in enumerate(logits):
            logits_RG[r, : len(row)] = torch.tensor(row, dtype=torch.float64)
        return cls(
            logits_RG=logits_RG,
            proposed_R=torch.tensor([len(row) for row in logits], dtype=torch.long),
            accepted_R=torch.tensor(accepted, dtype=torch.long),
            committed_R=torch.tensor(committed, dtype=torch.long),
        )

    @property
    def num_rounds(self) -> int:
        return self.logits_RG.shape[0]

    @property
    def block_size(self) -> int:
        return self.logits_RG.shape[1]

    def subset(self, index_R: torch.Tensor) -> ConfidenceRecords:
        return ConfidenceRecords(
            self.logits_RG[index_R],
            self.proposed_R[index_R],
            self.accepted_R[index_R],
            self.committed_R[index_R],
        )

    def valid_RG(self) -> torch.Tensor:
        """Slots that were verified (so have a label)."""
        return torch.arange(self.block_size).unsqueeze(0) < self.proposed_R.unsqueeze(1)

    def prefix_accepted_RG(self) -> torch.Tensor:
        """Label of slot k: drafts 0..k were all accepted."""
        return (torch.arange(self.block_size).unsqueeze(0) < self.accepted_R.unsqueeze(1)).double()


def confidence_temperatures(
    config, block_size: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """The STS temperatures stored in a drafter config, validated against its `block_size` (the
    most tokens it drafts a round: its kind's `decode.tokens_per_round`), or None."""
    temps = getattr(config, CONFIG_KEY, None)
    if temps is None:
        return None
    if len(temps) != block_size or any(not float(t) > 0.0 for t in temps):
        raise ConfigError(
            f"drafter config {CONFIG_KEY} must be {block_size} positive numbers, got {temps}"
        )
    return torch.tensor([float(t) for t in temps], dtype=torch.float32, device=device)


def write_confidence_temperatures(drafter_dir: str | Path, temps: list[float]) -> Path:
    """Store STS temperatures in a drafter directory's config.json (other keys untouched)."""
    path = Path(drafter_dir) / "config.json"
    config = json.loads(path.read_text())
    config[CONFIG_KEY] = [float(t) for t in temps]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # atomic: a crash never leaves a half-written config
    return path


def cumulative_confidence(
    logits_RG: torch.Tensor, temps_G: torch.Tensor | None = None
) -> torch.Tensor:
    """Π_{i≤k} σ(c_i / t_i) along the block (NaN slots stay NaN)."""
    scaled = logits_RG if temps_G is None else logits_RG / temps_G.to(logits_RG)
    return torch.cumprod(torch.sigmoid(scaled), dim=-1)


# ---- metrics on flat (prediction, label) pairs ----------------------------------------------


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, num_bins: int) -> list[dict]:
    """Equal-width bins of the prediction: mean prediction, observed frequency, count."""
    probs, labels = probs.double(), labels.double()
    index = (probs * num_bins).long().clamp(0, num_bins - 1)
    out = []
    for b in range(num_bins):
        sel = index == b
        count = int(sel.sum())
        if count:
            bin_row = {
                "lo": b / num_bins,
                "hi": (b + 1) / num_bins,
                "count": count,
                "mean_pred": float(probs[sel].mean()),
                "observed": float(labels[sel].mean()),
            }
            out.append(bin_row)
    return out


def expected_calibration_error(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 20
) -> float:
    """Σ_bins (n_b / n) |mean prediction - observed frequency| over equal-width bins
    (= Σ_bins |Σ predictions - Σ labels| / n)."""
    if probs.numel() == 0:
        return math.nan
    probs = probs.double()  # NOTE: fp32 products put values like 0.3 in the bin below
    index = (probs * num_bins).long().clamp(0, num_bins - 1)
    pred = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, index, probs.double())
    obs = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, index, labels.double())
    return float((pred - obs).abs().sum() / probs.numel())


def auroc(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied ranks averaged); NaN for one class."""
    positives = labels > 0.5
    num_pos, num_neg = int(positives.sum()), int((~positives).sum())
    if num_pos == 0 or num_neg == 0:
        return math.nan
    values, inverse, counts = torch.unique(probs.double(), return_inverse=True, return_counts=True)
    # The average rank of a tie group is (first rank + last rank) / 2, ranks starting at 1.
    last_rank = torch.cumsum(counts, 0).double()
    avg_rank = last_rank - (counts.double() - 1) / 2
    rank_sum_pos = float(avg_rank[inverse][positives].sum())
    return (rank_sum_pos - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float(((probs.double() - labels.double()) ** 2).mean()) if probs.numel() else math.nan


def _metrics(probs: torch.Tensor, labels: torch.Tensor, num_bins: int) -> dict:
    return {
        "count": int(probs.numel()),
        "ece": expected_calibration_error(probs, labels, num_bins),
        "auroc": auroc(probs, labels),
        "brier": brier_score(probs, labels),
        "mean_pred": float(probs.mean()) if probs.numel() else math.nan,
        "observed": float(labels.mean()) if probs.numel() else math.nan,
    }


def confidence_report(
    records: ConfidenceRecords, temps_G: torch.Tensor | None = None, num_bins: int = 20
) -> dict:
    """Per-position and pooled ECE / AUROC / Brier of the cumulative confidence, plus the pooled
    metrics of the per-slot (conditional) confidence on the rounds that reached each slot."""
    probs_RG = cumulative_confidence(records.logits_RG, temps_G)
    labels_RG = records.prefix_accepted_RG()
    valid_RG = records.valid_RG()
    per_position = []
    for k in range(records.block_size):
        sel = valid_RG[:, k]
        per_position.append(
            {"position": k, **_metrics(probs_RG[sel, k], labels_RG[sel, k], num_bins)}
        )
    pooled_p, pooled_y = probs_RG[valid_RG], labels_RG[valid_RG]
    # What the head is trained on: σ(c_k) against "slot k accepted" on rounds that reached k.
    reached_RG = valid_RG & (torch.arange(records.block_size) <= records.accepted_R.unsqueeze(1))
    step_RG = torch.sigmoid(
        records.logits_RG if temps_G is None else records.logits_RG / temps_G.to(records.logits_RG)
    )
    return {
        "pooled": _metrics(pooled_p, pooled_y, num_bins),
        "conditional": _metrics(step_RG[reached_RG], labels_RG[reached_RG], num_bins),
        "per_position": per_position,
        "reliability": reliability_bins(pooled_p, pooled_y, num_bins),
        "temperatures": temps_G.tolist() if temps_G is not None else None,
    }


# ---- sequential temperature scaling ---------------------------------------------------------


def default_temperature_grid() -> torch.Tensor:
    """Log-spaced temperatures from 0.05 to 20 (1.0 included exactly)."""
    grid = torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64)
    return torch.unique(torch.cat([grid, torch.ones(1, dtype=torch.float64)]))


def fit_sequential_temperatures(
    records: ConfidenceRecords, num_bins: int = 20, grid: torch.Tensor | None = None
) -> list[float]:
    """One temperature per position, left to right, minimising the ECE of the cumulative product.

    A position without labelled slots keeps temperature 1. Among equally good temperatures the
    one closest to 1 (in log space) wins, so an uninformative position is left alone.
    """
    grid = default_temperature_grid() if grid is None else grid.double()
    # Prefer temperatures near 1 on ties: scan them in order of |log t|.
    grid = grid[torch.argsort(grid.log().abs(), stable=True)]
    labels_RG = records.prefix_accepted_RG()
    valid_RG = records.valid_RG()
    temps: list[float] = []
    prefix_R = torch.ones(records.num_rounds, dtype=torch.float64)
    for k in range(records.block_size):
        sel = valid_RG[:, k]
        logits, labels, prefix = records.logits_RG[sel, k], labels_RG[sel, k], prefix_R[sel]
        best_t, best_ece = 1.0, math.inf
        if logits.numel():
            for t in grid.tolist():
                ece = expected_calibration_error(
                    prefix * torch.sigmoid(logits / t), labels, num_bins
                )
                if ece < best_ece - 1e-12:
                    best_t, best_ece = t, ece
        temps.append(best_t)
        prefix_R = prefix_R * torch.sigmoid(records.logits_RG[:, k].nan_to_num(0.0) / best_t)
    return temps


# ---- threshold sweep ------------------------------------------------------------------------


def threshold_sweep(
    records: ConfidenceRecords, thresholds: list[float], temps_G: torch.Tensor | None = None
) -> list[dict]:
    """What confidence truncation at each threshold would have done to the recorded rounds.

    Replays rounds decoded without truncation: the proposal is cut at the first slot whose
    (scaled) per-slot confidence is below the threshold. The drafts before the cut and their
    verification coins are the same, so a round keeps min(accepted, cut) drafts; when the cut
    lands at or before the first rejection the target's bonus token still adds one. Rounds
    after a changed round would differ in reality, so τ here is a per-round estimate.
    """
    probs_RG = torch.sigmoid(
        records.logits_RG if temps_G is None else records.logits_RG / temps_G.to(records.logits_RG)
    )
    positions_G = torch.arange(records.block_size).expand_as(probs_RG)
    proposed, accepted, committed = records.proposed_R, records.accepted_R, records.committed_R
    verify_full = float((proposed + 1).sum())
    rows = []
    for thr in thresholds:
        below_RG = (probs_RG < thr) & records.valid_RG()
        cut_R = torch.where(below_RG, positions_G, records.block_size).amin(dim=1)
        cut_R = torch.minimum(cut_R, proposed)
        changed_R = (cut_R < proposed) & (cut_R <= accepted)
        kept_R = torch.minimum(accepted, cut_R)
        tokens_R = torch.where(changed_R, cut_R + 1, committed)
        rounds = records.num_rounds
        row = {
            "threshold": float(thr),
            "tau": float(tokens_R.double().mean()) if rounds else math.nan,
            "accepted_fraction": float(kept_R.sum() / accepted.sum().clamp_min(1)),
            "mean_proposal_length": float(cut_R.double().mean()) if rounds else math.nan,
            "verify_tokens_saved": 1.0 - float((cut_R + 1).sum()) / max(verify_full, 1.0),
        }
        rows.append(row)
    return rows
