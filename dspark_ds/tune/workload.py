"""What one micro-batch of a recipe costs, independent of the machine: its matmul FLOPs (the
drafter kind's own count, through the registry, and the in-job target's forward) and its host
work, in units of one tensor op of a stand-in model.

Host work matters where tensors are small (every op costs host time whatever its size: the
tiny CPU recipe is all such time); the FLOPs where they are large. A copy of the drafter 32
wide (the recipe's layer count, block size, anchors, chunking, loss path and attention) runs
one forward + loss + backward on the CPU, the target's forward likewise. For a CPU machine
their seconds over the seconds per op of a stand-in (a small Qwen3 model, timed in the same
process) give the work in stand-in ops, which the machine's calibrated seconds per op turn
into seconds: the drafter's Python between its ops (the loss's bookkeeping, the metrics) and
its small matmuls cost more per op than the stand-in's, which a raw op count would miss. For a
GPU machine the host only launches each op: the raw op count is the work. The loops of the
blockwise attention and the chunked loss depend on the anchors and chunk sizes, which the copy
keeps; the widths do not change them.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark_ds.tune.inventory import Inventory

NARROW = dict(hidden=32, intermediate=64, heads=2, head_dim=8, vocab=256)
"""The widths of the copy whose host work is timed."""


class OpCounter(TorchDispatchMode):
    """Counts the tensor ops dispatched inside it (each ATen call once)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


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

    @property
    def flops(self) -> float:
        return sum(self.drafter_flops.values()) + self.target_flops


def target_in_job(run_cfg) -> bool:
    return run_cfg.data.mode != "offline" or bool(run_cfg.train.synthetic_samples)


def forward_flops(layer_params: int, layers: int, heads: int, head_dim: int, B: int, S: int):
    """A decoder's forward over B × S tokens: its layers' matmuls and the causal attention (QK^T
    and PV over the lower triangle); no lm_head (FrozenTarget taps states)."""
    attention = 4.0 * B * (S * S / 2) * heads * head_dim * layers
    return 2.0 * B * S * layer_params + attention


def target_forward_flops(inv: Inventory, run_cfg) -> float:
    B, S = run_cfg.data.batch_size, run_cfg.data.max_length
    return forward_flops(inv.target_layer_params, inv.target_layers, inv.heads, inv.head_dim, B, S)


def drafter_flops(inv: Inventory, run_cfg, device: str, stage: int) -> dict[str, float]:
    from dspark_ds.drafters.registry import get_kind

    kind = get_kind(run_cfg.model.kind)
    return kind.step_flops(inv.step_shape(run_cfg), run_cfg.perf, device, stage)


# ---- a drafter kind's training step, built for timing ------------------------------------------
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
    from dspark_ds.drafters.common.target_config import text_config

    config = copy.deepcopy(config)
    text = text_config(config)
    old_heads = int(text.num_attention_heads)
    old_kv = int(getattr(text, "num_key_value_heads", old_heads) or old_heads)
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
    if config is not text and getattr(config, "vocab_size", None):
        config.vocab_size = vocab
    return config


class KindStep:
    """One training micro-batch (forward + loss + backward) of a drafter kind, through the
    kind's `training_step`, built from a target config and a run's model and perf sections, on
    random inputs of B × S."""

    def __init__(self, model_section, perf, target_config, layer_ids, batch_size: int,
                 seq_len: int, zero3: bool, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32, target_path: str | None = None):  # fmt: skip
        from dspark_ds.drafters import build_draft_model
        from dspark_ds.drafters.common.target_config import text_config
        from dspark_ds.drafters.kind import TRAIN_KEYS, StepContext
        from dspark_ds.drafters.registry import get_kind

        device = device or torch.device("cpu")
        self.kind = kind = get_kind(model_section.kind)
        text = text_config(target_config)
        vocab, hidden = int(text.vocab_size), int(text.hidden_size)
        draft_config = kind.build_config(
            target_config, model_section, target_layer_ids=layer_ids,
            mask_token_id=vocab - 1, target_path=target_path,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = build_draft_model(draft_config).to(device, dtype).train()
        self.model.freeze_shared()
        if zero3:
            # NOTE: the loss path reads ZeRO-3 off the parameters (they carry `ds_id`)
            for p in self.model.parameters():
                p.ds_id = 0
        path = kind.prepare(self.model, perf)
        if zero3:
            for p in self.model.parameters():
                del p.ds_id
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
        self.device = device

    def __call__(self) -> None:
        out = self.kind.training_step(self.model, self.batch, self.ctx)
        out.loss.backward()
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# ---- host work --------------------------------------------------------------------------------
def stand_in_model(layers: int, dtype: torch.dtype = torch.float32):
    """A small Qwen3 model 32 wide (the structure of the drafter's and target's layers): the
    unit of host work, and the calibration's stand-in for DeepSpeed's costs. Returns a
    builder."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip

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


def narrow_config(config):
    return resized_config(
        config, hidden=NARROW["hidden"], intermediate=NARROW["intermediate"],
        heads=NARROW["heads"], head_dim=NARROW["head_dim"], vocab=NARROW["vocab"],
    )  # fmt: skip


def host_work(run_cfg, stages: tuple[int, ...], device: str = "cpu", timed: bool = True) -> dict:
    """{"drafter": {stage: stand-in ops}, "target": stand-in ops, "ops": the raw op counts}:
    the host work of one micro-batch on `device`, from the narrow copy timed on this CPU (the
    drafter's loss path follows the ZeRO stage, as in training); not `timed`: the op counts
    only (what a GPU's host does per op is launch it).

    NOTE: the attention's arithmetic grows with anchors × sequence whatever the width, so the
    copy runs at most 64 anchors (a sequence just long enough for them); past that its host
    work is extrapolated linearly in the anchors from 32 and 64 (the loops over attention and
    loss chunks grow with them)."""
    from transformers import AutoModelForCausalLM

    from dspark_ds.distributed import collective_device, has_group
    from dspark_ds.drafters.common.target_config import text_config
    from dspark_ds.target import FrozenTarget, default_layer_ids
    from dspark_ds.tune.inventory import target_config_of

    # NOTE: under a process group the loss all-reduces its denominators: the copy runs on the
    # group's device (every rank runs it, in step)
    run_on = collective_device() if has_group() else torch.device("cpu")
    perf = counted_perf(run_cfg.perf, device)
    config = narrow_config(target_config_of(run_cfg.target.path))
    num_layers = int(text_config(config).num_hidden_layers)
    layer_ids = run_cfg.target.layer_ids or default_layer_ids(num_layers)
    anchors = run_cfg.model.num_anchors
    points = [anchors] if anchors <= 64 else [32, 64]
    seq_len = min(run_cfg.data.max_length, 2 * max(points) + 64)
    out: dict = {"drafter": {}, "ops": {"drafter": {}}, "collectives_timed": has_group()}
    with torch.random.fork_rng():
        unit = StandInOps() if timed else None
        for stage in stages:
            work, ops = [], []
            for a in points:
                model = replace(run_cfg.model, num_anchors=a)
                step = KindStep(
                    model, perf, config, layer_ids, run_cfg.data.batch_size, seq_len,
                    zero3=stage == 3, device=run_on, target_path=run_cfg.target.path,
                )  # fmt: skip
                with OpCounter() as counter:
                    step()
                ops.append(counter.ops)
                work.append(unit.work(step) if unit else counter.ops)
            if len(points) == 2:  # linear in the anchors past 64
                slope = (work[1] - work[0]) / (points[1] - points[0])
                work.append(work[1] + slope * (anchors - points[1]))
                slope = (ops[1] - ops[0]) / (points[1] - points[0])
                ops.append(ops[1] + slope * (anchors - points[1]))
            out["ops"]["drafter"][stage] = ops[-1]
            out["drafter"][stage] = work[-1]
        target = FrozenTarget(AutoModelForCausalLM.from_config(config).float(), layer_ids)
        target = target.to(run_on)
        ids = torch.randint(0, NARROW["vocab"], (run_cfg.data.batch_size, min(seq_len, 64)))
        ids = ids.to(run_on)
        mask = torch.ones_like(ids)
        with OpCounter() as counter:
            target(ids, attention_mask=mask)
        out["ops"]["target"] = counter.ops
        out["target"] = counter.ops
        if unit:
            out["target"] = unit.work(lambda: target(ids, attention_mask=mask))
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
    )
