"""Muon for a drafter (`train.optimizer: muon`): DeepSpeed's `MuonWithAuxAdam`, handed to
`deepspeed.initialize` as the client optimizer, with the parameter groups made here.

- `muon_split`: which trained weights Muon takes: the 2-D matrices whose sides are both > 1
  and neither is the vocabulary's (the draft layers, the feature projection); AdamW takes the
  rest (norms, biases, vectors such as the confidence head's, and vocabulary-sized matrices such
  as the Markov head's factors, which are looked up by token like an embedding). This follows
  the usual Muon practice and speculators' split, kind-agnostically.
- `muon_param_groups`: the groups, one per matrix shape, each at the lr that makes DeepSpeed's
  update (Newton-Schulz, scaled by √max(1, rows / cols)) as large as torch's Muon with
  `adjust_lr_fn="match_rms_adamw"` (0.2 × √max(rows, cols)), and a weight decay that shrinks
  the weights by `muon_lr × muon_weight_decay` a step, as torch's does.
- `build_muon`: the optimizer from the run's DeepSpeed config (`optimizer.params`, filled by
  engine/config.py from train.*).

Shapes are read from DeepSpeed's `ds_shape` where ZeRO-3 has partitioned a weight already.
"""

from __future__ import annotations

import math

from torch import nn

from dspark_ds.engine.runtime import import_deepspeed


def _shape(param) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def _vocab_sizes(model: nn.Module) -> set[int]:
    config = getattr(model, "config", None)
    sizes = {int(getattr(config, "vocab_size", 0) or 0), int(getattr(model, "draft_vocab", 0) or 0)}
    return sizes - {0}


def muon_split(model: nn.Module) -> tuple[list, list]:
    """(Muon's, AdamW's) trained parameters of `model`, as (name, parameter) pairs."""
    vocab = _vocab_sizes(model)
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = _shape(param)
        matrix = len(shape) == 2 and min(shape) > 1 and not vocab & set(shape)
        (muon if matrix else adamw).append((name, param))
    return muon, adamw


def lr_scale(rows: int, cols: int) -> float:
    """The factor on Muon's lr that turns DeepSpeed's step on a [rows, cols] matrix into torch's
    `match_rms_adamw` step (the same RMS as AdamW's)."""
    return 0.2 * math.sqrt(max(rows, cols)) / math.sqrt(max(1.0, rows / cols))


def muon_param_groups(model: nn.Module, params: dict) -> list[dict]:
    """`MuonWithAuxAdam`'s groups from a DeepSpeed config's `optimizer.params` (engine/config.py:
    lr, betas, eps, weight_decay for AdamW; muon_lr, momentum, muon_weight_decay for Muon)."""
    muon, adamw = muon_split(model)
    by_shape: dict[tuple[int, int], list] = {}
    for _, param in muon:
        by_shape.setdefault(_shape(param), []).append(param)
    groups = []
    for (rows, cols), members in sorted(by_shape.items()):
        scale = lr_scale(rows, cols)
        for param in members:
            param.use_muon = True
        groups.append(
            dict(
                params=members,
                use_muon=True,
                lr=float(params["muon_lr"]) * scale,
                momentum=float(params["momentum"]),
                # DeepSpeed decays by the group's lr: the same shrink as at muon_lr
                weight_decay=float(params["muon_weight_decay"]) / scale,
            )
        )
    for _, param in adamw:
        param.use_muon = False
    if adamw:
        groups.append(
            dict(
                params=[p for _, p in adamw],
                use_muon=False,
                lr=float(params["lr"]),
                betas=tuple(float(b) for b in params["betas"]),
                eps=float(params["eps"]),
                weight_decay=float(params["weight_decay"]),
            )
        )
    return groups


def build_muon(model: nn.Module, ds_config: dict):
    """DeepSpeed's `MuonWithAuxAdam` over `model`'s trained weights (its AdamW half inline)."""
    import_deepspeed()
    # lazy: DeepSpeed's Muon (through import_deepspeed, which keeps MLflow out of its import)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    if get_accelerator().device_name() == "cpu":
        _run_eagerly(original_muon)
        _run_eagerly(muon_optimizer)
    return muon_optimizer.MuonWithAuxAdam(
        muon_param_groups(model, ds_config["optimizer"]["params"])
    )


def _run_eagerly(module) -> None:
    """DeepSpeed wraps Muon's update and its Newton-Schulz iterations in torch.compile; on a CPU
    that is an inductor C++ build per matrix shape (about 50 s for the tests' tiny drafter, more
    than its whole run) for matrices a CPU run keeps small, so there they run as written. The
    ZeRO optimizers import `muon_update` from its module when they call it, the optimizer's
    module at its import, and it calls the iterations through its module's globals: the
    modules' names are what is replaced."""
    names = ("muon_update", "adam_update", "zeropower_via_newtonschulz5")
    for name in (*names, "zeropower_via_gram_newtonschulz"):
        fn = getattr(module, name, None)
        eager = getattr(fn, "_torchdynamo_orig_callable", None)
        if eager is not None:
            setattr(module, name, eager)
