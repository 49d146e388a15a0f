"""`--write_recipe PATH`: the recommended point as a `dspark-ds train` recipe.

The recipe is the tuned one (with the tuner's --overrides and --target.path) at the point's
micro-batch and global batch (and perf.activation_checkpointing true where the point recomputes
the draft layers), every field of the train config written out, and its DeepSpeed
section the whole config training would build for that option on that cluster: the shipped
JSON (`deepspeed.config`, the option's) with the recipe's and the option's overrides merged,
every "auto" filled (batch sizes, accumulation, clipping, precision, the optimizer) and the ZeRO
values the tuner read from DeepSpeed's defaults made explicit, as `deepspeed.overrides`. Merged
over the same shipped JSON, those overrides are the config itself, so `dspark-ds train --config
PATH` builds exactly it; a run on another world size is refused by name (the batch keys are
explicit), as it should be: the point was chosen for this one.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

from dspark_ds.config import dump_config
from dspark_ds.engine.config import zero_settings
from dspark_ds.tune.config import OPTIONS
from dspark_ds.tune.estimate import resolved_ds_config
from dspark_ds.tune.search import point_config


def explicit_zero(ds_config: dict) -> dict:
    """`ds_config` with the ZeRO settings the tuner reads (engine.config.zero_settings: DeepSpeed's
    values, its defaults where the JSON is silent) written into its zero_optimization."""
    z = zero_settings(ds_config)
    out = copy.deepcopy(ds_config)
    section = out.setdefault("zero_optimization", {})
    values = {
        "stage": z.stage,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_bucket_size": z.reduce_bucket_size,
    }
    if z.stage in (1, 2):
        values["allgather_bucket_size"] = z.allgather_bucket_size
    if z.stage == 3:
        values |= {
            "stage3_prefetch_bucket_size": z.prefetch_bucket_size,
            "stage3_param_persistence_threshold": z.param_persistence_threshold,
            "stage3_model_persistence_threshold": z.model_persistence_threshold,
        }
    for key, value in values.items():
        # NOTE: DeepSpeed takes a ZeRO-3 key under its field name or its stage3_ alias: one of
        # them, the one the config already uses
        alias = key.removeprefix("stage3_")
        if key not in section and alias not in section:
            section[key] = value
    return out


def recipe_config(best, run_cfg, world: int, device: str, nodes: int = 1):
    """The train config of the point `best` (an `Estimate` with its `point`) on `world` ranks
    over `nodes` nodes."""
    option = next(o for o in OPTIONS if o.name == best.option)
    point = best.point
    cfg = point_config(
        run_cfg, point["micro_batch"], point["global_batch"], point.get("recompute", False)
    )
    ds_config = resolved_ds_config(option, cfg, world, device == "cuda", world // nodes)
    ds_config = explicit_zero(ds_config)
    cfg.deepspeed = replace(cfg.deepspeed, config=option.config, overrides=ds_config)
    return cfg


def write_recipe(path: str, best, run_cfg, world: int, nodes: int, device: str) -> str:
    """Writes the recipe of `best` to `path`; returns the line the report prints."""
    cfg = recipe_config(best, run_cfg, world, device, nodes)
    per_node = world // nodes
    launch = f"torchrun --nproc_per_node {per_node} -m dspark_ds.cli train --config {path}"
    if nodes > 1:
        launch = f"(on each of {nodes} nodes) " + launch.replace(
            "torchrun ", f"torchrun --nnodes {nodes} "
        )
    rc = " recomputing the draft layers" if best.point.get("recompute") else ""
    head = (
        f"# Written by dspark-ds tune: {best.option} at micro-batch {best.point['micro_batch']}{rc} x "
        f"{best.step['accum']} accumulation = {best.point['global_batch']} sequences per step "
        f"on {nodes} node(s) x {per_node} rank(s) ({device}); predicted "
        f"{best.step['predicted_step_s']:.4g} s per step.\n"
        "# deepspeed.overrides is the whole DeepSpeed config training builds for it.\n"
        f"# Run: {launch}\n"
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(head + dump_config(cfg))
    return (
        f"wrote {path}: {best.option} at micro-batch {best.point['micro_batch']}{rc}; run: {launch}"
    )
