"""`dspark-ds demo`: the whole pipeline, through the same code users run on clusters.

Stages (each timed, each printed with a header):

1. corpus      synthetic chat corpus from the seed (`dspark_ds.data.synthetic`), no downloads
2. target      BPE tokenizer + tiny Qwen3 trained on it, cached (`dspark_ds.demo.target`)

   imports     (launcher "fork") torch, transformers, DeepSpeed, MLflow, once for every rank

then for every seed of `seeds` (stage names end in `-s<seed>`):

3. regenerate  the target answers the training prompts (`dspark-ds regenerate`, N ranks)
4. prepare     chat template + assistant loss masks → token store (`dspark-ds prepare`)
5. build-cache the target's features, once (`dspark-ds build-cache`, N ranks; offline mode)
6. train       DSpark, DFlash, Eagle3: `dspark-ds train` on N ranks with DeepSpeed, the same
               budget and supervision; each run exports its interchange directory
7. eval        batched speculative decoding of the held-out prompts at every temperature, and
               the target alone at the same batch size (`run_eval`): τ and wall-clock speedup

and last, summary: per seed and its spread → table, summary.json, MLflow (`demo/summary.py`).

The N-rank stages run `dspark-ds <subcommand> --config configs/<stage>.yaml` on ranks forked
from this process or under torchrun (`launcher`, demo/launcher.py).

Layout of `output_dir`: data/ (corpus, held-out prompts; data/seed<k>/: regenerated answers,
token store, cache), configs/ (the YAML each subprocess ran with), runs/ (training and eval
runs, `<kind>-s<seed>` and `eval-<kind>-T<t>-s<seed>`), logs/, mlflow.db, summary.json,
summary.txt.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from dspark_ds.config import (
    CheckpointConfig,
    DeepSpeedConfig,
    TrackingConfig,
    TrainConfig,
    TrainRunConfig,
    ValidationConfig,
    dump_config,
)
from dspark_ds.data.config import BuildCacheConfig, DataConfig, PrepareConfig, RegenerateConfig
from dspark_ds.data.synthetic import make_corpus, write_jsonl
from dspark_ds.data.tokens import TokenStore, prepare
from dspark_ds.demo import launcher
from dspark_ds.demo.config import DemoConfig
from dspark_ds.demo.summary import (
    build_summary,
    format_summary,
    log_summary,
    start_demo_run,
    temp_key,
)
from dspark_ds.demo.target import ensure_demo_target
from dspark_ds.distributed import print0
from dspark_ds.drafters import build_anchor_candidate_mask
from dspark_ds.drafters.presets import PRESETS, DrafterConfig, preset, sized
from dspark_ds.drafters.registry import get_kind
from dspark_ds.eval.config import CalibrationConfig, EvalConfig
from dspark_ds.eval.runner import run_eval
from dspark_ds.target import TargetConfig, TargetPathConfig
from dspark_ds.tracking.store import resolve_uri


def _cpu_seconds() -> float:
    """CPU time of this process and of every subprocess it has waited for (torchrun's ranks)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _Stages:
    """Prints a header per stage and records its wall time and CPU time.

    NOTE: on a machine that other jobs keep busy, wall time grows with their load; CPU time
    (all ranks together) much less so, which makes it the figure to compare between machines."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def run(self, name: str, what: str, fn, *args, **kwargs):
        print(flush=True)
        print0(f"{'=' * 78}\n[demo] stage {len(self.seconds) + 1}: {name} — {what}\n{'=' * 78}")
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        out = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - t0
        self.cpu_seconds[name] = _cpu_seconds() - cpu0
        print0(f"[demo] {name}: {self.seconds[name]:.1f} s (CPU {self.cpu_seconds[name]:.1f} s)")
        return out

    @property
    def total(self) -> float:
        return time.perf_counter() - self._t0


def max_valid_anchors(prepared_dir: Path) -> int:
    """The most valid anchor positions (p and p + 1 both supervised) any sequence of a prepared
    token store has: anchors enough to start a block at every valid position of every sequence."""
    store = TokenStore.load(prepared_dir)
    most = 0
    for i in range(len(store)):
        mask = store[i]["loss_mask"].unsqueeze(0)
        most = max(most, int(build_anchor_candidate_mask(mask).sum()))
    return max(most, 1)


class DemoPipeline:
    """The demo's stages; `run()` runs them all and returns the summary."""

    def __init__(self, cfg: DemoConfig):
        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.output_dir).resolve()
        self.data_dir = self.out / "data"
        self.runs_dir = self.out / "runs"
        self.conf_dir = self.out / "configs"
        self.log_dir = self.out / "logs"

        self.uri = resolve_uri(cfg.tracking_uri, str(self.out))
        self.tracker = None
        """The demo's MLflow run (`run`): its stages' runs are nested under it."""
        self.nproc = cfg.budget.world_size
        self.stages = _Stages()
        self.target = None
        self.num_anchors: dict[int, int] = {}
        """seed -> the most valid anchor positions a training sequence of that seed has: the
        anchors per sequence of a drafter that trains on anchor blocks
        (`Capabilities.anchor_blocks`) when its size block leaves num_anchors to the demo."""
        self.results: dict[int, dict[str, dict]] = {}
        """seed -> drafter -> {"train": ..., "T0": eval row, "T1": ...}."""

    def seed_data(self, seed: int) -> Path:
        return self.data_dir / f"seed{seed}"

    def run_name(self, kind: str, seed: int) -> str:
        """`kind`'s training of `seed`: its directory under runs/, its log, config and MLflow
        run names (tools/depth_study.py names one per depth and budget)."""
        return f"{kind}-s{seed}"

    def eval_name(self, kind: str, temperature: float, seed: int) -> str:
        """The evaluation of `kind`'s drafter of `seed` at `temperature` (its run's name)."""
        return f"eval-{kind}-{temp_key(temperature)}-s{seed}"

    def export_dir(self, kind: str, seed: int) -> Path:
        return self.runs_dir / self.run_name(kind, seed) / "export"

    # ---- helpers --------------------------------------------------------------------------
    def _stage_env(self) -> dict[str, str]:
        """The variables every stage's ranks run with (on top of this process's environment)."""
        return dict(
            DS_ACCELERATOR="cpu",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            OMP_NUM_THREADS=str(self.cfg.num_threads),
            MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
        )

    def _torchrun_env(self) -> dict[str, str]:
        env = self._stage_env()
        # NOTE: DeepSpeed's ZeRO-3 calls deprecated torch.distributed collectives every step;
        # their FutureWarnings would bury the progress bars of the demo (forked ranks filter
        # them in-process).
        warn = "ignore::FutureWarning"
        env["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), warn) if w)
        # the subprocesses import this very package, wherever it was imported from
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        return env

    def _write_config(self, name: str, cfg) -> Path:
        """A typed config as the YAML a subprocess (or a person) runs with."""
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        path = self.conf_dir / f"{name}.yaml"
        path.write_text(dump_config(cfg))
        return path

    def _launch(self, stage: str, subcommand: str, config: Path, nproc: int) -> None:
        """`dspark-ds <subcommand> --config <yaml>` on `nproc` ranks, started by the configured
        launcher (demo/launcher.py); the output goes to the console and to logs/<stage>.log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{stage}.log"
        argv = [subcommand, "--config", str(config)]
        if self.tracker is not None:  # NOTE: its sender thread idle (holding no lock) at fork
            self.tracker.flush(timeout_s=30)
        if self.cfg.launcher == "fork":
            rc = launcher.run_forked(argv, nproc, self._stage_env(), log_path, self.cfg.num_threads)
        else:
            rc = launcher.run_torchrun(argv, nproc, self._torchrun_env(), log_path)
        sys.stdout.flush()
        if rc != 0:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
            raise RuntimeError(f"demo stage {stage!r} failed (exit {rc}); log {log_path}:\n{tail}")

    # ---- stages ---------------------------------------------------------------------------
    def corpus(self) -> dict:
        d = self.cfg.data
        # NOTE: the drafters' prompts are the first rows of the target's own corpus (same seed);
        # held-out prompts come from the generator's independent held-out stream.
        train, heldout = make_corpus(
            self.cfg.target.seed, d.num_train_prompts, d.num_heldout_prompts
        )
        write_jsonl(train, self.data_dir / "prompts.jsonl")
        write_jsonl(heldout, self.data_dir / "heldout.jsonl")
        bench = self.data_dir / "bench"
        # the eval's benchmark layout: {"turns": [first user turn]}
        write_jsonl(
            [
                {"turns": [m["content"] for m in r["messages"] if m["role"] == "user"]}
                for r in heldout
            ],
            bench / "demo.jsonl",
        )  # type: ignore[misc]
        print0(
            f"[demo] {len(train)} training prompts, {len(heldout)} held-out prompts -> "
            f"{self.data_dir}"
        )
        return {"train_prompts": len(train), "heldout_prompts": len(heldout)}

    def train_target(self) -> dict:
        self.target = ensure_demo_target(self.cfg.target)
        r = self.target.report
        state = "cached" if self.target.from_cache else "trained now"
        print0(
            f"[demo] target ({state}): {self.target.path}\n"
            f"[demo]   {r.get('num_parameters', 0) / 1e6:.2f} M parameters, final loss "
            f"{r.get('final_loss', float('nan')):.3f}, assistant entropy "
            f"{r.get('probe', {}).get('assistant_entropy_nats', float('nan')):.3f} nats"
        )
        return {"path": str(self.target.path), "from_cache": self.target.from_cache}

    def regenerate(self, seed: int) -> None:
        d = self.cfg.data
        out = self.seed_data(seed) / "regenerated.jsonl"
        cfg = RegenerateConfig(
            data=DataConfig(
                paths=[str(self.data_dir / "prompts.jsonl")], max_length=d.max_length, num_workers=0
            ),
            target=self._target_config(),
            output=str(out),
            batch_size=d.regenerate_batch_size,
            max_new_tokens=d.max_new_tokens,
            temperature=d.temperature,
            top_p=d.top_p,
            top_k=d.top_k,
            seed=seed,
        )
        self._launch(
            f"regenerate-s{seed}",
            "regenerate",
            self._write_config(f"regenerate-s{seed}", cfg),
            self.nproc,
        )
        if not out.is_file() or not out.stat().st_size:
            raise RuntimeError(f"regenerate wrote no rows to {out}")

    def prepare(self, seed: int) -> dict:
        prepared = self.seed_data(seed) / "prepared"
        cfg = PrepareConfig(
            data=DataConfig(
                paths=[str(self.seed_data(seed) / "regenerated.jsonl")],
                tokenizer=str(self.target.path),
                max_length=self.cfg.data.max_length,
                num_workers=0,
            ),
            output_dir=str(prepared),
        )
        self._write_config(f"prepare-s{seed}", cfg)
        counts = prepare(cfg)
        self.num_anchors[seed] = max_valid_anchors(prepared)
        for name in self.cfg.drafters:
            if get_kind(preset(name).kind).capabilities.anchor_blocks:
                given = self.cfg.drafter.block(name).num_anchors is not None
                print0(
                    f"[demo] {PRESETS[name].label}: {self.anchors_of(name, seed)} anchor blocks "
                    "per sequence"
                    + ("" if given else " (every valid position of the longest answer)")
                )
        return counts

    def build_cache(self, seed: int) -> None:
        cfg = BuildCacheConfig(
            data=DataConfig(
                paths=[str(self.seed_data(seed) / "prepared")],
                cache_dir=str(self.seed_data(seed) / "cache"),
                mode="offline",
                max_length=self.cfg.data.max_length,
                num_workers=0,
                cache_dtype="float32",
                samples_per_shard=256,
            ),
            target=self._target_config(),
            batch_size=32,
        )
        self._launch(
            f"build-cache-s{seed}",
            "build-cache",
            self._write_config(f"build-cache-s{seed}", cfg),
            self.nproc,
        )

    def _target_config(self):
        return TargetConfig(path=str(self.target.path), dtype="float32", device="cpu")

    def anchors_of(self, name: str, seed: int) -> int:
        """Anchor blocks per sequence of the drafter `name` (a kind that trains on anchor
        blocks) in `seed`'s training: its size block's, or one per valid position."""
        given = self.cfg.drafter.block(name).num_anchors
        return given if given is not None else self.num_anchors[seed]

    def drafter_model(self, name: str, seed: int) -> DrafterConfig:
        """The preset `name` sized to the tiny target by its kind's size block (`sized`), with
        `seed`'s anchors where it trains on anchor blocks and the loss `loss` names."""
        block = self.cfg.drafter.block(name)
        if get_kind(preset(name).kind).capabilities.anchor_blocks:
            block = replace(block, num_anchors=self.anchors_of(name, seed))
        return replace(sized(name, block), **self.cfg.loss_fields(name))

    def train_config(self, kind: str, seed: int) -> TrainRunConfig:
        """The `dspark-ds train` config of one drafter; only `model`, the data's order, the
        optimizer's measured settings and the names differ between the drafters, only the seed
        and the data between the seeds."""
        c, b = self.cfg, self.cfg.budget
        if c.data.mode == "offline":
            source = dict(cache_dir=str(self.seed_data(seed) / "cache"))
        else:
            source = dict(paths=[str(self.seed_data(seed) / "prepared")])
        return TrainRunConfig(
            name=self.run_name(kind, seed),
            output_dir=str(self.runs_dir),
            model=self.drafter_model(kind, seed),
            target=self._target_config(),
            data=DataConfig(
                mode=c.data.mode,
                max_length=c.data.max_length,
                batch_size=b.micro_batch_size,
                num_workers=0,
                seed=seed,
                **source,
                **c.data_order(kind),
            ),
            train=TrainConfig(
                lr=b.lr,
                warmup_ratio=b.warmup_ratio,
                optimizer=b.optimizer,
                weight_decay=b.weight_decay,
                min_lr_ratio=0.0,
                precision="fp32",
                global_batch_size=b.global_batch_size,
                num_epochs=1000,
                max_steps=b.max_steps,
                seed=seed,
                log_every=10,
                **c.train_fields(kind),
            ),
            deepspeed=DeepSpeedConfig(config=b.zero),
            tracking=TrackingConfig(
                uri=self.uri,
                experiment=c.experiment,
                run_name=f"demo-train-{self.run_name(kind, seed)}",
                parent_run_id=self._parent_run_id(),
                tags={"demo": "true", "recipe": "demo"},
            ),
            # NOTE: the demo needs the exported weights, not resumable checkpoints
            checkpoint=CheckpointConfig(
                every_steps=0, keep_last=1, resume=None, save_final=False, export_final=True
            ),
            validation=ValidationConfig(every_steps=0, num_batches=1),
        )

    def train(self, kind: str, seed: int) -> dict:
        name = self.run_name(kind, seed)
        run_dir = self.runs_dir / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts fresh (and a new MLflow run)
        self._launch(
            f"train-{name}",
            "train",
            self._write_config(f"train-{name}", self.train_config(kind, seed)),
            self.nproc,
        )
        export = self.export_dir(kind, seed)
        if not (export / "config.json").is_file():
            raise RuntimeError(f"training {kind} (seed {seed}) exported nothing to {export}")
        info = {"export": str(export), **_train_log_summary(run_dir / "train_log.jsonl")}
        if get_kind(preset(kind).kind).capabilities.anchor_blocks:
            info["num_anchors"] = self.anchors_of(kind, seed)
        self.results.setdefault(seed, {}).setdefault(kind, {})["train"] = info
        return info

    def evaluate(self, kind: str, temperature: float, seed: int) -> dict:
        e = self.cfg.eval
        name = self.eval_name(kind, temperature, seed)
        cfg = EvalConfig(
            target=TargetPathConfig(path=str(self.target.path)),
            drafter=str(self.export_dir(kind, seed)),
            benchmarks=["demo"],
            data_dir=str(self.data_dir / "bench"),
            max_samples=None,
            max_new_tokens=e.max_new_tokens,
            temperature=temperature,
            draft_temperature=e.draft_temperature,
            seed=seed,
            batch_size=e.batch_size,
            measure_baseline=True,
            dtype="float32",
            device="cpu",
            name=name,
            output_dir=str(self.runs_dir),
            calibration=CalibrationConfig(),
            # nested under the training of its drafter (the export names that run)
            tracking=TrackingConfig(
                uri=self.uri,
                experiment=self.cfg.experiment,
                tags={"demo": "true", "recipe": "demo"},
            ),
        )
        self._write_config(name, cfg)
        payload = run_eval(cfg)
        bench = payload["benchmarks"][0]
        row = {
            "tau": payload["average"]["tau"],
            "speedup": bench.get("speedup"),
            "tokens_per_s": bench["tokens_per_s"],
            "baseline_tokens_per_s": bench.get("baseline_tokens_per_s"),
            "accept_rate_by_position": bench["accept_rate_by_position"],
            "mean_proposal_length": bench["mean_proposal_length"],
            "rounds": bench["rounds"],
            "new_tokens": bench["new_tokens"],
            # a request's share of the batch's drafting / verification time, per round
            "draft_ms_per_round": 1e3 * bench["draft_time_s"] / max(bench["rounds"], 1),
            "verify_ms_per_round": 1e3 * bench["verify_time_s"] / max(bench["rounds"], 1),
            "prompts": bench["num_prompts"],
            "mlflow_run_id": payload.get("mlflow_run_id"),
        }
        calib = payload.get("calibration") or {}
        if "raw" in calib:
            row["calibration"] = {
                variant: {k: calib[variant]["pooled"][k] for k in ("ece", "auroc", "brier")}
                for variant in ("raw", "sts")
                if variant in calib
            }
        self.results.setdefault(seed, {}).setdefault(kind, {})[temp_key(temperature)] = row
        return row

    def _parent_run_id(self) -> str | None:
        return self.tracker.run_id if self.tracker is not None else None

    # ---- the whole thing -------------------------------------------------------------------
    def run(self) -> dict:
        """Every stage, inside the demo's MLflow run (FAILED if a stage fails)."""
        self.out.mkdir(parents=True, exist_ok=True)
        # a rerun into the same directory redoes every stage (the target stays cached)
        for sub in ("data", "runs", "configs", "logs"):
            shutil.rmtree(self.out / sub, ignore_errors=True)
        self.tracker = start_demo_run(self.cfg, self.uri, self.runs_dir)
        with parent_run(self.tracker):
            summary = self._run()
        return summary

    def _run(self) -> dict:
        cfg, s = self.cfg, self.stages
        torch.set_num_threads(cfg.num_threads)
        print0(
            f"[demo] output {self.out}; {self.nproc} rank(s); seeds {cfg.seeds}; MLflow "
            f"{self.uri} (experiment {cfg.experiment!r})"
        )
        lengths = cfg.draft_lengths()
        if len(set(lengths.values())) > 1:
            print0(
                f"[demo] NOTE: the drafters draft different lengths ({lengths}): each kind's "
                "size block sets its own (--drafter.<kind>.<size>); their τ are not compared "
                "at one γ"
            )
        s.run("corpus", "synthetic chat corpus from the seed", self.corpus)
        s.run(
            "target",
            "tokenizer + tiny Qwen3 target (cached after the first run)",
            self.train_target,
        )
        if cfg.launcher == "fork":
            s.run(
                "imports",
                "torch, transformers, DeepSpeed and MLflow once, for every forked rank",
                launcher.preload,
                self._stage_env(),
            )
        for seed in cfg.seeds:
            self.run_seed(seed)
        summary = build_summary(
            cfg,
            self.results,
            s.seconds,
            s.total,
            self.target,
            self.nproc,
            self.uri,
            stage_cpu_seconds=s.cpu_seconds,
        )
        text = format_summary(summary)
        print("\n" + text, flush=True)
        (self.out / "summary.txt").write_text(text + "\n")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log_summary(summary, text, self.tracker)
        print0(f"[demo] done in {s.total:.0f} s: {self.out / 'summary.json'}")
        return summary

    def run_seed(self, seed: int) -> None:
        """Everything after the target, for one seed."""
        cfg, s = self.cfg, self.stages
        s.run(
            f"regenerate-s{seed}",
            f"the target answers the prompts ({self.nproc} rank(s), seed {seed})",
            self.regenerate,
            seed,
        )
        s.run(f"prepare-s{seed}", "chat template + assistant loss masks", self.prepare, seed)
        if cfg.data.mode == "offline":
            s.run(
                f"build-cache-s{seed}",
                "target features, once, for every drafter",
                self.build_cache,
                seed,
            )
        for kind in cfg.drafters:
            s.run(
                f"train-{kind}-s{seed}",
                f"{PRESETS[kind].label} with DeepSpeed {cfg.budget.zero}, {cfg.budget.optimizer}, "
                f"{self.nproc} rank(s), "
                f"{cfg.budget.max_steps} steps, seed {seed}",
                self.train,
                kind,
                seed,
            )
        for kind in cfg.drafters:
            for t in cfg.eval.temperatures:
                s.run(
                    f"eval-{kind}-{temp_key(t)}-s{seed}",
                    f"{PRESETS[kind].label} speculative decoding at T = {t:g}, batch "
                    f"{cfg.eval.batch_size}, and the target alone",
                    self.evaluate,
                    kind,
                    t,
                    seed,
                )


@contextmanager
def parent_run(tracker):
    """`tracker`'s run is the parent of the stages' runs while the block runs: MLFLOW_RUN_ID,
    which a stage would adopt, is set aside and restored after; the run finishes FAILED if the
    block raises, FINISHED otherwise."""
    adopted = os.environ.pop("MLFLOW_RUN_ID", None)
    try:
        yield
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        if adopted is not None:
            os.environ["MLFLOW_RUN_ID"] = adopted
    tracker.finish()


def _train_log_summary(log: Path) -> dict:
    """Steps, first and final loss (mean of the last tenth), and the anchor sampler's share of
    the valid positions it anchored (DSpark / DFlash), from a run's train_log.jsonl."""
    if not log.is_file():
        return {}
    rows = [json.loads(line) for line in log.read_text().splitlines() if line]
    losses = [r["loss"] for r in rows if r["loss"] is not None]  # null: a skipped step
    if not losses:
        return {"steps": 0}
    tail = losses[-max(1, len(losses) // 10) :]
    info = {"steps": len(losses), "first_loss": losses[0], "final_loss": sum(tail) / len(tail)}
    valid = [r["train/valid_anchors_abs"] for r in rows if "train/valid_anchors_abs" in r]
    sampled = [r["train/sampled_anchors_abs"] for r in rows if "train/sampled_anchors_abs" in r]
    if valid and sum(valid) > 0:
        info["valid_anchors_per_sequence"] = sum(valid) / len(valid)
        info["anchored_share_of_valid"] = sum(sampled) / sum(valid)
    return info


def run_demo(cfg: DemoConfig) -> dict:
    """Entry point of `dspark-ds demo`."""
    return DemoPipeline(cfg).run()
