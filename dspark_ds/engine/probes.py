"""What the ZeRO tuner asks of DeepSpeed: its own memory estimators, and engines / CPU Adam /
asynchronous I/O around stand-ins for the calibration (`dspark_ds.tune.calibrate`) of the
step-time model.

    deepspeed_model_states_estimate   DeepSpeed's estimate of the model states per GPU and node
    plain_engine / frozen_engine      a real engine around a stand-in model (trained / frozen);
                                      `release_engine` when done
    cpu_adam                          DeepSpeed's CPU Adam, the optimizer of an offloaded run
    aio_bandwidth                     one file written and read through NVMe offload's I/O path
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dspark_ds.engine.config import zero_stage
from dspark_ds.engine.runtime import import_deepspeed, join_deepspeed_comm, zero_init
from dspark_ds.engine.target import shard_target


def deepspeed_model_states_estimate(
    stage: int,
    trainable_params: int,
    largest_layer_params: int,
    gpus_per_node: int,
    nodes: int,
    offload_optimizer: bool,
    offload_params: bool,
) -> tuple[int, int]:
    """DeepSpeed's own estimate of the model states (bf16 params + Adam) as (host bytes per
    node, bytes per GPU), from estimate_zero2/zero3_model_states_mem_needs."""
    import_deepspeed()
    if stage == 3:
        # lazy: deepspeed (1.4 s), never at the engine's import
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            trainable_params,
            largest_layer_params,
            num_gpus_per_node=gpus_per_node,
            num_nodes=nodes,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params and offload_optimizer,
            zero_init=True,
        )
        return int(cpu), int(gpu)
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cpu, gpu = estimate_zero2_model_states_mem_needs(
        trainable_params,
        num_gpus_per_node=gpus_per_node,
        num_nodes=nodes,
        cpu_offload=offload_optimizer,
    )
    return int(cpu), int(gpu)


def plain_engine(make_model: Callable[[], nn.Module], ds_config: dict):
    """A DeepSpeed engine around a stand-in model (the tuner's calibration measures what the
    engine adds to a step): built inside zero.Init under ZeRO-3, as the drafter is. Returns the
    engine; call it, `.backward(loss)`, `.step()`, and `release_engine` when done."""
    deepspeed = import_deepspeed()
    join_deepspeed_comm()
    if zero_stage(ds_config) == 3:
        with zero_init(ds_config):
            model = make_model()
    else:
        model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable, config=ds_config
    )
    return ds_engine


def frozen_engine(module: nn.Module, ds_config: dict):
    """An optimizer-less ZeRO-3 engine around a frozen module, as an in-job target gets one
    (the tuner's calibration times its forward hooks)."""
    join_deepspeed_comm()
    return shard_target(module.requires_grad_(False).eval(), ds_config)


def release_engine(ds_engine) -> None:
    """Drops an engine's hooks and buffers (DeepSpeed's `destroy` where it has one)."""
    if hasattr(ds_engine, "destroy"):
        ds_engine.destroy()


def cpu_adam(params: list[torch.Tensor], lr: float = 1e-4) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam (AdamW mode), the optimizer of an offloaded run."""
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True)


def aio_bandwidth(
    directory: str | Path, nbytes: int, aio: dict | None = None
) -> tuple[float, float]:
    """(write, read) seconds of one `nbytes` file under `directory` through DeepSpeed's
    asynchronous I/O, the path NVMe offload swaps through (O_DIRECT), with a config's `aio`
    settings (DeepSpeed's defaults where it leaves one out). The file is removed."""
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    settings = get_aio_config({"aio": aio or {}})
    handle = (
        AsyncIOBuilder()
        .load(verbose=False)
        .aio_handle(
            block_size=settings["block_size"],
            queue_depth=settings["queue_depth"],
            single_submit=settings["single_submit"],
            overlap_events=settings["overlap_events"],
            intra_op_parallelism=settings["intra_op_parallelism"],
        )
    )
    buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    path = Path(directory) / f"aio_probe_{os.getpid()}.swp"
    try:
        buffer.fill_(1)
        t0 = time.perf_counter()
        handle.sync_pwrite(buffer, str(path))
        t1 = time.perf_counter()
        handle.sync_pread(buffer, str(path))
        t2 = time.perf_counter()
    finally:
        handle.free_cpu_locked_tensor(buffer)
        path.unlink(missing_ok=True)
    return t1 - t0, t2 - t1
