"""`perf.compile`: torch.compile of the drafter, in place.

"layers" compiles each draft decoder layer (`nn.Module.compile`, which keeps the module and its
parameter names: checkpoints, export and ZeRO's hooks see the same tree); "model" compiles the
whole drafter's forward. Under ZeRO-3 DeepSpeed's gather / release hooks are excluded from
compilation (`torch.compiler.disable`), so a compiled layer runs as graphs between them.
Recompiles follow the flex kernel's plan (drafters/common/flex.py): the first step compiles for
its shapes, the first batch of another length recompiles with the length symbolic.
"""

from __future__ import annotations

from torch import nn

from dspark_ds.perf.config import COMPILE_MODES


def compile_drafter(model: nn.Module, mode: str) -> nn.Module:
    """Compiles `model` in place per `mode` ("off" | "layers" | "model"); returns it."""
    if mode not in COMPILE_MODES or mode == "auto":
        raise ValueError(f"perf.compile: expected off, layers or model, got {mode!r}")
    if mode == "layers":
        for layer in model.layers:
            layer.compile(dynamic=None)
    elif mode == "model":
        model.compile(dynamic=None)
    return model
