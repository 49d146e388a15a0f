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
  engine/config.py from train.*); with an offloaded optimizer its AdamW half is DeepSpeed's CPU
  Adam, as DeepSpeed's own Muon has it there.
- `ns_owners` / the sharded step: under ZeRO-0 in fp32 on several ranks every rank holds
  every matrix and its gradient, and DeepSpeed's step runs every matrix's Newton-Schulz
  iteration on every rank; with `train.muon_shard_ns` each matrix's update is computed by one
  rank (DeepSpeed's `muon_update`, the same call on the same inputs) and broadcast with its
  momentum, so every rank applies the same bits for about 1/N of the work (ZeRO-1/2/3, and
  DeepSpeed's BF16 optimizer under ZeRO-0, partition the matrices and split it themselves).

Shapes are read from DeepSpeed's `ds_shape` where ZeRO-3 has partitioned a weight already.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dspark_ds.engine.config import optimizer_offloaded
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
    """DeepSpeed's `MuonWithAuxAdam` over `model`'s trained weights: its AdamW half inline, or
    DeepSpeed's CPU Adam when the optimizer is offloaded (as DeepSpeed builds its own Muon
    there: ZeRO-1/2/3 then orthogonalise the gathered gradients on the device and the CPU
    applies the step); its Newton-Schulz work split over the ranks under ZeRO-0 when
    `optimizer.params` asks (`muon_shard_ns`, from train.muon_shard_ns) and there are
    several."""
    import_deepspeed()
    # lazy: DeepSpeed's Muon (through import_deepspeed, which keeps MLflow out of its import)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    if get_accelerator().device_name() == "cpu":
        _run_eagerly(original_muon)
        _run_eagerly(muon_optimizer)
    params = ds_config["optimizer"]["params"]
    groups = muon_param_groups(model, params)
    # ZeRO-0 in fp32 keeps whole matrices on every rank; in bf16 DeepSpeed's BF16 optimizer
    # partitions them and splits the Newton-Schulz work itself, as ZeRO-1/2/3 do
    zero = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if params.get("muon_shard_ns") and zero == 0 and not bf16 and ranks > 1:
        return _sharded(muon_optimizer)(groups)
    if optimizer_offloaded(ds_config):
        # lazy: DeepSpeed's CPU Adam (its op is built on first use), as import_deepspeed above
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cpu_adam = {"adamw_mode": True, "fp32_optimizer_states": True}
        return muon_optimizer.MuonWithAuxAdam(
            groups, adam_optimizer=DeepSpeedCPUAdam, adam_optimizer_kwargs=cpu_adam
        )
    return muon_optimizer.MuonWithAuxAdam(groups)


def ns_cost(shape: tuple[int, ...]) -> int:
    """What one matrix's Newton-Schulz iteration costs, in proportion: its Gram matrix
    (short side²) times the long side."""
    short, long = sorted(shape) if len(shape) == 2 else (1, math.prod(shape))
    return short * short * long


def ns_owners(shapes: list[tuple[int, ...]], world_size: int) -> list[int]:
    """The rank that computes each matrix's update: the costliest first, each to the least
    loaded rank (ties to the lower rank), so every rank derives the same split from the shapes
    alone."""
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += ns_cost(shapes[i])
    return owners


def _sharded(muon_optimizer):
    """DeepSpeed's `MuonWithAuxAdam` whose Muon half computes each matrix's update on one rank
    (defined on first use: DeepSpeed is imported lazily)."""
    base = muon_optimizer.MuonWithAuxAdam

    class NSShardedMuonWithAuxAdam(base):
        """ZeRO-0 on several ranks: the same step as `MuonWithAuxAdam`'s, bit for bit (its
        `muon_update` runs on the owning rank with the gradient and momentum every rank holds
        alike, and the result is copied, not recomputed), each rank computing its share."""

        @torch.no_grad()
        def step(self, closure=None, step_id=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            muon = [g for g in self.param_groups if g["use_muon"]]
            updates = iter(self._muon_updates(muon))
            for group in muon:
                for p in group["params"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(next(updates).reshape(p.shape), alpha=-group["lr"])
            # the AdamW half as DeepSpeed's step runs it, over the other groups only
            every = self.param_groups
            self.param_groups = [g for g in every if not g["use_muon"]]
            try:
                base.step(self, step_id=step_id)
            finally:
                self.param_groups = every
            return loss

        def _muon_updates(self, groups: list[dict]) -> list[torch.Tensor]:
            """Every Muon matrix's update, in the groups' order."""
            params = [p for g in groups for p in g["params"]]
            if any(p.dim() < 2 for p in params):
                raise ValueError(
                    "the sharded Muon step needs whole weight matrices (ZeRO-0); "
                    "set train.muon_shard_ns false"
                )
            rank, world = dist.get_rank(), dist.get_world_size()
            owners = ns_owners([tuple(p.shape) for p in params], world)
            updates: list[torch.Tensor] = []
            for group in groups:
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    state = self.state[p]
                    if len(state) == 0:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    if owners[len(updates)] != rank:
                        updates.append(torch.empty_like(p.grad))
                        continue
                    updates.append(
                        muon_optimizer.muon_update(
                            p.grad,
                            state["momentum_buffer"],
                            beta=group["momentum"],
                            ns_method=group.get("ns_method", "gram"),
                            is_expert_group=getattr(p, "is_expert_group", False),
                        )
                    )
            for src in range(world):
                mine = [i for i, owner in enumerate(owners) if owner == src]
                tensors = [updates[i] for i in mine]
                tensors += [self.state[params[i]]["momentum_buffer"] for i in mine]
                _broadcast(tensors, src)
            return updates

    return NSShardedMuonWithAuxAdam


def _broadcast(tensors: list[torch.Tensor], src: int) -> None:
    """`tensors` from rank `src` into every other rank's, one flat buffer per dtype."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.broadcast(flat, src=src)
        if dist.get_rank() != src:
            for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(value)


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
