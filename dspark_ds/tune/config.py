"""`dspark-ds tune`'s options and the ZeRO stage × offload options it compares."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dspark_ds.errors import ConfigError
from dspark_ds.target import TargetPathConfig


@dataclass(frozen=True)
class ZeroOption:
    name: str
    config: str
    """Shipped DeepSpeed JSON (deepspeed.config)."""
    overrides: dict | None = None
    """deepspeed.overrides that turn it into this option."""

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
]
OPTION_NAMES = [o.name for o in OPTIONS]


@dataclass
class TunerConfig:
    """`dspark-ds tune`: which ZeRO stage / offload fits a recipe on a cluster."""

    recipe: str = "dspark_ds/recipes/dspark_qwen3_8b.yaml"
    """A `dspark-ds train` YAML recipe."""
    overrides: list[str] = field(default_factory=list)
    """Extra `dspark-ds train` flags applied on top of the recipe, e.g. [--data.batch_size, 2];
    --deepspeed.overrides here (bucket sizes, persistence threshold...) apply to every option."""
    target: TargetPathConfig = field(default_factory=TargetPathConfig)
    """target.path replaces the recipe's (a local model directory or a hub id listed in
    KNOWN_TARGETS); None = the recipe's."""
    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """GPUs (= ranks) per node."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU (GiB)."""
    cpu_memory_gb: float = 1024.0
    """Host RAM of one node (GiB), for offloading."""
    device: str | None = None
    """Where the estimate is for: cuda (flex attention: no score matrices) or cpu (blockwise /
    dense attention); None = cuda, except cpu for --measure on a machine without CUDA."""
    reserve_gb: float = 2.0
    """Per-GPU memory kept free for the CUDA context, NCCL and allocator fragmentation."""
    options: list[str] = field(default_factory=lambda: list(OPTION_NAMES))
    """Options to estimate (and measure): any of zero0, zero1, zero2, zero2+offload_opt,
    zero3, zero3+offload_opt, zero3+offload_opt+param, zero3+nvme."""
    measure: bool = False
    """Run a few real steps of each option on this machine (the world size of the launcher,
    e.g. torchrun --nproc_per_node 2) and print measured peak memory and step time."""
    measure_steps: int = 3
    """Timed optimizer steps per option (after one warm-up step that measures memory)."""
    output_json: str | None = None
    """Also write the table as JSON here."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> TunerConfig:
        for name in ("nodes", "gpus_per_node", "measure_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory_gb", "cpu_memory_gb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.device not in (None, "cuda", "cpu"):
            raise ConfigError(f"device: expected cuda or cpu, got {self.device!r}")
        bad = [o for o in self.options if o not in OPTION_NAMES]
        if bad:
            raise ConfigError(f"options: unknown {bad}; choose from {OPTION_NAMES}")
        return self
