"""DeepSpeed itself, for the engine's parts: `import_deepspeed()` (the one way they import it),
the process group it shares with the job, and the accelerator it picked.

No part of the engine imports deepspeed when it is itself imported: the trainer and the tuner
import the parts they need at their top, and DeepSpeed (seconds of import) is loaded by the
first function that uses it.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch.distributed as dist
from torch import nn


def import_deepspeed() -> ModuleType:
    """The deepspeed module, imported on first use.

    NOTE: DeepSpeed's autotuner (a feature not used here) imports MLflow when it can: 1.7 s of
    CPU in every rank that starts, although only rank 0 tracks (dspark_ds.tracking imports
    MLflow itself). While DeepSpeed is imported, `import mlflow` fails for it, unless MLflow is
    loaded already. A part that imports from `deepspeed.<submodule>` calls this first.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    blocked = "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        # lazy: deepspeed, 1.4 s of import, with mlflow kept out (the NOTE above)
        import deepspeed
    finally:
        if blocked and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def join_deepspeed_comm() -> None:
    """Hands the process group `dspark_ds.distributed.init` made to deepspeed.comm.

    NOTE: zero.Init reads the world size from deepspeed.comm, which reports 1 until it knows
    the group (the batch-size check then fails); wrapping the existing torch group makes no
    new rendezvous and keeps its backend and device.
    """
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def zero_init(ds_config: dict, **kwargs):
    """`deepspeed.zero.Init` under the run's DeepSpeed config (`kwargs`: its other arguments).

    NOTE: with hpZ (`zero_hpz_partition_size` > 1) a zero.Init given no parameter group makes
    DeepSpeed's node-local one, and a second one fails ("ZeRO parameter intra parallel group is
    already initialized", deepspeed/utils/groups.py): the in-job target's, the drafter's and the
    tuner's stand-in models all take the group the first one made.
    """
    deepspeed = import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.utils import groups

    return deepspeed.zero.Init(
        config_dict_or_path=ds_config,
        zero_param_parallel_group=groups._get_zero_param_intra_parallel_group(),
        **kwargs,
    )


def moe_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of `model`'s MoE blocks: the modules with an `experts` child (every MoE
    family's block in transformers, DeepSeek-V4's draft layers among them, and the usual
    remote-code layout)."""
    return {type(m) for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)}


def set_zero3_leaves(model: nn.Module) -> None:
    """ZeRO-3: each MoE block of `model` (`moe_block_classes`) becomes one of DeepSpeed's leaf
    modules (its parameters gathered whole when it runs, none of its submodules hooked). Call it
    before `deepspeed.initialize`, which puts the hooks on.

    NOTE: ZeRO-3 records the order its hooked modules run in during a step, and while later
    steps follow that trace it keeps and prefetches parameters by it; a step that leaves it
    drops the trace and gathers on demand. A block that loops over the experts its tokens were
    routed to (transformers' eager experts call their activation once per expert hit; remote
    code with one module per expert) calls its submodules as the data decides: it follows the
    trace on one rank and leaves it on another; the ranks then gather different parameters and
    the next collective never completes (a hang after step 1). transformers' grouped-matmul
    experts call each submodule once a forward, but which implementation runs is the config's.
    """
    classes = moe_block_classes(model)
    if classes:
        import_deepspeed()
        # lazy: deepspeed (1.4 s), never at the engine's import
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, list(classes))


def accelerator_name() -> str:
    """The accelerator DeepSpeed uses in this process ("cpu", "cuda", ...): chosen once, from
    DS_ACCELERATOR or the hardware, when DeepSpeed was first imported."""
    import_deepspeed()
    # lazy: deepspeed (1.4 s), never at the engine's import
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()
