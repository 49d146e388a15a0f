"""What is measured on this machine, by every rank of the launcher: the machine's figures
calibrated here (calibrate.py's samples; `--cluster.save_profile` keeps them) and `--measure`'s
real steps of each option (measure.py), interleaved: each option's timed steps run between
calibration samples in its engine mode, so that both see the same conditions."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.cost.inventory import Inventory
from dspark_ds.tune.calibrate import Calibration, engine_values, host_memory_bytes
from dspark_ds.tune.cluster import Machine, engine_mode, resolve, save_profile, with_values
from dspark_ds.tune.config import OPTIONS, TunerConfig, ZeroOption
from dspark_ds.tune.dataio import measure_read, reads_cache
from dspark_ds.tune.estimate import Estimate, option_zero, resolved_ds_config
from dspark_ds.tune.prediction import PredictionInputs, loss_stages, predict_one
from dspark_ds.tune.search import point_args, point_config, search

LAUNCHER = "the launcher's ranks"
"""The source of the figures `--measure` takes from the launcher: one node of its ranks."""


def here(cfg: TunerConfig, run_cfg) -> tuple[TunerConfig, torch.device]:
    """The process group of the launcher (every rank runs the tuner), this machine's device,
    and the config's device set to it."""
    distributed.init(run_cfg.deepspeed.backend, settings=run_cfg.distributed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = replace(cfg, device=cfg.device or ("cuda" if cuda else "cpu"))
    return cfg, device


@dataclass
class Calibrated:
    """What `calibrate_and_measure` found."""

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


def measure_points(cfg: TunerConfig, run_cfg, inv: Inventory, options) -> dict[str, dict]:
    """The point `--measure` runs each option at: the search on this machine (one node of the
    launcher's ranks, its own memory when calibrating) before anything is timed, so with the
    preset's or profile's rates and no host work: in practice the largest micro-batch that
    fits."""
    machine = resolve(cfg.cluster)
    ranks = {"gpus_per_node": distributed.world_size()}
    calibrating = cfg.cluster.calibrate
    if calibrating is None:
        calibrating = not cfg.cluster.profile
    if calibrating:  # the figures the calibration will give the machine (machine_values)
        cuda = (cfg.device or "cuda") == "cuda" and torch.cuda.is_available()
        ranks["host_memory_bytes"] = host_memory_bytes()
        ranks["gpu_memory_bytes"] = (
            float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
            if cuda
            else ranks["host_memory_bytes"]
        )
    flags = cfg.cluster.flag_values()
    machine = with_values(machine, {k: v for k, v in ranks.items() if k not in flags}, LAUNCHER)
    given = PredictionInputs(cfg, run_cfg, inv, machine, None)
    return {e.option: e.point for e in search(given, options, 1)}


def at_points(given: PredictionInputs, options, points: dict) -> list[Estimate]:
    """Each option predicted at its given point on one node (what `--measure` ran)."""
    out = []
    for option in options:
        point = points[option.name]
        at = point_config(given.run_cfg, **point_args(point))
        est = predict_one(replace(given, run_cfg=at), option, 1)
        est.point = dict(point, accum=est.step["accum"])
        out.append(est)
    return out


def calibrate_and_measure(
    cfg: TunerConfig, run_cfg, options, device, points: dict[str, dict] | None = None
) -> Calibrated:
    """The cluster's figures (calibrated here, and saved; or the preset / profile), the
    recipe's host work when calibrated, and the measurements of `--measure` (each option at its
    point of `points`), each option's timed steps interleaved with calibration samples in its
    engine mode."""
    calibrating = cfg.cluster.calibrate
    if calibrating is None:  # --measure predicts for this machine: its own figures
        calibrating = cfg.measure and not cfg.cluster.profile
    where = cfg.device or "cuda"
    nvme = _nvme_option(run_cfg, where)

    def mode_of(option: ZeroOption) -> int:
        zero, _ = option_zero(option, run_cfg, 1, where)
        return engine_mode(zero.stage, zero.offload_optimizer, zero.offload_param)

    cal = None
    if calibrating:
        cal = Calibration(run_cfg, device, loss_stages(run_cfg, options, where))
    out = Calibrated(machine=resolve(cfg.cluster))
    spans: dict[str, tuple[int, int]] = {}
    if cfg.measure:
        out.measured, spans = _measure(cfg, run_cfg, options, points, cal, mode_of, nvme)
    elif cal is not None:
        zero3 = nvme.get("zero_optimization", {})
        path = (zero3.get("offload_optimizer") or {}).get("nvme_path")
        cal.once(path if path and Path(path).is_dir() else None, nvme.get("aio"))
        cal.run(sorted({mode_of(o) for o in options}), cfg.cluster.samples)
    if cal is not None:
        _calibrated(cfg, run_cfg, cal, spans, out)
    if cfg.measure:  # the machine measured is this one: one node of the launcher's ranks
        ranks = {"gpus_per_node": distributed.world_size()}
        out.machine = with_values(out.machine, ranks, LAUNCHER)
        out.own = {k: (with_values(m, ranks, LAUNCHER), w) for k, (m, w) in out.own.items()}
    return out


def _nvme_option(run_cfg, device: str):
    """The DeepSpeed config of the zero3+nvme option (its nvme_path and aio settings)."""
    option = next(o for o in OPTIONS if o.name == "zero3+nvme")
    return resolved_ds_config(option, run_cfg, 1, use_gpu=device == "cuda")


def _measure(
    cfg: TunerConfig, run_cfg, options, points, cal: Calibration | None, mode_of, nvme: dict
) -> tuple[dict[str, dict], dict[str, tuple[int, int]]]:
    """`--measure`: each option's real steps at its point, with calibration samples in its
    engine mode between them; (the measurements, each option's span of `cal.samples`)."""
    # NOTE: measure.py imports the trainer (a second of imports): only --measure needs it
    # lazy: the trainer and aiohttp, 0.13 s of `tune --help` (docs/testing.md)
    from dspark_ds.tune.measure import measure

    measured, spans = {}, {}
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
            at = point_config(run_cfg, **point_args(points[option.name]))
            measured[option.name] = measure(
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
    return measured, spans


def _calibrated(
    cfg: TunerConfig, run_cfg, cal: Calibration, spans: dict[str, tuple[int, int]], out: Calibrated
) -> None:
    """`out` given the calibration's figures (and the cache directory's read rate), saved with
    --cluster.save_profile; each option measured between samples its own figures from them."""
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
