"""Compare MLflow runs side by side: the params that differ, final and best metrics, and overlay
plots of loss and τ against the step.

    dspark-ds compare --tracking_uri sqlite:///runs/mlflow.db --experiment dspark-ds
    dspark-ds compare --tracking_uri http://mlflow:5000 --run_ids [a1b2, c3d4]
    dspark-ds compare --tracking_uri sqlite:///runs/mlflow.db \
        --filter "params.\\`model.markov_rank\\` = '0'" --out_dir compare/

Runs are chosen by id, or by experiment(s) plus an MLflow search filter (newest first, at most
--max_runs). "Best" is the minimum for losses / errors / memory and the maximum for τ, accept
rates and throughput. The plots are PNG files in --out_dir (loss.png, tau.png).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from dspark_ds.errors import ConfigError

DEFAULT_METRICS = [
    "train/tau_probabilistic",
    "train/tau_greedy",
    "val/tau_probabilistic",
    "val/tau_greedy",
    "train/loss",
    "train/ce_loss",
    "train/l1_loss",
    "train/confidence_loss",
    "val/loss",
    "system/tokens_per_s",
    "system/peak_memory_mb",
]
HIGHER_IS_BETTER = ("tau", "accept", "tokens_per_s", "samples_per_s", "auroc", "speedup")
IGNORED_PARAMS = ("name", "tracking.run_name", "output_dir")


@dataclass
class CompareConfig:
    """Select MLflow runs and compare them."""

    tracking_uri: str = "sqlite:///runs/mlflow.db"
    """MLflow tracking URI (the trainer's default store is sqlite:///<output_dir>/mlflow.db)."""
    run_ids: list[str | int] = field(default_factory=list)
    """Runs to compare, by id (a unique prefix of at least 6 characters is enough). An
    all-digit prefix reads as a number on the command line and is used as its digits (quote it,
    `['00123456']`, when it starts with 0)."""
    experiment: list[str] = field(default_factory=lambda: ["dspark-ds"])
    """Experiment names to search when run_ids is empty."""
    filter: str = ""
    """MLflow search filter, e.g. "params.`train.lr` = '0.003'" or "attributes.status = 'FINISHED'"."""
    max_runs: int = 10
    """At most this many runs (newest first) from a search."""
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    """Metric keys to show (those a run lacks print as '-'); "@" may be written "_at_"."""
    out_dir: str | None = "compare"
    """Where to write loss.png and tau.png; None = no plots."""
    show_all_params: bool = False
    """Print every param, not only those that differ."""


def select_runs(client: MlflowClient, cfg: CompareConfig) -> list:
    if cfg.run_ids:
        runs = []
        for rid in map(str, cfg.run_ids):
            try:
                runs.append(client.get_run(rid))
            except Exception:  # noqa: BLE001 - try it as a prefix
                matches = [r for r in _search(client, cfg, "") if r.info.run_id.startswith(rid)]
                if len(rid) < 6 or len(matches) != 1:
                    raise ConfigError(f"run_ids: {rid!r} matches {len(matches)} runs") from None
                runs.append(matches[0])
        return runs
    runs = _search(client, cfg, cfg.filter)
    if not runs:
        raise ConfigError(
            f"no runs in experiment(s) {cfg.experiment} at {cfg.tracking_uri}"
            + (f" matching filter {cfg.filter!r}" if cfg.filter else "")
        )
    return runs


def _search(client: MlflowClient, cfg: CompareConfig, filter_string: str) -> list:
    ids = []
    for name in cfg.experiment:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise ConfigError(f"experiment: {name!r} does not exist at {cfg.tracking_uri}")
        ids.append(exp.experiment_id)
    try:
        return client.search_runs(
            ids,
            filter_string=filter_string,
            max_results=cfg.max_runs,
            order_by=["attributes.start_time DESC"],
        )
    except mlflow.exceptions.MlflowException as err:
        raise ConfigError(f"filter: {err}") from err


def run_label(run) -> str:
    name = run.data.tags.get("mlflow.runName") or run.info.run_name or ""
    return f"{name} ({run.info.run_id[:8]})"


def differing_params(runs: list, show_all: bool = False) -> dict[str, list[str]]:
    keys = sorted(set().union(*(r.data.params for r in runs)))
    out = {}
    for key in keys:
        values = [r.data.params.get(key, "-") for r in runs]
        if key in IGNORED_PARAMS and not show_all:
            continue
        if show_all or len(set(values)) > 1:
            out[key] = values
    return out


def _better(key: str) -> str:
    return "max" if any(h in key for h in HIGHER_IS_BETTER) else "min"


def metric_summary(client: MlflowClient, runs: list, keys: list[str]) -> dict[str, list[tuple]]:
    """{metric: [(final, best, best_step) or None per run]} for metrics at least one run has."""
    out: dict[str, list[tuple | None]] = {}
    for key in keys:
        key = key.replace("@", "_at_")
        row: list[tuple | None] = []
        for run in runs:
            hist = _history(client, run.info.run_id, key)
            if not hist:
                row.append(None)
                continue
            final = hist[-1]
            pick = max if _better(key) == "max" else min
            best = pick(hist, key=lambda sv: sv[1])
            row.append((final[1], best[1], best[0]))
        if any(x is not None for x in row):
            out[key] = row
    return out


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    hist = client.get_metric_history(run_id, key)
    # NOTE: a resumed run may log a step twice; keep the latest value of each step
    latest: dict[int, tuple[int, float]] = {}
    for m in hist:
        if m.step not in latest or m.timestamp >= latest[m.step][0]:
            latest[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(latest.items()) if not math.isnan(v)]


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])


def plot(client: MlflowClient, runs: list, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    panels = {
        "loss.png": ("loss", ["train/loss", "val/loss"]),
        "tau.png": (
            "τ (acceptance length)",
            ["train/tau_probabilistic", "val/tau_probabilistic", "train/tau_greedy"],
        ),
    }
    for fname, (ylabel, keys) in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = 0
        for i, run in enumerate(runs):
            color = f"C{i % 10}"
            for j, key in enumerate(keys):
                hist = _history(client, run.info.run_id, key)
                if not hist:
                    continue
                steps, values = zip(*hist)
                style = ["-", "--", ":"][j % 3]
                ax.plot(
                    steps,
                    values,
                    style,
                    color=color,
                    marker="o" if len(steps) < 3 else None,
                    label=f"{run_label(run)} {key}",
                )
                drawn += 1
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def compare(cfg: CompareConfig) -> str:
    """The report as text (also printed by main); writes the plots."""
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    runs = select_runs(client, cfg)
    labels = [run_label(r) for r in runs]
    parts = [f"{len(runs)} run(s) at {cfg.tracking_uri}"]
    parts.append(
        _table(
            ["run", "status", "zero", "world"],
            [
                [
                    labels[i],
                    r.info.status,
                    r.data.params.get("derived.zero_stage", "-"),
                    r.data.params.get("derived.world_size", "-"),
                ]
                for i, r in enumerate(runs)
            ],
        )
    )
    params = differing_params(runs, cfg.show_all_params)
    title = "params" if cfg.show_all_params else "params that differ"
    if params:
        parts.append(
            f"\n{title}:\n" + _table(["param", *labels], [[k, *v] for k, v in params.items()])
        )
    else:
        parts.append(f"\n{title}: none")
    metrics = metric_summary(client, runs, cfg.metrics)
    if metrics:
        rows = []
        for key, row in metrics.items():
            rows.append([key, "final", *[_fmt(x[0] if x else None) for x in row]])
            rows.append(
                [
                    "",
                    f"best ({_better(key)})",
                    *[f"{_fmt(x[1])} @{x[2]}" if x else "-" for x in row],
                ]
            )
        parts.append("\nmetrics:\n" + _table(["metric", "", *labels], rows))
    if cfg.out_dir:
        written = plot(client, runs, Path(cfg.out_dir))
        parts.append("\nplots: " + ", ".join(str(p) for p in written))
    return "\n".join(parts)


def run_compare(cfg: CompareConfig) -> str:
    """`dspark-ds compare`: prints the report (and writes the plots)."""
    text = compare(cfg)
    print(text)
    return text
