"""`--cluster.from_run RUN_DIR`: the compute rate of the step-time model taken from a finished
training run, so that the model predicts that run's own step as it was measured
(`machine_from_run`).

From the run directory:

- `train_log.jsonl`: on every log step the window's mean step (`system/step_s`), its model
  FLOP/s per GPU (`system/tflops_per_gpu`: the kind's count, cost/flops.py), MFU when the run
  knew its peak (`system/mfu`), tokens and kept anchor blocks per sequence
  (`system/tokens_per_s` / `system/samples_per_s`, `train/sampled_anchors_abs`). The first log
  window (the first step's warm-up) is left out; the step and its FLOPs are the medians of the
  others, and the run's achieved FLOP/s and MFU their ratio.
- the newest checkpoint: the run's config (`run_config.yaml`), DeepSpeed config and world size.

The run's MFU charges the whole step to its matmuls; the model's `sustained_fraction` is the
rate of the compute term alone, beside the other terms (host time, DeepSpeed's own, gradient
reduction, the optimizer...). So the fraction is the one for which the model's step of the
run's point — its option, micro-batch, accumulation and ranks, at its mean tokens and anchor
blocks per sequence — equals the measured step when its compute is the log's FLOPs: found by
bisection (the step only shrinks as the fraction grows; on a GPU the host time hides behind a
longer compute). It applies to the drafter's step and the target's forward alike (one run
cannot tell them apart). With the fraction, the model's own FLOPs for that point predict the
measured step to within the ratio of the two counts (1 when the run's sequences have the same
length and anchors; `predicted_step_s` below says it).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dspark_ds.config import TrainRunConfig, parse
from dspark_ds.cost.inventory import inventory
from dspark_ds.errors import ConfigError
from dspark_ds.train.checkpoint_files import latest_tag
from dspark_ds.train.lineage import zero_option
from dspark_ds.tune.cluster import Machine, with_values
from dspark_ds.tune.config import TunerConfig, ZeroOption
from dspark_ds.tune.prediction import PredictionInputs, option_step, options_host_work
from dspark_ds.tune.steptime import step_time

LOG_FILE = "train_log.jsonl"  # train/metrics.py's


@dataclass(frozen=True)
class RunLog:
    """What a finished run measured (medians over its log windows after the first)."""

    run_dir: str
    run_cfg: object
    """The run's TrainRunConfig (its newest checkpoint's run_config.yaml)."""
    ds_config: dict
    world: int
    windows: int
    """Log windows the medians are over."""
    step_s: float
    flops_per_step: float
    """Model FLOPs of one optimizer step per GPU (the median of each window's tflops_per_gpu ×
    step_s)."""
    peak_flops: float | None
    """The peak its MFU was against (None: it logged no MFU)."""
    tokens_per_sequence: float
    anchors_per_sequence: float | None


def _median(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def read_run(run_dir: str | Path) -> RunLog:
    """A finished run's figures; ConfigError names `cluster.from_run` and what is missing."""
    run = Path(run_dir)
    log = run / LOG_FILE
    if not log.is_file():
        raise ConfigError(f"cluster.from_run: {log} does not exist (a `dspark-ds train` run?)")
    rows = []
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "system/tflops_per_gpu" in row and "system/step_s" in row:
            rows.append(row)
    if not rows:
        raise ConfigError(
            f"cluster.from_run: {log} has no log step with system/tflops_per_gpu and "
            "system/step_s (written by an older version?)"
        )
    used = rows[1:] or rows  # the first window holds the first step's warm-up
    tag = latest_tag(run / "checkpoints")
    if tag is None:
        raise ConfigError(
            f"cluster.from_run: {run / 'checkpoints'} holds no complete checkpoint, which "
            "records the run's config (checkpoint.save_final true keeps one)"
        )
    tag_dir = run / "checkpoints" / tag
    run_cfg = parse(
        TrainRunConfig, ["--config", str(tag_dir / "run_config.yaml")], prog="dspark-ds tune"
    )
    meta = json.loads((tag_dir / "meta.json").read_text())
    per_window = [r["system/tflops_per_gpu"] * 1e12 * r["system/step_s"] for r in used]
    peaks = [
        r["system/tflops_per_gpu"] * 1e12 / r["system/mfu"] for r in used if r.get("system/mfu")
    ]
    tokens = [
        r["system/tokens_per_s"] / r["system/samples_per_s"]
        for r in used
        if r.get("system/samples_per_s")
    ]
    return RunLog(
        run_dir=str(run),
        run_cfg=run_cfg,
        ds_config=json.loads((tag_dir / "ds_config.json").read_text()),
        world=int(meta["world_size"]),
        windows=len(used),
        step_s=_median(used, "system/step_s"),
        flops_per_step=statistics.median(per_window),
        peak_flops=statistics.median(peaks) if peaks else None,
        tokens_per_sequence=statistics.median(tokens) if tokens else run_cfg.data.max_length,
        anchors_per_sequence=_median(used, "train/sampled_anchors_abs"),
    )


def achieved_flops(log: RunLog) -> float:
    """FLOP/s per GPU of the run's median step: its FLOPs over its time (what MFU divides)."""
    return log.flops_per_step / log.step_s


def run_point(log: RunLog):
    """The run's config at its mean tokens and kept anchor blocks per sequence (rounded)."""
    cfg = log.run_cfg
    cfg = replace(cfg, data=replace(cfg.data, max_length=max(1, round(log.tokens_per_sequence))))
    if log.anchors_per_sequence is not None:
        anchors = max(1, round(log.anchors_per_sequence))
        cfg = replace(cfg, model=replace(cfg.model, num_anchors=anchors))
    return cfg


@dataclass(frozen=True)
class Prediction:
    """The model's step of the run's point on a machine."""

    step_s: float
    compute_s: float
    flops_per_step: float
    """The model's FLOPs of one optimizer step per GPU (its compute term's)."""


def fraction_for(log: RunLog, predict: Callable[[float], Prediction]) -> float:
    """The sustained fraction at which the model's step of the run's point, its compute being
    the log's FLOPs, is the measured step (see the module docstring). `predict(fraction)`: the
    model at that fraction with its own FLOPs."""
    scale = log.flops_per_step / predict(1.0).flops_per_step  # the log's count / the model's

    def step_at(fraction: float) -> float:  # with the log's FLOPs (compute ∝ FLOPs / fraction)
        return predict(fraction / scale).step_s

    lo, hi = 1e-9, 1.0
    if step_at(hi) >= log.step_s:  # the other terms alone reach the measured step
        return hi
    for _ in range(80):  # geometric bisection: fractions span many decades (a CPU, a GPU)
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if step_at(mid) < log.step_s else (mid, hi)
    return (lo * hi) ** 0.5


def summary(
    log: RunLog, point, option: str, accum: int, peak: float, fraction: float, pred: Prediction
) -> dict:
    """The JSON record of the calibration (the report's lines read it)."""
    return {
        "run_dir": log.run_dir,
        "option": option,
        "world": log.world,
        "micro_batch": point.data.batch_size,
        "accum": accum,
        "tokens_per_sequence": log.tokens_per_sequence,
        "anchors_per_sequence": log.anchors_per_sequence,
        "windows": log.windows,
        "measured_step_s": log.step_s,
        "tflops_per_gpu": achieved_flops(log) / 1e12,
        "peak_flops": peak,
        "peak_from_log": log.peak_flops is not None,
        "mfu": achieved_flops(log) / peak,
        "sustained_fraction": fraction,
        "logged_flops_per_step": log.flops_per_step,
        "model_flops_per_step": pred.flops_per_step,
        "predicted_step_s": pred.step_s,
        "other_terms_s": pred.step_s - pred.compute_s,
        "capped": fraction >= 1.0,
    }


def lines(rec: dict) -> list[str]:
    """The report's lines of a calibration from a run."""
    anchors = rec["anchors_per_sequence"]
    shape = f"{rec['tokens_per_sequence']:.0f} tokens"
    if anchors is not None:
        shape += f" and {anchors:.0f} anchor blocks"
    whose = "the run" if rec["peak_from_log"] else "the cluster"
    peak = f"{rec['peak_flops'] / 1e12:.4g} TFLOP/s ({whose}'s peak)"
    capped = []
    if rec["capped"]:
        capped = [
            "  NOTE: the model's other terms alone reach the measured step: the fraction "
            "is capped at 1 (their figures are too slow for this machine: calibrate them)"
        ]
    return [
        f"from run {rec['run_dir']}: {rec['option']}, {rec['world']} rank(s), micro-batch "
        f"{rec['micro_batch']} × {rec['accum']}, {shape} per sequence (medians of "
        f"{rec['windows']} log windows)",
        f"  measured {rec['measured_step_s']:.4g} s per step at {rec['tflops_per_gpu']:.4g} "
        f"TFLOP/s per GPU: MFU {rec['mfu']:.3g} of {peak}",
        f"  the model's other terms {rec['other_terms_s']:.4g} s; its compute at "
        f"sustained_fraction {rec['sustained_fraction']:.4g} (the drafter's step and the "
        "target's forward alike)",
        f"  predicted for the run's point: {rec['predicted_step_s']:.4g} s (measured "
        f"{rec['measured_step_s']:.4g} s; the model's FLOPs per step "
        f"{rec['model_flops_per_step'] / rec['logged_flops_per_step']:.3f}× the log's)",
        *capped,
    ]


def machine_from_run(cfg: TunerConfig, machine: Machine) -> tuple[Machine, dict]:
    """`--cluster.from_run`: `machine` with the sustained fraction (and peak) for which the model
    predicts the run's measured step, and the record of it (`summary`)."""
    log = read_run(cfg.cluster.from_run)
    point = run_point(log)
    source = f"run {log.run_dir}"
    peak = cfg.cluster.flag_values().get("peak_flops") or log.peak_flops or machine.peak_flops
    nodes, per_node = 1, log.world  # the run's ranks: one node unless they fill several
    if log.world > machine.gpus_per_node and log.world % machine.gpus_per_node == 0:
        nodes, per_node = log.world // machine.gpus_per_node, machine.gpus_per_node
    here = with_values(machine, {"gpus_per_node": per_node, "peak_flops": peak}, source)
    option = ZeroOption(zero_option(log.ds_config), point.deepspeed.config)
    work = options_host_work(point, [option], cfg.device or "cuda", here)
    step = option_step(PredictionInputs(cfg, point, inventory(point), here, work), option, nodes)

    def predict(fraction: float) -> Prediction:
        rates = {"sustained_fraction": fraction, "target_sustained_fraction": fraction}
        at = step_time(replace(step, machine=with_values(here, rates, source)))
        return Prediction(at.seconds, at.terms["compute"], step.accum * step.workload.flops)

    fraction = fraction_for(log, predict)
    record = summary(log, point, option.name, step.accum, peak, fraction, predict(fraction))
    values = {
        "peak_flops": peak,
        "sustained_fraction": fraction,
        "target_sustained_fraction": fraction,
    }
    return with_values(machine, values, source), record
