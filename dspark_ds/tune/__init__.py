"""ZeRO stage / offload tuner (`dspark-ds tune`): per-GPU memory of a recipe on a cluster shape,
for every ZeRO stage × offload option, which fit, which should be fastest; `--measure` runs a few
real steps of each option here and prints measured peak memory and step time beside the estimate.

    dspark-ds tune --recipe dspark_ds/recipes/dspark_qwen3_8b.yaml \
        --nodes 1 --gpus_per_node 8 --gpu_memory_gb 80 --cpu_memory_gb 1024
    dspark-ds tune --recipe dspark_ds/recipes/tiny_cpu.yaml \
        --target.path runs/tiny_target --measure true

config.py (the options), inventory.py (what the run holds, built by the drafter's kind),
estimate.py (per-option memory, from the DeepSpeed config training would use), measure.py (real
steps), report.py (the table).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dspark_ds.tune.config import OPTION_NAMES, OPTIONS, TunerConfig, ZeroOption
from dspark_ds.tune.estimate import Estimate, estimate, recommend
from dspark_ds.tune.inventory import KNOWN_TARGETS, Inventory, inventory, load_recipe
from dspark_ds.tune.report import report

__all__ = ["KNOWN_TARGETS", "OPTIONS", "OPTION_NAMES", "Estimate", "Inventory", "TunerConfig",
           "ZeroOption", "estimate", "inventory", "recommend", "run"]  # fmt: skip


def _measure_here(cfg: TunerConfig, run_cfg, options: list[ZeroOption]):
    """Real steps of each option on this machine's ranks; the config re-aimed at this machine
    (1 node × the launcher's world size) and the measurements."""
    from dspark_ds import distributed
    from dspark_ds.tune.measure import measure

    rank, world, _ = distributed.init(run_cfg.deepspeed.backend, settings=run_cfg.distributed)
    cfg = replace(
        cfg,
        nodes=1,
        gpus_per_node=world,
        device=cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"),
    )
    measured = {}
    # NOTE: the short runs write under the recipe's output_dir, which every host of a job sees
    # (a temp directory of each rank's own would be another directory on every rank)
    tmp = None
    if rank == 0:
        Path(run_cfg.output_dir).mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".dspark_tuner_", dir=run_cfg.output_dir)
    tmp = distributed.broadcast_object(tmp)
    try:
        for option in options:
            measured[option.name] = measure(option, run_cfg, cfg.measure_steps, tmp)
    finally:
        distributed.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return cfg, measured


def run(cfg: TunerConfig) -> dict:
    """Estimate (and measure); prints the table on rank 0 and returns it as a dict."""
    from dspark_ds.distributed import is_rank0

    cfg.validate()
    run_cfg = load_recipe(cfg)
    options = [o for o in OPTIONS if o.name in cfg.options]
    measured: dict[str, dict] = {}
    if cfg.measure:
        cfg, measured = _measure_here(cfg, run_cfg, options)
    inv = inventory(run_cfg)
    estimates = [estimate(o, inv, run_cfg, cfg) for o in options]
    text = report(estimates, cfg, inv, run_cfg, measured)
    result = {
        "inventory": inv.summary(),
        "estimates": [
            asdict(e)
            | {"device_total": e.device_total, "host_total_per_rank": e.host_total_per_rank}
            for e in estimates
        ],
        "measured": measured,
        "recommended": (recommend(estimates) or Estimate("none")).option,
        "text": text,
    }
    if is_rank0():
        print(text, flush=True)
        if cfg.output_json:
            Path(cfg.output_json).write_text(json.dumps(result, indent=1, default=float))
    return result
