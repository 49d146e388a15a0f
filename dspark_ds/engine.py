"""The DeepSpeed ZeRO engine around the drafter. The only module that imports deepspeed.

- `build_ds_config`: a JSON from `ds_configs/` (or a path) with its "auto" keys filled from the
  run (batch sizes, clipping, precision, AdamW); explicit keys must agree with the run.
- `DrafterEngine.build`: the drafter (inside `deepspeed.zero.Init` under ZeRO-3) wrapped by
  `deepspeed.initialize`; its frozen embedding / lm_head are the target's own Parameters when
  the target runs in the job (online / hybrid / synthetic: see "the target inside the job"
  below), copies of the target's tensors otherwise (offline). Frozen parameters are never
  given to the optimizer and never written into checkpoints.
- `load_target_in_job`: the online / hybrid target; under ZeRO-3 `load_partitioned_target`
  builds it inside `deepspeed.zero.Init` and each rank reads only its partitions from the
  checkpoint files.
- save / load (incl. DeepSpeed's universal checkpoint for a different world size) and the fp32
  weights of a checkpoint or of the live model, for export.
- for the ZeRO tuner: the ZeRO settings a config means (`zero_settings`), DeepSpeed's own memory
  estimators, and engines / CPU Adam around a stand-in model for its calibration
  (`plain_engine`, `frozen_engine`, `cpu_adam`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# NOTE: DeepSpeed's autotuner (a feature not used here) imports MLflow when it can: 1.7 s of
# CPU in every rank that starts, although only rank 0 tracks (dspark_ds.tracking imports MLflow
# itself). While DeepSpeed is imported, `import mlflow` fails for it, unless MLflow is loaded.
_MLFLOW_BLOCKED = "mlflow" not in sys.modules
if _MLFLOW_BLOCKED:
    sys.modules["mlflow"] = None  # type: ignore[assignment]
try:
    import deepspeed
finally:
    if _MLFLOW_BLOCKED and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
        del sys.modules["mlflow"]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.checkpoint.constants import (  # noqa: E402
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from torch import nn  # noqa: E402

from dspark_ds.config import DeepSpeedConfig, TrainConfig  # noqa: E402
from dspark_ds.errors import ConfigError  # noqa: E402

SHIPPED_DS_CONFIGS = Path(__file__).resolve().parent / "ds_configs"


# ---- config -------------------------------------------------------------------------------
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
) -> dict:
    """The DeepSpeed config dict of this run (see the module docstring)."""
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
    if cfg.get("fp16", {}).get("enabled") is True:
        raise ConfigError("deepspeed.config: fp16 is not supported; use train.precision bf16")
    optimizer = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if optimizer.get("type", "").lower() not in ("adamw", "adam"):
        raise ConfigError(
            f"deepspeed.config: optimizer.type must be AdamW, got {optimizer['type']!r}"
        )
    optimizer["type"] = "AdamW"
    fill("optimizer.params.lr", float(train.lr), "train.lr")
    fill("optimizer.params.betas", [float(b) for b in train.betas], "train.betas")
    fill("optimizer.params.eps", float(train.eps), "train.eps")
    fill("optimizer.params.weight_decay", float(train.weight_decay), "train.weight_decay")
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


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def optimizer_layout(ds_config: dict) -> dict[str, object]:
    """What a checkpoint's optimizer state depends on: the ZeRO stage (how it is partitioned),
    where optimizer and parameters live, and the optimizer implementation (torch's AdamW,
    DeepSpeed's fused or CPU Adam keep different param-group keys)."""
    zero = ds_config.get("zero_optimization", {})
    params = ds_config.get("optimizer", {}).get("params", {})
    return {
        "ZeRO stage": zero_stage(ds_config),
        "optimizer offload": zero.get("offload_optimizer", {}).get("device") or "none",
        "parameter offload": zero.get("offload_param", {}).get("device") or "none",
        "torch AdamW": bool(params.get("torch_adam", False)),
    }


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


def zero_settings(ds_config: dict) -> ZeroSettings:
    """The config's zero_optimization section parsed by DeepSpeed's own config class, so keys the
    section leaves out (or sets to "auto") take DeepSpeed's defaults, e.g. overlap_comm on at
    ZeRO-3 only, 5e8-element reduce buckets."""
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
    )


# ---- the target inside the job (online / hybrid mode) ----------------------------------------
# The drafter's `embed_tokens.weight` and `lm_head.weight` ARE the target's Parameter objects
# (`dspark_ds.target.share_embeddings_and_head`): one copy in memory, frozen, so never handed to
# the optimizer (it only gets requires_grad parameters) nor saved (exclude_frozen_parameters).
#   ZeRO-0/1/2: the target is a plain module, replicated on every rank.
#   ZeRO-3: the target arrives partitioned (`load_partitioned_target`: no rank ever holds it
#     whole) and `DrafterEngine.build` gives it to an optimizer-less DeepSpeed engine
#     (DeepSpeed's ZeRO-3 inference mode, same ds config): its parameters are partitioned across
#     ranks like the drafter's, and the hooks that engine puts on every submodule all-gather a
#     layer's weights just for that layer's forward, so calling `target(...)` (under no_grad,
#     taps are forward hooks) works unchanged. The drafter is then built inside zero.Init and
#     takes the two already-partitioned Parameters; its own engine's hooks gather them for the
#     drafter's forward. Either engine re-partitions them after use.
# NOTE: DeepSpeed casts a bf16 engine's parameters in place (`p.data = p.data.to(bf16)`): a
# shared Parameter in another dtype would silently change the target's embedding (and leave it
# unlike the rest of the target). So the target must already be in the compute dtype; anything
# else is refused (`check_target_dtype`).
def precision_dtype(precision: str) -> torch.dtype:
    """train.precision -> the compute dtype of the drafter (and of an in-job target)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def check_target_dtype(target_dtype: torch.dtype, precision: str) -> None:
    """Online / hybrid mode: the target must compute in the drafter's dtype (see above)."""
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
    from dspark_ds.target import load_target as load_whole

    if zero_stage(ds_config) == 3:
        return load_partitioned_target(target_cfg, ds_config)
    return load_whole(target_cfg, device)


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
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dspark_ds.target import (
        FrozenTarget,
        build_target_model,
        import_target_class,
        target_model_config,
    )
    from dspark_ds.target_weights import TargetWeights, fill_plan, local_target_dir

    config = target_model_config(target_cfg, partitioned=True)
    weights = TargetWeights(local_target_dir(target_cfg.path, target_cfg.revision))
    join_deepspeed_comm()
    import_target_class(config)
    # NOTE: zero.Init casts every floating tensor made inside it to the run's dtype by default;
    # the target's own dtype comes from target.dtype, and a buffer transformers computes in
    # fp32 (RoPE's inv_freq) must stay fp32 as from_pretrained leaves it, so only the device
    # is overridden.
    with deepspeed.zero.Init(
        config_dict_or_path=_target_ds_config(ds_config),
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
                # NOTE: DeepSpeed's layout (partition_parameters._partition_param): rank r
                # holds flat elements [r * size, (r + 1) * size) of the parameter, padded at
                # the end; tests/test_target_families_e2e.py pins it against a whole load.
                size = part.ds_numel
                start = size * dist.get_rank(group=tensor.ds_process_group)
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


def join_deepspeed_comm() -> None:
    """Hands the process group `dspark_ds.distributed.init` made to deepspeed.comm.

    NOTE: zero.Init reads the world size from deepspeed.comm, which reports 1 until it knows
    the group (the batch-size check then fails); wrapping the existing torch group makes no
    new rendezvous and keeps its backend and device.
    """
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def accelerator_name() -> str:
    """The accelerator DeepSpeed uses in this process ("cpu", "cuda", ...): chosen once, from
    DS_ACCELERATOR or the hardware, when DeepSpeed was first imported."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _shard_target(target: nn.Module, ds_config: dict):
    """ZeRO-3: the optimizer-less engine of the frozen target (partitioned first if it was
    loaded whole); returns the engine."""
    from deepspeed.accelerator import get_accelerator

    cfg = _target_ds_config(ds_config)
    if not any(hasattr(p, "ds_id") for p in target.parameters()):
        # NOTE: partition first, parameter by parameter onto the device (deepspeed.initialize
        # alone would move the whole module there before partitioning it).
        deepspeed.zero.Init(module=target, config_dict_or_path=cfg)
    device = torch.device(get_accelerator().current_device_name())
    for buf in target.buffers():  # buffers are not partitioned
        buf.data = buf.data.to(device)
    target_engine, _, _, _ = deepspeed.initialize(model=target, config=cfg)
    target_engine.eval()
    return target_engine


# ---- the engine -----------------------------------------------------------------------------
@torch.no_grad()
def _init_module_like_drafter(module: nn.Module, std: float) -> None:
    # NOTE: mirrors DSparkDraftModel.reset_parameters for one module. Under zero.Init the
    # drafter's own reset runs on already-partitioned (empty) tensors and does nothing, so the
    # engine re-initialises module by module, gathered. The 1-rank vs 2-rank test pins this.
    if isinstance(module, nn.Linear):
        module.weight.normal_(0.0, std)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, std)


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
    return _shard_target(target, ds_config)


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
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
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
                _init_module_like_drafter(module, std)
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


class DrafterEngine:
    """A drafter wrapped by a DeepSpeed engine, plus the save / load / export helpers."""

    def __init__(self, ds_engine, model: nn.Module, ds_config: dict, target_engine=None):
        self.ds = ds_engine
        self.model = model
        self.ds_config = ds_config
        self.zero_stage = zero_stage(ds_config)
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
        from dspark_ds.target import share_embeddings_and_head

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
        trainable = [p for p in model.parameters() if p.requires_grad]
        ds_engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=trainable,
            config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
        )
        return cls(ds_engine, model, ds_config, target_engine)

    # ---- the step ---------------------------------------------------------------------------
    def __call__(self, **batch):
        """The drafter's forward through DeepSpeed (ZeRO-3 gathers the weights it uses)."""
        return self.ds(**batch)

    @property
    def module(self) -> nn.Module:
        """The bare drafter (as a DeepSpeed engine's `.module`)."""
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> None:
        self.ds.step()

    def skip_step(self) -> None:
        """An optimizer step that is not taken (its loss was not finite): no update, but the
        learning-rate schedule moves on, so step numbers and rates stay those of the plan.
        Only valid when no micro-batch of the step has been back-propagated."""
        if self.ds.lr_scheduler is not None:
            self.ds.lr_scheduler.step()

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    @property
    def global_steps(self) -> int:
        return int(self.ds.global_steps)

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    @property
    def grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.ds.bfloat16_enabled() else torch.float32

    @property
    def optimizer_name(self) -> str:
        """The optimizer DeepSpeed built from the config (FusedAdam, DeepSpeedCPUAdam, AdamW...),
        under whatever ZeRO wrapper."""
        return type(getattr(self.ds, "basic_optimizer", None) or self.ds.optimizer).__name__

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, checkpoint_dir: str | Path, tag: str, client_state: dict) -> None:
        """Collective. Writes <checkpoint_dir>/<tag>/ without touching `latest` (the caller
        publishes the tag once every rank has finished)."""
        state = dict(client_state)
        # NOTE: ds_to_universal refuses ZeRO-1/2 checkpoints without this entry.
        state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }
        self.ds.save_checkpoint(
            str(checkpoint_dir),
            tag=tag,
            client_state=state,
            save_latest=False,
            exclude_frozen_parameters=True,
        )

    def load(self, checkpoint_dir: str | Path, tag: str) -> dict:
        """Collective. Restores weights, optimizer, scheduler; returns the client state."""
        path, client_state = self.ds.load_checkpoint(
            str(checkpoint_dir),
            tag=tag,
            load_module_strict=False,  # frozen embedding / lm_head are not in the file
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise ConfigError(f"{checkpoint_dir}/{tag}: DeepSpeed could not load it")
        return client_state or {}

    def full_fp32_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. Rank 0 gets every weight (trainable ones from the fp32 master copy);
        other ranks get None."""
        from deepspeed.utils import safe_get_full_fp32_param

        rank = dist.get_rank()
        out: dict[str, torch.Tensor] = {}
        seen: dict[int, torch.Tensor] = {}
        # NOTE: remove_duplicate=False: a tied target shares ONE Parameter as embedding and
        # lm_head; its partitioned state_dict entry would be empty under ZeRO-3.
        for name, param in self.model.named_parameters(remove_duplicate=False):
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
        for name, value in self.model.state_dict().items():
            if name not in out:
                out[name] = value.detach().float().cpu().clone()
        return out


# ---- checkpoint files (no process group needed) ----------------------------------------------
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
    return {k: v.float() for k, v in state.items()}


# ---- memory estimates (for the ZeRO tuner) -------------------------------------------------------
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
    if stage == 3:
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
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cpu, gpu = estimate_zero2_model_states_mem_needs(
        trainable_params,
        num_gpus_per_node=gpus_per_node,
        num_nodes=nodes,
        cpu_offload=offload_optimizer,
    )
    return int(cpu), int(gpu)


# ---- calibration (for the ZeRO tuner's step-time model) -------------------------------------------
def plain_engine(make_model: Callable[[], nn.Module], ds_config: dict):
    """A DeepSpeed engine around a stand-in model (the tuner's calibration measures what the
    engine adds to a step): built inside zero.Init under ZeRO-3, as the drafter is. Returns the
    engine; call it, `.backward(loss)`, `.step()`, and `release_engine` when done."""
    join_deepspeed_comm()
    if zero_stage(ds_config) == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
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
    return _shard_target(module.requires_grad_(False).eval(), ds_config)


def release_engine(ds_engine) -> None:
    """Drops an engine's hooks and buffers (DeepSpeed's `destroy` where it has one)."""
    if hasattr(ds_engine, "destroy"):
        ds_engine.destroy()


def cpu_adam(params: list[torch.Tensor], lr: float = 1e-4) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam (AdamW mode), the optimizer of an offloaded run."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True)


def aio_bandwidth(
    directory: str | Path, nbytes: int, aio: dict | None = None
) -> tuple[float, float]:
    """(write, read) seconds of one `nbytes` file under `directory` through DeepSpeed's
    asynchronous I/O, the path NVMe offload swaps through (O_DIRECT), with a config's `aio`
    settings (DeepSpeed's defaults where it leaves one out). The file is removed."""
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
