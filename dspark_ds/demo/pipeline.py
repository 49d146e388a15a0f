"""`dspark-ds demo`: the whole pipeline, through the same code users run on clusters.

Stages (each timed, each printed with a header):

1. corpus      synthetic chat corpus from the seed (`dspark_ds.data.synthetic`), no downloads
2. target      BPE tokenizer + tiny Qwen3 trained on it, cached (`dspark_ds.demo.target`)
3. regenerate  the target answers the training prompts (`dspark-ds regenerate`, N ranks)
4. prepare     chat template + assistant loss masks → token store (`dspark-ds prepare`)
5. build-cache the target's features, once (`dspark-ds build-cache`, N ranks; offline mode)
6. train       DSpark, DFlash, Eagle3: `torchrun -m dspark_ds.cli train`, DeepSpeed ZeRO-3,
               the same budget; each run exports its interchange directory
7. eval        real speculative decoding of held-out prompts at every temperature (`run_eval`)
8. summary     τ, acceptance by position, calibration, stage times → table, summary.json, MLflow

Layout of `output_dir`: data/ (corpus, regenerated answers, token store, cache, held-out
prompts), configs/ (the YAML each subprocess ran with), runs/ (training and eval runs),
logs/, mlflow.db, summary.json, summary.txt.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from dspark_ds.config import TrainRunConfig, dump_config
from dspark_ds.demo.config import DemoConfig
from dspark_ds.distributed import free_port, print0
from dspark_ds.drafters.presets import DrafterConfig, preset

_LABELS = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}


def _temp_key(t: float) -> str:
    return f"T{t:g}"


class _Stages:
    """Prints a header per stage and records its wall time."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def run(self, name: str, what: str, fn, *args, **kwargs):
        print(flush=True)
        print0(f"{'=' * 78}\n[demo] stage {len(self.seconds) + 1}: {name} — {what}\n{'=' * 78}")
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - t0
        print0(f"[demo] {name}: {self.seconds[name]:.1f} s")
        return out

    @property
    def total(self) -> float:
        return time.perf_counter() - self._t0


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
        self.uri = cfg.tracking_uri or f"sqlite:///{self.out / 'mlflow.db'}"
        self.nproc = cfg.budget.world_size
        self.stages = _Stages()
        self.target = None
        self.exports: dict[str, Path] = {}
        self.train_info: dict[str, dict] = {}
        self.evals: dict[str, dict[str, dict]] = {}

    # ---- helpers --------------------------------------------------------------------------
    def _env(self) -> dict:
        env = dict(os.environ)
        env.update(DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   OMP_NUM_THREADS=str(self.cfg.num_threads),
                   MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")  # fmt: skip
        # NOTE: DeepSpeed's ZeRO-3 calls deprecated torch.distributed collectives every step;
        # their FutureWarnings would bury the progress bars of the demo.
        warn = "ignore::FutureWarning"
        env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), warn) if w)
        # the subprocesses import this very package, wherever it was imported from
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return env

    def _write_config(self, name: str, cfg) -> Path:
        """A typed config as the YAML a subprocess (or a person) runs with."""
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        path = self.conf_dir / f"{name}.yaml"
        path.write_text(dump_config(cfg))
        return path

    def _launch(self, stage: str, subcommand: str, config: Path, nproc: int) -> None:
        """`torchrun --nproc_per_node N -m dspark_ds.cli <subcommand> --config <yaml>`; the
        output goes to the console and to logs/<stage>.log."""
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "dspark_ds.cli", subcommand, "--config", str(config)]  # fmt: skip
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{stage}.log"
        print0("[demo] $ " + " ".join(cmd[1:]))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd,
                env=self._env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(line)
            rc = proc.wait()
        sys.stdout.flush()
        if rc != 0:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
            raise RuntimeError(f"demo stage {stage!r} failed (exit {rc}); log {log_path}:\n{tail}")

    # ---- stages ---------------------------------------------------------------------------
    def corpus(self) -> dict:
        from dspark_ds.data.synthetic import make_corpus, write_jsonl

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
        from dspark_ds.demo.target import ensure_demo_target

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

    def regenerate(self) -> None:
        from dspark_ds.data.config import DataConfig, RegenerateConfig

        d = self.cfg.data
        out = self.data_dir / "regenerated.jsonl"
        cfg = RegenerateConfig(
            data=DataConfig(paths=[str(self.data_dir / "prompts.jsonl")],
                            max_length=d.max_length, num_workers=0),
            target=self._target_config(), output=str(out), batch_size=d.regenerate_batch_size,
            max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_p=d.top_p,
            top_k=d.top_k, seed=self.cfg.budget.seed,
        )  # fmt: skip
        self._launch("regenerate", "regenerate", self._write_config("regenerate", cfg), self.nproc)
        if not out.is_file() or not out.stat().st_size:
            raise RuntimeError(f"regenerate wrote no rows to {out}")

    def prepare(self) -> dict:
        from dspark_ds.data.config import DataConfig, PrepareConfig
        from dspark_ds.data.tokens import prepare

        cfg = PrepareConfig(
            data=DataConfig(paths=[str(self.data_dir / "regenerated.jsonl")],
                            tokenizer=str(self.target.path), max_length=self.cfg.data.max_length,
                            num_workers=0),
            output_dir=str(self.data_dir / "prepared"),
        )  # fmt: skip
        self._write_config("prepare", cfg)
        return prepare(cfg)

    def build_cache(self) -> None:
        from dspark_ds.data.config import BuildCacheConfig, DataConfig

        cfg = BuildCacheConfig(
            data=DataConfig(paths=[str(self.data_dir / "prepared")],
                            cache_dir=str(self.data_dir / "cache"), mode="offline",
                            max_length=self.cfg.data.max_length, num_workers=0,
                            cache_dtype="float32", samples_per_shard=256),
            target=self._target_config(), batch_size=32,
        )  # fmt: skip
        self._launch(
            "build-cache", "build-cache", self._write_config("build-cache", cfg), self.nproc
        )

    def _target_config(self):
        from dspark_ds.target import TargetConfig

        return TargetConfig(path=str(self.target.path), dtype="float32", device="cpu")

    def drafter_model(self, name: str) -> DrafterConfig:
        """The preset `name` (dspark | dflash | eagle3) sized to the tiny target."""
        dr = self.cfg.drafter
        blocks = dict(
            num_draft_layers=dr.num_draft_layers,
            block_size=dr.block_size,
            num_anchors=dr.num_anchors,
        )
        sizes = {
            "dspark": {**blocks, "markov_rank": dr.markov_rank},
            "dflash": blocks,
            # ttt_length = γ: every drafter proposes at most γ tokens a round
            "eagle3": {"num_draft_layers": dr.eagle3_layers, "ttt_length": dr.block_size},
        }
        return preset(name, **sizes[name])

    def train_config(self, kind: str) -> TrainRunConfig:
        """The `dspark-ds train` config of one drafter; only `model` differs between them."""
        from dspark_ds.config import (
            CheckpointConfig,
            DeepSpeedConfig,
            TrackingConfig,
            TrainConfig,
            ValidationConfig,
        )
        from dspark_ds.data.config import DataConfig

        c, b = self.cfg, self.cfg.budget
        if c.data.mode == "offline":
            source = dict(cache_dir=str(self.data_dir / "cache"))
        else:
            source = dict(paths=[str(self.data_dir / "prepared")])
        return TrainRunConfig(
            name=kind,
            output_dir=str(self.runs_dir),
            model=self.drafter_model(kind),
            target=self._target_config(),
            data=DataConfig(mode=c.data.mode, max_length=c.data.max_length,
                            batch_size=b.micro_batch_size, num_workers=0, seed=b.seed, **source),
            train=TrainConfig(lr=b.lr, warmup_ratio=b.warmup_ratio, min_lr_ratio=0.0,
                              precision="fp32", global_batch_size=b.global_batch_size,
                              num_epochs=1000, max_steps=b.max_steps, seed=b.seed, log_every=10),
            deepspeed=DeepSpeedConfig(config=b.zero),
            tracking=TrackingConfig(uri=self.uri, experiment=c.experiment,
                                    run_name=f"demo-train-{kind}", tags={"demo": "true"}),
            # NOTE: the demo needs the exported weights, not resumable checkpoints
            checkpoint=CheckpointConfig(every_steps=0, keep_last=1, resume=None,
                                        save_final=False, export_final=True),
            validation=ValidationConfig(every_steps=0, num_batches=1),
        )  # fmt: skip

    def train(self, kind: str) -> dict:
        run_dir = self.runs_dir / kind
        shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts fresh (and a new MLflow run)
        self._launch(
            f"train-{kind}",
            "train",
            self._write_config(f"train-{kind}", self.train_config(kind)),
            self.nproc,
        )
        export = run_dir / "export"
        if not (export / "config.json").is_file():
            raise RuntimeError(f"training {kind} exported nothing to {export}")
        self.exports[kind] = export
        info: dict = {"export": str(export)}
        log = run_dir / "train_log.jsonl"
        if log.is_file():
            rows = [json.loads(line) for line in log.read_text().splitlines() if line]
            losses = [r["loss"] for r in rows if r["loss"] is not None]  # null: a skipped step
            tail = losses[-max(1, len(losses) // 10) :]
            info.update(steps=len(losses), first_loss=losses[0], final_loss=sum(tail) / len(tail))
        self.train_info[kind] = info
        return info

    def evaluate(self, kind: str, temperature: float) -> dict:
        from dspark_ds.config import TrackingConfig
        from dspark_ds.eval.config import CalibrationConfig, EvalConfig
        from dspark_ds.eval.runner import run_eval
        from dspark_ds.target import TargetPathConfig

        e = self.cfg.eval
        cfg = EvalConfig(
            target=TargetPathConfig(path=str(self.target.path)), drafter=str(self.exports[kind]),
            benchmarks=["demo"], data_dir=str(self.data_dir / "bench"), max_samples=None,
            max_new_tokens=e.max_new_tokens, temperature=temperature, seed=e.seed,
            dtype="float32", device="cpu", name=f"eval-{kind}-{_temp_key(temperature)}",
            output_dir=str(self.runs_dir), calibration=CalibrationConfig(),
            tracking=TrackingConfig(uri=self.uri, experiment=self.cfg.experiment,
                                    tags={"demo": "true", "drafter_kind": kind}),
        )  # fmt: skip
        self._write_config(f"eval-{kind}-{_temp_key(temperature)}", cfg)
        payload = run_eval(cfg)
        bench = payload["benchmarks"][0]
        row = {
            "tau": payload["average"]["tau"],
            "accept_rate_by_position": bench["accept_rate_by_position"],
            "mean_proposal_length": bench["mean_proposal_length"],
            "rounds": bench["rounds"], "new_tokens": bench["new_tokens"],
            "prompts": bench["num_prompts"], "tokens_per_s": bench["tokens_per_s"],
            "mlflow_run_id": payload.get("mlflow_run_id"),
        }  # fmt: skip
        calib = payload.get("calibration") or {}
        if "raw" in calib:
            row["calibration"] = {
                variant: {k: calib[variant]["pooled"][k] for k in ("ece", "auroc", "brier")}
                for variant in ("raw", "sts")
                if variant in calib
            }
        self.evals.setdefault(kind, {})[_temp_key(temperature)] = row
        return row

    # ---- the whole thing -------------------------------------------------------------------
    def run(self) -> dict:
        import torch

        cfg, s = self.cfg, self.stages
        torch.set_num_threads(cfg.num_threads)
        self.out.mkdir(parents=True, exist_ok=True)
        # a rerun into the same directory redoes every stage (the target stays cached)
        for sub in ("data", "runs", "configs", "logs"):
            shutil.rmtree(self.out / sub, ignore_errors=True)
        print0(
            f"[demo] output {self.out}; {self.nproc} rank(s); MLflow {self.uri} "
            f"(experiment {cfg.experiment!r})"
        )
        s.run("corpus", "synthetic chat corpus from the seed", self.corpus)
        s.run(
            "target",
            "tokenizer + tiny Qwen3 target (cached after the first run)",
            self.train_target,
        )
        s.run(
            "regenerate", f"the target answers the prompts ({self.nproc} rank(s))", self.regenerate
        )
        s.run("prepare", "chat template + assistant loss masks", self.prepare)
        if cfg.data.mode == "offline":
            s.run("build-cache", "target features, once, for every drafter", self.build_cache)
        for kind in cfg.drafters:
            s.run(
                f"train-{kind}",
                f"{_LABELS[kind]} with DeepSpeed {cfg.budget.zero}, "
                f"{self.nproc} rank(s), {cfg.budget.max_steps} steps",
                self.train,
                kind,
            )
        for kind in cfg.drafters:
            for t in cfg.eval.temperatures:
                s.run(
                    f"eval-{kind}-{_temp_key(t)}",
                    f"{_LABELS[kind]} speculative decoding at T = {t:g}",
                    self.evaluate,
                    kind,
                    t,
                )
        summary = self.summary()
        text = format_summary(summary)
        print("\n" + text, flush=True)
        (self.out / "summary.txt").write_text(text + "\n")
        (self.out / "summary.json").write_text(json.dumps(_finite(summary), indent=2) + "\n")
        self.log_summary(summary, text)
        print0(f"[demo] done in {s.total:.0f} s: {self.out / 'summary.json'}")
        return summary

    def summary(self) -> dict:
        cfg = self.cfg
        drafters = {}
        for kind in cfg.drafters:
            entry = dict(self.evals.get(kind, {}))
            entry["train"] = self.train_info.get(kind, {})
            entry["stage_seconds"] = {
                k: v
                for k, v in self.stages.seconds.items()
                if k == f"train-{kind}" or k.startswith(f"eval-{kind}-")
            }
            drafters[kind] = entry
        ratios = {}
        if "dspark" in drafters and "dflash" in drafters:
            for t in cfg.eval.temperatures:
                a = drafters["dspark"].get(_temp_key(t), {}).get("tau")
                b = drafters["dflash"].get(_temp_key(t), {}).get("tau")
                if a and b:
                    ratios[_temp_key(t)] = a / b
        report = self.target.report if self.target is not None else {}
        return {
            "drafters": drafters,
            "tau_ratio_dspark_over_dflash": ratios,
            "stage_seconds": dict(self.stages.seconds),
            "total_seconds": self.stages.total,
            "target": {
                "path": str(self.target.path) if self.target else None,
                "from_cache": bool(self.target and self.target.from_cache),
                "num_parameters": report.get("num_parameters"),
                "final_loss": report.get("final_loss"),
                "train_seconds": report.get("train_seconds"),
                "probe": report.get("probe"),
            },
            "ranks": self.nproc,
            "temperatures": list(cfg.eval.temperatures),
            "config": asdict(cfg),
            "mlflow": {"uri": self.uri, "experiment": cfg.experiment},
        }

    def log_summary(self, summary: dict, text: str) -> None:
        """One MLflow run with the comparison: metrics per drafter × temperature, stage times,
        the table and summary.json as artifacts."""
        from dspark_ds.tracking.mlflow import Tracker, default_artifact_location

        run_dir = self.runs_dir / "summary"
        shutil.rmtree(run_dir, ignore_errors=True)
        tracker = Tracker(
            enabled=True,
            uri=self.uri,
            experiment=self.cfg.experiment,
            run_name="demo-summary",
            run_dir=str(run_dir),
            # the same place as the training and evaluation runs (all under runs/)
            artifact_location=default_artifact_location(str(self.runs_dir)),
        )
        try:
            metrics: dict[str, float] = {}
            for kind, entry in summary["drafters"].items():
                for t in self.cfg.eval.temperatures:
                    row = entry.get(_temp_key(t))
                    if not row:
                        continue
                    metrics[f"{kind}/{_temp_key(t)}/tau"] = row["tau"]
                    for k, a in enumerate(row["accept_rate_by_position"]):
                        if a is not None:
                            metrics[f"{kind}/{_temp_key(t)}/accept_rate@{k}"] = a
                    for variant, vals in row.get("calibration", {}).items():
                        for key, v in vals.items():
                            metrics[f"{kind}/{_temp_key(t)}/confidence_{variant}_{key}"] = v
            for name, sec in summary["stage_seconds"].items():
                metrics[f"seconds/{name}"] = sec
            for t, r in summary["tau_ratio_dspark_over_dflash"].items():
                metrics[f"tau_ratio_dspark_over_dflash/{t}"] = r
            tracker.log_params(
                {
                    "drafters": ",".join(self.cfg.drafters),
                    "ranks": self.nproc,
                    "zero": self.cfg.budget.zero,
                    "max_steps": self.cfg.budget.max_steps,
                    "target_from_cache": summary["target"]["from_cache"],
                }
            )
            tracker.set_tags({"kind": "demo-summary", "demo": "true"})
            tracker.log_metrics(
                {
                    k: float(v)
                    for k, v in metrics.items()
                    if v is not None and math.isfinite(float(v))
                },
                step=0,
            )
            tracker.log_text(text, "summary.txt")
            tracker.log_dict(_finite(summary), "summary.json")
        finally:
            tracker.finish()


def _finite(x):
    """NaN → None so summary.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _f(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def format_summary(summary: dict) -> str:
    """The final comparison table (τ, acceptance by position, calibration) and stage times."""
    temps = [_temp_key(t) for t in summary["temperatures"]]
    width = max((len(row.get("accept_rate_by_position", []))
                 for e in summary["drafters"].values() for k, row in e.items() if k in temps),
                default=0)  # fmt: skip
    header = ["drafter", "T", "tau", "prompts", "rounds"] + [f"acc@{k}" for k in range(width)]
    header += ["ECE", "AUROC", "ECE(STS)", "train_s"]
    rows = [header]
    for kind, entry in summary["drafters"].items():
        for t in temps:
            row = entry.get(t)
            if not row:
                continue
            acc = list(row["accept_rate_by_position"]) + [None] * width
            cal = row.get("calibration", {})
            rows.append([_LABELS[kind], t[1:], _f(row["tau"]), str(row["prompts"]),
                         str(row["rounds"])] + [_f(a) for a in acc[:width]] + [
                _f(cal.get("raw", {}).get("ece")), _f(cal.get("raw", {}).get("auroc")),
                _f(cal.get("sts", {}).get("ece")),
                _f(entry["stage_seconds"].get(f"train-{kind}"), 1)])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for t, r in summary["tau_ratio_dspark_over_dflash"].items():
        lines.append(f"tau(DSpark) / tau(DFlash) at T = {t[1:]}: {r:.3f}")
    lines.append("")
    lines.append(
        "stage wall times (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in summary["stage_seconds"].items())
    )
    target = summary["target"]
    lines.append(
        f"total {summary['total_seconds']:.1f} s; target "
        f"{'from cache' if target['from_cache'] else 'trained in this run'}; "
        f"{summary['ranks']} rank(s)"
    )
    return "\n".join(lines)


def run_demo(cfg: DemoConfig) -> dict:
    """Entry point of `dspark-ds demo`."""
    return DemoPipeline(cfg).run()
