"""Compare MLflow runs, one table per kind: training runs side by side (the params that differ,
final and best metrics, overlay plots of loss and τ against the step), evaluations (τ, speedup,
calibration, the training run each drafter came from), tuning sweeps (one table per sweep, a row
per ZeRO option), demos.

    dspark-ds compare --tracking_uri sqlite:///runs/mlflow.db --experiment [dspark-ds]
    dspark-ds compare --tracking_uri http://mlflow:5000 --run_ids [a1b2, c3d4]
    dspark-ds compare --tracking_uri sqlite:///runs/demo/mlflow.db --experiment [dspark-ds-demo] \
        --parent 3f2a1b              # the runs nested under a demo (its trainings and evals)
    dspark-ds compare --tracking_uri sqlite:///runs/mlflow.db --kind [tune]

Runs are chosen by id, by parent (every run nested under it, at any depth), or by experiment(s)
plus an MLflow search filter (newest first, at most --max_runs; a sweep's options come with
their sweep). "Best" is the minimum for losses / errors / memory and the maximum for τ, accept
rates and throughput. The plots are PNG files in --out_dir (loss.png, tau.png).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from dspark_ds.errors import ConfigError
from dspark_ds.tracking.store import KIND_TAG, PARENT_TAG, resolve_experiment

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


def _as_strings(text: str) -> str:
    """`[a, 'b', "c"]` (or one bare id) as a JSON list of the ids' text."""
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    ids = [item.strip().strip("'\"") for item in inner.split(",")]
    return json.dumps([i for i in ids if i])


@dataclass
class CompareConfig:
    """Select MLflow runs and compare them."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db (the
    trainer's default store is sqlite:///<output_dir>/mlflow.db)."""
    run_ids: list[str | int] = field(default_factory=list)
    """Runs to compare, by id (a unique prefix of at least 6 characters is enough). Each id is
    taken as written: `[44420656, 755331e2, 00123456]` are three prefixes, not numbers."""
    experiment: list[str] = field(default_factory=list)
    """Experiment names to search when run_ids is empty; empty = $MLFLOW_EXPERIMENT_NAME, else
    dspark-ds."""

    @staticmethod
    def normalize_argv(argv: list[str]) -> list[str]:
        """`--run_ids [a, b]` as a list of strings before YAML reads it: a hex id prefix such
        as 755331e2 or 0x1f2e3d would otherwise become a number (75533100.0, 2043197)."""
        for i, arg in enumerate(argv):
            if arg.startswith("--run_ids="):
                argv[i] = "--run_ids=" + _as_strings(arg.split("=", 1)[1])
            elif arg == "--run_ids" and i + 1 < len(argv):
                argv[i + 1] = _as_strings(argv[i + 1])
        return argv

    def __post_init__(self) -> None:
        self.tracking_uri = (
            self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///runs/mlflow.db"
        )
        self.experiment = list(self.experiment) or [resolve_experiment(None)]

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
    parent: str | None = None
    """Compare the runs nested under this run (id or a unique prefix of 6+ characters), at any
    depth: a demo's trainings and evaluations, a sweep's options."""
    kind: list[str] = field(default_factory=list)
    """Only runs of these kinds (train, eval, tune, demo, bench); empty = all."""
    runs_per_table: int = 3
    """Training runs per params / metrics table (more runs: more tables, each narrow enough to
    read)."""


def select_runs(client: MlflowClient, cfg: CompareConfig) -> list:
    runs = _select(client, cfg)
    if cfg.kind:
        runs = [r for r in runs if kind_of(r) in cfg.kind]
        if not runs:
            raise ConfigError(f"kind: none of the selected runs is of kind {cfg.kind}")
    return runs


def _select(client: MlflowClient, cfg: CompareConfig) -> list:
    if cfg.parent:
        return _descendants(client, _by_id(client, cfg, str(cfg.parent), "parent"))
    if cfg.run_ids:
        return [_by_id(client, cfg, str(rid), "run_ids") for rid in cfg.run_ids]
    runs = _search(client, cfg, cfg.filter)
    if not runs:
        raise ConfigError(
            f"no runs in experiment(s) {cfg.experiment} at {cfg.tracking_uri}"
            + (f" matching filter {cfg.filter!r}" if cfg.filter else "")
        )
    return runs


def _by_id(client: MlflowClient, cfg: CompareConfig, rid: str, option: str):
    try:
        return client.get_run(rid)
    except Exception:  # noqa: BLE001 - try it as a prefix
        everything = replace(cfg, max_runs=50_000)
        matches = [r for r in _search(client, everything, "") if r.info.run_id.startswith(rid)]
        if len(rid) < 6 or len(matches) != 1:
            raise ConfigError(f"{option}: {rid!r} matches {len(matches)} runs") from None
        return matches[0]


def _children(client: MlflowClient, run) -> list:
    return client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{run.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )


def _descendants(client: MlflowClient, parent) -> list:
    out, todo = [], [parent]
    while todo:
        for child in _children(client, todo.pop(0)):
            out.append(child)
            todo.append(child)
    if not out:
        raise ConfigError(f"parent: run {parent.info.run_id} has no nested runs")
    return out


def kind_of(run) -> str:
    """The run's `kind` tag; runs logged before there was one: train when they have a
    training param."""
    kind = run.data.tags.get(KIND_TAG)
    if kind:
        return kind
    if run.data.tags.get("mlflow.runName") == "demo-summary":
        return "demo"
    return "train" if "train.lr" in run.data.params else "other"


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
    # lazy: matplotlib, 0.3 s of import, only to plot
    import matplotlib

    matplotlib.use("Agg")
    # lazy: after matplotlib.use("Agg")
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


def _short(run_id: str | None) -> str:
    return run_id[:8] if run_id else "-"


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), max(size, 1))] or [[]]


def training_section(client: MlflowClient, runs: list, cfg: CompareConfig) -> list[str]:
    """The training runs: who they are, then params and metrics, `runs_per_table` runs a table."""
    parts = [
        _table(
            ["run", "status", "drafter", "zero", "world", "seed", "parent"],
            [
                [
                    run_label(r),
                    r.info.status,
                    r.data.tags.get("drafter_kind", "-"),
                    r.data.tags.get("zero", r.data.params.get("derived.zero_stage", "-")),
                    r.data.params.get("derived.world_size", r.data.tags.get("world_size", "-")),
                    r.data.params.get("train.seed", "-"),
                    _short(r.data.tags.get(PARENT_TAG)),
                ]
                for r in runs
            ],
        )
    ]
    params = differing_params(runs, cfg.show_all_params)
    title = "params" if cfg.show_all_params else "params that differ"
    metrics = metric_summary(client, runs, cfg.metrics)
    if not params:
        parts.append(f"\n{title}: none")
    for cols in _chunks(list(range(len(runs))), cfg.runs_per_table):
        labels = [run_label(runs[i]) for i in cols]
        if params:
            rows = [[k, *[v[i] for i in cols]] for k, v in params.items()]
            parts.append(f"\n{title}:\n" + _table(["param", *labels], rows))
        if metrics:
            rows = []
            for key, row in metrics.items():
                mine = [row[i] for i in cols]
                rows.append([key, "final", *[_fmt(x[0] if x else None) for x in mine]])
                best = [
                    "",
                    f"best ({_better(key)})",
                    *[f"{_fmt(x[1])} @{x[2]}" if x else "-" for x in mine],
                ]
                rows.append(best)
            parts.append("\nmetrics:\n" + _table(["metric", "", *labels], rows))
    return parts


def _mean_of(run, suffix: str) -> float | None:
    """The mean over a run's benchmarks of `<benchmark>/<suffix>` (average/ excluded)."""
    values = [
        v
        for k, v in run.data.metrics.items()
        if k.endswith("/" + suffix) and k.count("/") == 1 and not k.startswith("average/")
    ]
    return sum(values) / len(values) if values else None


def evaluation_section(runs: list) -> list[str]:
    rows = []
    for r in runs:
        m, tags = r.data.metrics, r.data.tags
        row = [
            run_label(r),
            tags.get("drafter_kind", "-"),
            tags.get("temperature", r.data.params.get("temperature", "-")),
            _short(tags.get("trained_by")),
            _fmt(m.get("average/tau")),
            _fmt(_mean_of(r, "speedup")),
            _fmt(_mean_of(r, "tokens_per_s")),
            _fmt(m.get("confidence_raw/auroc")),
            _fmt(m.get("confidence_raw/ece")),
        ]
        rows.append(row)
    header = ["run", "drafter", "T", "trained by", "tau", "speedup", "tok/s", "AUROC", "ECE"]
    return [_table(header, rows)]


def sweep_section(client: MlflowClient, parent, children: list) -> list[str]:
    """One sweep: its options as one table (predicted memory and step; measured with
    --measure)."""
    tags = parent.data.tags
    head = (
        f"sweep {run_label(parent)}: recipe {tags.get('recipe', '-')}, recommended "
        f"{tags.get('recommended', '-')}"
    )
    rows = []
    for c in children:
        m = c.data.metrics
        row = [
            c.data.tags.get("zero", c.info.run_name),
            "yes" if m.get("fits") else "no",
            _fmt(m.get("memory/device_gib")),
            _fmt(m.get("memory/host_per_rank_gib")),
            _fmt(m.get("predicted/step_s")),
            _fmt(m.get("predicted/tokens_per_s")),
            _fmt(m.get("measured/step_s")),
            _fmt(m.get("measured/peak_gib")),
        ]
        rows.append(row)
    header = [
        "option",
        "fits",
        "GPU GiB",
        "host GiB",
        "step s",
        "tok/s",
        "measured s",
        "measured GiB",
    ]
    return [head, _table(header, rows)]


def tuning_section(client: MlflowClient, runs: list) -> list[str]:
    """Every sweep among `runs` (a parent, or options whose parent it is), one table each."""
    parents: dict[str, object] = {}
    for r in runs:
        parent_id = r.data.tags.get(PARENT_TAG)
        if parent_id and kind_of(client.get_run(parent_id)) == "tune":
            parents.setdefault(parent_id, client.get_run(parent_id))
        else:
            parents.setdefault(r.info.run_id, r)
    parts = []
    for parent in parents.values():
        parts += sweep_section(client, parent, _children(client, parent)) + [""]
    return parts[:-1]


def demo_section(client: MlflowClient, runs: list) -> list[str]:
    rows = []
    for r in runs:
        nested = _children(client, r)
        row = [
            run_label(r),
            r.info.status,
            r.data.tags.get("seeds", "-"),
            r.data.tags.get("drafters", "-"),
            str(len(nested)),
        ]
        rows.append(row)
    return [_table(["run", "status", "seeds", "drafters", "trainings"], rows)]


SECTIONS = (
    ("train", "training runs"),
    ("eval", "evaluations"),
    ("tune", "tuning sweeps"),
    ("demo", "demos"),
    ("bench", "benchmarks"),
    ("other", "other runs"),
)


def compare(cfg: CompareConfig) -> str:
    """The report as text (also printed by main); writes the plots of the training runs."""
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    runs = select_runs(client, cfg)
    parts = [f"{len(runs)} run(s) at {cfg.tracking_uri}"]
    by_kind: dict[str, list] = {}
    for r in runs:
        kind = kind_of(r)
        by_kind.setdefault(kind if kind in dict(SECTIONS) else "other", []).append(r)
    for kind, title in SECTIONS:
        mine = by_kind.get(kind)
        if not mine:
            continue
        parts.append(f"\n== {title} ({len(mine)}) ==")
        if kind == "train":
            parts += training_section(client, mine, cfg)
        elif kind == "eval":
            parts += evaluation_section(mine)
        elif kind == "tune":
            parts += tuning_section(client, mine)
        elif kind == "demo":
            parts += demo_section(client, mine)
        else:
            parts.append(_table(["run", "status"], [[run_label(r), r.info.status] for r in mine]))
    if cfg.out_dir and by_kind.get("train"):
        written = plot(client, by_kind["train"], Path(cfg.out_dir))
        parts.append("\nplots: " + ", ".join(str(p) for p in written))
    return "\n".join(parts)


def run_compare(cfg: CompareConfig) -> str:
    """`dspark-ds compare`: prints the report (and writes the plots)."""
    text = compare(cfg)
    print(text)
    return text
