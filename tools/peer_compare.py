"""dspark-ds against speculators 0.9 on the demo's work: the same target, prepared data,
budget, learning rate and schedule for both trainers, every drafter evaluated by our evaluator
on the same held-out prompts (docs/peers.md).

    python tools/peer_compare.py                                  # docs/peers.md, peers.json
    python tools/peer_compare.py --seeds [0] --budget.max_steps 40 --docs_dir /tmp/p
    python tools/peer_compare.py --reuse_theirs docs/peers.json   # ours again, theirs as recorded
    python tools/peer_compare.py --draws 3 --docs_dir /tmp/d      # three trainings a side and seed

Every option of `dspark-ds demo` applies (--budget.*, --drafter.*, --data.*, --target.*,
--seeds, ...); the default seeds are 0, 1, 2. Per seed: the demo's stages up to training
(regenerate, prepare, build-cache), then per drafter kind:

- ours: `dspark-ds train` with the demo's settings (DemoPipeline.train), exported;
- theirs: speculators' Trainer (tools/speculators_train.py, in the speculators environment
  tools/install.sh makes) on the same prepared sequences, with the target's features computed
  here by our FrozenTarget; the drafter's architecture is ours (its speculators config.json,
  `save_speculators_model` of our drafter), its init, loss and optimizer speculators' own;
- both read by `run_eval` (a speculators directory through the speculators-format reader) at
  every temperature of the demo, on the demo's held-out prompts.

With `--draws N` (N > 1) each side trains every kind N times on each seed's data: the seed's own
training and N - 1 more with another init and data order (`draw_seeds`: ours with train.seed =
data.seed = 100 + k, speculators with seed 100 + k; the evaluation's sampling is the seed's for
all), and a record's τ and acceptance are the means over its draws (each draw kept in `draws`):
the verdicts then tell a trainer's lead from one training's luck.

With `--reuse_theirs <peers.json>`, speculators is neither trained nor evaluated: each kind and
seed takes that file's `theirs` record (`Previous`), and only if it was made with this run's
budget, data, target, drafter sizes, evaluation and speculators options, target weights and
prepared data (`inputs_record`: the same options train another target on another CPU type; a
one-line error otherwise); the records and the table say where and when it was made.

Written: `output_dir` (the demo's layout; theirs under theirs/), `docs_dir`/peers.json (one
record per kind and seed) and the table of `docs_dir`/peers.md (between its table markers; a
file without them keeps its text, the table appended); with several draws
`docs_dir`/images/peers_draws.png (each training's τ and the means, per kind and temperature).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# the repository's own package, wherever this script is run from
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_ds.config import parse  # noqa: E402
from dspark_ds.data.tokens import TokenStore  # noqa: E402
from dspark_ds.demo import launcher  # noqa: E402
from dspark_ds.demo.config import DemoConfig  # noqa: E402
from dspark_ds.demo.pipeline import DemoPipeline  # noqa: E402
from dspark_ds.demo.summary import temp_key  # noqa: E402
from dspark_ds.drafters import load_draft_model  # noqa: E402
from dspark_ds.drafters.io import save_speculators_model  # noqa: E402
from dspark_ds.drafters.presets import PRESETS, DrafterSizes, preset  # noqa: E402
from dspark_ds.drafters.registry import get_kind  # noqa: E402
from dspark_ds.errors import ConfigError  # noqa: E402
from dspark_ds.files import sha256_file, write_between_markers  # noqa: E402
from dspark_ds.target import FrozenTarget, TargetConfig, decoder_layers, residual_state  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tools" / "speculators_train.py"
DEFAULT_ENV = "~/.cache/dspark-ds/speculators-venv"
TABLE_BEGIN = "<!-- peers table: written by tools/peer_compare.py -->"
TABLE_END = "<!-- end of the peers table -->"


@dataclass
class PeerConfig(DemoConfig):
    """tools/peer_compare.py: ours and speculators' drafters on the demo's work."""

    output_dir: str = "runs/peers"
    """Everything the comparison writes but the docs: the demo's layout, theirs under theirs/."""
    seeds: list[int] | None = None
    """Seeds (each repeats everything after the target, for both trainers); None = [0, 1, 2]."""
    docs_dir: str = "docs"
    """Where peers.json and peers.md's table go."""
    speculators_env: str | None = None
    """The speculators environment (tools/install.sh); None = $DSPARK_DS_SPECULATORS_ENV or
    ~/.cache/dspark-ds/speculators-venv."""
    drafter: DrafterSizes = field(default_factory=DrafterSizes.for_demo)
    """Drafter sizes: the demo's (DSpark and DFlash 3 layers since docs/study.md, Eagle3 one).
    The 2-layer records (docs/peers.json before 2026-12-06 21:54, docs/peers.md's 2-layer
    table) are reused with `--drafter.dspark.num_draft_layers 2
    --drafter.dflash.num_draft_layers 2`."""
    draws: int = 1
    """Trainings of each side per kind and seed: the seed's own, then another init and data
    order each (`draw_seeds`); with more than one the table gives each side's mean τ over them,
    with their range, and the verdicts compare the means."""
    reuse_theirs: str | None = None
    """A previous run's peers.json whose `theirs` records (speculators' τ and acceptance) this
    run takes instead of training and evaluating speculators again; each kind and seed must
    have been made with this run's budget, data, target, drafter sizes, evaluation and
    speculators options, from the same target weights and prepared data (else a one-line
    error). Ours is trained and evaluated as always."""

    def __post_init__(self) -> None:
        if self.seeds is None:
            self.seeds = [0, 1, 2]
        if self.draws < 1:
            raise ConfigError(f"draws: {self.draws}; it counts trainings a side, at least 1")
        twice = [s for s in self.seeds if s in self.draw_seeds(s)[1:]]
        if twice:
            others = self.draw_seeds(twice[0])[1:]
            raise ConfigError(
                f"seeds: {twice[0]} is also one of its draws' training seeds ({others[0]} to "
                f"{others[-1]}); with --draws {self.draws} use other seeds"
            )

    def draw_seeds(self, seed: int) -> list[int]:
        """The training seeds of `seed`'s draws: the seed itself (the demo's training), then
        100 + k (another init and data order, on the same data)."""
        return [seed] + [100 + k for k in range(1, self.draws)]


def speculators_python(cfg: PeerConfig) -> Path:
    env = cfg.speculators_env or os.environ.get("DSPARK_DS_SPECULATORS_ENV") or DEFAULT_ENV
    python = Path(env).expanduser() / "bin" / "python"
    if not python.exists():
        raise ConfigError(
            f"speculators_env: no speculators environment at {python.parent.parent} (run "
            "tools/install.sh, which makes it, or set --speculators_env)"
        )
    return python


def draw_tag(seed: int, draw: int | None) -> str:
    """What names `seed`'s training of draw seed `draw` (its runs, evaluations and stages):
    nothing for the seed's own (None or the seed), -d<draw> for another."""
    return "" if draw in (None, seed) else f"-d{draw}"


class Drawn:
    """A pipeline's trainings of one draw (`PeerConfig.draw_seeds`): None or the seed is the
    seed's own training, with the demo's names; a draw seed d trains with train.seed =
    data.seed = d, its runs and evaluations named ...-d<d> (`draw_tag`). The evaluation's
    sampling stays the seed's."""

    draw: int | None = None

    def run_name(self, kind: str, seed: int) -> str:
        return super().run_name(kind, seed) + draw_tag(seed, self.draw)

    def eval_name(self, kind: str, temperature: float, seed: int) -> str:
        return super().eval_name(kind, temperature, seed) + draw_tag(seed, self.draw)

    def train_seed(self, seed: int) -> int:
        return seed if self.draw is None else self.draw

    def train_config(self, kind: str, seed: int):
        cfg = super().train_config(kind, seed)
        cfg.train.seed = cfg.data.seed = self.train_seed(seed)
        return cfg


class OursPipeline(Drawn, DemoPipeline):
    """The demo's stages for ours; `drawn(d)` is a view of it that trains draw `d`."""

    def drawn(self, draw: int | None) -> OursPipeline:
        view = copy.copy(self)  # the same target, data, anchors and stages
        view.draw, view.results = draw, {}
        return view


class TheirsPipeline(Drawn, DemoPipeline):
    """The demo's evaluation pointed at speculators' drafters
    (theirs/<kind>-s<seed>[-d<draw>]/run/model), with its own run directories; the target and
    the data are the demo's."""

    def __init__(self, cfg: DemoConfig, ours: DemoPipeline, draw: int | None = None):
        super().__init__(cfg)
        self.runs_dir = self.out / "theirs"
        self.conf_dir = self.runs_dir / "configs"
        self.target = ours.target
        self.num_anchors = ours.num_anchors
        self.draw = draw

    def export_dir(self, kind: str, seed: int) -> Path:
        return self.runs_dir / self.run_name(kind, seed) / "run" / "model"


# ---- theirs: the features, the architecture, the run --------------------------------------
def write_features(target_path: str, layer_ids: list[int], prepared: Path, out: Path) -> None:
    """The prepared sequences with the target's features as speculators' trainer reads them:
    `hidden_states` = the tapped layers (our ids, concatenated in order, as our cache holds
    them), `verifier_last_hidden_states` = the last decoder layer's output before the final
    norm (speculators applies the verifier's norm itself)."""
    target = FrozenTarget.from_config(
        TargetConfig(path=target_path, layer_ids=layer_ids, dtype="float32", device="cpu")
    )
    last: dict[str, torch.Tensor] = {}
    layers = decoder_layers(target.decoder, target.num_layers)
    hook = layers[-1].register_forward_hook(
        lambda _m, _i, output: last.update(
            state=residual_state(output[0] if isinstance(output, tuple) else output)
        )
    )
    store, sequences = TokenStore.load(prepared), []
    try:
        for i in range(len(store)):
            row = store[i]
            hidden, _ = target(row["input_ids"].unsqueeze(0))
            sequences.append(
                {
                    "input_ids": row["input_ids"].clone(),
                    "loss_mask": row["loss_mask"].clone(),
                    "hidden_states": hidden[0].clone(),
                    "verifier_last_hidden_states": last["state"][0].clone(),
                }
            )
    finally:
        hook.remove()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"sequences": sequences}, out)


def speculators_architecture(export: Path, target_path: str, out: Path) -> dict:
    """Our trained drafter's architecture as a speculators config.json in `out` (the weights
    are not kept: speculators initialises its own); the native config.json's dict."""
    model = load_draft_model(export)
    save_speculators_model(model, out, target_path=target_path)
    (out / "model.safetensors").unlink()
    return json.loads((export / "config.json").read_text())


def their_job(pipe: OursPipeline, kind: str, seed: int, work: Path) -> dict:
    """tools/speculators_train.py's job for one drafter: the demo's budget (steps, sequences
    per step, packed into one sequence of that many × max_length tokens), lr, warmup and
    cosine decay; DSpark / DFlash get as many anchor blocks as ours, Eagle3 as many steps."""
    native = speculators_architecture(pipe.export_dir(kind, seed), str(pipe.target.path), work)
    spec = json.loads((work / "config.json").read_text())
    features = work / "features.pt"
    write_features(
        str(pipe.target.path), native["target_layer_ids"], prepared_dir(pipe, seed), features
    )
    return {
        "type": spec["speculators_model_type"],
        "config_dir": str(work),
        "target": str(pipe.target.path),
        "features": str(features),
        "out": str(work.parent / "run"),
        **their_settings(pipe, kind, seed),
        "seed": pipe.train_seed(seed),
        "threads": pipe.nproc,
    }


def their_settings(pipe: DemoPipeline, kind: str, seed: int) -> dict:
    """What a speculators job of `kind` and `seed` is given from the demo's options: the
    budget, lr and warmup, anchor blocks (DSpark / DFlash) or steps (Eagle3) as ours."""
    c, b = pipe.cfg, pipe.cfg.budget
    anchors = 1
    if get_kind(preset(kind).kind).capabilities.anchor_blocks:
        anchors = pipe.anchors_of(kind, seed)
    return {
        "steps": b.max_steps,
        "sequences_per_step": b.global_batch_size,
        "total_seq_len": b.global_batch_size * c.data.max_length,
        "lr": b.lr,
        "warmup_ratio": b.warmup_ratio,
        "max_anchors": b.global_batch_size * anchors,
        "ttt_steps": c.draft_lengths()[kind],
    }


def prepared_dir(pipe: DemoPipeline, seed: int) -> Path:
    return pipe.seed_data(seed) / "prepared"


def train_theirs(cfg: PeerConfig, jobs: list[dict], log: Path) -> None:
    """speculators' Trainer on every job, in one process of its environment."""
    jobs_file = log.with_suffix(".json")
    jobs_file.write_text(json.dumps({"jobs": jobs}, indent=2))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    with log.open("w") as f:
        rc = subprocess.run(
            [str(speculators_python(cfg)), str(DRIVER), str(jobs_file)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        ).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"speculators' training failed (exit {rc}); log {log}:\n{tail}")


# ---- the comparison ------------------------------------------------------------------------
def train_their_seed(cfg: PeerConfig, ours: OursPipeline, theirs: TheirsPipeline, seed: int):
    """speculators' trainer on every kind of one seed (and `theirs`' draw); kind -> its job."""
    for kind in cfg.drafters:  # a rerun starts fresh
        shutil.rmtree(theirs.runs_dir / theirs.run_name(kind, seed), ignore_errors=True)
    jobs = {
        kind: their_job(ours, kind, seed, theirs.runs_dir / theirs.run_name(kind, seed) / "init")
        for kind in cfg.drafters
    }
    ours.log_dir.mkdir(parents=True, exist_ok=True)
    name = f"train-theirs-s{seed}{draw_tag(seed, theirs.draw)}"
    ours.stages.run(
        name,
        "speculators' trainer, every kind",
        train_theirs,
        cfg,
        list(jobs.values()),
        ours.log_dir / f"{name}.log",
    )
    return jobs


def run_seed(
    cfg: PeerConfig,
    ours: OursPipeline,
    theirs: TheirsPipeline,
    seed: int,
    previous: Previous | None = None,
) -> dict:
    """Both trainers on one seed's data, every draw (theirs taken from `previous` when given);
    kind -> its draws, each {"draw": its training seed, "ours": ..., "theirs": ... or
    "reused": its record, "their_job": ...}."""
    s = ours.stages
    s.run(f"regenerate-s{seed}", "the target answers the prompts", ours.regenerate, seed)
    s.run(f"prepare-s{seed}", "chat template + assistant loss masks", ours.prepare, seed)
    if cfg.data.mode == "offline":
        s.run(f"build-cache-s{seed}", "target features for ours", ours.build_cache, seed)
    draws, inputs = cfg.draw_seeds(seed), inputs_record(ours, seed)
    if previous is not None:  # before our training: a record that does not fit stops the run
        reused = {
            (k, d): previous.theirs(ours, k, seed, d, inputs) for k in cfg.drafters for d in draws
        }
    results: dict[str, list] = {kind: [] for kind in cfg.drafters}
    for draw in draws:
        mine_d, theirs_d = ours.drawn(draw), TheirsPipeline(cfg, ours, draw)
        tag = draw_tag(seed, draw)
        for kind in cfg.drafters:
            s.run(f"train-ours-{kind}-s{seed}{tag}", f"ours: {kind}", mine_d.train, kind, seed)
        jobs = train_their_seed(cfg, mine_d, theirs_d, seed) if previous is None else {}
        for kind in cfg.drafters:
            mine = {"train": mine_d.results[seed][kind]["train"]}
            for t in cfg.eval.temperatures:
                key = temp_key(t)
                mine[key] = s.run(
                    f"eval-ours-{kind}-{key}-s{seed}{tag}", "", mine_d.evaluate, kind, t, seed
                )
            entry = {"draw": draw, "ours": mine, "inputs": inputs}
            if previous is not None:
                settings = their_settings(ours, kind, seed)
                results[kind].append({**entry, "reused": reused[kind, draw], "their_job": settings})
                continue
            other = {"train": json.loads(Path(jobs[kind]["out"], "result.json").read_text())}
            for t in cfg.eval.temperatures:
                key = temp_key(t)
                other[key] = s.run(
                    f"eval-theirs-{kind}-{key}-s{seed}{tag}", "", theirs_d.evaluate, kind, t, seed
                )
            results[kind].append({**entry, "theirs": other, "their_job": jobs[kind]})
    return results


# ---- theirs from a previous run (--reuse_theirs) ----------------------------------------------
WORK_SECTIONS = ("target", "data", "drafter", "eval")
"""The option sections that decide speculators' result besides the budget: the target's weights
and the prepared data, the drafter's architecture, the evaluation."""
MADE = re.compile(r"Made by `[^`]*` on (\d{4}-\d\d-\d\d \d\d:\d\d UTC)")


def work_record(cfg: PeerConfig) -> dict:
    """The options of the work both trainers share (`WORK_SECTIONS`), as a record keeps them:
    what a later `--reuse_theirs` compares, whatever the defaults have become since."""
    return json.loads(json.dumps({s: asdict(getattr(cfg, s)) for s in WORK_SECTIONS}))


def inputs_record(pipe: DemoPipeline, seed: int) -> dict:
    """What the work's options do not pin down, as a record keeps it: the trained target's
    weights (sha256) and the fingerprint of the seed's prepared data. The same options train
    another target on another CPU type (its kernels round otherwise: every τ moves), so a record
    is reused only where both are this run's."""
    meta = json.loads((pipe.seed_data(seed) / "prepared" / "meta.json").read_text())
    weights = Path(pipe.target.path) / "model.safetensors"
    return {"target_sha256": sha256_file(weights), "data_fingerprint": meta["fingerprint"]}


@dataclass
class Previous:
    """A previous run's peers.json whose `theirs` records this run takes (`--reuse_theirs`)."""

    path: Path
    records: list[dict]

    @classmethod
    def load(cls, path: str, cfg: PeerConfig) -> Previous:
        """Its records, refused (a ConfigError naming the first difference) where a seed or a
        kind of this run is missing or a record's command ran other target, data, drafter or
        evaluation options."""
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"reuse_theirs: no file {file}")
        records = json.loads(file.read_text())
        md = file.with_suffix(".md")
        made = MADE.search(md.read_text()) if md.is_file() else None
        previous = cls(file, records)
        now = work_record(cfg)
        for seed in cfg.seeds:
            for kind in cfg.drafters:
                rec = previous.record(kind, seed)
                rec.setdefault("date", made.group(1) if made else None)
                # NOTE: a record made before they were written down: its command, read with
                # today's defaults
                work = rec.get("work") or work_record(
                    parse(PeerConfig, shlex.split(rec["command"])[2:])
                )
                for section in WORK_SECTIONS:
                    previous.same(rec, section, work[section], now[section])
                drawn = sorted(their_draws(rec))
                missing = [d for d in cfg.draw_seeds(seed) if d not in drawn]
                if missing:
                    raise ConfigError(
                        f"reuse_theirs: {file}'s {kind} seed {seed} has no training of draw "
                        f"{missing[0]} (it has {drawn}); run with fewer --draws, or without "
                        "--reuse_theirs"
                    )
        return previous

    def record(self, kind: str, seed: int) -> dict:
        found = [r for r in self.records if r["kind"] == kind and r["seed"] == seed]
        if not found:
            raise ConfigError(f"reuse_theirs: {self.path} has no record of {kind} seed {seed}")
        return found[0]

    def same(self, rec: dict, what: str, then: dict, now: dict, why: str = "") -> None:
        """Refuses `rec` where `then` (its options) and `now` (this run's) differ."""
        for key in sorted(set(then) | set(now)):
            if then.get(key) != now.get(key):
                raise ConfigError(
                    f"reuse_theirs: {self.path}'s {rec['kind']} seed {rec['seed']} was made with "
                    f"{what}.{key} {then.get(key)!r}, this run has {now.get(key)!r}{why}; run "
                    "without --reuse_theirs to train speculators' again"
                )

    def theirs(
        self,
        pipe: DemoPipeline,
        kind: str,
        seed: int,
        draw: int | None = None,
        inputs: dict | None = None,
    ) -> dict:
        """The `theirs` record of `kind` and `seed` (of its draw `draw`, a training seed of
        `PeerConfig.draw_seeds`; None = the seed's own), with where and when it was made, if
        its target weights, prepared data (`inputs`: this run's `inputs_record`, computed here
        when not given), budget and speculators options are this run's (refused otherwise)."""
        rec = self.record(kind, seed)
        if "inputs" not in rec:
            raise ConfigError(
                f"reuse_theirs: {self.path}'s {kind} seed {seed} keeps no fingerprint of its "
                "target's weights and data (made before 2026-12-08): the same options train "
                "another target on another CPU type, so nothing shows that it is this run's; "
                "run without --reuse_theirs to train speculators' again"
            )
        why = " (the same options: another CPU type trains another target)"
        now = inputs if inputs is not None else inputs_record(pipe, seed)
        self.same(rec, "inputs", rec["inputs"], now, why)
        settings = their_settings(pipe, kind, seed)
        self.same(rec, "budget", rec["budget"], budget_record(pipe.cfg, settings))
        options = rec["theirs"]["options"]
        given = {k: options.get(k) for k in THEIR_OPTIONS}
        self.same(rec, "options", given, {k: settings[v] for k, v in THEIR_OPTIONS.items()})
        theirs = their_draws(rec)[seed if draw is None else draw]  # `load` checked it is there
        origin = dict(file=str(self.path), date=rec.get("date"), command=rec["command"])
        return {**theirs, "reused_from": theirs.get("reused_from", origin)}


def their_draws(rec: dict) -> dict[int, dict]:
    """A record's trainings of speculators by draw seed (`PeerConfig.draw_seeds`); a record of
    one draw holds its seed's own."""
    return {d["draw"]: d["theirs"] for d in rec.get("draws", [])} or {rec["seed"]: rec["theirs"]}


THEIR_OPTIONS = {
    "lr": "lr",
    "scheduler_warmup_ratio": "warmup_ratio",
    "max_anchors": "max_anchors",
    "ttt_steps": "ttt_steps",
    "total_seq_len": "total_seq_len",
}
"""speculators' options (as its result records them) that a job sets: `their_settings`' key."""


def _side(entry: dict, temperatures: list[float]) -> dict:
    out = {}
    for t in temperatures:
        row = entry[temp_key(t)]
        out[f"tau_{temp_key(t)}"] = row["tau"]
        out[f"accept_rate_by_position_{temp_key(t)}"] = row["accept_rate_by_position"]
    train = entry["train"]
    out["train_s"] = train.get("train_s")
    out["steps"] = train.get("steps")
    return out


def budget_record(cfg: PeerConfig, settings: dict) -> dict:
    """The shared budget of a kind's record (`settings`: `their_settings`)."""
    b = cfg.budget
    return {
        "optimizer_steps": b.max_steps,
        "sequences_per_step": b.global_batch_size,
        "max_length": cfg.data.max_length,
        "tokens_per_step_at_most": b.global_batch_size * cfg.data.max_length,
        "lr": b.lr,
        "warmup_ratio": b.warmup_ratio,
        "schedule": "linear warmup, cosine decay to 0",
        "anchor_blocks_per_step": settings["max_anchors"],
        "draft_length": settings["ttt_steps"],
    }


def _mean_side(sides: list[dict], temperatures: list[float]) -> dict:
    """One side's draws as one: τ, acceptance by position and seconds averaged, τ's range."""
    out = {}
    for t in temperatures:
        taus = [x[f"tau_{temp_key(t)}"] for x in sides]
        out[f"tau_{temp_key(t)}"] = sum(taus) / len(taus)
        out[f"tau_{temp_key(t)}_range"] = [min(taus), max(taus)]
        rates = [x[f"accept_rate_by_position_{temp_key(t)}"] for x in sides]
        out[f"accept_rate_by_position_{temp_key(t)}"] = [sum(c) / len(c) for c in zip(*rates)]
    seconds = [x["train_s"] for x in sides]
    out["train_s"] = None if None in seconds else sum(seconds) / len(seconds)
    steps = sorted({x["steps"] for x in sides}, key=str)
    out["steps"] = steps[0] if len(steps) == 1 else steps
    return out


def records(cfg: PeerConfig, results: dict, seconds: dict, command: str, date: str) -> list[dict]:
    """peers.json's records: one per kind and seed; with several draws its sides are the
    means (`_mean_side`) and `draws` holds each training's."""
    temps = cfg.eval.temperatures
    out = []
    for seed, kinds in results.items():
        for kind, entries in kinds.items():
            draws = []
            for entry in entries:
                tag = draw_tag(seed, entry["draw"])
                ours = _side(entry["ours"], temps)
                ours["train_s"] = seconds.get(f"train-ours-{kind}-s{seed}{tag}")
                if "reused" in entry:
                    theirs = entry["reused"]
                else:
                    theirs = _side(entry["theirs"], temps)
                    theirs["options"] = entry["theirs"]["train"]["options"]
                draws.append({"draw": entry["draw"], "ours": ours, "theirs": theirs})
            rec = {"kind": kind, "label": PRESETS[kind].label, "seed": seed}
            if len(draws) == 1:
                rec |= {"ours": draws[0]["ours"], "theirs": draws[0]["theirs"]}
            else:
                rec["ours"] = _mean_side([d["ours"] for d in draws], temps)
                rec["theirs"] = _mean_side([d["theirs"] for d in draws], temps)
                first = draws[0]["theirs"]
                rec["theirs"] |= {k: first[k] for k in ("options", "reused_from") if k in first}
                rec["draws"] = draws
            out.append(
                rec
                | {
                    "budget": budget_record(cfg, entries[0]["their_job"]),
                    "work": work_record(cfg),
                    "inputs": entries[0]["inputs"],
                    "command": command,
                    "date": date,
                }
            )
    return out


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def _cell(side: dict, key: str) -> str:
    """A side's τ; with several draws their mean and range."""
    span = side.get(f"tau_{key}_range")
    tau = _fmt(side[f"tau_{key}"])
    return tau if span is None else f"{tau} ({span[0]:.2f}–{span[1]:.2f})"


def table(recs: list[dict], temperatures: list[float], command: str, date: str) -> str:
    """The markdown table of the records (per kind and seed, then ours ≥ theirs counted; with
    several draws, on their means)."""
    keys = [temp_key(t) for t in temperatures]
    draws = max(len(r.get("draws", [])) for r in recs) or 1
    head = ["drafter", "seed"]
    for t in temperatures:
        head += [f"τ T={t:g} ours", f"τ T={t:g} theirs"]
    head += ["train s ours (job)", "train s theirs (loop)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in recs:
        cells = [r["label"], str(r["seed"])]
        for k in keys:
            cells += [_cell(r["ours"], k), _cell(r["theirs"], k)]
        cells += [f"{r['ours']['train_s'] or 0:.0f}", f"{r['theirs']['train_s'] or 0:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    what = "τ" if draws == 1 else f"mean τ over {draws} trainings a side"
    for label in dict.fromkeys(r["label"] for r in recs):
        mine = [r for r in recs if r["label"] == label]
        counts = ", ".join(
            f"T={t:g} {sum(r['ours'][f'tau_{k}'] >= r['theirs'][f'tau_{k}'] for r in mine)}"
            f"/{len(mine)}"
            for t, k in zip(temperatures, keys)
        )
        lines.append(f"- {label}: ours ≥ theirs in {what} in {counts} seeds")
    if draws > 1:
        many = next(r for r in recs if len(r.get("draws", [])) == draws)
        seeds = ", ".join(str(d["draw"]) for d in many["draws"][1:])
        lines += [
            "",
            f"Each cell: the mean over {draws} trainings of that side on the seed's data (the "
            f"seed's own and training seeds {seeds}: another init and data order each), the "
            "range of the trainings in brackets; the training seconds are means.",
        ]
    lines += ["", f"Made by `{command}` on {date}."]
    reused = {}
    for r in recs:
        origin = r["theirs"].get("reused_from")
        if origin:
            key = (origin["file"], origin["date"] or "an unrecorded date", origin["command"])
            reused.setdefault(key, []).append(f"{r['label']} {r['seed']}")
    for (file, made, then), which in reused.items():
        lines.append(
            f"Theirs of {', '.join(which)} reused from {file} (made by `{then}` on {made}): "
            "the same budget, data, target, drafter sizes, evaluation and speculators options, "
            "the same target weights and prepared data; "
            "their training seconds are of that run."
        )
    return "\n".join(lines)


def plot(recs: list[dict], temperatures: list[float], path: Path) -> None:
    """A panel per temperature and kind: each training's τ by seed, ours and theirs side by
    side, their means as bars (the records of several draws)."""
    # lazy: matplotlib, 0.3 s of import, only to plot
    import matplotlib

    matplotlib.use("Agg")
    # lazy: after matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in recs))
    rows, cols = len(temperatures), len(labels)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for row, t in zip(axes, temperatures):
        key = f"tau_{temp_key(t)}"
        for ax, label in zip(row, labels):
            mine = [r for r in recs if r["label"] == label]
            for side, dx, color in (("ours", -0.12, "C0"), ("theirs", 0.12, "C1")):
                for i, r in enumerate(mine):
                    taus = [d[side][key] for d in r.get("draws", [r])]
                    ax.scatter([i + dx] * len(taus), taus, s=18, color=color, alpha=0.6)
                    ax.hlines(r[side][key], i + dx - 0.09, i + dx + 0.09, color=color, lw=2.5)
                ax.scatter([], [], color=color, label=side)
            ax.set(title=f"{label}, T = {t:g}", xticks=range(len(mine)))
            ax.set(xticklabels=[f"seed {r['seed']}" for r in mine], ylabel="τ (tokens per round)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("τ of each training (dots) and their mean (bars), ours and speculators'")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_docs(docs: Path, recs: list[dict], text: str, temperatures: list[float]) -> None:
    """peers.json, peers.md's table, and with several draws images/peers_draws.png."""
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "peers.json").write_text(json.dumps(recs, indent=2) + "\n")
    write_between_markers(docs / "peers.md", TABLE_BEGIN, TABLE_END, text)
    if any("draws" in r for r in recs):
        plot(recs, temperatures, docs / "images" / "peers_draws.png")


def compare(cfg: PeerConfig, command: str) -> list[dict]:
    # before anything runs
    previous = Previous.load(cfg.reuse_theirs, cfg) if cfg.reuse_theirs else None
    if previous is None:
        speculators_python(cfg)
    ours = OursPipeline(cfg)
    ours.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.num_threads)
    ours.stages.run("corpus", "synthetic chat corpus", ours.corpus)
    ours.stages.run("target", "tokenizer + tiny Qwen3 target", ours.train_target)
    if cfg.launcher == "fork":
        ours.stages.run("imports", "for the forked ranks", launcher.preload, ours._stage_env())
    theirs = TheirsPipeline(cfg, ours)
    results: dict[int, dict] = {}
    for seed in cfg.seeds:  # the docs are written after each seed: a cut run keeps its seeds
        results[seed] = run_seed(cfg, ours, theirs, seed, previous)
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        recs = records(cfg, results, ours.stages.seconds, command, date)
        text = table(recs, cfg.eval.temperatures, command, date)
        if len(results) < len(cfg.seeds):
            text += (
                f" Seeds measured so far: {list(results)} of {cfg.seeds} (the table is "
                "written after each seed)."
            )
        write_docs(Path(cfg.docs_dir), recs, text, cfg.eval.temperatures)
    print(f"[peers] done in {ours.stages.total:.0f} s: {Path(cfg.docs_dir) / 'peers.json'}")
    return recs


def main(argv: list[str]) -> int:
    try:
        cfg = parse(PeerConfig, argv, prog="tools/peer_compare.py")
        command = shlex.join(["python", "tools/peer_compare.py", *argv])
        t0 = time.perf_counter()
        compare(cfg, command)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[peers] {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
