"""ZeRO stage / offload tuner (`dspark-ds tune`): per-GPU memory and predicted step time of a
recipe on a cluster, for every ZeRO stage × offload option at each micro-batch that keeps the
global batch; each option's fastest point that fits, the fastest of them recommended (and
written as a train recipe with --write_recipe); `--measure` runs real steps of each option's
point here and prints measured peak memory and step time beside the estimate and the
prediction.

    dspark-ds tune --recipe dspark_ds/recipes/dspark_qwen3_8b.yaml --cluster.nodes 1,2,8,64
    torchrun --nproc_per_node 2 -m dspark_ds.cli tune --recipe dspark_ds/recipes/tiny_cpu.yaml \\
        --target.path runs/tiny_target --measure true

This module is the package's face: `run` (pipeline.py, the stages end to end) and the names a
user of the tuner reads. The stages: onsite.py (the figures calibrated here, with --measure's
real steps between the samples: calibrate.py, measure.py), fromrun.py (the compute rate of a
finished run), search.py (each option's micro-batch point, predicted by prediction.py from
estimate.py's memory and steptime.py's step time), report.py and fleet.py (the tables),
write.py (the recipe of --write_recipe), sweep_runs.py (the sweep as MLflow runs). Beside them:
config.py (the options and the recipe), cluster.py (presets, profiles, `--cluster.*`),
workload.py (a micro-batch's host work), dataio.py (the data term); what a run holds and its
FLOPs are the cost layer's (dspark_ds/cost/), which training reads too. A stage module imports
the others, never this one.
"""

from __future__ import annotations

from dspark_ds.cost.inventory import KNOWN_TARGETS, Inventory, inventory
from dspark_ds.tune.cluster import ClusterConfig, Machine
from dspark_ds.tune.config import OPTION_NAMES, OPTIONS, TunerConfig, ZeroOption
from dspark_ds.tune.estimate import Estimate, estimate, recommend
from dspark_ds.tune.pipeline import run
from dspark_ds.tune.steptime import StepTime

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
