"""`dspark-ds tune` from end to end (`run`), stage by stage: the recipe and the machine (its
preset or profile, calibrated here with `--measure`'s real steps between the samples:
onsite.py; the compute rate of a finished run: fromrun.py), the search of each option's point
on each node count (search.py, predicting with prediction.py), the tables (report.py, a served
run's fleet: fleet.py), the recommended point as a recipe (write.py), the sweep as MLflow runs
(sweep_runs.py) and the JSON."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dspark_ds.cost.flops import target_served
from dspark_ds.cost.inventory import Inventory, inventory
from dspark_ds.distributed import is_rank0
from dspark_ds.tune.cluster import Machine, save_profile
from dspark_ds.tune.config import OPTIONS, TunerConfig, ZeroOption, default_options, load_recipe
from dspark_ds.tune.dataio import data_lines
from dspark_ds.tune.estimate import Estimate, ds_config_warnings, recommend
from dspark_ds.tune.fleet import as_served, fleet_lines, size_fleet
from dspark_ds.tune.fromrun import lines as from_run_lines
from dspark_ds.tune.fromrun import machine_from_run
from dspark_ds.tune.onsite import Calibrated, at_points, calibrate_and_measure, here, measure_points
from dspark_ds.tune.prediction import PredictionInputs, options_host_work, predict, predict_one
from dspark_ds.tune.report import report
from dspark_ds.tune.search import point_args, point_config, search
from dspark_ds.tune.sweep_runs import log_sweep
from dspark_ds.tune.write import write_recipe


@dataclass
class Tuning:
    """What the stages found: the recipe, its options, the machine, the predictions."""

    run_cfg: object
    """The recipe (a TrainRunConfig), as a served run under --served."""
    inv: Inventory
    options: list[ZeroOption]
    node_counts: list[int]
    """The node counts predicted (1: the launcher's node, under --measure)."""
    points: dict[str, dict] | None
    """The point `--measure` ran each option at (None without it)."""
    found: Calibrated
    machine: Machine
    work: dict
    """The recipe's host work (calibrated, or computed for the machine)."""
    from_run: dict | None = None
    """`--cluster.from_run`'s record."""
    scaling: dict[int, list[Estimate]] = field(default_factory=dict)
    """Each option's point on each node count."""
    as_given: list[Estimate] = field(default_factory=list)
    """Each option at the recipe's own micro-batch (the first node count)."""
    at_measurement: dict[str, float] = field(default_factory=dict)
    """Each option measured between calibration samples: its predicted step from those."""

    @property
    def estimates(self) -> list[Estimate]:
        """Each option's point on the first node count (the table's)."""
        return self.scaling[self.node_counts[0]]


def run(cfg: TunerConfig) -> dict:
    """Estimate, predict (and measure); prints the tables on rank 0 and returns them."""
    cfg.validate()
    cfg, tuning = _machine(cfg)
    _predict(cfg, tuning)
    text, warnings, fleet = _report(cfg, tuning)
    result = _result(tuning, text, warnings, fleet)
    if cfg.write_recipe and is_rank0():
        text += "\n" + _write_recipe(cfg, tuning)
        result["text"] = text
    if is_rank0():
        print(text, flush=True)
        if tracking_on(cfg):
            result["mlflow_run_id"] = log_sweep(
                cfg,
                tuning.run_cfg,
                tuning.estimates,
                tuning.scaling,
                tuning.found.measured,
                tuning.at_measurement,
                result["recommended"],
                text,
            )
        if cfg.output_json:
            Path(cfg.output_json).write_text(json.dumps(result, indent=1, default=float))
    return result


def tracking_on(cfg: TunerConfig) -> bool:
    t = cfg.tracking
    return t.enabled or t.uri is not None or bool(os.environ.get("MLFLOW_TRACKING_URI"))


def _machine(cfg: TunerConfig) -> tuple[TunerConfig, Tuning]:
    """The recipe, its options and the machine: the preset's or profile's, calibrated here and
    measured (`--measure`), with a finished run's compute rate (`--cluster.from_run`)."""
    run_cfg = load_recipe(cfg)
    if cfg.served and not target_served(run_cfg):
        run_cfg = as_served(run_cfg)
    node_counts = [1] if cfg.measure else cfg.cluster.node_counts
    names = cfg.options if cfg.options is not None else default_options(node_counts[0])
    options = [o for o in OPTIONS if o.name in names]
    device = None
    if cfg.measure or cfg.cluster.calibrate:  # the launcher's ranks and device
        cfg, device = here(cfg, run_cfg)
    inv = inventory(run_cfg)
    points = measure_points(cfg, run_cfg, inv, options) if cfg.measure else None
    found = calibrate_and_measure(cfg, run_cfg, options, device, points)
    work = found.work
    if work is None:
        work = options_host_work(run_cfg, options, cfg.device or "cuda", found.machine)
    tuning = Tuning(run_cfg, inv, options, node_counts, points, found, found.machine, work)
    if cfg.cluster.from_run:
        tuning.machine, tuning.from_run = machine_from_run(cfg, tuning.machine)
        if cfg.cluster.save_profile and is_rank0():  # what was measured here or in the run
            meta = dict(found.meta, from_run=tuning.from_run)
            save_profile(
                tuning.machine,
                cfg.cluster.save_profile,
                meta,
                only_from=("calibrated", "profile", "run "),
            )
    return cfg, tuning


def _predict(cfg: TunerConfig, t: Tuning) -> None:
    """Each option's point on each node count (the points measured, under `--measure`), at the
    recipe's own micro-batch, and at each measurement's own calibration samples."""
    given = PredictionInputs(cfg, t.run_cfg, t.inv, t.machine, t.work)
    if t.points is not None:  # the points measured
        t.scaling = {1: at_points(given, t.options, t.points)}
    else:
        t.scaling = {n: search(given, t.options, n) for n in t.node_counts}
    t.as_given = predict(given, t.options, t.node_counts[0])
    # each option measured between calibration samples: its prediction from those samples
    for option in t.options:
        if option.name in t.found.own:
            own_machine, own_work = t.found.own[option.name]
            at = point_config(t.run_cfg, **point_args(t.points[option.name]))
            own = replace(given, run_cfg=at, machine=own_machine, ops=own_work)
            est = predict_one(own, option, 1)
            t.at_measurement[option.name] = est.step["predicted_step_s"]


def _report(cfg: TunerConfig, t: Tuning) -> tuple[str, list[str], object]:
    """(The tables, the warnings, a served run's fleet or None)."""
    run_cfg, inv, machine, estimates = t.run_cfg, t.inv, t.machine, t.estimates
    warnings = ds_config_warnings(run_cfg)
    data = data_lines(recommend(estimates), run_cfg, inv, machine)
    data_warnings = [ln.removeprefix("warning: ") for ln in data if ln.startswith("warning: ")]
    findings = (t.found.measured, t.scaling, t.found.meta, t.at_measurement)
    text = report(estimates, cfg, inv, run_cfg, machine, *findings, warnings, t.as_given, data)
    if t.from_run is not None:
        text += "\n\n" + "\n".join(from_run_lines(t.from_run))
    fleet = None
    if target_served(run_cfg):
        best = recommend(estimates)
        fleet = size_fleet(best, run_cfg, inv, machine, cfg.prefill_mfu) if best else None
        text += "\n" + "\n".join(fleet_lines(fleet, run_cfg, machine))
    return text, warnings + data_warnings, fleet


def _rows(t: Tuning) -> list[dict]:
    """The table's rows: each option's point, its prediction and measurement."""
    rows = []
    for e in t.estimates:
        m = t.found.measured.get(e.option, {})
        rows.append(
            {
                "option": e.option,
                "micro_batch": e.point["micro_batch"],
                "recompute": e.point.get("recompute", False),
                "accum": e.step["accum"],
                "global_batch": e.point["global_batch"],
                "predicted_step_s": e.step["predicted_step_s"],
                "predicted_at_measurement_s": t.at_measurement.get(e.option),
                "measured_step_s": m.get("step_s"),
                "peak_bytes": m.get("peak_bytes"),
                "estimated_bytes": e.device_total + e.host_total_per_rank,
                "fits": e.fits,
                "tokens_per_s": e.step["tokens_per_s"],
                "terms": e.step["terms"],
            }
        )
    return rows


def _with_totals(e: Estimate) -> dict:
    return asdict(e) | {
        "device_total": e.device_total,
        "host_total_per_rank": e.host_total_per_rank,
    }


def _result(t: Tuning, text: str, warnings: list[str], fleet) -> dict:
    """What `run` returns (and --output_json writes)."""
    scaling = {
        str(n): [
            dict(
                e.step,
                fits=e.fits,
                micro_batch=e.point["micro_batch"],
                recompute=e.point.get("recompute", False),
            )
            for e in ests
        ]
        for n, ests in t.scaling.items()
    }
    return {
        "inventory": t.inv.summary(),
        "options": _rows(t),
        "estimates": [_with_totals(e) for e in t.estimates],
        "as_given": [_with_totals(e) for e in t.as_given],
        "scaling": scaling,
        "measured": t.found.measured,
        "machine": {k: v for k, v in asdict(t.machine).items() if k != "sources"},
        "machine_sources": dict(t.machine.sources),
        "calibration": t.found.meta,
        "from_run": t.from_run,
        "warnings": warnings,
        "recommended": (recommend(t.estimates) or Estimate("none")).option,
        "fleet": asdict(fleet) if fleet is not None else None,
        "text": text,
    }


def _write_recipe(cfg: TunerConfig, t: Tuning) -> str:
    """`--write_recipe`: the recommended point as a train recipe; the report's line of it."""
    best = recommend(t.estimates)
    if best is None:
        return f"--write_recipe {cfg.write_recipe}: nothing fits, no recipe written"
    nodes = t.node_counts[0]
    gpus = nodes * t.machine.gpus_per_node
    return write_recipe(cfg.write_recipe, best, t.run_cfg, gpus, nodes, cfg.device or "cuda")
