"""Benchmark summaries: τ, acceptance by position, timing; the table, JSON, CSV and plots."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark_ds.eval.rounds import DecodeStats
from dspark_ds.files import json_safe


@dataclass
class BenchmarkResult:
    """One benchmark's speculative-decoding numbers, summed over every prompt and rank."""

    benchmark: str
    num_prompts: int
    rounds: int
    new_tokens: int
    tau: float
    """Tokens per verifying target forward, bonus included (mean over rounds)."""
    mean_proposal_length: float
    """Draft tokens sent to verification per round (after truncation / budget / stop token)."""
    accept_rate_by_position: list[float | None]
    """Of the rounds that proposed a draft at position k, the share whose drafts 0..k were all
    accepted (k = 0..γ-1): the chance that a proposed draft k is kept."""
    draft_time_s: float
    verify_time_s: float
    prefill_time_s: float
    tokens_per_s: float
    """New tokens over prefill + draft + verify time, summed over prompts (one stream)."""
    baseline_tokens_per_s: float | None = None
    """Plain target decoding on the same prompts, when measured."""
    extra: dict = field(default_factory=dict)
    conditional_accept_rate: list[float | None] = field(default_factory=list)
    """P(accept k | drafts 0..k-1 accepted): of the rounds that proposed a draft at position k
    and accepted every draft before it, the share that accepted draft k too."""

    @property
    def speedup(self) -> float | None:
        if not self.baseline_tokens_per_s:
            return None
        return self.tokens_per_s / self.baseline_tokens_per_s


def summarize_benchmark(
    name: str,
    stats: list[DecodeStats],
    block_size: int,
    baseline_time_s: float | None = None,
    baseline_new_tokens: int | None = None,
) -> BenchmarkResult:
    """Fold per-prompt stats into one row (ratios of sums, so long prompts weigh more).

    The baseline's tokens/s counts `baseline_new_tokens` (what the target alone generated;
    None = as many as speculative decoding, which holds at T = 0)."""
    proposed_at = [0] * block_size
    accepted_at = [0] * block_size
    reached_at = [0] * block_size
    """Rounds that proposed a draft at k and accepted drafts 0..k-1."""
    for s in stats:
        for proposed, accepted in zip(s.proposed_per_round, s.accepted_per_round):
            for k in range(proposed):
                proposed_at[k] += 1
            for k in range(accepted):
                accepted_at[k] += 1
            for k in range(min(accepted + 1, proposed)):
                reached_at[k] += 1
    rounds = sum(s.rounds for s in stats)
    committed = sum(sum(s.committed_per_round) for s in stats)
    new_tokens = sum(s.new_tokens for s in stats)
    draft_s = sum(s.draft_time_s for s in stats)
    verify_s = sum(s.verify_time_s for s in stats)
    prefill_s = sum(s.prefill_time_s for s in stats)
    total_s = draft_s + verify_s + prefill_s
    return BenchmarkResult(
        benchmark=name,
        num_prompts=len(stats),
        rounds=rounds,
        new_tokens=new_tokens,
        tau=committed / rounds if rounds else math.nan,
        mean_proposal_length=sum(sum(s.proposed_per_round) for s in stats) / rounds
        if rounds
        else math.nan,
        accept_rate_by_position=[a / p if p else None for a, p in zip(accepted_at, proposed_at)],
        conditional_accept_rate=[a / r if r else None for a, r in zip(accepted_at, reached_at)],
        draft_time_s=draft_s,
        verify_time_s=verify_s,
        prefill_time_s=prefill_s,
        tokens_per_s=new_tokens / total_s if total_s > 0 else math.nan,
        baseline_tokens_per_s=(
            (new_tokens if baseline_new_tokens is None else baseline_new_tokens) / baseline_time_s
            if baseline_time_s
            else None
        ),
    )


def average_row(results: list[BenchmarkResult]) -> dict:
    """The unweighted mean over benchmarks (how the paper averages τ across its Table 1 sets)."""
    finite = [r.tau for r in results if not math.isnan(r.tau)]
    return {"benchmark": "average", "tau": sum(finite) / len(finite) if finite else math.nan}


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


# the text table's columns: (header, field of `result_dict`, digits of a float; 0: not a float)
TABLE_COLUMNS = (
    ("benchmark", "benchmark", 0),
    ("prompts", "num_prompts", 0),
    ("rounds", "rounds", 0),
    ("tau", "tau", 3),
    ("proposal", "mean_proposal_length", 2),
    ("tok/s", "tokens_per_s", 1),
    ("speedup", "speedup", 2),
    ("draft_s", "draft_time_s", 2),
    ("verify_s", "verify_time_s", 2),
)


def format_table(results: list[BenchmarkResult]) -> str:
    """A fixed-width text table: one row per benchmark plus the τ average."""
    block = max((len(r.accept_rate_by_position) for r in results), default=0)
    header = [name for name, _, _ in TABLE_COLUMNS] + [f"acc@{k}" for k in range(block)]
    rows = [header]
    for r in results:
        d = result_dict(r)
        rows.append(
            [_fmt(d[key], digits) for _, key, digits in TABLE_COLUMNS]
            + [_fmt(a) for a in r.accept_rate_by_position]
        )
    avg = average_row(results)
    rows.append(["average", "", "", _fmt(avg["tau"])] + [""] * (len(header) - 4))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_policy_table(results: list[BenchmarkResult]) -> str | None:
    """Throughput per verification policy (scheduler.compare), or None when not measured."""
    rows = [r for r in results if r.extra.get("policies")]
    if not rows:
        return None
    lines = [
        f"{'benchmark':<14} {'policy':<10} {'tok/s':>9} {'speedup':>8} {'tau':>6} {'verified':>9}"
    ]
    for r in rows:
        for name, p in r.extra["policies"].items():
            lines.append(
                f"{r.benchmark:<14} {name:<10} {_fmt(p['tokens_per_s'], 1):>9} "
                f"{_fmt(p['speedup'], 2):>8} {_fmt(p['tau'], 3):>6} "
                f"{_fmt(p['drafts_verified_per_round'], 2):>9}"
            )
    return "\n".join(lines)


def result_dict(r: BenchmarkResult) -> dict:
    out = asdict(r)
    out["speedup"] = r.speedup
    return out


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(payload), indent=2, sort_keys=True) + "\n")
    return path


def write_csv(path: Path, results: list[BenchmarkResult]) -> Path:
    """One row per benchmark; acceptance by position as accept_rate@k columns."""
    block = max((len(r.accept_rate_by_position) for r in results), default=0)
    scalar = [
        "benchmark",
        "num_prompts",
        "rounds",
        "new_tokens",
        "tau",
        "mean_proposal_length",
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "draft_time_s",
        "verify_time_s",
        "prefill_time_s",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(scalar + [f"accept_rate@{k}" for k in range(block)])
        for r in results:
            d = result_dict(r)
            writer.writerow(
                [_csv(d[k]) for k in scalar] + [_csv(a) for a in r.accept_rate_by_position]
            )
    return path


def _csv(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return repr(value) if isinstance(value, float) else str(value)


# ---- plots (matplotlib, headless) -----------------------------------------------------------


def _pyplot():
    # lazy: matplotlib, 0.3 s of import, only to plot
    import matplotlib

    matplotlib.use("Agg")
    # lazy: after matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def _figure(path: Path, figsize: tuple[float, float], title: str) -> Iterator:
    """One plot's axes; once the body has drawn, the title, then the figure laid out and saved
    to `path` (120 dpi). The figure is closed either way."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_acceptance_by_position(path: Path, results: list[BenchmarkResult]) -> Path:
    """Per benchmark, solid: of the rounds that proposed draft k, the share that kept drafts
    0..k (`accept_rate_by_position`); dashed: P(accept k | drafts 0..k-1 accepted)
    (`conditional_accept_rate`)."""
    with _figure(path, (6.5, 4), "Acceptance by draft position") as ax:
        for i, r in enumerate(results):
            color = f"C{i % 10}"
            for rates, style, what in (
                (r.accept_rate_by_position, "o-", "P(drafts 0..k accepted | k proposed)"),
                (r.conditional_accept_rate, "s--", "P(accept k | 0..k-1 accepted)"),
            ):
                xs = [k for k, a in enumerate(rates) if a is not None]
                label = f"{r.benchmark}: {what}"
                ax.plot(xs, [rates[k] for k in xs], style, color=color, label=label)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("acceptance rate")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return path


def plot_tau_by_benchmark(path: Path, results: list[BenchmarkResult]) -> Path:
    names = [r.benchmark for r in results] + ["average"]
    taus = [r.tau for r in results] + [average_row(results)["tau"]]
    with _figure(path, (6, 4), "Acceptance length by benchmark") as ax:
        ax.bar(names, taus, color=["C0"] * len(results) + ["C1"])
        for i, t in enumerate(taus):
            ax.text(i, t, f"{t:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("τ (tokens per target forward)")
        for label in ax.get_xticklabels():
            label.set(rotation=30, horizontalalignment="right")
    return path


def plot_reliability(path: Path, reports: dict[str, dict]) -> Path:
    """Pooled reliability curves of the cumulative confidence, one line per report (before/after)."""
    with _figure(path, (5, 5), "Confidence reliability (cumulative)") as ax:
        ax.plot([0, 1], [0, 1], "--", color="0.6", linewidth=1)
        for label, rep in reports.items():
            bins = rep["reliability"]
            ece = rep["pooled"]["ece"]
            ax.plot(
                [b["mean_pred"] for b in bins],
                [b["observed"] for b in bins],
                "o-",
                label=f"{label} (ECE {ece:.3f})",
            )
        ax.set_xlabel("predicted P(prefix accepted)")
        ax.set_ylabel("observed frequency")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return path


def plot_threshold_sweep(path: Path, sweep: list[dict]) -> Path:
    thr = [row["threshold"] for row in sweep]
    with _figure(path, (6, 4), "Confidence truncation threshold sweep") as ax:
        ax.plot(thr, [row["tau"] for row in sweep], "o-", color="C0", label="τ")
        ax.set_xlabel("confidence threshold")
        ax.set_ylabel("τ", color="C0")
        ax2 = ax.twinx()
        for key, style, color, label in (
            ("accepted_fraction", "s-", "C1", "accepted drafts kept"),
            ("verify_tokens_saved", "^-", "C2", "verify tokens saved"),
        ):
            ax2.plot(thr, [row[key] for row in sweep], style, color=color, label=label)
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("fraction")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="center left")
        ax.grid(alpha=0.3)
    return path
