"""The cluster a prediction is for (`--cluster.*`): its shape, memory and the rates the step-time
model divides by, from a preset, a calibration profile measured on a machine, and flags.

Resolution: the preset's figures, then a loaded profile's (`--cluster.profile`, written by
`--cluster.calibrate` / `--cluster.save_profile`), then every flag that is set. Each rate keeps
where it came from (`Machine.sources`), and the report prints it, so a user can tell a published
figure from an assumption from a measurement. docs/tuner.md lists the presets' sources.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from dspark_ds.cost.devices import GIB, GPUS, Gpu
from dspark_ds.errors import ConfigError

GB = 1e9
PRESET_NAMES = ("8xH100-80GB", "8xH200-141GB")
PROFILE_VERSION = 2


@dataclass(frozen=True)
class Machine:
    """Everything the tuner needs to know about the cluster, in SI units (bytes, seconds,
    FLOP/s). Per rank (= per GPU) unless a name says per node."""

    gpus_per_node: int
    gpu_memory_bytes: float
    host_memory_bytes: float
    """Host RAM of one node (offloaded states)."""
    peak_flops: float
    """Dense matmul FLOP/s of one device in the compute dtype (bf16 tensor cores on a GPU;
    measured fp32 / bf16 matmuls on a CPU rank)."""
    sustained_fraction: float
    """The share of peak_flops a drafter's training step runs its matmul FLOPs at (MFU): the
    elementwise work, launches and small matmuls around them are inside it."""
    target_sustained_fraction: float
    """The same for the frozen target's forward."""
    all_reduce_bytes_per_s: float
    """Bus bandwidth of an all-reduce inside a node (ring: 2(N-1)/N of the buffer crosses each
    rank's link)."""
    all_gather_bytes_per_s: float
    reduce_scatter_bytes_per_s: float
    collective_latency_s: float
    """Time of one small collective inside a node (launch, synchronisation, the ring's hops)."""
    inter_node_bytes_per_s: float
    """Per-GPU network bandwidth between nodes (one direction); a ring spanning nodes moves
    each rank's share over it."""
    inter_node_latency_s: float
    host_device_bytes_per_s: float
    """Host <-> device copy bandwidth of one rank (PCIe), one direction."""
    nvme_read_bytes_per_s: float
    """NVMe read bandwidth of one node (shared by its ranks)."""
    nvme_write_bytes_per_s: float
    device_adam_params_per_s: float
    """Adam updates per second on the device (FusedAdam on a GPU, torch's AdamW on a CPU)."""
    device_adam_tensor_s: float
    """...plus this per parameter tensor (plain data parallelism hands Adam the parameter list;
    ZeRO hands it flat buffers)."""
    cpu_adam_params_per_s: float
    """Adam updates per second of DeepSpeed's CPU Adam for one rank while every rank of the
    node runs its own (optimizer offload)."""
    op_overhead_s: float
    """Host time per dispatched tensor op (Python, autograd, dispatcher, kernel launch)."""
    dispatch_overlaps_compute: bool
    """GPU: ops are queued while earlier ones run, so the host time hides behind the device's
    (the larger of the two counts); CPU: the same thread does both (they add)."""
    engine_module_fwd_s: tuple[float, ...] = (0.0,) * 7
    """ZeRO-3's hooks per module call in the forward, for each engine mode of ENGINE_MODES
    (fetch / release bookkeeping; the all-gathers of partitioned parameters are counted
    apart)."""
    engine_module_bwd_s: tuple[float, ...] = (0.0,) * 7
    """...per module call in the backward (the calls whose output needs a gradient)."""
    engine_target_module_s: tuple[float, ...] = (0.0,) * 7
    """...and per module call of an in-job target's forward (its own optimizer-less engine)."""
    engine_micro_s: tuple[float, ...] = (0.0,) * 7
    """DeepSpeed's fixed cost per micro-batch (forward + backward) for each engine mode of
    ENGINE_MODES, beyond plain PyTorch."""
    engine_step_s: tuple[float, ...] = (0.0,) * 7
    """DeepSpeed's fixed cost per optimizer step for each engine mode (its bookkeeping and the
    step's small collectives), beyond plain PyTorch's optimizer."""
    comm_overlap: float = 0.0
    """Share of ZeRO-3's prefetched all-gathers that runs while the device computes (0..1)."""
    cache_read_bytes_per_s: float = 2 * GB
    """Read bandwidth of an offline cache's directory for one node (all its ranks reading at
    once): a shared file system's share, or local drives."""
    sources: dict = field(default_factory=dict, compare=False)
    """Field -> where its value came from (preset name, profile path, flag)."""

    def collective(self, op: str, nodes: int) -> tuple[float, float]:
        """(latency s, bus bandwidth bytes/s) of `op` over ranks on `nodes` nodes."""
        bw = getattr(self, f"{op}_bytes_per_s")
        if nodes > 1:
            return max(self.collective_latency_s, self.inter_node_latency_s), min(
                bw, self.inter_node_bytes_per_s
            )
        return self.collective_latency_s, bw


TUPLE_FIELDS = (
    "engine_module_fwd_s",
    "engine_module_bwd_s",
    "engine_target_module_s",
    "engine_micro_s",
    "engine_step_s",
)

# Engine modes the calibration measures (what DeepSpeed runs differently): ZeRO stage, optimizer
# offload, parameter offload. NVMe options run the parameter-offload engine plus the NVMe terms.
ENGINE_MODES = ("zero0", "zero1", "zero2", "zero2+off", "zero3", "zero3+off", "zero3+off+param")


def engine_mode(stage: int, offload_optimizer: str | None, offload_param: str | None) -> int:
    """Index into ENGINE_MODES."""
    if stage < 2:
        return stage
    if stage == 2:
        return 3 if offload_optimizer else 2
    if offload_param:
        return 6
    return 5 if offload_optimizer else 4


# ---- presets --------------------------------------------------------------------------------
# Published figures (docs/tuner.md has the sources): the GPUs' datasheets (cost/devices.py: dense
# bf16 FLOP/s, memory and its bandwidth), NVIDIA H100 / H200 SXM (NVLink 900 GB/s total = 450 GB/s
# per direction, PCIe Gen5 x16 128 GB/s total = 64 GB/s per direction), the DGX H100 / H200
# system specification (8 GPUs, 2 TB DDR5, eight 400 Gb/s ConnectX-7 = 50 GB/s per GPU, eight
# U.2 NVMe drives), Samsung PM1733 U.2 (6.4 GB/s read, 3.8 GB/s write per drive; the drive model
# is an assumption), Intel Xeon Platinum 8480C (8 DDR5-4800 channels = 307 GB/s per socket, two
# sockets).
# NOTE: the remaining values are ASSUMPTIONS, not measurements (no GPU was available): MFU 0.40,
# collective latency, host-side costs; docs/tuner.md says so. `--cluster.calibrate` on a node
# replaces all of them with measured ones.
_HOST_BW = 2 * 307.2 * GB
_ADAM_BYTES = 32.0  # fp32 param, grad, m, v read; param, m, v written; a 16-bit copy out (+2)


def _hopper_node(gpu: Gpu) -> dict:
    """The figures of a DGX node of 8 `gpu`s (H100 or H200)."""
    return dict(
        gpus_per_node=8,
        host_memory_bytes=2048 * GIB,
        peak_flops=gpu.peak_flops,
        sustained_fraction=0.40,
        target_sustained_fraction=0.40,
        all_reduce_bytes_per_s=450 * GB,
        all_gather_bytes_per_s=450 * GB,
        reduce_scatter_bytes_per_s=450 * GB,
        collective_latency_s=30e-6,
        inter_node_bytes_per_s=50 * GB,
        inter_node_latency_s=60e-6,
        host_device_bytes_per_s=64 * GB,
        nvme_read_bytes_per_s=8 * 6.4 * GB,
        nvme_write_bytes_per_s=8 * 3.8 * GB,
        # memory bound: half the node's DRAM bandwidth shared by 8 ranks, 32 bytes per update
        cpu_adam_params_per_s=0.5 * _HOST_BW / 8 / _ADAM_BYTES,
        device_adam_tensor_s=20e-6,
        op_overhead_s=10e-6,
        dispatch_overlaps_compute=True,
        engine_module_fwd_s=(0.0, 0.0, 0.0, 0.0, 100e-6, 100e-6, 150e-6),
        engine_module_bwd_s=(0.0, 0.0, 0.0, 0.0, 150e-6, 150e-6, 200e-6),
        engine_target_module_s=(0.0, 0.0, 0.0, 0.0, 100e-6, 100e-6, 150e-6),
        engine_micro_s=(1e-3,) * 7,
        engine_step_s=(5e-3,) * 7,
        comm_overlap=0.8,
        cache_read_bytes_per_s=2 * GB,
        gpu_memory_bytes=gpu.memory_bytes,
        # FusedAdam is memory bound: the HBM bandwidth over the 32 bytes of an update
        device_adam_params_per_s=gpu.memory_bytes_per_s / 32,
    )


_PUBLISHED = (
    "gpus_per_node",
    "host_memory_bytes",
    "peak_flops",
    "all_reduce_bytes_per_s",
    "all_gather_bytes_per_s",
    "reduce_scatter_bytes_per_s",
    "inter_node_bytes_per_s",
    "host_device_bytes_per_s",
    "gpu_memory_bytes",
)
_DERIVED = (
    "nvme_read_bytes_per_s",
    "nvme_write_bytes_per_s",
    "cpu_adam_params_per_s",
    "device_adam_params_per_s",
)
PRESETS: dict[str, dict] = {
    "8xH100-80GB": _hopper_node(GPUS["NVIDIA H100 80GB HBM3"]),
    "8xH200-141GB": _hopper_node(GPUS["NVIDIA H200"]),
}


def preset_machine(name: str) -> Machine:
    if name not in PRESETS:
        raise ConfigError(f"cluster.preset: unknown {name!r}; choose from {list(PRESETS)}")
    values = PRESETS[name]
    return Machine(**values, sources={k: f"{name} ({_kind(k)})" for k in values})


def _kind(key: str) -> str:
    if key in _PUBLISHED:
        return "published"
    return "derived" if key in _DERIVED else "assumed"


# ---- profiles (calibration results) ----------------------------------------------------------
def save_profile(
    machine: Machine, path: str | Path, meta: dict, only_from: str | tuple[str, ...] = ""
) -> None:
    """Writes a machine's figures as JSON, with where and when they were measured; with
    `only_from`, only the figures whose source starts with it (or one of them: what the
    calibration measured; the rest stays the preset's when the profile is loaded)."""
    values = asdict(machine)
    values.pop("sources")
    if only_from:
        values = {
            k: v for k, v in values.items() if machine.sources.get(k, "").startswith(only_from)
        }
    data = {"version": PROFILE_VERSION, "meta": meta, "machine": values}
    Path(path).write_text(json.dumps(data, indent=1))


def load_profile(path: str | Path) -> tuple[dict, dict]:
    """(the measured values, the meta data) of a saved profile; ConfigError names the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cluster.profile: cannot read {path}: {err}") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ConfigError(
            f"cluster.profile: {path} is not a version-{PROFILE_VERSION} profile of "
            "`dspark-ds tune --cluster.calibrate true --cluster.save_profile ...`"
        )
    known = {f.name for f in fields(Machine)}
    values = {k: v for k, v in data.get("machine", {}).items() if k in known}
    for key in TUPLE_FIELDS:
        if key in values:
            values[key] = tuple(values[key])
    return values, data.get("meta", {})


def with_values(machine: Machine, values: dict, source: str) -> Machine:
    """`machine` with `values` replacing its own, each recorded as coming from `source`."""
    sources = dict(machine.sources)
    sources.update({k: source for k in values})
    return replace(machine, **values, sources=sources)


# ---- the CLI group ----------------------------------------------------------------------------
@dataclass
class ClusterConfig:
    """The cluster: a preset, a measured profile, or this machine (`calibrate`), and flags that
    replace single figures. Unset figures come from the profile, then the preset."""

    preset: str = "8xH100-80GB"
    """Base figures: 8xH100-80GB or 8xH200-141GB (DGX-like nodes: NVLink, 400 Gb/s per GPU;
    docs/tuner.md lists the published sources and the assumptions)."""
    profile: str | None = None
    """A profile measured by --cluster.calibrate (JSON); its figures replace the preset's."""
    calibrate: bool | None = None
    """Measure the rates on this machine (matmul and training rates, collectives on the
    launcher's ranks, host <-> device copies, NVMe with --measure, optimizer steps, DeepSpeed's
    own costs) and predict for it; None = only with --measure and no --cluster.profile;
    false = never (the preset's or the profile's figures)."""
    samples: int = 3
    """Calibration samples per engine mode (each a pass over every measured rate); with
    --measure, per option, taken between blocks of its timed steps."""
    from_run: str | None = None
    """A finished `dspark-ds train` run directory: the sustained fraction (and the peak, when
    the run logged MFU) for which the model predicts that run's measured step (its log's
    step time and model FLOP/s; docs/tuner.md); applied after the preset, profile and
    calibration, and kept by --cluster.save_profile."""
    save_profile: str | None = None
    """Write the calibrated profile here (with --cluster.from_run its figures too), for a
    later --cluster.profile."""
    nodes: int | list[int] | str = 1
    """Nodes: one count, or several to see the scaling (`1,2,8,64` or `[1, 2, 8, 64]`); the
    memory table is for the first."""
    gpus_per_node: int | None = None
    """GPUs (= ranks) per node."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU (GiB)."""
    host_memory_gb: float | None = None
    """Host RAM of one node (GiB), for offloading."""
    peak_tflops: float | None = None
    """Dense matmul rate of one GPU in the compute dtype (TFLOP/s)."""
    sustained_fraction: float | None = None
    """Share of the peak a training step's matmul FLOPs run at (0..1; the drafter's step and
    the target's forward alike)."""
    intra_node_gb_per_s: float | None = None
    """Collective bus bandwidth inside a node, per GPU and direction (GB/s; NVLink)."""
    inter_node_gb_per_s: float | None = None
    """Network bandwidth between nodes per GPU and direction (GB/s; 400 Gb/s = 50)."""
    host_device_gb_per_s: float | None = None
    """Host <-> GPU copy bandwidth per GPU and direction (GB/s; PCIe)."""
    nvme_read_gb_per_s: float | None = None
    """NVMe read bandwidth of a node (GB/s)."""
    nvme_write_gb_per_s: float | None = None
    """NVMe write bandwidth of a node (GB/s)."""
    collective_latency_us: float | None = None
    """Time of one small collective inside a node (microseconds)."""
    cache_read_gb_per_s: float | None = None
    """Read bandwidth of the offline cache's directory for one node (GB/s), all its ranks
    reading at once (data.mode offline: the data term)."""

    @property
    def node_counts(self) -> list[int]:
        """`nodes` as a list of counts (ConfigError names the option)."""
        raw = self.nodes
        if isinstance(raw, str):
            try:
                raw = [
                    int(x) for x in raw.replace("[", "").replace("]", "").split(",") if x.strip()
                ]
            except ValueError:
                raise ConfigError(
                    f"cluster.nodes: expected counts like 1,2,8,64, got {self.nodes!r}"
                ) from None
        counts = [raw] if isinstance(raw, int) else list(raw)
        if not counts or any(int(n) < 1 for n in counts):
            raise ConfigError(f"cluster.nodes: every count must be >= 1, got {self.nodes!r}")
        return [int(n) for n in counts]

    def validate(self) -> ClusterConfig:
        self.node_counts  # noqa: B018 - validates nodes
        if self.preset not in PRESETS:
            raise ConfigError(
                f"cluster.preset: unknown {self.preset!r}; choose from {list(PRESETS)}"
            )
        if self.samples < 1:
            raise ConfigError(f"cluster.samples: must be >= 1, got {self.samples}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ConfigError(f"cluster.gpus_per_node: must be >= 1, got {self.gpus_per_node}")
        for name in (
            "gpu_memory_gb",
            "host_memory_gb",
            "peak_tflops",
            "intra_node_gb_per_s",
            "inter_node_gb_per_s",
            "host_device_gb_per_s",
            "nvme_read_gb_per_s",
            "nvme_write_gb_per_s",
            "cache_read_gb_per_s",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"cluster.{name}: must be > 0, got {value}")
        if self.sustained_fraction is not None and not 0 < self.sustained_fraction <= 1:
            raise ConfigError(
                f"cluster.sustained_fraction: must be in (0, 1], got {self.sustained_fraction}"
            )
        if self.collective_latency_us is not None and self.collective_latency_us < 0:
            raise ConfigError(
                f"cluster.collective_latency_us: must be >= 0, got {self.collective_latency_us}"
            )
        if self.profile is not None and not Path(self.profile).is_file():
            raise ConfigError(f"cluster.profile: {self.profile} does not exist")
        if self.from_run is not None:
            if not Path(self.from_run).is_dir():
                raise ConfigError(f"cluster.from_run: {self.from_run} is not a directory")
            if self.sustained_fraction is not None:
                raise ConfigError(
                    "cluster.sustained_fraction: --cluster.from_run derives it; set one of them"
                )
        return self

    def flag_values(self) -> dict:
        """The figures set by flags, as Machine fields."""
        out: dict = {}
        if self.gpus_per_node is not None:
            out["gpus_per_node"] = int(self.gpus_per_node)
        if self.gpu_memory_gb is not None:
            out["gpu_memory_bytes"] = self.gpu_memory_gb * GIB
        if self.host_memory_gb is not None:
            out["host_memory_bytes"] = self.host_memory_gb * GIB
        if self.peak_tflops is not None:
            out["peak_flops"] = self.peak_tflops * 1e12
        if self.sustained_fraction is not None:
            out["sustained_fraction"] = self.sustained_fraction
            out["target_sustained_fraction"] = self.sustained_fraction
        if self.intra_node_gb_per_s is not None:
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                out[f"{op}_bytes_per_s"] = self.intra_node_gb_per_s * GB
        for name, key in (
            ("inter_node_gb_per_s", "inter_node_bytes_per_s"),
            ("host_device_gb_per_s", "host_device_bytes_per_s"),
            ("nvme_read_gb_per_s", "nvme_read_bytes_per_s"),
            ("nvme_write_gb_per_s", "nvme_write_bytes_per_s"),
            ("cache_read_gb_per_s", "cache_read_bytes_per_s"),
        ):
            if getattr(self, name) is not None:
                out[key] = getattr(self, name) * GB
        if self.collective_latency_us is not None:
            out["collective_latency_s"] = self.collective_latency_us * 1e-6
        return out


def resolve(cfg: ClusterConfig, measured: dict | None = None, measured_source: str = "") -> Machine:
    """The preset, then a profile (file or `measured`), then the flags."""
    machine = preset_machine(cfg.preset)
    if cfg.profile:
        values, _ = load_profile(cfg.profile)
        machine = with_values(machine, values, f"profile {cfg.profile}")
    if measured:
        machine = with_values(machine, measured, measured_source or "measured here")
    flags = cfg.flag_values()
    if flags:
        machine = with_values(machine, flags, "flag")
    return machine
