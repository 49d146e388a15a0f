"""DeepSpeed checkpoints of the drafter's engine, and the weights in them.

- `save_tag` / `load_tag`: one tag directory of an engine (weights, optimizer, scheduler, the
  trainer's client state), frozen parameters left out.
- `optimizer_layout`: what a checkpoint's optimizer state depends on (it loads only into the same).
- `convert_to_universal` / `enable_universal_load`: DeepSpeed's universal checkpoint, to resume
  on another world size.
- fp32 weights, for export: `checkpoint_trainable_fp32` of a tag on disk (no process group),
  `full_fp32_state_dict` of the live (possibly partitioned) drafter.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dspark_ds.engine.config import zero_stage
from dspark_ds.engine.runtime import import_deepspeed
from dspark_ds.errors import ConfigError


def save_tag(ds_engine, checkpoint_dir: str | Path, tag: str, client_state: dict) -> None:
    """Collective. Writes <checkpoint_dir>/<tag>/ without touching `latest` (the caller
    publishes the tag once every rank has finished)."""
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    state = dict(client_state)
    # NOTE: ds_to_universal refuses ZeRO-1/2 checkpoints without this entry.
    state[UNIVERSAL_CHECKPOINT_INFO] = {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
    }
    ds_engine.save_checkpoint(
        str(checkpoint_dir),
        tag=tag,
        client_state=state,
        save_latest=False,
        exclude_frozen_parameters=True,
    )


def load_tag(ds_engine, checkpoint_dir: str | Path, tag: str) -> dict:
    """Collective. Restores weights, optimizer, scheduler; returns the client state."""
    path, client_state = ds_engine.load_checkpoint(
        str(checkpoint_dir),
        tag=tag,
        load_module_strict=False,  # frozen embedding / lm_head are not in the file
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if path is None:
        raise ConfigError(f"{checkpoint_dir}/{tag}: DeepSpeed could not load it")
    return client_state or {}


def optimizer_layout(ds_config: dict) -> dict[str, object]:
    """What a checkpoint's optimizer state depends on: the ZeRO stage (how it is partitioned),
    where optimizer and parameters live, and the optimizer (AdamW or Muon) and its implementation
    (torch's AdamW, DeepSpeed's fused or CPU Adam keep different param-group keys)."""
    zero = ds_config.get("zero_optimization", {})
    params = ds_config.get("optimizer", {}).get("params", {})
    return {
        "optimizer": ds_config.get("optimizer", {}).get("type", "AdamW"),
        "ZeRO stage": zero_stage(ds_config),
        "optimizer offload": zero.get("offload_optimizer", {}).get("device") or "none",
        "parameter offload": zero.get("offload_param", {}).get("device") or "none",
        "torch AdamW": bool(params.get("torch_adam", False)),
    }


def convert_to_universal(tag_dir: str | Path, out_dir: str | Path) -> None:
    """DeepSpeed's ds_to_universal (a ZeRO-1/2/3 checkpoint loadable on any world size)."""
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag_dir),
        "--output_folder",
        str(out_dir),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed for {tag_dir}:\n{proc.stderr[-3000:]}")


def enable_universal_load(ds_config: dict) -> dict:
    cfg = copy.deepcopy(ds_config)
    cfg.setdefault("checkpoint", {})["load_universal"] = True
    return cfg


def checkpoint_trainable_fp32(tag_dir: str | Path) -> dict[str, torch.Tensor]:
    """The trainable weights of one checkpoint tag directory, fp32, for any ZeRO stage."""
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = Path(tag_dir)
    if list(tag_dir.glob("*optim_states.pt")):
        # ZeRO-1/2/3 (and bf16 at stage 0): the fp32 master partitions live in the optimizer files
        state = get_fp32_state_dict_from_zero_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, exclude_frozen_parameters=True
        )
    else:
        # stage 0 fp32: the module state is the master copy
        files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ConfigError(f"{tag_dir}: no DeepSpeed model states")
        # NOTE: DeepSpeed's own checkpoints carry non-tensor objects; only load those we wrote.
        state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    # integer / bool buffers (a draft vocabulary's d2t, t2d) keep their dtype
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def full_fp32_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective. Rank 0 gets every weight of the engine's drafter `model` (trainable ones
    from the fp32 master copy); other ranks get None."""
    deepspeed = import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.utils import safe_get_full_fp32_param

    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    # NOTE: remove_duplicate=False: a tied target shares ONE Parameter as embedding and
    # lm_head; its partitioned state_dict entry would be empty under ZeRO-3.
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in seen:  # collective: every rank gathers each Parameter once
            full = safe_get_full_fp32_param(param) if param.requires_grad else None
            if full is None:
                with deepspeed.zero.GatheredParameters([param]):
                    full = param.data.detach().float().clone()
            seen[id(param)] = full.detach().float().cpu() if rank == 0 else full[:0]
        if rank == 0:
            out[name] = seen[id(param)].clone()
    if rank != 0:
        return None
    # persistent buffers (e.g. Gemma4's layer_scalar) are saved too; ZeRO never shards them
    for name, value in model.state_dict().items():
        if name not in out:  # integer / bool ones (a draft vocabulary's d2t, t2d) as they are
            value = value.detach().float() if value.is_floating_point() else value.detach()
            out[name] = value.cpu().clone()
    return out
