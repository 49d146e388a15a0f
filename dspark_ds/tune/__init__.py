"""ZeRO stage / offload tuner (`dspark-ds tune`): per-GPU memory and predicted step time of a
recipe on a cluster, for every ZeRO stage × offload option; which fit, which is fastest;
`--measure` runs real steps of each option here and prints measured peak memory and step time
beside the estimate and the prediction.

    dspark-ds tune --recipe dspark_ds/recipes/dspark_qwen3_8b.yaml --cluster.nodes 1,2,8,64
    torchrun --nproc_per_node 2 -m dspark_ds.cli tune --recipe dspark_ds/recipes/tiny_cpu.yaml \\
        --target.path runs/tiny_target --measure true

config.py (the options), cluster.py (presets, profiles, `--cluster.*`), calibrate.py (the
rates measured here), inventory.py (what the run holds, built by the drafter's kind),
workload.py (a micro-batch's FLOPs and host work), estimate.py (per-option memory, from the
DeepSpeed config training would use), steptime.py (per-option step time), measure.py (real
steps), report.py (the tables).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dspark_ds.tune.cluster import ClusterConfig, Machine, resolve, save_profile, with_values
from dspark_ds.tune.config import OPTION_NAMES, OPTIONS, TunerConfig, ZeroOption
from dspark_ds.tune.estimate import Estimate, estimate, option_zero, recommend
from dspark_ds.tune.inventory import KNOWN_TARGETS, Inventory, inventory, load_recipe
from dspark_ds.tune.report import report
from dspark_ds.tune.steptime import StepTime, step_time
from dspark_ds.tune.workload import host_work, workload

__all__ = ["KNOWN_TARGETS", "OPTIONS", "OPTION_NAMES", "ClusterConfig", "Estimate", "Inventory",
           "Machine", "StepTime", "TunerConfig", "ZeroOption", "estimate", "inventory",
           "recommend", "run"]  # fmt: skip


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


def _calibrate_and_measure(cfg: TunerConfig, run_cfg, options, device):
    """The cluster's figures (calibrated here, and saved; or the preset / profile), the
    recipe's host work when calibrated on a CPU, and the measurements of `--measure`."""
    from dspark_ds import distributed
    from dspark_ds.tune.calibrate import Calibration, Probe
    from dspark_ds.tune.cluster import engine_mode
    from dspark_ds.tune.measure import measure

    calibrating = cfg.cluster.calibrate
    if calibrating is None:  # --measure predicts for this machine: its own figures
        calibrating = cfg.measure and not cfg.cluster.profile
    meta: dict = {}
    work = None
    measured: dict[str, dict] = {}
    cal = None
    if calibrating:
        cal = Calibration(run_cfg, device, _stages(run_cfg, options, cfg.device or "cuda"))
        if cfg.measure:
            cal.once()
        else:
            cal.run()
    probe = None
    if cfg.measure:
        dtype = torch.bfloat16 if run_cfg.train.precision == "bf16" else torch.float32
        probe = cal.probe if cal is not None else Probe(device, dtype)
        # NOTE: the short runs write under the recipe's output_dir, which every host of a job
        # sees (a temp directory of each rank's own would be another directory on every rank)
        tmp = None
        if distributed.is_rank0():
            Path(run_cfg.output_dir).mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".dspark_tuner_", dir=run_cfg.output_dir)
        tmp = distributed.broadcast_object(tmp)
        try:
            for option in options:
                if cal is not None:  # the same load for the prediction and the measurement
                    cal.round()
                    zero, _ = option_zero(option, run_cfg, 1, cfg.device or "cuda")
                    cal.engine(engine_mode(zero.stage, zero.offload_optimizer, zero.offload_param))
                measured[option.name] = measure(
                    option, run_cfg, cfg.measure_steps, tmp, memory=cfg.measure_memory,
                    probe=probe,
                )  # fmt: skip
        finally:
            distributed.barrier()
            if distributed.is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)
    if cal is not None:
        values, meta, work = cal.result()
        source = f"calibrated {meta['date']}"
        machine = resolve(cfg.cluster, measured=values, measured_source=source)
        if cfg.cluster.save_profile and distributed.is_rank0():
            save_profile(machine, cfg.cluster.save_profile, meta, only_from=source)
    else:
        machine = resolve(cfg.cluster)
    if cfg.measure:  # the machine measured is this one: one node of the launcher's ranks
        machine = with_values(
            machine, {"gpus_per_node": distributed.world_size()}, "the launcher's ranks"
        )
    return machine, meta, work, measured


def _host_work(run_cfg, options: list[ZeroOption], device: str, machine: Machine) -> dict:
    """Host work of the loss paths the options take (ZeRO-3 has its own): timed on a CPU
    machine, counted ops on a GPU one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny ops; more threads only contend with the launcher's
    try:
        return host_work(
            run_cfg, _stages(run_cfg, options, device), device,
            timed=not machine.dispatch_overlaps_compute,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def predict(
    cfg: TunerConfig, run_cfg, inv: Inventory, machine: Machine, options: list[ZeroOption],
    nodes: int, ops: dict,
) -> list[Estimate]:  # fmt: skip
    """Memory and step time of each option on `nodes` nodes."""
    device = cfg.device or "cuda"
    out = []
    for option in options:
        est = estimate(option, inv, run_cfg, cfg, machine, nodes)
        world = nodes * machine.gpus_per_node
        zero, b = option_zero(option, run_cfg, world, device)
        wl = workload(inv, run_cfg, device, zero.stage, ops)
        persistent = inv.persistent_numels(
            zero.param_persistence_threshold, zero.model_persistence_threshold // world
        )
        est.step = step_time(
            option.name, zero, b, inv, run_cfg, machine, nodes, wl, persistent
        ).as_dict()
        out.append(est)
    return out


def load_factor(measured: dict, machine: Machine) -> float | None:
    """How much slower the machine ran while an option was measured than when it was
    calibrated (the probe's seconds then over its seconds at calibration); None without both."""
    probe = measured.get("probe_s")
    if not probe or not machine.probe_s:
        return None
    return probe / machine.probe_s


def run(cfg: TunerConfig) -> dict:
    """Estimate, predict (and measure); prints the tables on rank 0 and returns them."""
    from dspark_ds.distributed import is_rank0

    cfg.validate()
    run_cfg = load_recipe(cfg)
    options = [o for o in OPTIONS if o.name in cfg.options]
    device = None
    if cfg.measure or cfg.cluster.calibrate:  # the launcher's ranks and device
        cfg, device = _here(cfg, run_cfg)
    machine, calibration, work, measured = _calibrate_and_measure(cfg, run_cfg, options, device)
    node_counts = [1] if cfg.measure else cfg.cluster.node_counts
    inv = inventory(run_cfg)
    if work is None:
        work = _host_work(run_cfg, options, cfg.device or "cuda", machine)
    scaling = {n: predict(cfg, run_cfg, inv, machine, options, n, work) for n in node_counts}
    estimates = scaling[node_counts[0]]
    text = report(estimates, cfg, inv, run_cfg, machine, measured, scaling, calibration)
    rows = []
    for e in estimates:
        m = measured.get(e.option, {})
        load = load_factor(m, machine)
        rows.append(
            {
                "option": e.option,
                "predicted_step_s": e.step["predicted_step_s"],
                "load_factor": load,
                "predicted_under_load_s": None
                if load is None
                else load * e.step["predicted_step_s"],
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
        "scaling": {
            str(n): [dict(e.step, fits=e.fits) for e in ests] for n, ests in scaling.items()
        },
        "measured": measured,
        "machine": {k: v for k, v in asdict(machine).items() if k != "sources"},
        "machine_sources": dict(machine.sources),
        "calibration": calibration,
        "recommended": (recommend(estimates) or Estimate("none")).option,
        "text": text,
    }
    if is_rank0():
        print(text, flush=True)
        if cfg.output_json:
            Path(cfg.output_json).write_text(json.dumps(result, indent=1, default=float))
    return result
