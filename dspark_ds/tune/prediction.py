"""Each option predicted: its memory (estimate.py) and its step time (steptime.py) on a number of
nodes, from the recipe's inventory and host work and the machine's figures; what the search,
`--measure` and `--cluster.from_run` predict with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark_ds.cost.flops import target_in_job
from dspark_ds.cost.inventory import Inventory
from dspark_ds.tune.cluster import Machine
from dspark_ds.tune.config import TunerConfig, ZeroOption
from dspark_ds.tune.dataio import sequence_bytes
from dspark_ds.tune.estimate import Estimate, estimate, option_zero
from dspark_ds.tune.steptime import Step, accumulation, step_time
from dspark_ds.tune.workload import host_work, workload


def loss_stages(run_cfg, options: list[ZeroOption], device: str) -> tuple[int, ...]:
    """The loss paths the options take: 0 (ZeRO-0/1/2) and / or 3."""
    zero3 = {option_zero(o, run_cfg, 1, device)[0].stage == 3 for o in options}
    return tuple(sorted({3 if z else 0 for z in zero3}))


def options_host_work(run_cfg, options: list[ZeroOption], device: str, machine: Machine) -> dict:
    """Host work of the loss paths the options take (ZeRO-3 has its own): timed on a CPU
    machine, counted ops on a GPU one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny ops; more threads only contend with the launcher's
    try:
        return host_work(
            run_cfg,
            loss_stages(run_cfg, options, device),
            device,
            timed=not machine.dispatch_overlaps_compute,
        )
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class PredictionInputs:
    """What predicting an option reads besides the option and its node count."""

    cfg: TunerConfig
    run_cfg: Any
    """The recipe (at a point: `search.point_config`)."""
    inv: Inventory
    machine: Machine
    ops: dict | None
    """The recipe's host work (`workload.host_work`)."""


def predict(given: PredictionInputs, options: list[ZeroOption], nodes: int) -> list[Estimate]:
    """Memory and step time of each option on `nodes` nodes."""
    return [predict_one(given, o, nodes) for o in options]


def predict_one(given: PredictionInputs, option: ZeroOption, nodes: int) -> Estimate:
    """Memory and step time of one option on `nodes` nodes."""
    est = estimate(option, given.inv, given.run_cfg, given.cfg, given.machine, nodes)
    est.step = step_time(option_step(given, option, nodes)).as_dict()
    return est


def option_step(given: PredictionInputs, option: ZeroOption, nodes: int) -> Step:
    """What the step-time model reads for one option on `nodes` nodes."""
    cfg, run_cfg, inv, machine = given.cfg, given.run_cfg, given.inv, given.machine
    device = cfg.device or "cuda"
    world = nodes * machine.gpus_per_node
    zero, b = option_zero(option, run_cfg, world, device, machine.gpus_per_node)
    wl = workload(inv, run_cfg, device, zero.stage, given.ops)
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
