"""The DeepSpeed config of a run, and what it means.

- `build_ds_config`: a JSON from `ds_configs/` (or a path) with its "auto" keys filled from the
  run (batch sizes, clipping, precision, AdamW or Muon, hpZ's node-local group = the ranks of a
  node);
  explicit keys must agree with the run.
- `zero_stage`, `optimizer_offloaded`: read off a config dict.
- `zero_settings`: the ZeRO settings memory depends on, parsed by DeepSpeed's own config class
  (the tuner reads them here rather than copying DeepSpeed's defaults).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dspark_ds.config import DeepSpeedConfig, TrainConfig
from dspark_ds.engine.runtime import import_deepspeed
from dspark_ds.errors import ConfigError

MUON = "Muon"
"""The optimizer type of a run with train.optimizer muon (engine/optimizer.py builds it)."""
SHIPPED_DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


def resolve_ds_config_path(name_or_path: str) -> Path:
    """A shipped name (`zero3`) or a path to a JSON file."""
    path = Path(name_or_path)
    if path.suffix == ".json" or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"deepspeed.config: {name_or_path} does not exist")
        return path
    shipped = SHIPPED_DS_CONFIGS / f"{name_or_path}.json"
    if not shipped.is_file():
        names = sorted(p.stem for p in SHIPPED_DS_CONFIGS.glob("*.json"))
        raise ConfigError(f"deepspeed.config: unknown config {name_or_path!r}; shipped: {names}")
    return shipped


def merge_config(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in key by key (nested dicts merged, other values replaced), as
    `deepspeed.overrides` applies to a JSON config; neither argument is modified."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_ds_config(
    section: DeepSpeedConfig,
    train: TrainConfig,
    *,
    micro_batch_size: int,
    world_size: int,
    use_gpu: bool,
    ranks_per_node: int | None = None,
) -> dict:
    """The DeepSpeed config dict of this run (see the module docstring); `ranks_per_node`
    (None: every rank on one node) fills an "auto" `zero_hpz_partition_size`."""
    path = resolve_ds_config_path(section.config)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed.config: {path} is not valid JSON: {err}") from err
    cfg = merge_config(cfg, section.overrides or {})
    per_step = micro_batch_size * world_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
            f"data.batch_size × world size = {micro_batch_size} × {world_size}"
        )
    grad_accum = train.global_batch_size // per_step

    def fill(keys: str, value, option: str) -> None:
        node = cfg
        *parents, leaf = keys.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        current = node.get(leaf, "auto")
        if current == "auto":
            node[leaf] = value
        elif current != value and not (isinstance(value, list) and list(current) == value):
            raise ConfigError(
                f"deepspeed.config: {path.name} sets {keys}={current!r} but {option} gives "
                f'{value!r}; set it to "auto" or change {option}'
            )

    fill("train_batch_size", train.global_batch_size, "train.global_batch_size")
    fill("train_micro_batch_size_per_gpu", micro_batch_size, "data.batch_size")
    fill("gradient_accumulation_steps", grad_accum, "train.global_batch_size")
    fill("gradient_clipping", float(train.max_grad_norm), "train.max_grad_norm")
    fill("bf16.enabled", train.precision == "bf16", "train.precision")
    zero = cfg.get("zero_optimization", {})
    if zero.get("zero_hpz_partition_size") == "auto":  # hpZ: a node's ranks hold a whole copy
        zero["zero_hpz_partition_size"] = ranks_per_node or world_size
    if cfg.get("fp16", {}).get("enabled") is True:
        raise ConfigError("deepspeed.config: fp16 is not supported; use train.precision bf16")
    optimizer = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    _optimizer_type(optimizer, train)
    fill("optimizer.params.lr", float(train.lr), "train.lr")
    fill("optimizer.params.betas", [float(b) for b in train.betas], "train.betas")
    fill("optimizer.params.eps", float(train.eps), "train.eps")
    fill("optimizer.params.weight_decay", float(train.weight_decay), "train.weight_decay")
    if optimizer["type"] == MUON:
        _fill_muon(cfg, train, fill)
        return cfg
    torch_adam = section.torch_adam
    if torch_adam is None:
        # NOTE: DeepSpeed's FusedAdam is a CUDA kernel; its CPU Adam is only picked (and JIT
        # built) when the optimizer is offloaded. Plain CPU training uses torch's AdamW.
        torch_adam = not use_gpu and not optimizer_offloaded(cfg)
    if torch_adam:
        optimizer["params"]["torch_adam"] = True
    if "scheduler" in cfg:
        raise ConfigError(
            "deepspeed.config: drop the scheduler block; the schedule comes from train.lr, "
            "train.warmup_ratio and train.min_lr_ratio"
        )
    return cfg


def _optimizer_type(optimizer: dict, train: TrainConfig) -> None:
    """The JSON's optimizer type as train.optimizer chooses it: AdamW (or Adam, its AdamW) is
    the AdamW half of Muon too; a JSON that names Muon needs train.optimizer muon."""
    named = str(optimizer.get("type", "")).lower()
    if named not in ("adamw", "adam", "muon"):
        raise ConfigError(
            f"deepspeed.config: optimizer.type must be AdamW or Muon, got {optimizer['type']!r}"
        )
    if named == "muon" and train.optimizer != "muon":
        raise ConfigError(
            "deepspeed.config: optimizer.type is Muon but train.optimizer is "
            f"{train.optimizer!r}; set --train.optimizer muon"
        )
    optimizer["type"] = MUON if train.optimizer == "muon" else "AdamW"


def _fill_muon(cfg: dict, train: TrainConfig, fill) -> None:
    """Muon's own settings beside its AdamW half's, and what DeepSpeed's Muon needs: with an
    offloaded optimizer, leave to us which optimizer runs (`zero_force_ds_cpu_optimizer`); no
    reduce-scatter under ZeRO-3, and no gradient clipping under ZeRO-1/2/3, whose clipping norm
    is taken over the orthogonalised updates rather than the gradients
    (docs/training.md#muon)."""
    lr = float(train.muon_lr if train.muon_lr is not None else train.lr)
    fill("optimizer.params.muon_lr", lr, "train.muon_lr")
    fill("optimizer.params.momentum", float(train.muon_momentum), "train.muon_momentum")
    fill(
        "optimizer.params.muon_weight_decay",
        float(train.muon_weight_decay),
        "train.muon_weight_decay",
    )
    fill("optimizer.params.muon_shard_ns", bool(train.muon_shard_ns), "train.muon_shard_ns")
    if optimizer_offloaded(cfg):
        # DeepSpeed stops a client optimizer under optimizer offload unless told; ours is its own
        # MuonWithAuxAdam with its CPU Adam as the AdamW half (engine/optimizer.py)
        cfg["zero_force_ds_cpu_optimizer"] = False
    stage = zero_stage(cfg)
    if stage >= 1:
        cfg["gradient_clipping"] = 0.0
    if stage == 3:
        cfg["zero_optimization"]["reduce_scatter"] = False


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def optimizer_offloaded(ds_config: dict) -> bool:
    device = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
    return device in ("cpu", "nvme")


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO settings memory depends on, as DeepSpeed reads them from a config (`zero_settings`).
    Sizes are in elements."""

    stage: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_bucket_size: int
    """stage3_prefetch_bucket_size."""
    param_persistence_threshold: int
    """stage3_param_persistence_threshold: ZeRO-3 never partitions a parameter this small."""
    model_persistence_threshold: int
    """stage3_model_persistence_threshold: the most elements kept whole that way, in all."""
    offload_optimizer: str | None
    """cpu | nvme | None."""
    offload_param: str | None
    """cpu | nvme | None."""
    param_swap_elems: int = 0
    """NVMe parameter offload: the page-locked host buffers the parameters swap through
    (offload_param.buffer_count × buffer_size elements, in the parameters' dtype); else 0."""
    optimizer_swap_buffers: int = 0
    """NVMe optimizer offload: how many page-locked host buffers of the largest fp32 partition
    the optimizer states swap through (offload_optimizer.buffer_count); else 0."""
    hpz_partition_size: int = 1
    """zero_hpz_partition_size (ZeRO++ hpZ): ZeRO-3 also keeps a secondary partition of each
    parameter over groups of this many consecutive ranks (a node's), which every gather but a
    trainable parameter's first after a step reads; 1 = off."""


def zero_settings(ds_config: dict) -> ZeroSettings:
    """The config's zero_optimization section parsed by DeepSpeed's own config class, so keys the
    section leaves out (or sets to "auto") take DeepSpeed's defaults, e.g. overlap_comm on at
    ZeRO-3 only, 5e8-element reduce buckets."""
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        zero = DeepSpeedZeroConfig(**ds_config.get("zero_optimization", {}))
    except ValueError as err:  # pydantic's ValidationError: one entry per bad key
        problems = [
            f"zero_optimization.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in getattr(err, "errors", lambda: [])()
        ] or [str(err).splitlines()[0]]
        raise ConfigError(f"deepspeed.config: {'; '.join(problems)}") from err

    def device(offload) -> str | None:
        return offload.device if offload is not None and offload.device != "none" else None

    return ZeroSettings(
        stage=int(zero.stage),
        overlap_comm=bool(zero.overlap_comm),
        contiguous_gradients=bool(zero.contiguous_gradients),
        reduce_bucket_size=int(zero.reduce_bucket_size),
        allgather_bucket_size=int(zero.allgather_bucket_size),
        prefetch_bucket_size=int(zero.prefetch_bucket_size),
        param_persistence_threshold=int(zero.param_persistence_threshold),
        model_persistence_threshold=int(zero.model_persistence_threshold),
        offload_optimizer=device(zero.offload_optimizer),
        offload_param=device(zero.offload_param),
        param_swap_elems=int(zero.offload_param.buffer_count * zero.offload_param.buffer_size)
        if device(zero.offload_param) == "nvme"
        else 0,
        optimizer_swap_buffers=int(zero.offload_optimizer.buffer_count)
        if device(zero.offload_optimizer) == "nvme"
        else 0,
        hpz_partition_size=max(1, int(zero.zero_hpz_partition_size)),
    )
