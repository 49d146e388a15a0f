"""ZeRO stage / offload tuner: per-GPU memory of a recipe on a cluster shape, for every ZeRO
stage × offload option, which fit, which should be fastest; `--measure` runs a few real steps of
each option here and prints measured peak memory and step time beside the estimate.

    python -m dspark_ds.tune.tuner --recipe dspark_ds/recipes/dspark_qwen3_8b.yaml \
        --nodes 1 --gpus_per_node 8 --gpu_memory_gb 80 --cpu_memory_gb 1024
    python -m dspark_ds.tune.tuner --recipe dspark_ds/recipes/tiny_cpu.yaml \
        --target_path runs/tiny_target --measure true        # (tools/zero_tuner.py is the same)

Estimate, per GPU (bytes; b = 2 under bf16, 4 under fp32; N = data-parallel world size):

- trainable drafter params P_t (exact counts from the drafter built on the meta device):
  params b, grads b, fp32 master 4 and fp32 grads 4 (bf16 only; ZeRO-1/2 keep an fp32 copy of
  their partition either way), Adam m + v 8. ZeRO-1 partitions the fp32 states, ZeRO-2 also the
  grads, ZeRO-3 also the params (except those below stage3_param_persistence_threshold);
  offload_optimizer moves the fp32 states to host RAM, offload_param the params. DeepSpeed's own
  estimators (estimate_zero2/zero3_model_states_mem_needs) are shown beside ours for bf16.
- the frozen embedding + lm_head (2·V·H): with the target in the job (online / hybrid) the
  drafter uses the target's own Parameters, counted once with the target; offline a copy in the
  compute dtype. ZeRO-3 partitions them (and the in-job target) and gathers the lm_head / one
  target layer while in use.
- the in-job target's weights (whole on every GPU under ZeRO-0/1/2) and its forward (no grad):
  the tapped layers and one layer's working set.
- DeepSpeed's buffers: ZeRO-1/2 gradient buckets (reduce_bucket_size elements, twice with
  overlap_comm), ZeRO-3 reduce + prefetch buckets.
- activations of one micro-batch (B × S), per attention implementation and loss path
  (dspark_ds/tune/activations.py): the batch's features, what autograd saves in the draft
  layers (norms, q / k / v, the attention's own saves, the MLP), and the larger of the loss's
  working set (the reference path's fp32 [B·A·γ, V] tensors, or one chunk of
  loss_chunk_anchors·γ rows) and the attention backward's transients. Checked on CPU against
  the bytes autograd saves and the peak of live tensors (docs/tuner.md).

Speed: the same compute for every option, so the ranking is by overhead: ZeRO-3 gathers
parameters in forward and backward (1.5× ZeRO-2's traffic), offloading the optimizer runs Adam on
the CPU and moves gradients and weights over PCIe every step, offloading parameters moves them
every forward and backward. The fastest option that fits is recommended.
"""

from __future__ import annotations

import copy
import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

GB = 1024**3
MB = 1024**2

# Public configs of the targets the shipped recipes use (no download needed to estimate them).
KNOWN_TARGETS: dict[str, dict] = {
    "Qwen/Qwen3-4B": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-8B": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-14B": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class ZeroOption:
    name: str
    config: str
    """Shipped DeepSpeed JSON (deepspeed.config)."""
    overrides: dict | None = None
    """deepspeed.overrides that turn it into this option."""

    @property
    def cli(self) -> str:
        text = f"--deepspeed.config {self.config}"
        if self.overrides:
            text += f" --deepspeed.overrides '{json.dumps(self.overrides)}'"
        return text


_OFF_OPT = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
OPTIONS: list[ZeroOption] = [
    ZeroOption("zero0", "zero0"),
    ZeroOption("zero1", "zero1"),
    ZeroOption("zero2", "zero2"),
    ZeroOption("zero2+offload_opt", "zero2", _OFF_OPT),
    ZeroOption("zero3", "zero3"),
    ZeroOption("zero3+offload_opt", "zero3", _OFF_OPT),
    ZeroOption("zero3+offload_opt+param", "zero3_offload_cpu"),
    ZeroOption("zero3+nvme", "zero3_offload_nvme"),
]
OPTION_NAMES = [o.name for o in OPTIONS]


@dataclass
class TunerConfig:
    """`python -m dspark_ds.tune.tuner`: which ZeRO stage / offload fits a recipe on a cluster."""

    recipe: str = "dspark_ds/recipes/dspark_qwen3_8b.yaml"
    """A `dspark-ds train` YAML recipe."""
    overrides: list[str] = field(default_factory=list)
    """Extra `dspark-ds train` flags applied on top of the recipe, e.g. [--data.batch_size, 2]."""
    target_path: str | None = None
    """Replace target.path (a local model directory or a hub id listed in KNOWN_TARGETS)."""
    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """GPUs (= ranks) per node."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU (GiB)."""
    cpu_memory_gb: float = 1024.0
    """Host RAM of one node (GiB), for offloading."""
    device: str | None = None
    """Where the estimate is for: cuda (flex attention: no score matrices) or cpu (blockwise /
    dense attention); None = cuda, except cpu for --measure on a machine without CUDA."""
    reserve_gb: float = 2.0
    """Per-GPU memory kept free for the CUDA context, NCCL and allocator fragmentation."""
    options: list[str] = field(default_factory=lambda: list(OPTION_NAMES))
    """Options to estimate (and measure): any of zero0, zero1, zero2, zero2+offload_opt,
    zero3, zero3+offload_opt, zero3+offload_opt+param, zero3+nvme."""
    measure: bool = False
    """Run a few real steps of each option on this machine (the world size of the launcher,
    e.g. torchrun --nproc_per_node 2) and print measured peak memory and step time."""
    measure_steps: int = 3
    """Timed optimizer steps per option (after one warm-up step that measures memory)."""
    output_json: str | None = None
    """Also write the table as JSON here."""

    def validate(self) -> TunerConfig:
        for name in ("nodes", "gpus_per_node", "measure_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory_gb", "cpu_memory_gb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        bad = [o for o in self.options if o not in OPTION_NAMES]
        if bad:
            raise ValueError(f"options: unknown {bad}; choose from {OPTION_NAMES}")
        return self


# ---- the model inventory -----------------------------------------------------------------------
@dataclass
class Inventory:
    """Parameter counts and the shapes the activations depend on."""

    trainable: int
    frozen: int
    trainable_persistent: int
    """Trainable parameters below stage3_param_persistence_threshold (never partitioned)."""
    largest_module: int
    """Elements of the largest module (DeepSpeed's `largest_layer_params`)."""
    target_params: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_layers: int
    target_layers: int
    taps: int
    markov_rank: int


def load_recipe(cfg: TunerConfig):
    from dspark_ds.config import TrainRunConfig, parse

    argv = ["--config", cfg.recipe, *cfg.overrides]
    if cfg.target_path:
        argv += ["--target.path", cfg.target_path]
    return parse(TrainRunConfig, argv, prog="dspark-ds tune")


def target_config_of(path: str):
    from transformers import AutoConfig, Qwen3Config

    if path in KNOWN_TARGETS and not Path(path).exists():
        return Qwen3Config(**KNOWN_TARGETS[path])
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        raise ValueError(
            f"target.path: cannot read the config of {path!r} ({err}); use a local "
            f"directory or one of {sorted(KNOWN_TARGETS)}"
        ) from err


def inventory(run_cfg, persistence_threshold: int = 100_000) -> Inventory:
    """Counts from the real drafter and target classes built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from dspark_ds.drafters import build_draft_config, build_draft_model
    from dspark_ds.target import default_layer_ids, text_config

    tcfg_full = target_config_of(run_cfg.target.path)
    tcfg = text_config(tcfg_full)
    layer_ids = run_cfg.target.layer_ids or default_layer_ids(int(tcfg.num_hidden_layers))
    m = run_cfg.model
    draft_cfg = build_draft_config(
        tcfg_full,
        target_layer_ids=layer_ids,
        mask_token_id=m.mask_token_id if m.mask_token_id is not None else 0,
        num_draft_layers=m.num_draft_layers,
        block_size=m.block_size,
        num_anchors=m.num_anchors,
        markov_rank=m.markov_rank,
        markov_head_type=m.markov_head_type,
        confidence_head_alpha=m.confidence_head_alpha,
        confidence_head_with_markov=m.confidence_head_with_markov,
    )
    with torch.device("meta"):
        drafter = build_draft_model(draft_cfg)
        target = AutoModelForCausalLM.from_config(tcfg_full)
    frozen_names = {"embed_tokens.weight", "lm_head.weight"}
    trainable = frozen = persistent = 0
    for name, p in drafter.named_parameters():
        if name in frozen_names:
            frozen += p.numel()
        else:
            trainable += p.numel()
            if p.numel() < persistence_threshold:
                persistent += p.numel()
    largest = max(
        sum(p.numel() for p in mod.parameters(recurse=False)) for mod in drafter.modules()
    )
    target_params = sum(p.numel() for p in target.parameters())
    heads = int(tcfg.num_attention_heads)
    return Inventory(
        trainable=trainable,
        frozen=frozen,
        trainable_persistent=persistent,
        largest_module=largest,
        target_params=target_params,
        hidden=int(tcfg.hidden_size),
        intermediate=int(tcfg.intermediate_size),
        vocab=int(tcfg.vocab_size),
        heads=heads,
        kv_heads=int(getattr(tcfg, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads),
        draft_layers=m.num_draft_layers,
        target_layers=int(tcfg.num_hidden_layers),
        taps=len(layer_ids),
        markov_rank=m.markov_rank,
    )


# ---- the estimate -------------------------------------------------------------------------------
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
    overhead: float = 0.0
    """Relative step overhead used for the ranking (0 = ZeRO-0/1/2 without offload)."""
    fits: bool = False
    why: str = ""

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total_per_rank(self) -> float:
        return sum(self.host_per_rank.values())


def option_overrides(option: ZeroOption, run_cfg) -> dict:
    """The recipe's own deepspeed.overrides (bucket sizes, NVMe path...) with the option's on
    top."""
    from dspark_ds.engine import _merge

    return _merge(run_cfg.deepspeed.overrides or {}, option.overrides or {})


def _zero_section(option: ZeroOption, run_cfg) -> dict:
    from dspark_ds.engine import SHIPPED_DS_CONFIGS, _merge

    cfg = json.loads((SHIPPED_DS_CONFIGS / f"{option.config}.json").read_text())
    return _merge(cfg, option_overrides(option, run_cfg)).get("zero_optimization", {})


def activation_bytes(
    inv: Inventory, run_cfg, device: str = "cuda", stage: int = 2
) -> dict[str, float]:
    """Peak activation memory of one micro-batch, by component (dspark_ds/tune/activations.py:
    what autograd saves per attention implementation and loss path, and the loss's peak)."""
    from dspark_ds.perf.config import PerfConfig
    from dspark_ds.tune.activations import StepShape
    from dspark_ds.tune.activations import activation_bytes as micro_batch_bytes

    perf = getattr(run_cfg, "perf", None) or PerfConfig()
    m = run_cfg.model
    shape = StepShape(
        batch=run_cfg.data.batch_size,
        seq_len=run_cfg.data.max_length,
        num_anchors=m.num_anchors,
        block_size=m.block_size,
        hidden=inv.hidden,
        intermediate=inv.intermediate,
        vocab=inv.vocab,
        heads=inv.heads,
        kv_heads=inv.kv_heads,
        head_dim=inv.head_dim,
        draft_layers=inv.draft_layers,
        taps=inv.taps,
        markov_rank=inv.markov_rank,
        compute_bytes=2 if run_cfg.train.precision == "bf16" else 4,
        feature_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[run_cfg.target.dtype],
        confidence_head=m.confidence_head_alpha > 0,
    )
    attn = perf.attn_implementation
    if attn == "auto":  # the drafter's own rule (DSparkDraftModel.resolve_attn_implementation)
        attn = "flex" if device == "cuda" else "blockwise"
    # the trainer's rule (dspark_ds.drafters.dspark.step.resolve_loss_impl): "auto" is
    # chunked, in its recompute form under ZeRO-3
    loss = "chunked" if perf.loss_impl == "auto" else perf.loss_impl
    if loss == "chunked" and stage == 3:
        loss = "recompute"
    return micro_batch_bytes(shape, attn, loss, perf.chunk_anchors(device))


def online_target_bytes(inv: Inventory, run_cfg) -> dict[str, float]:
    if run_cfg.data.mode == "offline" and not run_cfg.train.synthetic_samples:
        return {}
    bt = {"float32": 4, "bfloat16": 2, "float16": 2}[run_cfg.target.dtype]
    B, S, H, F = run_cfg.data.batch_size, run_cfg.data.max_length, inv.hidden, inv.intermediate
    return {
        "target_weights": inv.target_params * bt,
        # no grad: one layer's working set at a time (hidden, q/k/v, mlp) on top of the taps
        "target_forward": B * S * (4 * H + 3 * F) * bt,
    }


def estimate(option: ZeroOption, inv: Inventory, run_cfg, cfg: TunerConfig) -> Estimate:
    zero = _zero_section(option, run_cfg)
    stage = int(zero.get("stage", 0))
    off_opt = zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme")
    off_param = zero.get("offload_param", {}).get("device") in ("cpu", "nvme")
    nvme = zero.get("offload_optimizer", {}).get("device") == "nvme"
    bf16 = run_cfg.train.precision == "bf16"
    b = 2 if bf16 else 4
    N = cfg.nodes * cfg.gpus_per_node
    P = inv.trainable
    P_part = P - (inv.trainable_persistent if stage == 3 else 0)
    P_rep = P - P_part
    est = Estimate(option.name)
    dev, host = est.device, est.host_per_rank

    # trainable model states
    params = (P_rep + P_part / N) * b if stage == 3 else P * b
    grads = P * b / N if stage >= 2 else P * b
    # fp32 master (+ fp32 grads under bf16): ZeRO-1/2/3 always keep an fp32 partition
    fp32_copies = (
        (4 if bf16 else 0) + (4 if bf16 else 0) if stage == 0 else (4 + (4 if bf16 else 0))
    )
    opt_states = P * (fp32_copies + 8) / (N if stage >= 1 else 1)
    if stage == 3 and off_param:
        host["params"] = params
        dev["params_working_set"] = min(P, inv.largest_module) * b
    else:
        dev["params"] = params
    dev["grads"] = grads
    if off_opt:
        host["optimizer_states"] = 0 if nvme else opt_states
    else:
        dev["optimizer_states"] = opt_states

    # frozen embedding + lm_head. With the target in the job (online / hybrid / synthetic) the
    # drafter uses the target's own two Parameters (one copy, counted with the target, which
    # ZeRO-3 partitions like the drafter); offline it holds a copy in the compute dtype.
    target = online_target_bytes(inv, run_cfg)
    in_job = "target_weights" in target
    if stage == 3:
        if not in_job:
            (host if off_param else dev)["frozen_embed_lm_head"] = inv.frozen * b / N
        dev["frozen_gathered"] = inv.frozen / 2 * b  # the lm_head, gathered while in use
    elif not in_job:
        dev["frozen_embed_lm_head"] = inv.frozen * b

    # DeepSpeed buffers
    overlap = bool(zero.get("overlap_comm", stage == 3))
    contiguous = bool(zero.get("contiguous_gradients", True))
    rbs = float(zero.get("reduce_bucket_size", 5e8))
    if stage in (1, 2) and contiguous:
        # ZeRO-1 stages the fp32 accumulator, ZeRO-2 the low-precision grads
        dev["ds_grad_buckets"] = rbs * (2 if overlap else 1) * (4 if stage == 1 else b)
    elif stage == 3:
        prefetch = float(zero.get("stage3_prefetch_bucket_size", 5e7))
        # the contiguous gradient buffer is allocated whole (measured), even when every
        # parameter is persistent; prefetched parameters are in flight up to the bucket size
        dev["ds_grad_buckets"] = rbs * b if contiguous else 0.0
        dev["ds_prefetch"] = min(prefetch, P_part) * b

    if in_job and stage == 3:
        (host if off_param else dev)["target_weights"] = target["target_weights"] / N
        # one decoder layer gathered at a time while the target runs
        layer = (inv.target_params - inv.frozen) / max(inv.target_layers, 1)
        dev["target_gathered_layer"] = layer * target["target_weights"] / inv.target_params
    elif in_job:
        dev["target_weights"] = target["target_weights"]
    acts = activation_bytes(inv, run_cfg, cfg.device or "cuda", stage)
    # the target's forward ends (its transient freed) before the drafter's begins: the peak
    # holds whichever phase is larger (the features it produced are part of both)
    if target.get("target_forward", 0.0) > sum(acts.values()) - acts["features_in"]:
        dev["act_features_in"] = acts["features_in"]
        dev["target_forward"] = target["target_forward"]
    else:
        dev.update({f"act_{k}": v for k, v in acts.items()})

    # DeepSpeed's own estimators for the trainable model states (they assume bf16 / fp16)
    if bf16 and stage in (2, 3):
        from dspark_ds.engine import deepspeed_model_states_estimate

        cpu_mem, gpu_mem = deepspeed_model_states_estimate(
            stage, P, inv.largest_module, cfg.gpus_per_node, cfg.nodes, off_opt, off_param
        )
        est.deepspeed_states, est.deepspeed_host_per_node = float(gpu_mem), float(cpu_mem)

    # speed: relative overhead of this option over plain data parallelism
    overhead = 0.0
    if stage == 3:
        overhead += 0.15
    if off_opt:
        overhead += 0.35 if not nvme else 0.8
    if off_param:
        overhead += 0.3 if not nvme else 0.6
    est.overhead = overhead

    limit = cfg.gpu_memory_gb * GB - cfg.reserve_gb * GB
    host_limit = cfg.cpu_memory_gb * GB * 0.8 / cfg.gpus_per_node
    if est.device_total > limit:
        est.why = f"needs {est.device_total / GB:.1f} GiB per GPU > {limit / GB:.1f} GiB usable"
    elif est.host_total_per_rank > host_limit:
        est.why = (
            f"needs {est.host_total_per_rank * cfg.gpus_per_node / GB:.0f} GiB host RAM "
            f"per node > 80% of {cfg.cpu_memory_gb:.0f} GiB"
        )
    else:
        est.fits = True
    return est


def recommend(estimates: list[Estimate]) -> Estimate | None:
    order = {name: i for i, name in enumerate(OPTION_NAMES)}
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None
    # least overhead; among equals the lower stage (less communication, simpler checkpoints),
    # except that ZeRO-0/1 replicate more memory for no speed gain over ZeRO-2
    return min(
        fitting, key=lambda e: (e.overhead, 0 if e.option == "zero2" else 1, order[e.option])
    )


# ---- measurement ---------------------------------------------------------------------------------
def _cpu_peak(prof) -> float:
    """Peak of the bytes held by torch's CPU allocator during the profile, relative to its
    start (every allocation and free is a "[memory]" event with a signed size)."""
    events = prof.profiler.kineto_results.events()
    mem = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    live = peak = 0
    for _, n in mem:
        live += n
        peak = max(peak, live)
    return float(peak)


def measure(option: ZeroOption, run_cfg, steps: int, workdir: str) -> dict[str, float]:
    """Builds the trainer for this option and runs 1 + `steps` optimizer steps: peak memory of
    the build + first step (CUDA: max_memory_allocated; CPU: the profiler's allocation timeline),
    then the mean time of the next `steps`."""
    from dspark_ds import distributed
    from dspark_ds.train.trainer import Trainer

    cfg = copy.deepcopy(run_cfg)
    cfg.deepspeed.config = option.config
    cfg.deepspeed.overrides = option_overrides(option, run_cfg) or None
    cfg.name = "tuner_" + option.name.replace("+", "_")
    cfg.output_dir = workdir
    cfg.tracking.enabled = False
    cfg.checkpoint.every_steps, cfg.checkpoint.resume = 0, None
    cfg.checkpoint.save_final = cfg.checkpoint.export_final = False
    cfg.train.progress_bar = False
    cfg.train.max_steps = steps + 1
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    from torch.profiler import ProfilerActivity, profile

    prof_ctx = (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) if not cuda else _Null()
    )
    with prof_ctx as prof:
        trainer = Trainer(cfg)
        it = iter(trainer.source)
        _one_step(trainer, it)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else _cpu_peak(prof)
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        distributed.barrier()
        t0 = time.perf_counter()
        _one_step(trainer, it)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak, step_s = distributed.all_reduce_values([peak, sum(times) / len(times)], op="max")
    _release(trainer)
    return {"peak_bytes": peak, "step_s": step_s}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _one_step(trainer, it) -> None:
    for _ in range(trainer.grad_accum):
        batch = next(it)
        loss, _ = trainer._forward_loss(batch)
        trainer.engine.backward(loss)
        trainer.engine.step()


def _release(trainer) -> None:
    ds = trainer.engine.ds
    if hasattr(ds, "destroy"):
        ds.destroy()
    trainer.engine = None
    trainer.target = None
    gc.collect()


# ---- report ------------------------------------------------------------------------------------
def _fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / GB:.2f} GiB" if x >= GB else f"{x / MB:.1f} MiB"


def report(
    estimates: list[Estimate],
    cfg: TunerConfig,
    inv: Inventory,
    run_cfg,
    measured: dict[str, dict] | None = None,
) -> str:
    lines = [
        f"recipe {cfg.recipe}: drafter {inv.trainable / 1e6:.1f} M trainable + "
        f"{inv.frozen / 1e6:.1f} M frozen params, target {inv.target_params / 1e9:.2f} B "
        f"({run_cfg.data.mode}), micro-batch {run_cfg.data.batch_size} × "
        f"{run_cfg.data.max_length}, A={run_cfg.model.num_anchors} γ={run_cfg.model.block_size} "
        f"V={inv.vocab}, {run_cfg.train.precision}",
        f"cluster {cfg.nodes} node(s) × {cfg.gpus_per_node} GPU(s) of {cfg.gpu_memory_gb:g} GiB, "
        f"{cfg.cpu_memory_gb:g} GiB host RAM per node",
        "",
    ]
    header = [
        "option",
        "per GPU",
        "host/node",
        "states",
        "DeepSpeed est.",
        "activations",
        "fits",
        "overhead",
    ]
    if measured:
        header += ["measured peak", "est/meas", "step s"]
    rows = []
    for e in estimates:
        states = sum(
            v
            for k, v in e.device.items()
            if k in ("params", "params_working_set", "grads", "optimizer_states")
        )
        act = sum(v for k, v in e.device.items() if k.startswith("act_"))
        row = [
            e.option,
            _fmt_bytes(e.device_total),
            _fmt_bytes(e.host_total_per_rank * cfg.gpus_per_node),
            _fmt_bytes(states),
            _fmt_bytes(e.deepspeed_states),
            _fmt_bytes(act),
            "yes" if e.fits else "no",
            f"+{e.overhead:.0%}",
        ]
        if measured:
            m = measured.get(e.option)
            if m is None:
                row += ["-", "-", "-"]
            else:
                est_here = e.device_total + e.host_total_per_rank
                row += [
                    _fmt_bytes(m["peak_bytes"]),
                    f"{est_here / m['peak_bytes']:.2f}",
                    f"{m['step_s']:.3f}",
                ]
        rows.append(row)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines.append("  ".join(f"{h:<{w}}" for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) for r in rows]
    for e in estimates:
        if not e.fits:
            lines.append(f"  {e.option}: does not fit: {e.why}")
    best = recommend(estimates)
    lines.append("")
    if best is None:
        lines.append(
            "nothing fits: lower data.batch_size / data.max_length / model.num_anchors, "
            "use the chunked loss, more GPUs, or data.mode offline"
        )
    else:
        option = next(o for o in OPTIONS if o.name == best.option)
        lines.append(
            f"recommended: {best.option} ({option.cli}): the least overhead among the "
            f"options that fit, {_fmt_bytes(best.device_total)} per GPU"
        )
    if measured:
        lines.append(
            "measured here: estimate covers device + host bytes of one rank "
            "(on a CPU-only machine both live in the same RAM)"
        )
    return "\n".join(lines)


def run(cfg: TunerConfig) -> dict:
    """Estimate (and measure); prints the table on rank 0 and returns it as a dict."""
    cfg.validate()
    run_cfg = load_recipe(cfg)
    options = [o for o in OPTIONS if o.name in cfg.options]
    measured: dict[str, dict] | None = None
    if cfg.measure:
        from dspark_ds import distributed

        rank, world, _ = distributed.init(run_cfg.deepspeed.backend)
        cfg = replace(
            cfg,
            nodes=1,
            gpus_per_node=world,
            device=cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        )
        measured = {}
        with tempfile.TemporaryDirectory(prefix="dspark_tuner_") as tmp:
            for option in options:
                if option.name == "zero3+nvme":
                    continue  # needs an NVMe path and libaio; estimate only
                measured[option.name] = measure(option, run_cfg, cfg.measure_steps, tmp)
    inv = inventory(run_cfg)
    estimates = [estimate(o, inv, run_cfg, cfg) for o in options]
    text = report(estimates, cfg, inv, run_cfg, measured)
    result = {
        "inventory": asdict(inv),
        "estimates": [
            asdict(e)
            | {"device_total": e.device_total, "host_total_per_rank": e.host_total_per_rank}
            for e in estimates
        ],
        "measured": measured or {},
        "recommended": (recommend(estimates) or Estimate("none")).option,
        "text": text,
    }
    from dspark_ds.distributed import is_rank0

    if is_rank0():
        print(text, flush=True)
        if cfg.output_json:
            Path(cfg.output_json).write_text(json.dumps(result, indent=1, default=float))
    return result
