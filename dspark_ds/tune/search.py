"""The search over micro-batches and recomputation: for each ZeRO option, every micro-batch that
keeps the recipe's global batch (gradient accumulation adjusted: micro-batch × accumulation ×
ranks = the global batch), predicted; where one does not fit as it is, the same micro-batch
recomputing the draft layers in backward (perf.activation_checkpointing: less activation
memory, one more forward of the layers); the option's point is the fastest predicted one that
fits (memory grows with the micro-batch, so that is, in practice, the largest that fits, with
recomputation where only it lets that one fit). A cluster that
cannot split the global batch over its ranks holds the nearest one it can (`BatchPlan.note`
says so), the same for every point, so that their step times compare.

`point_config` is the recipe at a point: what the estimate, `--measure` and `--write_recipe`
take.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from dspark_ds.errors import ConfigError
from dspark_ds.tune.config import ZeroOption
from dspark_ds.tune.prediction import PredictionInputs, predict_one


@dataclass(frozen=True)
class BatchPlan:
    """The sequences per step every point of a cluster holds."""

    global_batch: int
    """Sequences per optimizer step: the recipe's, or the nearest multiple of the ranks."""
    per_rank: int
    """Sequences per rank and step (micro-batch × accumulation)."""
    note: str = ""
    """Why the recipe's global batch is not kept exactly (empty when it is)."""

    @property
    def micro_batches(self) -> list[int]:
        """The micro-batches that divide a rank's sequences exactly, smallest first."""
        return [m for m in range(1, self.per_rank + 1) if self.per_rank % m == 0]


def batch_plan(run_cfg, world: int) -> BatchPlan:
    """The global batch held on `world` ranks (see the module docstring)."""
    wanted = run_cfg.train.global_batch_size
    per_rank = max(1, int(wanted / world + 0.5))
    held = per_rank * world
    note = ""
    if held != wanted:
        note = (
            f"train.global_batch_size {wanted} is not a multiple of data.batch_size × world "
            f"size on {world} ranks: the search holds {held} sequences per step ({per_rank} per "
            "rank) for every point, and --write_recipe writes that"
        )
    return BatchPlan(held, per_rank, note)


def point_config(run_cfg, micro_batch: int, global_batch: int, recompute: bool = False):
    """The recipe at one point: data.batch_size, train.global_batch_size and
    perf.activation_checkpointing replaced."""
    cfg = copy.copy(run_cfg)
    cfg.data = replace(run_cfg.data, batch_size=micro_batch)
    cfg.train = replace(run_cfg.train, global_batch_size=global_batch)
    cfg.perf = replace(run_cfg.perf, activation_checkpointing=recompute)
    return cfg


def point_args(point: dict) -> dict:
    """`point_config`'s arguments of a searched point."""
    return {
        "micro_batch": point["micro_batch"],
        "global_batch": point["global_batch"],
        "recompute": point.get("recompute", False),
    }


def search_option(given: PredictionInputs, option: ZeroOption, nodes: int):
    """The option's point on `nodes` nodes: an `Estimate` (from `prediction.predict_one`) at the
    fastest predicted micro-batch that fits (among equal times, the larger), or at micro-batch
    1 when none fits; a micro-batch that does not fit as it is is tried again recomputing the
    draft layers (unless `cfg.recompute` is false). Its `point` holds the micro-batch, whether
    it recomputes, the accumulation, the global batch held, the note and every point tried."""
    cfg, run_cfg = given.cfg, given.run_cfg
    world = nodes * given.machine.gpus_per_node
    plan = batch_plan(run_cfg, world)
    micro_batches = [
        m for m in plan.micro_batches if not cfg.micro_batches or m in cfg.micro_batches
    ]
    if not micro_batches:
        raise ConfigError(
            f"micro_batches: none of {cfg.micro_batches} divides the {plan.per_rank} sequences "
            f"per rank on {world} ranks (global batch {plan.global_batch}); choose from "
            f"{plan.micro_batches}"
        )
    best = first = None
    tried = []
    # NOTE: recomputation is tried only where the plain point does not fit: at a micro-batch
    # that fits as it is, it is never faster (an I/O-bound step would tie, and lose the tie)
    points = ((micro, recompute) for micro in micro_batches for recompute in (False, True))
    for micro, recompute in points:
        if recompute and (not cfg.recompute or tried[-1]["fits"]):
            continue
        at = point_config(run_cfg, micro, plan.global_batch, recompute)
        est = predict_one(replace(given, run_cfg=at), option, nodes)
        point = {
            "micro_batch": micro,
            "recompute": recompute,
            "accum": est.step["accum"],
            "fits": est.fits,
            "predicted_step_s": est.step["predicted_step_s"],
            "device_bytes": est.device_total,
        }
        tried.append(point)
        first = first or (micro, recompute, est)
        # NOTE: equal up to rounding (an I/O-bound step is the read time whatever the
        # micro-batch) counts as equal: the larger micro-batch
        if est.fits and (
            best is None
            or est.step["predicted_step_s"] <= best[2].step["predicted_step_s"] * (1 + 1e-9)
        ):
            best = (micro, recompute, est)
    micro, recompute, chosen = best or first
    chosen.point = {
        "micro_batch": micro,
        "recompute": recompute,
        "accum": chosen.step["accum"],
        "global_batch": plan.global_batch,
        "largest_fitting_micro_batch": max(
            (t["micro_batch"] for t in tried if t["fits"] and not t["recompute"]), default=None
        ),
        "largest_fitting_with_recompute": max(
            (t["micro_batch"] for t in tried if t["fits"] and t["recompute"]), default=None
        ),
        "note": plan.note,
        "tried": tried,
    }
    return chosen


def search(given: PredictionInputs, options: list[ZeroOption], nodes: int) -> list:
    """Each option's point on `nodes` nodes (`search_option`)."""
    return [search_option(given, o, nodes) for o in options]
