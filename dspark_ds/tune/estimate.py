"""Per-GPU memory of one ZeRO option for a recipe on a cluster (docs/tuner.md has the model).

Bytes per GPU; b = 2 under bf16, 4 under fp32; N = the data-parallel world size. Every ZeRO
value (stage, offload devices, bucket sizes, overlap_comm, the ZeRO-3 persistence thresholds)
is read from the DeepSpeed config training would use for the option: `engine.config.build_ds_config`
of the shipped JSON + the recipe's and the option's deepspeed.overrides, parsed by DeepSpeed's
own config class (`engine.config.zero_settings`).

- trainable drafter params P (exact counts from the drafter built on the meta device): params
  b, grads b, fp32 master 4 and fp32 grads 4 (bf16 only; ZeRO-1/2 keep an fp32 copy of their
  partition either way), Adam m + v 8. ZeRO-1 partitions the fp32 states, ZeRO-2 also the
  grads, ZeRO-3 also the params (except the persistent ones); offload_optimizer moves the fp32
  states to host RAM, offload_param the params. DeepSpeed's own estimators
  (estimate_zero2/zero3_model_states_mem_needs) are kept beside ours for bf16.
- the frozen embedding + lm_head (2·V·H; (V + N)·H with a draft vocabulary of N, whose head
  of N rows the drafter holds itself, also with the target in the job): with the target in the
  job (online / hybrid) the drafter uses the target's own Parameters, counted once with the
  target; offline a copy in the compute dtype. ZeRO-3 partitions them (and the in-job target)
  and gathers the lm_head / one target layer while in use.
- the in-job target's weights (whole on every GPU under ZeRO-0/1/2) and its forward (no grad):
  one layer's working set.
- hpZ (zero_hpz_partition_size h > 1): the secondary partition, every partitioned parameter
  once more over the h ranks of a node.
- DeepSpeed's buffers: ZeRO-1/2 gradient buckets (reduce_bucket_size elements, twice with
  overlap_comm), ZeRO-3's contiguous reduce buffer and prefetch bucket.
- activations of one micro-batch (B × S): the drafter kind's own terms (its
  `activation_bytes`: drafters/dspark/memory.py, drafters/eagle3/memory.py).

Speed: `steptime.py` (one named term per cost: compute, host time, collectives, offload
traffic, the optimizer, NVMe, DeepSpeed's own costs) for each option, from the cluster's rates
(`cluster.py`); search.py finds each option's micro-batch; the fastest predicted point that
fits is recommended.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from dspark_ds.cost.flops import target_in_job
from dspark_ds.cost.inventory import DTYPE_BYTES, Inventory
from dspark_ds.drafters.registry import get_kind
from dspark_ds.engine.config import (
    SHIPPED_DS_CONFIGS,
    ZeroSettings,
    build_ds_config,
    merge_config,
    zero_settings,
)
from dspark_ds.engine.probes import deepspeed_model_states_estimate
from dspark_ds.tune.cluster import Machine
from dspark_ds.tune.config import ALL_OPTION_NAMES, TunerConfig, ZeroOption

GB = 1024**3
STATE_KEYS = ("params", "params_working_set", "grads", "optimizer_states")
"""The device components that are trainable model states (the report's "states" column)."""


@dataclass
class Estimate:
    option: str
    device: dict[str, float] = field(default_factory=dict)
    """Bytes per GPU by component."""
    host_per_rank: dict[str, float] = field(default_factory=dict)
    """Host bytes per rank by component (offloaded states)."""
    deepspeed_states: float | None = None
    """DeepSpeed's own estimator for the trainable model states (bf16 ZeRO-2/3), per GPU."""
    deepspeed_host_per_node: float | None = None
    step: dict = field(default_factory=dict)
    """The predicted step (steptime.StepTime.as_dict): seconds, tokens/s, its terms."""
    fits: bool = False
    why: str = ""
    zero: dict = field(default_factory=dict)
    """The ZeRO settings the estimate read (engine.config.ZeroSettings as a dict)."""
    point: dict = field(default_factory=dict)
    """The searched point (search.py): micro_batch, recompute, accum, global_batch,
    largest_fitting_micro_batch, largest_fitting_with_recompute, note, tried; {} for an
    estimate of the recipe as given."""

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total_per_rank(self) -> float:
        return sum(self.host_per_rank.values())

    @property
    def states(self) -> float:
        return sum(v for k, v in self.device.items() if k in STATE_KEYS)

    @property
    def activations(self) -> float:
        return sum(v for k, v in self.device.items() if k.startswith("act_"))


# ---- the DeepSpeed config of an option ---------------------------------------------------------
def option_overrides(option: ZeroOption, run_cfg) -> dict:
    """The recipe's own deepspeed.overrides (bucket sizes, NVMe path...) with the option's on
    top."""
    return merge_config(run_cfg.deepspeed.overrides or {}, option.overrides or {})


def batch_mismatch(run_cfg, world_size: int) -> str | None:
    """Why training would refuse the recipe's global batch on `world_size` ranks, or None."""
    per_step = run_cfg.data.batch_size * world_size
    if run_cfg.train.global_batch_size % per_step == 0:
        return None
    return (
        f"train.global_batch_size {run_cfg.train.global_batch_size} is not a multiple of "
        f"data.batch_size × world size = {run_cfg.data.batch_size} × {world_size}: training "
        f"on this cluster would refuse it; change it with --overrides"
    )


def resolved_ds_config(
    option: ZeroOption, run_cfg, world_size: int, use_gpu: bool, ranks_per_node: int | None = None
) -> dict:
    """The DeepSpeed config `dspark-ds train` builds for this option on `world_size` ranks,
    `ranks_per_node` of them on a node (None: one node)."""
    section = replace(
        run_cfg.deepspeed, config=option.config, overrides=option_overrides(option, run_cfg)
    )
    train = run_cfg.train
    if batch_mismatch(run_cfg, world_size):
        # NOTE: memory does not depend on gradient accumulation; the report says what to fix
        train = replace(train, global_batch_size=run_cfg.data.batch_size * world_size)
    return build_ds_config(
        section,
        train,
        micro_batch_size=run_cfg.data.batch_size,
        world_size=world_size,
        use_gpu=use_gpu,
        ranks_per_node=ranks_per_node,
    )


# ---- the DeepSpeed keys the model reads --------------------------------------------------------
READ_KEYS = frozenset(
    {
        # the batch shape (filled from the run; an explicit value must agree with it)
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "bf16.enabled",
        # zero_settings (engine/config.py), under DeepSpeed's field names and their aliases
        "zero_optimization.stage",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.prefetch_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.param_persistence_threshold",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.model_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_param.device",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
        # where NVMe offload swaps and how (the calibration measures that directory with them)
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.nvme_path",
        "aio.block_size",
        "aio.queue_depth",
        "aio.thread_count",
        "aio.single_submit",
        "aio.overlap_events",
        # ZeRO++ hpZ: its gathers within the node-local group, its secondary partition
        "zero_optimization.zero_hpz_partition_size",
    }
)
"""Dotted keys of a DeepSpeed config that the memory estimate or the step-time model reads."""

NO_EFFECT_KEYS = frozenset(
    {
        "optimizer.type",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "gradient_clipping",
        "steps_per_print",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.gather_16bit_weights_on_model_save",
    }
)
"""Keys that change neither a step's memory nor its time (the optimizer's hyperparameters, the
clipping threshold, logging, what a checkpoint saves)."""


def dotted_keys(config: dict, prefix: str = "") -> list[str]:
    """The leaf keys of a nested dict, dotted (`zero_optimization.offload_param.device`)."""
    out = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += dotted_keys(value, name + ".")
        else:
            out.append(name)
    return out


def unread_keys(run_cfg) -> list[str]:
    """The recipe's (and the tuner's --overrides') deepspeed.overrides keys that neither the
    estimate nor the step-time model reads: every option's prediction ignores them."""
    keys = dotted_keys(run_cfg.deepspeed.overrides or {})
    return [k for k in keys if k not in READ_KEYS and k not in NO_EFFECT_KEYS]


def ds_config_warnings(run_cfg) -> list[str]:
    """One line per thing of the recipe's DeepSpeed section (and its optimizer) the predictions
    do not follow."""
    lines = []
    if run_cfg.train.optimizer == "muon":
        lines.append(
            "train.optimizer muon: the tuner prices AdamW for every trainable parameter: its "
            "memory counts two optimizer states per element where Muon keeps one for its "
            "matrices (an over-estimate), and its step times leave out Muon's Newton-Schulz "
            "iterations (4.7 of 20.7 s in a profile of the demo's CPU training): time a few "
            "steps of the run with dspark-ds train before trusting them"
        )
    unread = unread_keys(run_cfg)
    if unread:
        lines.append(
            "deepspeed.overrides keys the tuner's memory and step-time model do not read (its "
            f"figures ignore them; training would not): {', '.join(unread)}"
        )
    own = run_cfg.deepspeed.config
    if not (SHIPPED_DS_CONFIGS / f"{own}.json").is_file():
        lines.append(
            f"deepspeed.config {own}: the tuner compares the shipped configs (ds_configs/) "
            "with the recipe's deepspeed.overrides, not this file: pass the keys of it you "
            "need as --deepspeed.overrides"
        )
    return lines


# ---- the terms ------------------------------------------------------------------------------------
def partitioned_params(inv: Inventory, zero: ZeroSettings, world: int) -> int:
    """Trainable elements the option partitions across ranks (ZeRO-3 keeps persistent ones)."""
    if zero.stage != 3:
        return inv.trainable
    model_threshold = zero.model_persistence_threshold // world  # as zero.Init divides it
    return inv.trainable - inv.persistent(zero.param_persistence_threshold, model_threshold)


def model_states(
    inv: Inventory, zero: ZeroSettings, b: int, world: int, partitioned: int
) -> tuple[dict[str, float], dict[str, float]]:
    """The trainable drafter's params, grads, fp32 copies and Adam states: (device, host)."""
    P, stage = inv.trainable, zero.stage
    params = ((P - partitioned) + partitioned / world) * b if stage == 3 else P * b
    grads = P * b / world if stage >= 2 else P * b
    # fp32 master + fp32 grads under bf16; under fp32 ZeRO-1/2/3 still keep an fp32 partition
    fp32_copies = 8 if b == 2 else (4 if stage >= 1 else 0)
    opt_states = P * (fp32_copies + 8) / (world if stage >= 1 else 1)
    device: dict[str, float] = {}
    host: dict[str, float] = {}
    if stage == 3 and zero.offload_param:
        host["params"] = params
        device["params_working_set"] = min(P, inv.largest_module) * b
    else:
        device["params"] = params
    device["grads"] = grads
    if not zero.offload_optimizer:
        device["optimizer_states"] = opt_states
    else:
        host["optimizer_states"] = 0 if zero.offload_optimizer == "nvme" else opt_states
    # NVMe offload swaps through page-locked host buffers DeepSpeed allocates whole at start:
    # the parameters' (in their dtype), and the optimizer's (each one fp32 partition)
    if zero.param_swap_elems:
        host["nvme_param_buffers"] = zero.param_swap_elems * b
    if zero.optimizer_swap_buffers:
        largest = partitioned / world if stage == 3 else P / world
        host["nvme_optimizer_buffers"] = zero.optimizer_swap_buffers * largest * 4
    return device, host


def online_target_bytes(inv: Inventory, run_cfg) -> dict[str, float]:
    """The in-job target's weights and forward working set; {} when it does not run in the job."""
    if not target_in_job(run_cfg):
        return {}
    bt = DTYPE_BYTES[run_cfg.target.dtype]
    B, S, H, F = run_cfg.data.batch_size, run_cfg.data.max_length, inv.hidden, inv.intermediate
    return {
        "target_weights": inv.target_params * bt,
        # no grad: one layer's working set at a time (hidden, q/k/v, mlp) on top of the taps
        "target_forward": B * S * (4 * H + 3 * F) * bt,
    }


def frozen_and_target(
    inv: Inventory, zero: ZeroSettings, b: int, world: int, target: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """The frozen embedding + lm_head and the in-job target's weights: (device, host).

    With the target in the job (online / hybrid / synthetic) the drafter uses the target's own
    two Parameters (one copy, counted with the target, which ZeRO-3 partitions like the
    drafter); offline it holds a copy in the compute dtype."""
    device: dict[str, float] = {}
    host: dict[str, float] = {}
    in_job = "target_weights" in target
    off_param = zero.offload_param is not None
    head = inv.vocab * inv.hidden  # the drafter's lm_head: a draft vocabulary's N rows
    if zero.stage == 3:
        if not in_job:
            (host if off_param else device)["frozen_embed_lm_head"] = inv.frozen * b / world
        device["frozen_gathered"] = head * b  # the lm_head, gathered while in use
    elif not in_job:
        device["frozen_embed_lm_head"] = inv.frozen * b
    elif inv.draft_head:  # the target's own embedding, but a head of its own
        device["draft_head"] = inv.draft_head * b
    if in_job and zero.stage == 3:
        (host if off_param else device)["target_weights"] = target["target_weights"] / world
        # one decoder layer gathered at a time while the target runs
        layer = (inv.target_params - inv.frozen) / max(inv.target_layers, 1)
        device["target_gathered_layer"] = layer * target["target_weights"] / inv.target_params
    elif in_job:
        device["target_weights"] = target["target_weights"]
    return device, host


def hpz_secondary(
    inv: Inventory, zero: ZeroSettings, b: int, world: int, partitioned: int, in_job: bool
) -> dict[str, float]:
    """hpZ's secondary partition: each partitioned parameter once more, split over the
    node-local group only (the drafter's trainable ones, and the in-job target or the offline
    frozen embedding / lm_head); on the host with parameter offload (DeepSpeed's remote
    device)."""
    ranks = min(zero.hpz_partition_size, world)
    if zero.stage != 3 or ranks < 2:
        return {}
    frozen = inv.target_params if in_job else inv.frozen
    return {"hpz_secondary": (partitioned + frozen) * b / ranks}


def deepspeed_buffers(zero: ZeroSettings, b: int, partitioned: int) -> dict[str, float]:
    """Gradient buckets (and ZeRO-3's parameter prefetch), sized by the config's own values."""
    if zero.stage in (1, 2) and zero.contiguous_gradients:
        # ZeRO-1 stages the fp32 accumulator, ZeRO-2 the low-precision grads
        copies = 2 if zero.overlap_comm else 1
        return {"ds_grad_buckets": zero.reduce_bucket_size * copies * (4 if zero.stage == 1 else b)}
    if zero.stage == 3:
        # the contiguous gradient buffer is allocated whole (measured), even when every
        # parameter is persistent; prefetched parameters are in flight up to the bucket size
        return {
            "ds_grad_buckets": zero.reduce_bucket_size * b if zero.contiguous_gradients else 0.0,
            "ds_prefetch": min(zero.prefetch_bucket_size, partitioned) * b,
        }
    return {}


def activation_bytes(
    inv: Inventory, run_cfg, device: str = "cuda", stage: int = 2
) -> dict[str, float]:
    """Peak activation memory of one micro-batch (forward saved tensors + the largest backward
    transient), by component: the drafter kind's own model (drafters/<kind>/memory.py)."""
    kind = get_kind(run_cfg.model.kind)
    return kind.cost.activation_bytes(inv.step_shape(run_cfg), run_cfg.perf, device, stage)


def peak_phase(acts: dict[str, float], target: dict[str, float]) -> dict[str, float]:
    """The micro-batch's share of the peak. The target's forward ends (its transient freed)
    before the drafter's begins: the peak holds whichever phase is larger (the features it
    produced are part of both)."""
    if target.get("target_forward", 0.0) > sum(acts.values()) - acts["features_in"]:
        return {"act_features_in": acts["features_in"], "target_forward": target["target_forward"]}
    return {f"act_{k}": v for k, v in acts.items()}


def judge_fit(est: Estimate, cfg: TunerConfig, machine: Machine) -> None:
    """Sets `fits`, or `why` not: GPU memory less the reserve, 80 % of the node's host RAM."""
    limit = machine.gpu_memory_bytes - cfg.reserve_gb * GB
    host_limit = machine.host_memory_bytes * 0.8 / machine.gpus_per_node
    if est.device_total > limit:
        est.why = f"needs {est.device_total / GB:.1f} GiB per GPU > {limit / GB:.1f} GiB usable"
    elif est.host_total_per_rank > host_limit:
        est.why = (
            f"needs {est.host_total_per_rank * machine.gpus_per_node / GB:.0f} GiB host RAM "
            f"per node > 80% of {machine.host_memory_bytes / GB:.0f} GiB"
        )
    else:
        est.fits = True


# ---- one option -----------------------------------------------------------------------------------
def option_zero(
    option: ZeroOption, run_cfg, world: int, device: str, ranks_per_node: int | None = None
) -> tuple[ZeroSettings, int]:
    """The ZeRO settings training would use for the option on `world` ranks (`ranks_per_node`
    of them on a node; None: one node), and the bytes of its compute dtype."""
    ds_config = resolved_ds_config(option, run_cfg, world, device == "cuda", ranks_per_node)
    b = 2 if ds_config.get("bf16", {}).get("enabled") is True else 4
    return zero_settings(ds_config), b


def estimate(
    option: ZeroOption, inv: Inventory, run_cfg, cfg: TunerConfig, machine: Machine, nodes: int
) -> Estimate:
    device = cfg.device or "cuda"
    world = nodes * machine.gpus_per_node
    zero, b = option_zero(option, run_cfg, world, device, machine.gpus_per_node)
    partitioned = partitioned_params(inv, zero, world)
    est = Estimate(option.name, zero=asdict(zero))
    target = online_target_bytes(inv, run_cfg)
    for dev, host in (
        model_states(inv, zero, b, world, partitioned),
        frozen_and_target(inv, zero, b, world, target),
    ):
        est.device.update(dev)
        est.host_per_rank.update(host)
    secondary = hpz_secondary(inv, zero, b, world, partitioned, "target_weights" in target)
    (est.host_per_rank if zero.offload_param else est.device).update(secondary)
    est.device.update(deepspeed_buffers(zero, b, partitioned))
    acts = activation_bytes(inv, run_cfg, device, zero.stage)
    est.device.update(peak_phase(acts, target))
    if b == 2 and zero.stage in (2, 3):  # DeepSpeed's estimators assume bf16 / fp16
        cpu_mem, gpu_mem = deepspeed_model_states_estimate(
            zero.stage,
            inv.trainable,
            inv.largest_module,
            machine.gpus_per_node,
            nodes,
            zero.offload_optimizer is not None,
            zero.offload_param is not None,
        )
        est.deepspeed_states, est.deepspeed_host_per_node = float(gpu_mem), float(cpu_mem)
    judge_fit(est, cfg, machine)
    return est


def recommend(estimates: list[Estimate]) -> Estimate | None:
    """The fastest predicted point that fits (among equal times, the earlier option)."""
    order = {name: i for i, name in enumerate(ALL_OPTION_NAMES)}
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None
    # NOTE: times equal to 9 digits are equal (rounding must not pick between them)
    return min(
        fitting,
        key=lambda e: (float(f"{e.step.get('predicted_step_s', 0.0):.9g}"), order[e.option]),
    )
