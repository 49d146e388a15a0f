"""What one micro-batch of a recipe costs, independent of the machine: its matmul FLOPs (the
drafter kind's own count and the in-job target's forward: cost/flops.py), its host work in units
of one tensor op of a stand-in model, and how often its modules run (ZeRO-3 hooks each module
call).

Host work matters where tensors are small (every op costs host time whatever its size: the
tiny CPU recipe is all such time); the FLOPs where they are large. A copy of the drafter 32
wide (the recipe's layer count, block size, anchors, chunking, loss path and attention) runs
one forward + loss + backward through the kind's `training_step`, the target's forward
likewise (`FrozenTarget`, as training calls it). For a CPU machine their seconds over the
seconds per op of a stand-in (a small Qwen3 model, timed in the same process) give the work in
stand-in ops, which the machine's calibrated seconds per op turn into seconds: the drafter's
Python between its ops (the loss's bookkeeping, the metrics) and its small matmuls cost more
per op than the stand-in's, which a raw op count would miss. For a GPU machine the host only
launches each op: the raw op count is the work. The loops of the blockwise attention and the
chunked loss depend on the anchors (DSpark) or positions (Eagle3) and the chunk sizes, which the
copy keeps (`DrafterKind.cost.host_scale`: past 64, two copies at 32 and 64 and a line through
them); the widths do not change them. The same copies, under a real DeepSpeed engine, are what the calibration times
DeepSpeed's own costs on (calibrate.py).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dspark_ds.cost.flops import drafter_flops, target_forward_flops, target_in_job
from dspark_ds.cost.inventory import Inventory, target_config_of
from dspark_ds.distributed import collective_device, has_group
from dspark_ds.drafters import build_draft_model
from dspark_ds.drafters.common.target_config import global_attr, text_config
from dspark_ds.drafters.kind import TRAIN_KEYS, StepContext
from dspark_ds.drafters.registry import get_kind
from dspark_ds.target import FrozenTarget, default_layer_ids
from dspark_ds.target_checkpoint import causal_lm_config

NARROW = dict(hidden=32, intermediate=64, heads=2, head_dim=8, vocab=256)
"""The widths of the copy whose host work is timed."""
SCALE_POINTS = (32, 64)
"""Past the last of these, the copy's work is extrapolated linearly in the kind's host scale
(`DrafterKind.cost.host_scale`: anchors, positions) from both (its attention's arithmetic would
otherwise grow with anchors × sequence)."""


class OpCounter(TorchDispatchMode):
    """Counts the tensor ops dispatched inside it (each ATen call once)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class CallCounter:
    """Counts the module calls of `model` while open: every forward (ZeRO-3's forward hooks
    run on each) and those whose output needs a gradient (its backward hooks run on those)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.forward = self.backward = 0
        self._handles: list = []

    def __enter__(self) -> CallCounter:
        def pre(_module, _args):
            self.forward += 1

        def post(_module, _args, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in outputs):
                self.backward += 1

        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass(frozen=True)
class Workload:
    """One micro-batch of one rank."""

    drafter_flops: dict[str, float]
    """Matmul FLOPs by component (forward + backward), for this option's loss path."""
    target_flops: float
    """The in-job target's forward (0 offline)."""
    drafter_ops: float
    """Host work of the drafter's forward + loss + backward, in stand-in ops."""
    target_ops: float
    collectives_timed: bool
    """The host work was timed on a process group: it holds the loss's small all-reduces."""
    tokens: int
    """B · S, the micro-batch's tokens."""
    drafter_calls: tuple[float, float] = (0.0, 0.0)
    """Module calls of the drafter's forward + loss (ZeRO-3's forward hooks) and of those
    with a gradient (its backward hooks)."""
    target_calls: float = 0.0
    """Module calls of the in-job target's forward (0 offline)."""

    @property
    def flops(self) -> float:
        return sum(self.drafter_flops.values()) + self.target_flops


# ---- a drafter kind's training step and the target's forward, built for timing -------------
def counted_perf(perf, device: str):
    """The perf section a copy runs on the CPU for a `device` prediction: the loss chunks of
    `device`; on CUDA the dense kernel stands in for flex_attention (one fused kernel per call
    either way; flex has no CPU backward)."""
    attn = perf.attn_implementation
    if device == "cuda" and attn in ("auto", "flex"):
        attn = "dense"
    return replace(perf, loss_chunk_anchors=perf.chunk_anchors(device), attn_implementation=attn)


def resized_config(config, *, hidden, intermediate, heads, head_dim, vocab, layers=None):
    """A copy of a target config with other widths (the same model type; `layers` decoder
    layers, or as many as it has)."""
    config = copy.deepcopy(config)
    text = text_config(config)
    old_heads = int(global_attr(text, "num_attention_heads"))
    old_kv = int(global_attr(text, "num_key_value_heads", old_heads))
    grouped = old_heads // max(old_kv, 1) > 1  # keep GQA where the target has it
    values = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2) if grouped else heads,
        head_dim=head_dim,
        vocab_size=vocab,
    )
    if layers is not None:
        values["num_hidden_layers"] = layers
    for key, value in values.items():
        setattr(text, key, value)
    if getattr(text, "global_head_dim", None):  # Gemma4's wide global heads
        text.global_head_dim = head_dim
    if getattr(text, "kv_lora_rank", None) and getattr(text, "qk_rope_head_dim", None):
        # MLA (GLM-5, DeepSeek-V3.x): its rotary embedding is head_dim wide and rotates the
        # queries' and keys' rope part, so the two stay equal
        text.qk_rope_head_dim = head_dim
    if config is not text and getattr(config, "vocab_size", None):
        config.vocab_size = vocab
    return config


def narrow_config(config):
    return resized_config(
        config,
        hidden=NARROW["hidden"],
        intermediate=NARROW["intermediate"],
        heads=NARROW["heads"],
        head_dim=NARROW["head_dim"],
        vocab=NARROW["vocab"],
    )


class KindStep:
    """One training micro-batch (forward + loss + backward) of a drafter kind, through the
    kind's `training_step`, built from a target config and a run's model and perf sections, on
    random inputs of B × S. `make()` builds a fresh drafter (for an engine to wrap); `loss(m)`
    runs the step's forward + loss through `m` (the drafter or a DeepSpeed engine around one);
    calling the step runs forward, loss and backward on its own drafter."""

    def __init__(
        self,
        model_section,
        perf,
        target_config,
        layer_ids,
        batch_size: int,
        seq_len: int,
        zero3: bool,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        target_path: str | None = None,
    ):
        device = device or torch.device("cpu")
        self.kind = kind = get_kind(model_section.kind)
        text = text_config(target_config)
        vocab, hidden = int(text.vocab_size), int(text.hidden_size)
        self.draft_config = kind.build_config(
            target_config,
            model_section,
            target_layer_ids=layer_ids,
            mask_token_id=vocab - 1,
            target_path=target_path,
        )
        self.device, self.dtype, self.perf = device, dtype, perf
        self.model = self.make()
        path = kind.train.prepare(self.model, perf, zero_stage=3 if zero3 else 0)
        # NOTE: as in training, the loss sums its denominators over the ranks of a process
        # group: every rank of the group runs the step together
        self.ctx = StepContext(model=model_section, perf=perf, loss_impl=path, training=True)
        g = torch.Generator().manual_seed(0)
        B = batch_size
        loss_mask = torch.ones(B, seq_len)
        loss_mask[:, : min(16, seq_len // 4)] = 0
        batch = dict(
            input_ids=torch.randint(0, vocab - 2, (B, seq_len), generator=g),
            loss_mask=loss_mask,
            target_hidden_states=torch.randn(B, seq_len, len(layer_ids) * hidden, generator=g),
            target_last_hidden_states=torch.randn(B, seq_len, hidden, generator=g),
        )
        self.batch = {k: batch[k].to(device) for k in TRAIN_KEYS}
        for key in ("target_hidden_states", "target_last_hidden_states"):
            self.batch[key] = self.batch[key].to(dtype)
        self.batch["sample_ids"] = torch.arange(B)

    def make(self) -> nn.Module:
        """A fresh drafter (the same seed every time), its shared weights frozen, on the step's
        device and dtype, with the run's attention."""
        torch.manual_seed(0)
        model = build_draft_model(self.draft_config).to(self.device, self.dtype).train()
        model.freeze_shared()
        model.attn_implementation = self.perf.attn_implementation
        return model

    def loss(self, model) -> torch.Tensor:
        return self.kind.train.training_step(model, self.batch, self.ctx).loss

    def __call__(self) -> None:
        self.loss(self.model).backward()
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class TargetForward:
    """The frozen target's forward over B × S tokens as training calls it (`FrozenTarget`, no
    gradient), built from a target config."""

    def __init__(
        self,
        config,
        layer_ids,
        batch_size: int,
        seq_len: int,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.config, self.layer_ids = config, layer_ids
        self.device, self.dtype = device or torch.device("cpu"), dtype
        vocab = int(text_config(config).vocab_size)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(self.device)
        self.mask = torch.ones_like(self.ids)
        self.target = self.make()

    def make(self) -> nn.Module:
        """A fresh `FrozenTarget` (for an engine to partition)."""
        # lazy: transformers, 0.9 s of import
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        config = causal_lm_config(self.config)
        model = AutoModelForCausalLM.from_config(config).to(self.device, self.dtype)
        return FrozenTarget(model, self.layer_ids)

    def run(self, target: nn.Module) -> None:
        target(self.ids, attention_mask=self.mask)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self) -> None:
        self.run(self.target)


# ---- host work --------------------------------------------------------------------------------
def stand_in_model(layers: int, dtype: torch.dtype = torch.float32):
    """A small Qwen3 model 32 wide (the structure of the drafter's and target's layers): the
    unit of host work, and the calibration's stand-in for DeepSpeed's costs. Returns a
    builder."""
    # lazy: transformers' Qwen3 model, 2.7 s of import
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )

    def make():
        torch.manual_seed(0)
        return Qwen3Model(config).to(dtype)

    return make


def stand_in_step(model, ids) -> None:
    model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()


class StandInOps:
    """The unit of host work: seconds per op of the stand-in's forward + backward (CPU)."""

    def __init__(self):
        self.model = stand_in_model(2)().train()
        self.ids = torch.randint(0, 64, (1, 32))
        with OpCounter() as counter:
            self.step()
        self.ops = counter.ops

    def step(self) -> None:
        stand_in_step(self.model, self.ids)
        self.model.zero_grad(set_to_none=True)

    def work(self, fn, repeats: int = 7) -> float:
        """`fn`'s seconds in stand-in ops: each run timed next to a stand-in step, the median
        of the ratios (a burst of other jobs slows both of a pair alike)."""
        fn()
        self.step()  # warm-up
        ratios = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            self.step()
            t2 = time.perf_counter()
            ratios.append((t1 - t0) / ((t2 - t1) / self.ops))
        return statistics.median(ratios)


def scale_points(scale: int) -> list[int]:
    """The host scales the narrow copy runs at (SCALE_POINTS past the last of them)."""
    return [scale] if scale <= SCALE_POINTS[-1] else list(SCALE_POINTS)


def at_scale(values: list[float], scale: int) -> float:
    """A value measured at `scale_points(scale)`, linear in the scale past the last."""
    if len(values) == 1:
        return values[0]
    (a0, a1), (v0, v1) = SCALE_POINTS, values
    return v1 + (v1 - v0) / (a1 - a0) * (scale - a1)


class NarrowCopies:
    """The recipe's drafter (for each loss path `stages` asks for: 0 or 3, and each point of its
    kind's host scale) and its target, 32 wide, on `device` (the process group's, when there is one: the
    loss all-reduces its denominators, every rank runs the copy in step), in `dtype` (the
    calibration's: the run's compute dtype, which its engines train in)."""

    def __init__(
        self,
        run_cfg,
        stages: tuple[int, ...],
        device: str = "cpu",
        run_on: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        run_on = run_on or torch.device("cpu")
        perf = counted_perf(run_cfg.perf, device)
        self.config = narrow_config(target_config_of(run_cfg.target.path))
        num_layers = int(text_config(self.config).num_hidden_layers)
        layer_ids = run_cfg.target.layer_ids or default_layer_ids(num_layers)
        kind, length = get_kind(run_cfg.model.kind), run_cfg.data.max_length
        self.scale = kind.cost.host_scale(run_cfg.model, length)
        points = scale_points(self.scale)
        copies = [kind.cost.host_copy(run_cfg.model, length, n, max(points)) for n in points]
        B = run_cfg.data.batch_size
        self.steps = {
            stage: [
                KindStep(
                    model,
                    perf,
                    self.config,
                    layer_ids,
                    B,
                    seq_len,
                    zero3=stage == 3,
                    device=run_on,
                    dtype=dtype,
                    target_path=run_cfg.target.path,
                )
                for model, seq_len in copies
            ]
            for stage in stages
        }
        self.target = TargetForward(self.config, layer_ids, B, min(length, 64), run_on, dtype)

    def counts(self) -> dict:
        """{"ops": {"drafter": {stage: n}, "target": n}, "calls": {"drafter": {stage: (forward,
        backward)}, "target": n}}: one micro-batch's tensor ops and module calls."""
        ops: dict = {"drafter": {}}
        calls: dict = {"drafter": {}}
        for stage, steps in self.steps.items():
            n_ops, fwd, bwd = [], [], []
            for step in steps:
                with OpCounter() as counter, CallCounter(step.model) as called:
                    step()
                n_ops.append(counter.ops)
                fwd.append(called.forward)
                bwd.append(called.backward)
            ops["drafter"][stage] = at_scale(n_ops, self.scale)
            calls["drafter"][stage] = (at_scale(fwd, self.scale), at_scale(bwd, self.scale))
        with OpCounter() as counter, CallCounter(self.target.target) as called:
            self.target()
        ops["target"], calls["target"] = counter.ops, called.forward
        return {"ops": ops, "calls": calls}


def host_work(run_cfg, stages: tuple[int, ...], device: str = "cpu", timed: bool = True) -> dict:
    """{"drafter": {stage: stand-in ops}, "target": stand-in ops, "ops": the raw op counts,
    "calls": the module calls (NarrowCopies.counts)}: the host work of one micro-batch on
    `device`, from the narrow copy timed on this CPU (the drafter's loss path follows the ZeRO
    stage, as in training); not `timed`: the op counts only (what a GPU's host does per op is
    launch it)."""
    run_on = collective_device() if has_group() else torch.device("cpu")
    with torch.random.fork_rng():
        copies = NarrowCopies(run_cfg, stages, device, run_on)
        out = dict(copies.counts(), collectives_timed=has_group())
        out["drafter"] = dict(out["ops"]["drafter"])
        out["target"] = out["ops"]["target"]
        if timed:
            unit = StandInOps()
            for stage, steps in copies.steps.items():
                work = [unit.work(step) for step in steps]
                out["drafter"][stage] = at_scale(work, copies.scale)
            out["target"] = unit.work(copies.target)
    return out


def workload(inv: Inventory, run_cfg, device: str, stage: int, work: dict | None) -> Workload:
    """One micro-batch of `run_cfg` at ZeRO `stage` (its loss path)."""
    in_job = target_in_job(run_cfg)
    key = 3 if stage == 3 else 0
    return Workload(
        drafter_flops=drafter_flops(inv, run_cfg, device, stage),
        target_flops=target_forward_flops(inv, run_cfg) if in_job else 0.0,
        drafter_ops=work["drafter"][key] if work else 0.0,
        target_ops=(work["target"] if in_job else 0.0) if work else 0.0,
        collectives_timed=bool(work and work["collectives_timed"]),
        tokens=run_cfg.data.batch_size * run_cfg.data.max_length,
        drafter_calls=tuple(work["calls"]["drafter"][key]) if work else (0.0, 0.0),
        target_calls=(work["calls"]["target"] if in_job else 0.0) if work else 0.0,
    )
