"""The frozen target inside the job (online / hybrid mode, synthetic data) under DeepSpeed.

- `check_target_dtype`: the target must compute in the drafter's dtype (below).
- `load_target_in_job`: the target of such a run; under ZeRO-3 `load_partitioned_target` builds
  it inside `deepspeed.zero.Init` and each rank reads only its partitions from the checkpoint
  files.
- `shard_target`: ZeRO-3: the optimizer-less DeepSpeed engine that owns the target's partitions.

The drafter's `embed_tokens.weight` and `lm_head.weight` ARE the target's Parameter objects
(`dspark_ds.target.share_embeddings_and_head`): one copy in memory, frozen, so never handed to
the optimizer (it only gets requires_grad parameters) nor saved (exclude_frozen_parameters).

  ZeRO-0/1/2: the target is a plain module, replicated on every rank.
  ZeRO-3: the target arrives partitioned (`load_partitioned_target`: no rank ever holds it
    whole) and `DrafterEngine.build` gives it to an optimizer-less DeepSpeed engine
    (`shard_target`: DeepSpeed's ZeRO-3 inference mode, same ds config): its parameters are
    partitioned across ranks like the drafter's, and the hooks that engine puts on every
    submodule all-gather a layer's weights just for that layer's forward, so calling
    `target(...)` (under no_grad, taps are forward hooks) works unchanged. The drafter is then
    built inside zero.Init and takes the two already-partitioned Parameters; its own engine's
    hooks gather them for the drafter's forward. Either engine re-partitions them after use.

NOTE: DeepSpeed casts a bf16 engine's parameters in place (`p.data = p.data.to(bf16)`): a
shared Parameter in another dtype would silently change the target's embedding (and leave it
unlike the rest of the target). So the target must already be in the compute dtype; anything
else is refused (`check_target_dtype`).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from dspark_ds.engine.config import zero_stage
from dspark_ds.engine.runtime import (
    import_deepspeed,
    join_deepspeed_comm,
    set_zero3_leaves,
    zero_init,
)
from dspark_ds.errors import ConfigError
from dspark_ds.target import (
    FrozenTarget,
    build_target_model,
    import_target_class,
    load_target,
    target_model_config,
)
from dspark_ds.target_weights import TargetWeights, fill_plan, local_target_dir


def precision_dtype(precision: str) -> torch.dtype:
    """train.precision -> the compute dtype of the drafter (and of an in-job target)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def check_target_dtype(target_dtype: torch.dtype, precision: str) -> None:
    """Online / hybrid mode: the target must compute in the drafter's dtype (NOTE above)."""
    want = precision_dtype(precision)
    if target_dtype != want:
        have, need = (str(d).removeprefix("torch.") for d in (target_dtype, want))
        raise ConfigError(
            f"target.dtype: the drafter shares the target's embedding and lm_head, so the "
            f"target must be in the training compute dtype; train.precision={precision} needs "
            f"target.dtype={need}, got {have}"
        )


def load_target_in_job(target_cfg, ds_config: dict, device: torch.device):
    """The frozen target of an online / hybrid run: under ZeRO-3 built partitioned
    (`load_partitioned_target`), otherwise loaded whole onto `device`."""
    if zero_stage(ds_config) == 3:
        return load_partitioned_target(target_cfg, ds_config)
    return load_target(target_cfg, device)


def _target_ds_config(ds_config: dict) -> dict:
    """The run's DeepSpeed config for the target's optimizer-less engine."""
    cfg = {k: v for k, v in copy.deepcopy(ds_config).items() if k not in ("optimizer", "scheduler")}
    cfg.get("checkpoint", {}).pop("load_universal", None)  # nothing is ever loaded into it
    offload = cfg.get("zero_optimization", {}).get("offload_param") or {}
    if offload.get("device") == "nvme" and offload.get("nvme_path"):
        # NOTE: each zero.Init's parameter swapper empties <nvme_path>/zero_stage_3/ when it
        # starts: the drafter's would delete the target's swapped-out parameters
        offload["nvme_path"] = os.path.join(offload["nvme_path"], "target")
    return cfg


def load_partitioned_target(target_cfg, ds_config: dict):
    """ZeRO-3: the target built from its config inside `deepspeed.zero.Init` (each parameter
    partitioned as soon as its module exists), then every rank reads from the checkpoint files
    only the elements of its own partition of each parameter (target_weights.py). No rank ever
    holds the whole target: what a rank holds at most is its partitions (in device memory, or in
    host memory with `offload_param`) plus one converted group of a MoE checkpoint, or one
    tensor for parameters DeepSpeed keeps gathered (docs/known-limits.md has the formula)."""
    deepspeed = import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    config = target_model_config(target_cfg, partitioned=True)
    weights = TargetWeights(local_target_dir(target_cfg.path, target_cfg.revision))
    join_deepspeed_comm()
    import_target_class(config)
    # NOTE: zero.Init casts every floating tensor made inside it to the run's dtype by default;
    # the target's own dtype comes from target.dtype, and a buffer transformers computes in
    # fp32 (RoPE's inv_freq) must stay fp32 as from_pretrained leaves it, so only the device
    # is overridden.
    with zero_init(
        _target_ds_config(ds_config),
        tensor_overrides=[deepspeed.zero.DeepSpeedTensorOverride.device],
    ):
        model = build_target_model(target_cfg, config)
    rank = dist.get_rank()
    with torch.no_grad():
        for _name, tensor, source in fill_plan(model, weights):
            if not hasattr(tensor, "ds_id"):  # a buffer: never partitioned
                tensor.copy_(source.read().view(tensor.shape))
                continue
            part = tensor.ds_tensor
            if (
                tensor.ds_status == ZeroParamStatus.NOT_AVAILABLE
                and getattr(part, "final_location", None) != OffloadDeviceEnum.nvme
            ):
                for part, group in _partitions(tensor):
                    # NOTE: DeepSpeed's layout (partition_parameters._partition_param): rank r
                    # of the partition's group holds flat elements [r * size, (r + 1) * size)
                    # of the parameter, padded at the end; tests/e2e/test_target_families_e2e.py
                    # pins it against a whole load.
                    size = part.ds_numel
                    start = size * dist.get_rank(group=group)
                    end = min(start + size, tensor.ds_numel)
                    if start < end:
                        part.narrow(0, 0, end - start).copy_(source.read(start, end))
                continue
            # swapped to NVMe, or kept whole: the public way, one whole tensor on rank 0
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                if rank == 0:
                    tensor.copy_(source.read().view(tensor.shape))
    target = FrozenTarget(model, target_cfg.layer_ids)
    target.name_or_path = target_cfg.path
    return target


def _partitions(param) -> list[tuple[torch.Tensor, object]]:
    """A ZeRO-3 parameter's partitions on this rank, each with the group it is split over: its
    partition of the whole world and, under hpZ (`zero_hpz_partition_size` > 1), its secondary
    partition of the node-local group, which the gathers after the first read instead.

    NOTE: zero.Init makes the secondary partition from the freshly built (uninitialised)
    parameter, and DeepSpeed refreshes it only after a gather or a `GatheredParameters` with a
    modifier; a frozen target's is never invalidated (the optimizer drops only trainable ones
    after its step), so writing the primary partition alone leaves hpZ's gathers reading
    garbage: the first run's loss differed and then went non-finite."""
    out = [(param.ds_tensor, param.ds_process_group)]
    if getattr(param, "ds_secondary_tensor", None) is not None:
        import_deepspeed()
        # lazy: deepspeed (1.4 s), never at the engine's import
        from deepspeed.utils import groups

        out.append((param.ds_secondary_tensor, groups._get_zero_param_intra_parallel_group()))
    return out


def _register_direct_parameters(target: nn.Module, deepspeed) -> None:
    """Parameters a module reads from a child without calling the child: ZeRO-3 gathers a
    module's parameters around its own forward only, so they are registered with the module
    that reads them. The hybrids' Gated DeltaNet and Mamba2 mixers (Qwen3.5, Qwen3-Next,
    Granite-4.0-H, Falcon-H1) pass `self.conv1d.weight` / `.bias` to a convolution function."""
    for module in target.modules():
        conv = getattr(module, "conv1d", None)
        if isinstance(conv, nn.Conv1d):
            for param in conv.parameters():
                if hasattr(param, "ds_id"):
                    deepspeed.zero.register_external_parameter(module, param)


def shard_target(target: nn.Module, ds_config: dict):
    """ZeRO-3: the optimizer-less engine of the frozen target (partitioned first if it was
    loaded whole); returns the engine."""
    deepspeed = import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.accelerator import get_accelerator

    cfg = _target_ds_config(ds_config)
    if not any(hasattr(p, "ds_id") for p in target.parameters()):
        # NOTE: partition first, parameter by parameter onto the device (deepspeed.initialize
        # alone would move the whole module there before partitioning it).
        zero_init(cfg, module=target)
    device = torch.device(get_accelerator().current_device_name())
    for buf in target.buffers():  # buffers are not partitioned
        buf.data = buf.data.to(device)
    _register_direct_parameters(target, deepspeed)
    set_zero3_leaves(target)
    target_engine, _, _, _ = deepspeed.initialize(model=target, config=cfg)
    target_engine.eval()
    return target_engine
