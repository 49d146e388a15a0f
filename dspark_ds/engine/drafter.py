"""`DrafterEngine`: the drafter wrapped by a DeepSpeed engine.

`DrafterEngine.build` makes the drafter (inside `deepspeed.zero.Init` under ZeRO-3) and hands it
to `deepspeed.initialize`; its frozen embedding / lm_head are the target's own Parameters when
the target runs in the job (online / hybrid / synthetic: `engine/target.py`), copies of the
target's tensors otherwise (offline). Frozen parameters are never given to the optimizer and
never written into checkpoints.

The trainer drives the DeepSpeed engine itself (`engine.ds.backward(loss)`, `.step()`,
`.train()`, `.eval()`); a drafter kind's step calls the `DrafterEngine` as its model (the forward
through DeepSpeed) and finds the bare drafter at `.module`, as on any DeepSpeed engine.
Checkpoints of the engine are `engine/checkpoint.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dspark_ds.engine.config import MUON, zero_stage
from dspark_ds.engine.optimizer import build_muon
from dspark_ds.engine.runtime import (
    import_deepspeed,
    join_deepspeed_comm,
    set_zero3_leaves,
    zero_init,
)
from dspark_ds.engine.target import check_target_dtype, shard_target
from dspark_ds.errors import ConfigError
from dspark_ds.target import share_embeddings_and_head


def _use_zero_init(ds_config: dict, zero_init: bool | None) -> bool:
    """deepspeed.zero_init: None = on under ZeRO-3; never outside ZeRO-3."""
    stage = zero_stage(ds_config)
    return (stage == 3) if zero_init is None else (zero_init and stage == 3)


def _prepare_target(target: nn.Module, ds_config: dict, use_zero_init: bool):
    """Checks an in-job target's dtype; under ZeRO-3 partitions it (returns its engine)."""
    bf16 = ds_config.get("bf16", {}).get("enabled") is True
    check_target_dtype(target.dtype, "bf16" if bf16 else "fp32")
    if zero_stage(ds_config) != 3:
        return None
    if not use_zero_init:
        # NOTE: DeepSpeed would take the drafter for a zero.Init model (it holds partitioned
        # Parameters) and skip its cast and device move.
        raise ConfigError(
            "deepspeed.zero_init: false is not supported with a target in the job under "
            "ZeRO-3 (its shared embedding and lm_head are partitioned); leave it unset"
        )
    return shard_target(target, ds_config)


def _build_whole(
    make_model: Callable[[], nn.Module],
    seed: int,
    init_state: dict[str, torch.Tensor] | None,
    shared_weights: tuple[torch.Tensor, torch.Tensor] | None,
) -> nn.Module:
    """ZeRO-0/1/2 (or zero_init off): the drafter built whole on every rank."""
    model = make_model()
    torch.manual_seed(seed)
    model.reset_parameters()
    if init_state is not None:
        own = model.state_dict()
        with torch.no_grad():
            for key, value in init_state.items():
                if key in own:
                    own[key].copy_(value.to(own[key].dtype))
    if shared_weights is not None:
        model.initialize_embeddings_and_head(*shared_weights)
    return model


def _build_partitioned(
    make_model: Callable[[], nn.Module],
    ds_config: dict,
    seed: int,
    init_state: dict[str, torch.Tensor] | None,
    shared_weights: tuple[torch.Tensor, torch.Tensor] | None,
) -> nn.Module:
    """ZeRO-3: the drafter built inside zero.Init (no rank holds it whole), then initialised
    module by module, gathered, on rank 0."""
    deepspeed = import_deepspeed()
    with zero_init(ds_config):
        model = make_model()
    rank = dist.get_rank()
    torch.manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                # NOTE: under zero.Init the drafter's own reset ran on already-partitioned
                # (empty) tensors and did nothing; each module is initialised here, gathered,
                # as its reset would (the 1-rank vs 2-rank test pins this)
                model.init_module(module, std)
                for pname, p in module.named_parameters(recurse=False):
                    full = f"{name}.{pname}" if name else pname
                    if init_state is not None and full in init_state:
                        p.data.copy_(init_state[full].to(p.dtype))
    if shared_weights is not None:
        with deepspeed.zero.GatheredParameters(
            [model.embed_tokens.weight, model.lm_head.weight], modifier_rank=0
        ):
            if rank == 0:
                model.initialize_embeddings_and_head(*shared_weights)
        model.freeze_shared()
    return model


def _copy_head_rows(model: nn.Module, target) -> None:
    """A draft vocabulary's head (model.draft_vocab_size) from the in-job target's lm_head, when
    ZeRO-3 partitions either: both gathered, copied on rank 0 (`share_embeddings_and_head`
    copies them when neither is)."""
    head, own = target.lm_head_weight, model.lm_head.weight
    if not (hasattr(head, "ds_shape") or hasattr(own, "ds_shape")):
        return
    with import_deepspeed().zero.GatheredParameters([head, own], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                own.copy_(model.head_weight_rows(head.detach()))


class DrafterEngine:
    """A drafter wrapped by a DeepSpeed engine (`ds`); `module` is the bare drafter."""

    def __init__(self, ds_engine, module: nn.Module, zero_stage: int, target_engine=None):
        self.ds = ds_engine
        self.module = module
        self.zero_stage = zero_stage
        self.target_engine = target_engine  # ZeRO-3 + a target in the job: owns its partitions

    @classmethod
    def build(
        cls,
        make_model: Callable[[], nn.Module],
        *,
        ds_config: dict,
        seed: int,
        lr_lambda: Callable[[int], float],
        target: nn.Module | None = None,
        shared_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
        init_state: dict[str, torch.Tensor] | None = None,
        zero_init: bool | None = None,
    ) -> DrafterEngine:
        """`make_model` builds a random drafter; `init_state` optionally replaces its random
        trainable weights. Exactly one of: `target`, the frozen target running in the job (a
        `FrozenTarget`), whose embedding / lm_head Parameters the drafter then shares and which
        is partitioned under ZeRO-3; `shared_weights` = (embedding, lm_head) tensors of a target
        not in the job, copied into the drafter."""
        if (target is None) == (shared_weights is None):
            raise ValueError("DrafterEngine.build: pass exactly one of target / shared_weights")
        join_deepspeed_comm()
        use_zero_init = _use_zero_init(ds_config, zero_init)
        target_engine = None
        if target is not None:
            target_engine = _prepare_target(target, ds_config, use_zero_init)
            if target_engine is not None:  # loaded partitioned: not checked yet
                target.check_head()  # one forward on every rank
        # NOTE: the drafter's own embedding / lm_head are initialised (and dropped when shared)
        # so that the random draws of every other module do not depend on the mode.
        if use_zero_init:
            model = _build_partitioned(make_model, ds_config, seed, init_state, shared_weights)
        else:
            model = _build_whole(make_model, seed, init_state, shared_weights)
        if target is not None:
            share_embeddings_and_head(model, target)
            if getattr(model, "draft_vocab", 0):
                _copy_head_rows(model, target)
        if zero_stage(ds_config) == 3:
            set_zero3_leaves(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer, config = None, ds_config
        if ds_config["optimizer"]["type"] == MUON:  # ours, with our groups (engine/optimizer.py)
            optimizer = build_muon(model, ds_config)
            config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        ds_engine, _, _, _ = import_deepspeed().initialize(
            model=model,
            model_parameters=trainable,
            optimizer=optimizer,
            config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
        )
        return cls(ds_engine, model, zero_stage(ds_config), target_engine)

    def __call__(self, **batch):
        """The drafter's forward through DeepSpeed (ZeRO-3 gathers the weights it uses)."""
        return self.ds(**batch)

    def skip_step(self) -> None:
        """An optimizer step that is not taken (its loss was not finite): no update, but the
        learning-rate schedule moves on, so step numbers and rates stay those of the plan.
        Only valid when no micro-batch of the step has been back-propagated."""
        if self.ds.lr_scheduler is not None:
            self.ds.lr_scheduler.step()

    @property
    def lr(self) -> float:
        """The learning rate of the next step (train.lr's schedule: under Muon, its AdamW
        group's; each Muon group's is scaled by its matrix shape)."""
        groups = self.ds.optimizer.param_groups
        return float(next((g["lr"] for g in groups if not g.get("use_muon")), groups[0]["lr"]))

    @property
    def grad_norm(self) -> float | None:
        """The last step's global gradient norm (None before the first)."""
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def optimizer_name(self) -> str:
        """The optimizer DeepSpeed built from the config (FusedAdam, DeepSpeedCPUAdam, AdamW...),
        under whatever ZeRO wrapper."""
        return type(getattr(self.ds, "basic_optimizer", None) or self.ds.optimizer).__name__
