"""τ and speedup of DSpark, DFlash and Eagle3 against draft depth and training budget, on the
demo's work, compared at equal training time and at equal draft cost per round (docs/study.md).

    python tools/depth_study.py                                   # docs/study.md, study.json
    python tools/depth_study.py --depths [1,2] --budgets [1,2] --docs_dir /tmp/s \\
        --output_dir /tmp/s/run                                   # a small grid
    python tools/depth_study.py --resume false                    # start afresh

Every option of `dspark-ds demo` applies. A cell: one kind at one depth (`num_draft_layers` of
its kind's size block; DSpark's sizes DFlash too) and one budget multiple (of
`budget.max_steps`). Per seed: the demo's data stages once, then per cell the demo's training
(`<kind>-d<depth>-b<multiple>-s<seed>` under runs/) and its evaluation at every temperature
(`eval.temperatures` must hold 1.0: the comparisons are at T = 1).

Resuming: `<output_dir>/study.json` is written after every cell; a rerun (`--resume true`, the
default) skips its cells and reuses its seeds' data, and refuses with one line naming the option
a run whose settings differ (every option but the grid, `NOT_SETTINGS`, and where things go,
plus each drafter's loss and order as `--loss` resolves them): a larger grid reuses the cells
it shares. `--resume false` starts afresh (data, runs go).

Written: `output_dir` (the demo's layout, study.json, artifacts/), `docs_dir`/study.json (every
record, the base budget, command and date), study.md's tables (between its markers; a new file
gets a header) and images/study.png; into MLflow (the demo's store unless --tracking_uri): one
run with the options as params, per cell metrics `<metric>/<kind>_d<depth>_b<multiple>` at
step = seed, the picture, study.json and the tables as artifacts; each training nested under
it, each evaluation under its training, as the demo nests them.
"""

from __future__ import annotations

import datetime
import json
import shlex
import shutil
import sys
import time
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path

import torch

# the repository's own package, wherever this script is run from
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_ds.config import flatten, parse  # noqa: E402
from dspark_ds.demo import launcher  # noqa: E402
from dspark_ds.demo.config import DemoConfig  # noqa: E402
from dspark_ds.demo.pipeline import DemoPipeline, max_valid_anchors, parent_run  # noqa: E402
from dspark_ds.demo.summary import temp_key  # noqa: E402
from dspark_ds.drafters.presets import PRESETS, preset  # noqa: E402
from dspark_ds.errors import ConfigError  # noqa: E402
from dspark_ds.files import write_between_markers  # noqa: E402
from dspark_ds.tracking.mlflow import Tracker  # noqa: E402
from dspark_ds.tracking.store import RUN_ID_FILE, default_artifact_location  # noqa: E402

TABLE_BEGIN = "<!-- study table: written by tools/depth_study.py -->"
TABLE_END = "<!-- end of the study table -->"
HEADER = """# Draft depth × training budget

The demo's drafters against draft depth and training budget, by `python tools/depth_study.py`.
"""
REFERENCE = "eagle3"
"""The kind the others are compared with at equal training time and equal draft cost."""
T1 = temp_key(1.0)
NOT_SETTINGS = "depths budgets seeds drafters output_dir docs_dir resume tracking_uri".split()
NOT_SETTINGS += ["experiment"]
"""Options that do not change a cell's result: the grid, and where things go (the output and
docs directories, MLflow's store and experiment)."""


@dataclass
class StudyConfig(DemoConfig):
    """tools/depth_study.py: the demo's drafters over draft depths and training budgets."""

    output_dir: str = "runs/study"
    """Everything the study writes but the docs: the demo's layout, study.json, artifacts/."""
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 5])
    """Draft depths (`num_draft_layers` of every kind's size block)."""
    budgets: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Training budgets, as multiples of `budget.max_steps`."""
    docs_dir: str = "docs"
    """Where study.json, study.md's tables and images/study.png go."""
    resume: bool = True
    """Skip the cells `<output_dir>/study.json` holds (refused if its settings differ);
    false: start afresh."""

    def validate(self) -> None:
        super().validate()
        for name in ("depths", "budgets"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values) or min(values) < 1:
                raise ConfigError(f"{name}: need >= 1 distinct values >= 1, got {values}")
        if 1.0 not in self.eval.temperatures:
            raise ConfigError(
                f"eval.temperatures: the study compares at T = 1; include 1.0, got "
                f"{self.eval.temperatures}"
            )


@dataclass(frozen=True)
class Cell:
    """One drafter kind at one depth and budget multiple, for one seed."""

    kind: str
    depth: int
    multiple: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.kind}-d{self.depth}-b{self.multiple}-s{self.seed}"

    def matches(self, rec: dict) -> bool:
        return tuple(rec[k] for k in CELL_KEYS) == astuple(self)


CELL_KEYS = ("kind", "depth", "budget_multiple", "seed")
"""A record's fields that name its cell (`Cell`'s, in order)."""


def cells(cfg: StudyConfig) -> list[Cell]:
    """Every cell, the smaller budgets first (a cut run has compared the most)."""
    return [
        Cell(kind, depth, multiple, seed)
        for seed in cfg.seeds
        for multiple in sorted(cfg.budgets)
        for depth in sorted(cfg.depths)
        for kind in cfg.drafters
    ]


def cell_config(cfg: StudyConfig, depth: int, multiple: int) -> StudyConfig:
    """The study's options with every kind's size block at `depth` layers and the steps
    multiplied by `multiple`."""
    sizes = cfg.drafter
    for name in cfg.drafters:
        kind = preset(name).kind
        sizes = replace(sizes, **{kind: replace(getattr(sizes, kind), num_draft_layers=depth)})
    budget = replace(cfg.budget, max_steps=cfg.budget.max_steps * multiple)
    return replace(cfg, drafter=sizes, budget=budget)


class CellPipeline(DemoPipeline):
    """The demo's training and evaluation at one depth and budget multiple, on the study's
    target, data, stages and MLflow run (`data`), under names of their own."""

    def __init__(self, cfg: StudyConfig, data: DemoPipeline, depth: int, multiple: int):
        super().__init__(cell_config(cfg, depth, multiple))
        self.tag = f"d{depth}-b{multiple}"
        self.target, self.num_anchors = data.target, data.num_anchors
        self.tracker, self.stages = data.tracker, data.stages

    def run_name(self, kind: str, seed: int) -> str:
        return f"{kind}-{self.tag}-s{seed}"

    def eval_name(self, kind: str, temperature: float, seed: int) -> str:
        return f"eval-{kind}-{self.tag}-{temp_key(temperature)}-s{seed}"


# ---- what a rerun keeps: <output_dir>/study.json -------------------------------------------
def settings(cfg: StudyConfig) -> dict:
    """The options that decide a cell's result (the depth is the cell's own), and what `--loss`
    resolves to for each drafter (`trains_with.<name>`: its `model` loss fields, `data` order
    and `train` optimizer settings): a newer dspark-ds whose presets train otherwise under the
    same option does not resume the cells an older one made."""
    drop = {f"drafter.{preset(n).kind}.num_draft_layers" for n in PRESETS}
    kept = {k: v for k, v in flatten(cfg).items() if k.split(".")[0] not in NOT_SETTINGS}
    kept = {k: v for k, v in kept.items() if k not in drop}
    for name in PRESETS:
        kept[f"trains_with.{name}"] = {
            "model": cfg.loss_fields(name),
            "data": cfg.data_order(name),
            "train": cfg.train_fields(name),
        }
    return json.loads(json.dumps(kept, default=str))  # as study.json holds them


def load_state(cfg: StudyConfig) -> dict:
    """The previous run's state (records, seeds whose data is ready, settings) when resuming
    and its settings are this run's; a fresh one otherwise. A ConfigError names the first
    setting that differs."""
    now = {"settings": settings(cfg), "records": [], "data_ready": [], "params": None}
    path = Path(cfg.output_dir) / "study.json"
    if not cfg.resume or not path.is_file():
        return now
    then = json.loads(path.read_text())
    old, new = then.get("settings", {}), now["settings"]
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ConfigError(
                f"resume: {path} was made with {key} {old.get(key)!r}, this run has "
                f"{new.get(key)!r}; use --resume false to start afresh, or another --output_dir"
            )
    return {**now, **{k: then.get(k, now[k]) for k in ("records", "data_ready", "params")}}


def save_state(cfg: StudyConfig, state: dict) -> None:
    path = Path(cfg.output_dir) / "study.json"
    path.with_suffix(".tmp").write_text(json.dumps(state, indent=2) + "\n")
    path.with_suffix(".tmp").replace(path)  # a cut write never loses the cells done


# ---- one cell -------------------------------------------------------------------------------
def run_cell(cfg: StudyConfig, pipe: CellPipeline, cell: Cell) -> dict:
    """Trains and evaluates one cell; its record."""
    s, name = pipe.stages, pipe.run_name(cell.kind, cell.seed)
    label = PRESETS[cell.kind].label
    what = f"{label}, {cell.depth} layer(s), {pipe.cfg.budget.max_steps} steps, seed {cell.seed}"
    info = s.run(f"train-{name}", what, pipe.train, cell.kind, cell.seed)
    rows = {}
    for t in cfg.eval.temperatures:
        stage = pipe.eval_name(cell.kind, t, cell.seed)
        rows[temp_key(t)] = s.run(stage, f"T = {t:g}", pipe.evaluate, cell.kind, t, cell.seed)
    rec = {
        **dict(zip(CELL_KEYS, astuple(cell))),
        "label": label,
        "steps": pipe.cfg.budget.max_steps,
        "trained_steps": info.get("steps"),
        "run": name,
        "final_loss": info.get("final_loss"),
        "train_wall_s": s.seconds[f"train-{name}"],
        "train_cpu_s": s.cpu_seconds[f"train-{name}"],
    }
    for key, row in rows.items():
        for metric in ("tau", "speedup", "draft_ms_per_round", "verify_ms_per_round"):
            rec[f"{metric}_{key}"] = row[metric]
        rec[f"accept_rate_by_position_{key}"] = row["accept_rate_by_position"]
    return rec


def cell_metrics(rec: dict, temperatures: list[float]) -> dict[str, float]:
    """A cell's MLflow metrics: `<metric>/<kind>_d<depth>_b<multiple>`."""
    tag = f"{rec['kind']}_d{rec['depth']}_b{rec['budget_multiple']}"
    names = ["train_wall_s", "train_cpu_s", f"draft_ms_per_round_{T1}"]
    names += [f"{m}_{temp_key(t)}" for t in temperatures for m in ("tau", "speedup")]
    return {f"{n}/{tag}": rec[n] for n in names if rec.get(n) is not None}


class Progress:
    """The `[study] cell i/n` lines: the time so far and what is left (the seconds per
    training step of the cells this run has done, times the steps left)."""

    def __init__(self, total: int, steps_left: int):
        self.total, self.left, self.t0 = total, steps_left, time.perf_counter()
        self.spent, self.steps = 0.0, 0

    def start(self, i: int, cell: Cell, steps: int) -> float:
        eta = self.spent / self.steps * self.left if self.steps else None
        print(
            f"[study] cell {i}/{self.total}: {PRESETS[cell.kind].label} depth {cell.depth}, "
            f"{cell.multiple}x ({steps} steps), seed {cell.seed} ... elapsed "
            f"{_hms(time.perf_counter() - self.t0)}" + (f", ETA {_hms(eta)}" if eta else ""),
            flush=True,
        )
        return time.perf_counter()

    def finish(self, started: float, steps: int) -> None:
        self.left, self.steps = self.left - steps, self.steps + steps
        self.spent += time.perf_counter() - started


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


# ---- the tables -----------------------------------------------------------------------------
def _f(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _rows(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _order(rec: dict) -> tuple:
    kinds = list(PRESETS)
    return (rec["seed"], rec["budget_multiple"], kinds.index(rec["kind"]), rec["depth"])


def grid_table(recs: list[dict], temperatures: list[float]) -> list[str]:
    """Every cell: τ and speedup per temperature, draft / verify ms per round, acceptance by
    position at T = 1, training wall and CPU seconds."""
    keys = [temp_key(t) for t in temperatures]
    head = ["drafter", "depth", "budget", "steps", "seed"]
    head += [f"τ T={t:g}" for t in temperatures] + [f"speedup T={t:g}" for t in temperatures]
    head += ["draft ms/round T=1", "verify ms/round T=1", "train s", "train CPU s"]
    head += ["acceptance by position T=1"]
    rows = []
    for r in sorted(recs, key=_order):
        row = [r["label"], str(r["depth"]), f"{r['budget_multiple']}x", str(r["steps"])]
        row += [str(r["seed"])] + [_f(r[f"tau_{k}"]) for k in keys]
        row += [_f(r[f"speedup_{k}"], 2) for k in keys]
        row += [_f(r[f"draft_ms_per_round_{T1}"], 2), _f(r[f"verify_ms_per_round_{T1}"], 2)]
        row += [_f(r["train_wall_s"], 1), _f(r["train_cpu_s"], 1)]
        accept = r[f"accept_rate_by_position_{T1}"]
        row.append(" ".join("—" if a is None else f"{a:.2f}" for a in accept))
        rows.append(row)
    return _rows(head, rows)


def nearest(rec: dict, pool: list[dict], key: str) -> dict | None:
    """The record of `pool` whose `key` is nearest `rec`'s (a tie: the smaller budget, then the
    smaller depth); None where either has no value."""
    pool = [p for p in pool if p.get(key) is not None]
    if rec.get(key) is None or not pool:
        return None
    return min(pool, key=lambda p: (abs(p[key] - rec[key]), p["budget_multiple"], p["depth"]))


def matches(recs: list[dict], key: str, same_budget: bool) -> list[tuple[dict, dict | None]]:
    """Each cell of a kind other than REFERENCE beside the REFERENCE cell of its seed (and of
    its budget, with `same_budget`) whose `key` is nearest."""
    refs = [p for p in recs if p["kind"] == REFERENCE]
    out = []
    for r in sorted((r for r in recs if r["kind"] != REFERENCE), key=_order):
        pool = [p for p in refs if p["seed"] == r["seed"]]
        if same_budget:
            pool = [p for p in pool if p["budget_multiple"] == r["budget_multiple"]]
        out.append((r, nearest(r, pool, key)))
    return out


def _cell(r: dict | None) -> str:
    return "—" if r is None else f"{r['depth']} layer(s), {r['budget_multiple']}x"


def time_table(recs: list[dict]) -> list[str]:
    """At equal training time: each DSpark / DFlash cell beside the Eagle3 cell of its seed
    with the nearest training CPU seconds, whatever that cell's depth and budget."""
    head = ["budget", "drafter", "depth", "seed", "train CPU s", "Eagle3 cell", "its train CPU s"]
    head += ["τ T=1", "Eagle3 τ T=1", "τ ratio"]
    rows = []
    for r, e in matches(recs, "train_cpu_s", same_budget=False):
        tau, other = r[f"tau_{T1}"], e and e[f"tau_{T1}"]
        row = [f"{r['budget_multiple']}x", r["label"], str(r["depth"]), str(r["seed"])]
        row += [_f(r["train_cpu_s"], 1), _cell(e), _f(e and e["train_cpu_s"], 1)]
        rows.append(row + [_f(tau), _f(other), _f(_ratio(tau, other))])
    return _rows(head, rows)


def cost_table(recs: list[dict]) -> list[str]:
    """At equal draft cost per round: each DSpark / DFlash cell beside the Eagle3 cell of its
    seed and budget with the nearest draft ms per round at T = 1."""
    head = ["budget", "drafter", "depth", "seed", "draft ms/round", "Eagle3 depth"]
    head += ["its draft ms/round", "τ T=1", "Eagle3 τ T=1", "τ ratio", "speedup ratio"]
    rows, ms = [], f"draft_ms_per_round_{T1}"
    for r, e in matches(recs, ms, same_budget=True):
        tau, other = r[f"tau_{T1}"], e and e[f"tau_{T1}"]
        speedup = _ratio(r[f"speedup_{T1}"], e and e[f"speedup_{T1}"])
        row = [f"{r['budget_multiple']}x", r["label"], str(r["depth"]), str(r["seed"])]
        row += [_f(r[ms], 2), "—" if e is None else str(e["depth"]), _f(e and e[ms], 2)]
        rows.append(row + [_f(tau), _f(other), _f(_ratio(tau, other)), _f(speedup)])
    return _rows(head, rows)


def study_text(doc: dict, temperatures: list[float]) -> str:
    """study.md's part between the markers: the grid, then the two comparisons."""
    recs = doc["records"]
    intro = (
        f"Base budget (1x): {doc['base_steps']} steps × {doc['sequences_per_step']} sequences; "
        f"depths {doc['depths']}, budgets {doc['budgets']}, seeds {doc['seeds']}. Train s: wall "
        f"seconds of the {doc['ranks']}-rank job; train CPU s: CPU seconds of its ranks together."
    )
    return "\n\n".join(
        [
            intro,
            _section("Every cell", "", grid_table(recs, temperatures)),
            _section("At equal training time", TIME_NOTE, time_table(recs)),
            _section("At equal draft cost per round", COST_NOTE, cost_table(recs)),
            f"Made by `{doc['command']}` on {doc['date']}.",
        ]
    )


def _section(title: str, note: str, table: list[str]) -> str:
    return "\n\n".join(part for part in (f"### {title}", note, "\n".join(table)) if part)


TIME_NOTE = (
    "Each DSpark / DFlash cell beside the Eagle3 cell (any depth and budget, the same seed) "
    "whose training took the nearest CPU seconds: the budget is what equalises the time, so "
    "Eagle3's cells of every budget are candidates."
)
COST_NOTE = (
    "Each DSpark / DFlash cell beside the Eagle3 cell of the same budget and seed with the "
    "nearest draft ms per round at T = 1: the budget held equal, only the draft cost (the "
    "depth) varies."
)


# ---- the picture ----------------------------------------------------------------------------
def _mean_over_seeds(recs: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """(kind, depth, budget multiple) -> the mean of `keys` over its seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((r["kind"], r["depth"], r["budget_multiple"]), []).append(r)
    out = {}
    for g, rs in groups.items():
        vals = {k: [r[k] for r in rs if r.get(k) is not None] for k in keys}
        out[g] = {k: sum(v) / len(v) if v else None for k, v in vals.items()}
    return out


def _lines(ax, means: dict, group: int, x: str, y: str, label) -> None:
    """One line per (kind, the key at `group` of (kind, depth, multiple)), its points in the
    order of the other key (the budgets of a depth, the depths of a budget)."""
    series: dict[tuple, list] = {}
    for key, m in sorted(means.items()):
        if m[x] is not None and m[y] is not None:
            series.setdefault((key[0], key[group]), []).append((m[x], m[y]))
    values = sorted({g for _, g in series})
    for (kind, g), pts in sorted(series.items()):
        i, color = values.index(g), f"C{list(PRESETS).index(kind)}"
        style = dict(linestyle=["-", "--", ":", "-."][i % 4], marker="os^D"[i % 4])
        ax.plot(*zip(*pts), color=color, label=label(kind, g), **style)


def first_position_gaps(recs: list[dict]) -> dict[int, list[tuple[int, int, float]]]:
    """depth -> (budget multiple, seed, DSpark's acceptance at position 0 at T = 0 minus
    DFlash's) of every cell that has both, in budget and seed order."""
    key = f"accept_rate_by_position_{temp_key(0.0)}"
    first = {
        (r["kind"], r["depth"], r["budget_multiple"], r["seed"]): r[key][0]
        for r in recs
        if r.get(key) and r[key][0] is not None
    }
    gaps: dict[int, list[tuple[int, int, float]]] = {}
    for (kind, depth, multiple, seed), value in sorted(first.items()):
        other = first.get(("dflash", depth, multiple, seed))
        if kind == "dspark" and other is not None:
            gaps.setdefault(depth, []).append((multiple, seed, value - other))
    return gaps


def _first_position_panel(ax, gaps: dict[int, list[tuple[int, int, float]]]) -> None:
    """DSpark − DFlash at position 0 (T = 0) against the budget: a line per depth through the
    means over the seeds, each seed a dot."""
    for i, (depth, rows) in enumerate(sorted(gaps.items())):
        by_budget: dict[int, list[float]] = {}
        for multiple, _, gap in rows:
            by_budget.setdefault(multiple, []).append(gap)
        multiples = sorted(by_budget)
        means = [sum(by_budget[m]) / len(by_budget[m]) for m in multiples]
        color = f"C{i + 3}"
        ax.plot(multiples, means, color=color, marker="os^D"[i % 4], label=f"{depth} layer(s)")
        ax.scatter([m for m, _, _ in rows], [g for _, _, g in rows], color=color, s=12, alpha=0.5)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set(title="first position, T = 0: DSpark − DFlash", xlabel="budget (× the demo's steps)")
    ax.set(xticks=sorted({m for rows in gaps.values() for m, _, _ in rows}))
    ax.set(ylabel="acceptance at position 0, difference (dots: seeds)")


def plot(recs: list[dict], path: Path) -> None:
    """Three panels: τ at T = 1 against training CPU seconds and against draft ms per round,
    speedup at T = 1 against depth at the largest budget; a fourth where DSpark and DFlash
    were evaluated at T = 0: their difference at position 0 against the budget
    (`first_position_gaps`)."""
    # lazy: matplotlib, 0.3 s of import, only to plot
    import matplotlib

    matplotlib.use("Agg")
    # lazy: after matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (f"tau_{T1}", f"speedup_{T1}", f"draft_ms_per_round_{T1}", "train_cpu_s", "depth")
    means = _mean_over_seeds(recs, keys)
    gaps = first_position_gaps(recs)
    fig, axes = plt.subplots(1, 4 if gaps else 3, figsize=(21 if gaps else 16, 5))
    lab = PRESETS
    _lines(axes[0], means, 1, "train_cpu_s", keys[0], lambda k, d: f"{lab[k].label} {d} layer(s)")
    axes[0].set(title="τ vs training time (points: budgets)", xlabel="training CPU s (all ranks)")
    _lines(axes[1], means, 2, keys[2], keys[0], lambda k, b: f"{lab[k].label} {b}x")
    axes[1].set(title="τ vs draft cost (points: depths)", xlabel="draft ms per round")
    top = max(r["budget_multiple"] for r in recs)
    biggest = {k: m for k, m in means.items() if k[2] == top}
    _lines(axes[2], biggest, 2, "depth", keys[1], lambda k, b: f"{lab[k].label} {b}x")
    axes[2].set(title=f"speedup at T = 1, budget {top}x", xlabel="draft depth (layers)")
    axes[2].set(xticks=sorted({k[1] for k in biggest}), ylabel="speedup (× the target alone)")
    plt.setp(axes[:2], ylabel="τ at T = 1 (tokens per round)")
    if gaps:
        _first_position_panel(axes[3], gaps)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- writing --------------------------------------------------------------------------------
def document(cfg: StudyConfig, state: dict, command: str) -> dict:
    """study.json of the docs: every record with the grid, the base budget, command and date."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "base_steps": cfg.budget.max_steps,
        "sequences_per_step": cfg.budget.global_batch_size,
        "ranks": cfg.budget.world_size,
        **{k: getattr(cfg, k) for k in ("depths", "budgets", "seeds", "drafters")},
        "temperatures": cfg.eval.temperatures,
        "command": command,
        "date": date,
        "settings": state["settings"],
        "records": sorted(
            (r for r in state["records"] if any(c.matches(r) for c in cells(cfg))), key=_order
        ),
    }


def write_docs(cfg: StudyConfig, doc: dict, artifacts: Path) -> None:
    """study.json, study.md's tables, images/study.png into `docs_dir`, the same into
    `artifacts` (study-table.md: the tables alone) for MLflow."""
    text = study_text(doc, cfg.eval.temperatures)
    artifacts.mkdir(parents=True, exist_ok=True)
    plot(doc["records"], artifacts / "study.png")
    (artifacts / "study.json").write_text(json.dumps(doc, indent=2) + "\n")
    (artifacts / "study-table.md").write_text(text + "\n")
    docs = Path(cfg.docs_dir)
    (docs / "images").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(artifacts / "study.png", docs / "images" / "study.png")
    shutil.copyfile(artifacts / "study.json", docs / "study.json")
    write_between_markers(docs / "study.md", TABLE_BEGIN, TABLE_END, text, HEADER)


# ---- the study ------------------------------------------------------------------------------
def start_tracker(cfg: StudyConfig, pipe: DemoPipeline, state: dict) -> Tracker:
    """The study's MLflow run: the previous run's when resuming with the same options, else a
    new one (whose metrics of the cells kept are logged at once)."""
    run_dir = pipe.runs_dir / "study"
    params = {k: v for k, v in flatten(cfg).items() if k not in ("resume", "docs_dir")}
    params = json.loads(json.dumps(params, default=str))
    again = state["params"] == params
    id_file = run_dir / RUN_ID_FILE
    previous = id_file.read_text().strip() if again and id_file.is_file() else None
    tracker = Tracker(
        enabled=True,
        uri=pipe.uri,
        experiment=cfg.experiment,
        run_name="depth-study",
        run_dir=str(run_dir),
        artifact_location=default_artifact_location(str(pipe.runs_dir)),
        kind="demo",
        resume=again,
        tags={"demo": "true", "recipe": "demo", "study": "depth-budget"},
    )
    state["params"] = params
    tracker.log_params(params)
    if not previous or tracker.run_id != previous:
        for rec in state["records"]:
            tracker.log_metrics(cell_metrics(rec, cfg.eval.temperatures), step=rec["seed"])
    return tracker


def data_stages(cfg: StudyConfig, pipe: DemoPipeline, state: dict, seed: int) -> None:
    """The seed's regenerate, prepare and build-cache (its data reused when a previous run of
    the same settings made it)."""
    if seed in state["data_ready"] and (pipe.seed_data(seed) / "prepared").is_dir():
        pipe.num_anchors[seed] = max_valid_anchors(pipe.seed_data(seed) / "prepared")
        print(f"[study] seed {seed}: the data of {pipe.seed_data(seed)} again", flush=True)
        return
    shutil.rmtree(pipe.seed_data(seed), ignore_errors=True)  # a cut stage's rows do not count
    s = pipe.stages
    s.run(f"regenerate-s{seed}", "the target answers the prompts", pipe.regenerate, seed)
    s.run(f"prepare-s{seed}", "chat template + assistant loss masks", pipe.prepare, seed)
    if cfg.data.mode == "offline":
        s.run(f"build-cache-s{seed}", "target features, once", pipe.build_cache, seed)
    state["data_ready"].append(seed)
    save_state(cfg, state)


def run_grid(cfg: StudyConfig, pipe: DemoPipeline, state: dict, command: str) -> None:
    """Every cell not done yet; the state and the docs written after each."""
    grid = cells(cfg)
    todo = [c for c in grid if not any(c.matches(r) for r in state["records"])]
    progress = Progress(len(grid), sum(cfg.budget.max_steps * c.multiple for c in todo))
    if todo and cfg.launcher == "fork":
        pipe.stages.run("imports", "for the forked ranks", launcher.preload, pipe._stage_env())
    pipes: dict[tuple, CellPipeline] = {}
    for i, cell in enumerate(grid, 1):
        if cell not in todo:
            print(f"[study] cell {i}/{len(grid)}: {cell.name} done before, kept", flush=True)
            continue
        if cell.seed not in state["data_ready"] or cell.seed not in pipe.num_anchors:
            data_stages(cfg, pipe, state, cell.seed)
        key = (cell.depth, cell.multiple)
        if key not in pipes:
            pipes[key] = CellPipeline(cfg, pipe, cell.depth, cell.multiple)
        steps = pipes[key].cfg.budget.max_steps
        started = progress.start(i, cell, steps)
        rec = run_cell(cfg, pipes[key], cell)
        progress.finish(started, steps)
        state["records"].append(rec)
        save_state(cfg, state)
        pipe.tracker.log_metrics(cell_metrics(rec, cfg.eval.temperatures), step=cell.seed)
        write_docs(cfg, document(cfg, state, command), pipe.out / "artifacts")


def study(cfg: StudyConfig, command: str) -> dict:
    """The whole study; the docs' study.json document."""
    state = load_state(cfg)  # before anything is written: a changed setting stops the run
    pipe = DemoPipeline(cfg)
    pipe.out.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        for sub in ("data", "runs", "configs", "logs", "artifacts"):
            shutil.rmtree(pipe.out / sub, ignore_errors=True)
    torch.set_num_threads(cfg.num_threads)
    pipe.tracker = start_tracker(cfg, pipe, state)
    save_state(cfg, state)
    with parent_run(pipe.tracker):  # the cells' runs nest under the study's
        pipe.stages.run("corpus", "synthetic chat corpus", pipe.corpus)
        pipe.stages.run("target", "tokenizer + tiny Qwen3 target", pipe.train_target)
        run_grid(cfg, pipe, state, command)
        doc = document(cfg, state, command)
        write_docs(cfg, doc, pipe.out / "artifacts")
        pipe.tracker.log_artifacts(str(pipe.out / "artifacts"))
    print(f"[study] done in {pipe.stages.total:.0f} s: {Path(cfg.docs_dir) / 'study.json'}")
    return doc


def main(argv: list[str]) -> int:
    try:
        cfg = parse(StudyConfig, argv, prog="tools/depth_study.py")
        study(cfg, shlex.join(["python", "tools/depth_study.py", *argv]))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
