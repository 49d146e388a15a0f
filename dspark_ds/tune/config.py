"""`dspark-ds tune`'s options, the ZeRO stage × offload options it compares, and the recipe it
tunes (`load_recipe`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dspark_ds.config import TrackingConfig, TrainRunConfig, parse
from dspark_ds.errors import ConfigError
from dspark_ds.target import TargetPathConfig
from dspark_ds.tune.cluster import ClusterConfig


@dataclass(frozen=True)
class ZeroOption:
    name: str
    config: str
    """Shipped DeepSpeed JSON (deepspeed.config)."""
    overrides: dict | None = None
    """deepspeed.overrides that turn it into this option."""
    multi_node: bool = False
    """Listed by default only on more than one node (hpZ: on one node its node-local group is
    the whole world, and it gathers what plain ZeRO-3 gathers)."""

    @property
    def cli(self) -> str:
        text = f"--deepspeed.config {self.config}"
        if self.overrides:
            text += f" --deepspeed.overrides '{json.dumps(self.overrides)}'"
        return text


_OFF_OPT = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
OPTIONS: list[ZeroOption] = [
    ZeroOption("zero0", "zero0"),
    ZeroOption("zero1", "zero1"),
    ZeroOption("zero2", "zero2"),
    ZeroOption("zero2+offload_opt", "zero2", _OFF_OPT),
    ZeroOption("zero3", "zero3"),
    ZeroOption("zero3+offload_opt", "zero3", _OFF_OPT),
    ZeroOption("zero3+offload_opt+param", "zero3_offload_cpu"),
    ZeroOption("zero3+nvme", "zero3_offload_nvme"),
    # hpZ: zero_hpz_partition_size "auto" = the ranks of a node (engine.config.build_ds_config)
    ZeroOption("zero3+hpz", "zero3_hpz", multi_node=True),
]
OPTION_NAMES = [o.name for o in OPTIONS if not o.multi_node]
"""The options listed on any cluster (`--options` may also name the multi-node ones)."""
ALL_OPTION_NAMES = [o.name for o in OPTIONS]


def default_options(nodes: int) -> list[str]:
    """The options compared when `--options` is not given, for a table of `nodes` nodes."""
    return [o.name for o in OPTIONS if nodes > 1 or not o.multi_node]


@dataclass
class TunerConfig:
    """`dspark-ds tune`: which ZeRO stage / offload fits a recipe on a cluster, and how fast
    each one steps."""

    recipe: str = "dspark_ds/recipes/dspark_qwen3_8b.yaml"
    """A `dspark-ds train` YAML recipe."""
    overrides: list[str] = field(default_factory=list)
    """Extra `dspark-ds train` flags applied on top of the recipe, e.g. [--data.batch_size, 2];
    --deepspeed.overrides here (bucket sizes, persistence threshold...) apply to every option."""
    target: TargetPathConfig = field(default_factory=TargetPathConfig)
    """target.path replaces the recipe's (a local model directory or a hub id listed in
    KNOWN_TARGETS); None = the recipe's."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The cluster (--cluster.preset, --cluster.nodes 1,2,8,64, --cluster.calibrate ...)."""
    device: str | None = None
    """Where the estimate is for: cuda (flex attention: no score matrices) or cpu (blockwise /
    dense attention); None = cuda, except cpu for --measure on a machine without CUDA."""
    reserve_gb: float = 2.0
    """Per-GPU memory kept free for the CUDA context, NCCL and allocator fragmentation."""
    options: list[str] | None = None
    """Options to estimate (and measure): any of zero0, zero1, zero2, zero2+offload_opt,
    zero3, zero3+offload_opt, zero3+offload_opt+param, zero3+nvme, zero3+hpz (ZeRO-3 with
    hpZ's node-local secondary partition); None = all of them, zero3+hpz only when the first
    --cluster.nodes count is above 1."""
    micro_batches: list[int] = field(default_factory=list)
    """The micro-batches the search may take (e.g. [1] for the recipe's shape at micro-batch 1);
    empty = every one that keeps the global batch (the divisors of the sequences per rank)."""
    recompute: bool = True
    """Search recomputation of the draft layers (perf.activation_checkpointing: each layer's
    forward runs again in backward instead of keeping its activations) at the micro-batches that
    do not fit without it; false = every point without it."""
    measure: bool = False
    """Run a few real steps of each option on this machine (the world size of the launcher,
    e.g. torchrun --nproc_per_node 2) and print measured peak memory and the median step time
    beside the prediction for this machine (calibrated first unless --cluster.profile)."""
    measure_steps: int = 5
    """Timed optimizer steps per option (after one warm-up step that measures memory)."""
    measure_memory: bool = True
    """With --measure: profile the build and first step for the peak memory (CPU: the torch
    profiler, which takes a while); false = step times only."""
    output_json: str | None = None
    """Also write the table as JSON here."""
    write_recipe: str | None = None
    """Write the recommended point (its ZeRO option, micro-batch and accumulation on the first
    --cluster.nodes count) here as a `dspark-ds train` recipe, its whole DeepSpeed config
    explicit: `dspark-ds train --config PATH` runs it as it is."""
    served: bool = False
    """Tune the recipe as a served run (data.mode served: the target on a vLLM fleet, not in the
    job) and size that fleet: serving GPUs, bytes per sequence, storage bandwidth. A served
    recipe (data.mode served, or hybrid with data.served.urls) gets the fleet without it."""
    prefill_mfu: float = 0.4
    """The share of a serving GPU's peak FLOP/s its prefill runs at (the fleet's sizing)."""
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(enabled=False))
    """The sweep as MLflow runs (a parent, one child per option): logged when
    --tracking.enabled true, --tracking.uri or $MLFLOW_TRACKING_URI is set (default store:
    sqlite:///<the recipe's output_dir>/mlflow.db)."""

    def validate(self) -> TunerConfig:
        if self.measure_steps < 1:
            raise ConfigError(f"measure_steps: must be >= 1, got {self.measure_steps}")
        if not 0 < self.prefill_mfu <= 1:
            raise ConfigError(f"prefill_mfu: must be in (0, 1], got {self.prefill_mfu}")
        if self.served and (self.measure or self.write_recipe):
            raise ConfigError(
                "served: --measure and --write_recipe run or write the recipe as it is; give a "
                "served recipe (data.mode served and its data.served.urls) instead"
            )
        if self.reserve_gb < 0:
            raise ConfigError(f"reserve_gb: must be >= 0, got {self.reserve_gb}")
        self.cluster.validate()
        self.tracking.validate()
        if self.device not in (None, "cuda", "cpu"):
            raise ConfigError(f"device: expected cuda or cpu, got {self.device!r}")
        if any(m < 1 for m in self.micro_batches):
            raise ConfigError(f"micro_batches: each must be >= 1, got {self.micro_batches}")
        bad = [o for o in self.options or [] if o not in ALL_OPTION_NAMES]
        if bad:
            raise ConfigError(f"options: unknown {bad}; choose from {ALL_OPTION_NAMES}")
        return self


def load_recipe(cfg: TunerConfig):
    """The recipe as `dspark-ds train` would parse it, with the tuner's overrides."""
    argv = ["--config", cfg.recipe, *cfg.overrides]
    if cfg.target.path:
        argv += ["--target.path", cfg.target.path]
    return parse(TrainRunConfig, argv, prog="dspark-ds tune")
