"""ZeRO stage / offload tuner (`dspark-ds tune`): per-GPU memory and predicted step time of a
recipe on a cluster, for every ZeRO stage × offload option at each micro-batch that keeps the
global batch; each option's fastest point that fits, the fastest of them recommended (and
written as a train recipe with --write_recipe); `--measure` runs real steps of each option's
point here and prints measured peak memory and step time beside the estimate and the
prediction.

    dspark-ds tune --recipe dspark_ds/recipes/dspark_qwen3_8b.yaml --cluster.nodes 1,2,8,64
    torchrun --nproc_per_node 2 -m dspark_ds.cli tune --recipe dspark_ds/recipes/tiny_cpu.yaml \\
        --target.path runs/tiny_target --measure true

config.py (the options), cluster.py (presets, profiles, `--cluster.*`), calibrate.py (the
rates measured here), inventory.py (what the run holds, built by the drafter's kind),
workload.py (a micro-batch's FLOPs and host work), estimate.py (per-option memory, from the
DeepSpeed config training would use), steptime.py (per-option step time), search.py (each
option's micro-batch point), dataio.py (the data term), fleet.py (a served run's serving fleet
and storage bandwidth), measure.py (real steps), report.py (the tables), write.py (the recipe of
--write_recipe).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dspark_ds.tune.cluster import ClusterConfig, Machine, resolve, save_profile, with_values
from dspark_ds.tune.config import OPTION_NAMES, OPTIONS, TunerConfig, ZeroOption, default_options
from dspark_ds.tune.dataio import data_lines, measure_read, reads_cache, sequence_bytes
from dspark_ds.tune.estimate import (
    Estimate,
    ds_config_warnings,
    estimate,
    option_zero,
    recommend,
)
from dspark_ds.tune.fleet import as_served, fleet_lines, size_fleet
from dspark_ds.tune.inventory import KNOWN_TARGETS, Inventory, inventory, load_recipe
from dspark_ds.tune.report import report
from dspark_ds.tune.search import point_config, search
from dspark_ds.tune.steptime import Step, StepTime, accumulation, step_time
from dspark_ds.tune.workload import host_work, target_in_job, target_served, workload

__all__ = [
    "KNOWN_TARGETS",
    "OPTIONS",
    "OPTION_NAMES",
    "ClusterConfig",
    "Estimate",
    "Inventory",
    "Machine",
    "StepTime",
    "TunerConfig",
    "ZeroOption",
    "estimate",
    "inventory",
    "recommend",
    "run",
]


def _here(cfg: TunerConfig, run_cfg) -> tuple[TunerConfig, torch.device]:
    """The process group of the launcher (every rank runs the tuner), this machine's device,
    and the config's device set to it."""
    from dspark_ds import distributed

    distributed.init(run_cfg.deepspeed.backend, settings=run_cfg.distributed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = replace(cfg, device=cfg.device or ("cuda" if cuda else "cpu"))
    return cfg, device


def _stages(run_cfg, options: list[ZeroOption], device: str) -> tuple[int, ...]:
    """The loss paths the options take: 0 (ZeRO-0/1/2) and / or 3."""
    zero3 = {option_zero(o, run_cfg, 1, device)[0].stage == 3 for o in options}
    return tuple(sorted({3 if z else 0 for z in zero3}))


@dataclass
class Calibrated:
    """What `_calibrate_and_measure` found."""

    machine: Machine
    """The figures predictions use (every calibration sample's median, or preset / profile)."""
    meta: dict = field(default_factory=dict)
    """The calibration's what / where / when ({} without one)."""
    work: dict | None = None
    """The recipe's host work, when calibrated (else computed for the prediction)."""
    measured: dict[str, dict] = field(default_factory=dict)
    """`--measure`'s measurements per option."""
    own: dict[str, tuple[Machine, dict]] = field(default_factory=dict)
    """Per option measured with calibration samples between its steps: the figures and host
    work of those samples alone."""


def _nvme_option(run_cfg, device: str):
    """The DeepSpeed config of the zero3+nvme option (its nvme_path and aio settings)."""
    from dspark_ds.tune.estimate import resolved_ds_config

    option = next(o for o in OPTIONS if o.name == "zero3+nvme")
    return resolved_ds_config(option, run_cfg, 1, use_gpu=device == "cuda")


def _calibrate_and_measure(
    cfg: TunerConfig, run_cfg, options, device, points: dict[str, dict] | None = None
) -> Calibrated:
    """The cluster's figures (calibrated here, and saved; or the preset / profile), the
    recipe's host work when calibrated, and the measurements of `--measure` (each option at its
    point of `points`), each option's timed steps interleaved with calibration samples in its
    engine mode."""
    from dspark_ds import distributed
    from dspark_ds.tune.calibrate import Calibration, engine_values
    from dspark_ds.tune.cluster import engine_mode
    from dspark_ds.tune.measure import measure

    calibrating = cfg.cluster.calibrate
    if calibrating is None:  # --measure predicts for this machine: its own figures
        calibrating = cfg.measure and not cfg.cluster.profile
    here = cfg.device or "cuda"
    nvme = _nvme_option(run_cfg, here)

    def mode_of(option: ZeroOption) -> int:
        zero, _ = option_zero(option, run_cfg, 1, here)
        return engine_mode(zero.stage, zero.offload_optimizer, zero.offload_param)

    cal = Calibration(run_cfg, device, _stages(run_cfg, options, here)) if calibrating else None
    out = Calibrated(machine=resolve(cfg.cluster))
    spans: dict[str, tuple[int, int]] = {}
    if cfg.measure:
        # NOTE: the short runs write under the recipe's output_dir, which every host of a job
        # sees (a temp directory of each rank's own would be another directory on every rank)
        tmp = None
        if distributed.is_rank0():
            Path(run_cfg.output_dir).mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".dspark_tuner_", dir=run_cfg.output_dir)
        tmp = distributed.broadcast_object(tmp)
        try:
            if cal is not None:  # NVMe where the zero3+nvme run will swap (measure.py)
                cal.once(Path(tmp) / "nvme", nvme.get("aio"))
            for option in options:
                window = cal.window(mode_of(option)) if cal is not None else None
                first = len(cal.samples) if cal is not None else 0
                at = point_config(run_cfg, **_batch(points[option.name]))
                out.measured[option.name] = measure(
                    option,
                    at,
                    cfg.measure_steps,
                    tmp,
                    memory=cfg.measure_memory,
                    between=(lambda w=window: cal.sample(w)) if window else None,
                    blocks=cfg.cluster.samples,
                )
                if window is not None:
                    window.close()
                    spans[option.name] = (first, len(cal.samples))
        finally:
            distributed.barrier()
            if distributed.is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)
    elif cal is not None:
        zero3 = nvme.get("zero_optimization", {})
        path = (zero3.get("offload_optimizer") or {}).get("nvme_path")
        cal.once(path if path and Path(path).is_dir() else None, nvme.get("aio"))
        cal.run(sorted({mode_of(o) for o in options}), cfg.cluster.samples)
    if cal is not None:
        values, out.work = cal.values()
        out.meta = cal.meta()
        source = f"calibrated {out.meta['date']}"
        values.update(cal.machine_values())
        if reads_cache(run_cfg) and run_cfg.data.cache_dir:  # on the cache's own directory
            read = measure_read(run_cfg.data.cache_dir)
            if read is not None:
                values["cache_read_bytes_per_s"] = read[0] / read[1]
                out.meta["cache_read"] = {
                    "dir": run_cfg.data.cache_dir,
                    "bytes": read[0],
                    "seconds": read[1],
                }
        out.machine = resolve(cfg.cluster, measured=values, measured_source=source)
        if cfg.cluster.save_profile and distributed.is_rank0():
            save_profile(out.machine, cfg.cluster.save_profile, out.meta, only_from=source)
        for name, (first, last) in spans.items():
            own, work = cal.values(cal.samples[first:last])
            own = engine_values(own, cal.samples[first]["mode"], asdict(out.machine))
            out.own[name] = (with_values(out.machine, own, source), work)
    if cfg.measure:  # the machine measured is this one: one node of the launcher's ranks
        ranks = {"gpus_per_node": distributed.world_size()}
        out.machine = with_values(out.machine, ranks, "the launcher's ranks")
        out.own = {
            k: (with_values(m, ranks, "the launcher's ranks"), w) for k, (m, w) in out.own.items()
        }
    return out


def _host_work(run_cfg, options: list[ZeroOption], device: str, machine: Machine) -> dict:
    """Host work of the loss paths the options take (ZeRO-3 has its own): timed on a CPU
    machine, counted ops on a GPU one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny ops; more threads only contend with the launcher's
    try:
        return host_work(
            run_cfg,
            _stages(run_cfg, options, device),
            device,
            timed=not machine.dispatch_overlaps_compute,
        )
    finally:
        torch.set_num_threads(threads)


def _batch(point: dict) -> dict:
    """`point_config`'s arguments of a searched point."""
    return {
        "micro_batch": point["micro_batch"],
        "global_batch": point["global_batch"],
        "recompute": point.get("recompute", False),
    }


def _measure_points(cfg: TunerConfig, run_cfg, inv: Inventory, options) -> dict[str, dict]:
    """The point `--measure` runs each option at: the search on this machine (one node of the
    launcher's ranks, its own memory when calibrating) before anything is timed, so with the
    preset's or profile's rates and no host work: in practice the largest micro-batch that
    fits."""
    from dspark_ds import distributed
    from dspark_ds.tune.calibrate import host_memory_bytes

    machine = resolve(cfg.cluster)
    here = {"gpus_per_node": distributed.world_size()}
    calibrating = cfg.cluster.calibrate
    if calibrating is None:
        calibrating = not cfg.cluster.profile
    if calibrating:  # the figures the calibration will give the machine (machine_values)
        cuda = (cfg.device or "cuda") == "cuda" and torch.cuda.is_available()
        here["host_memory_bytes"] = host_memory_bytes()
        here["gpu_memory_bytes"] = (
            float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
            if cuda
            else here["host_memory_bytes"]
        )
    flags = cfg.cluster.flag_values()
    machine = with_values(
        machine, {k: v for k, v in here.items() if k not in flags}, "the launcher's ranks"
    )
    return {e.option: e.point for e in search(cfg, run_cfg, inv, machine, options, 1, None)}


def at_points(
    cfg: TunerConfig, run_cfg, inv: Inventory, machine: Machine, options, points: dict, ops: dict
) -> list[Estimate]:
    """Each option predicted at its given point on one node (what `--measure` ran)."""
    out = []
    for option in options:
        point = points[option.name]
        est = predict_one(cfg, point_config(run_cfg, **_batch(point)), inv, machine, option, 1, ops)
        est.point = dict(point, accum=est.step["accum"])
        out.append(est)
    return out


def predict(
    cfg: TunerConfig,
    run_cfg,
    inv: Inventory,
    machine: Machine,
    options: list[ZeroOption],
    nodes: int,
    ops: dict,
) -> list[Estimate]:
    """Memory and step time of each option on `nodes` nodes."""
    return [predict_one(cfg, run_cfg, inv, machine, o, nodes, ops) for o in options]


def predict_one(
    cfg: TunerConfig,
    run_cfg,
    inv: Inventory,
    machine: Machine,
    option: ZeroOption,
    nodes: int,
    ops: dict,
) -> Estimate:
    """Memory and step time of one option on `nodes` nodes."""
    est = estimate(option, inv, run_cfg, cfg, machine, nodes)
    est.step = step_time(option_step(cfg, run_cfg, inv, machine, option, nodes, ops)).as_dict()
    return est


def option_step(
    cfg: TunerConfig,
    run_cfg,
    inv: Inventory,
    machine: Machine,
    option: ZeroOption,
    nodes: int,
    ops: dict,
) -> Step:
    """What the step-time model reads for one option on `nodes` nodes."""
    device = cfg.device or "cuda"
    world = nodes * machine.gpus_per_node
    zero, b = option_zero(option, run_cfg, world, device, machine.gpus_per_node)
    wl = workload(inv, run_cfg, device, zero.stage, ops)
    persistent = inv.persistent_numels(
        zero.param_persistence_threshold, zero.model_persistence_threshold // world
    )
    accum, sequences, note = accumulation(run_cfg, world)
    return Step(
        option=option.name,
        zero=zero,
        dtype_bytes=b,
        inv=inv,
        machine=machine,
        nodes=nodes,
        workload=wl,
        persistent_numels=tuple(persistent),
        accum=accum,
        sequences=sequences,
        tokens_per_sequence=run_cfg.data.max_length,
        in_job=target_in_job(run_cfg),
        note=note,
        read_bytes_per_micro=run_cfg.data.batch_size * sequence_bytes(run_cfg, inv),
        loader_workers=run_cfg.data.num_workers,
        recompute=run_cfg.perf.activation_checkpointing,
    )


def _from_run(cfg: TunerConfig, machine: Machine) -> tuple[Machine, dict]:
    """`--cluster.from_run`: the machine with the sustained fraction (and peak) for which the
    model predicts the run's measured step (tune/fromrun.py), and the record of it."""
    from dspark_ds.train.lineage import zero_option
    from dspark_ds.tune import fromrun

    log = fromrun.read_run(cfg.cluster.from_run)
    point = fromrun.run_point(log)
    source = f"run {log.run_dir}"
    peak = cfg.cluster.flag_values().get("peak_flops") or log.peak_flops or machine.peak_flops
    nodes, per_node = 1, log.world  # the run's ranks: one node unless they fill several
    if log.world > machine.gpus_per_node and log.world % machine.gpus_per_node == 0:
        nodes, per_node = log.world // machine.gpus_per_node, machine.gpus_per_node
    here = with_values(machine, {"gpus_per_node": per_node, "peak_flops": peak}, source)
    option = ZeroOption(zero_option(log.ds_config), point.deepspeed.config)
    work = _host_work(point, [option], cfg.device or "cuda", here)
    step = option_step(cfg, point, inventory(point), here, option, nodes, work)

    def predict(fraction: float) -> fromrun.Prediction:
        rates = {"sustained_fraction": fraction, "target_sustained_fraction": fraction}
        at = step_time(replace(step, machine=with_values(here, rates, source)))
        return fromrun.Prediction(at.seconds, at.terms["compute"], step.accum * step.workload.flops)

    fraction = fromrun.fraction_for(log, predict)
    record = fromrun.summary(log, point, option.name, step.accum, peak, fraction, predict(fraction))
    values = {
        "peak_flops": peak,
        "sustained_fraction": fraction,
        "target_sustained_fraction": fraction,
    }
    return with_values(machine, values, source), record


def tracking_on(cfg: TunerConfig) -> bool:
    import os

    t = cfg.tracking
    return t.enabled or t.uri is not None or bool(os.environ.get("MLFLOW_TRACKING_URI"))


def run(cfg: TunerConfig) -> dict:
    """Estimate, predict (and measure); prints the tables on rank 0 and returns them."""
    from dspark_ds.distributed import is_rank0

    cfg.validate()
    run_cfg = load_recipe(cfg)
    if cfg.served and not target_served(run_cfg):
        run_cfg = as_served(run_cfg)
    node_counts = [1] if cfg.measure else cfg.cluster.node_counts
    names = cfg.options if cfg.options is not None else default_options(node_counts[0])
    options = [o for o in OPTIONS if o.name in names]
    device = None
    if cfg.measure or cfg.cluster.calibrate:  # the launcher's ranks and device
        cfg, device = _here(cfg, run_cfg)
    inv = inventory(run_cfg)
    points = _measure_points(cfg, run_cfg, inv, options) if cfg.measure else None
    found = _calibrate_and_measure(cfg, run_cfg, options, device, points)
    machine, work, measured = found.machine, found.work, found.measured
    if work is None:
        work = _host_work(run_cfg, options, cfg.device or "cuda", machine)
    from_run = None
    if cfg.cluster.from_run:
        machine, from_run = _from_run(cfg, machine)
        if cfg.cluster.save_profile and is_rank0():  # what was measured here or in the run
            meta = dict(found.meta, from_run=from_run)
            save_profile(
                machine, cfg.cluster.save_profile, meta, only_from=("calibrated", "profile", "run ")
            )
    if points is not None:  # the points measured
        scaling = {1: at_points(cfg, run_cfg, inv, machine, options, points, work)}
    else:
        scaling = {n: search(cfg, run_cfg, inv, machine, options, n, work) for n in node_counts}
    estimates = scaling[node_counts[0]]
    as_given = predict(cfg, run_cfg, inv, machine, options, node_counts[0], work)
    # each option measured between calibration samples: its prediction from those samples
    at_measurement = {}
    for option in options:
        if option.name in found.own:
            own_machine, own_work = found.own[option.name]
            at = point_config(run_cfg, **_batch(points[option.name]))
            est = predict_one(cfg, at, inv, own_machine, option, 1, own_work)
            at_measurement[option.name] = est.step["predicted_step_s"]
    warnings = ds_config_warnings(run_cfg)
    data = data_lines(recommend(estimates), run_cfg, inv, machine)
    data_warnings = [ln.removeprefix("warning: ") for ln in data if ln.startswith("warning: ")]
    findings = (measured, scaling, found.meta, at_measurement)
    text = report(estimates, cfg, inv, run_cfg, machine, *findings, warnings, as_given, data)
    if from_run is not None:
        from dspark_ds.tune.fromrun import lines

        text += "\n\n" + "\n".join(lines(from_run))
    fleet = None
    if target_served(run_cfg):
        best = recommend(estimates)
        fleet = size_fleet(best, run_cfg, inv, machine, cfg.prefill_mfu) if best else None
        text += "\n" + "\n".join(fleet_lines(fleet, run_cfg, machine))
    rows = []
    for e in estimates:
        m = measured.get(e.option, {})
        rows.append(
            {
                "option": e.option,
                "micro_batch": e.point["micro_batch"],
                "recompute": e.point.get("recompute", False),
                "accum": e.step["accum"],
                "global_batch": e.point["global_batch"],
                "predicted_step_s": e.step["predicted_step_s"],
                "predicted_at_measurement_s": at_measurement.get(e.option),
                "measured_step_s": m.get("step_s"),
                "peak_bytes": m.get("peak_bytes"),
                "estimated_bytes": e.device_total + e.host_total_per_rank,
                "fits": e.fits,
                "tokens_per_s": e.step["tokens_per_s"],
                "terms": e.step["terms"],
            }
        )
    result = {
        "inventory": inv.summary(),
        "options": rows,
        "estimates": [
            asdict(e)
            | {"device_total": e.device_total, "host_total_per_rank": e.host_total_per_rank}
            for e in estimates
        ],
        "as_given": [
            asdict(e)
            | {"device_total": e.device_total, "host_total_per_rank": e.host_total_per_rank}
            for e in as_given
        ],
        "scaling": {
            str(n): [
                dict(
                    e.step,
                    fits=e.fits,
                    micro_batch=e.point["micro_batch"],
                    recompute=e.point.get("recompute", False),
                )
                for e in ests
            ]
            for n, ests in scaling.items()
        },
        "measured": measured,
        "machine": {k: v for k, v in asdict(machine).items() if k != "sources"},
        "machine_sources": dict(machine.sources),
        "calibration": found.meta,
        "from_run": from_run,
        "warnings": warnings + data_warnings,
        "recommended": (recommend(estimates) or Estimate("none")).option,
        "fleet": asdict(fleet) if fleet is not None else None,
        "text": text,
    }
    best = recommend(estimates)
    if cfg.write_recipe and is_rank0():
        if best is None:
            line = f"--write_recipe {cfg.write_recipe}: nothing fits, no recipe written"
        else:
            from dspark_ds.tune.write import write_recipe

            gpus = node_counts[0] * machine.gpus_per_node
            line = write_recipe(
                cfg.write_recipe, best, run_cfg, gpus, node_counts[0], cfg.device or "cuda"
            )
        text += "\n" + line
        result["text"] = text
    if is_rank0():
        print(text, flush=True)
        if tracking_on(cfg):
            from dspark_ds.tune.sweep_runs import log_sweep

            recommended = result["recommended"]
            result["mlflow_run_id"] = log_sweep(
                cfg, run_cfg, estimates, scaling, measured, at_measurement, recommended, text
            )
        if cfg.output_json:
            Path(cfg.output_json).write_text(json.dumps(result, indent=1, default=float))
    return result
