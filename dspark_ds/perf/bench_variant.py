"""What runs inside one variant's process of `dspark-ds bench` (perf/train_bench.py): the preset's
drafter built for a random Qwen3 target of the bench's widths, a random batch, the kind's
`training_step` with its backward and AdamW, warmed up and timed; the peak memory split into
what stays resident (counted from the tensors) and the step's working memory; the kind's FLOP
count against a plain matmul timed in the same process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import Qwen3Config

from dspark_ds.drafters import build_draft_model
from dspark_ds.drafters.common.memory import StepShape, Widths
from dspark_ds.drafters.kind import TRAIN_KEYS, StepContext
from dspark_ds.drafters.presets import DrafterSizes
from dspark_ds.perf.train_bench import TrainBenchConfig


def target_config(cfg: TrainBenchConfig):
    """The random target the drafter is built for (a Qwen3 of the bench's widths)."""
    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_target_layers + 1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=max(4096, 2 * cfg.seq_len),
        tie_word_embeddings=False,
    )


def build_model(cfg: TrainBenchConfig):
    draft_cfg = cfg.kind.build_config(
        target_config(cfg),
        cfg.model,
        target_layer_ids=list(range(cfg.num_target_layers)),
        mask_token_id=cfg.vocab_size - 1,
    )
    torch.manual_seed(cfg.seed)
    # NOTE: built on its device: a 2.3 B-parameter drafter built on the CPU and moved costs
    # ~40 s per variant on a GPU node. The fp32 build before the cast is not in the peak
    # (run_variant resets the peak statistics after it).
    with torch.device(cfg.device):
        model = build_draft_model(draft_cfg)
    model.freeze_shared()
    return model.to(dtype=getattr(torch, cfg.dtype)).train()


def build_batch(cfg: TrainBenchConfig, device: str):
    """A training batch of B random sequences: `TRAIN_KEYS` on `device` (the target's features
    in the run's dtype, as a bf16 target gives them), `sample_ids` on the host."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    B, S, H = cfg.batch_size, cfg.seq_len, cfg.hidden_size
    loss_mask = torch.ones(B, S)
    loss_mask[:, : min(16, S - 2)] = 0  # a short unsupervised prompt, like chat data
    batch = dict(
        input_ids=torch.randint(0, cfg.vocab_size - 1, (B, S), generator=g),
        loss_mask=loss_mask,
        target_hidden_states=torch.randn(B, S, cfg.num_target_layers * H, generator=g),
        target_last_hidden_states=torch.randn(B, S, H, generator=g),
    )
    dtype = getattr(torch, cfg.dtype)
    for key in ("target_hidden_states", "target_last_hidden_states"):
        batch[key] = batch[key].to(dtype)
    out = {k: batch[k].to(device) for k in TRAIN_KEYS}
    out["sample_ids"] = torch.arange(B)
    return out


def step_shape(cfg: TrainBenchConfig):
    """The `StepShape` of the bench's micro-batch (what the kind's FLOP count reads)."""
    width = torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size()
    widths = Widths.of_config(target_config(cfg), cfg.model.num_draft_layers, cfg.num_target_layers)
    # the head's rows: a reduced draft vocabulary's N
    widths = replace(widths, vocab=cfg.model.draft_vocab_size or widths.vocab)
    drafter = cfg.kind.cost.step_part(cfg.model)
    return StepShape.of(widths, cfg.batch_size, cfg.seq_len, drafter, width, width)


def step_flops(cfg: TrainBenchConfig, variant: str) -> float:
    """FLOPs of one training step (forward + backward) of `variant`: the kind's count."""
    flops = cfg.kind.cost.step_flops(step_shape(cfg), cfg.perf(variant), cfg.device, 0)
    return sum(flops.values())


def matmul_flops_per_s(device: str, dtype: str, size: int, repeats: int = 5) -> float:
    """A plain [size x size] @ [size x size] rate in `dtype`, median of `repeats`."""
    a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i:  # the first one warms up
            times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


def resident_bytes(model, optimizer) -> dict[str, int]:
    """What stays allocated across steps, counted from the tensors: weights (parameters and
    buffers), gradients, optimizer state."""

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    weights = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(b) for b in model.buffers())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(
        nbytes(v)
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return {"weights_bytes": weights, "grads_bytes": grads, "optimizer_state_bytes": state}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _rss_bytes(field_name: str) -> int:
    """VmRSS / VmHWM of this process from /proc (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def reset_peak_memory(cuda: bool) -> None:
    """Starts the peak over from now: CUDA's allocator statistics, or this process's VmHWM
    (Linux's `/proc/self/clear_refs`; the high-water mark becomes the current RSS)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    Path("/proc/self/clear_refs").write_text("5")


def _memory_now(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else _rss_bytes("VmRSS")


def _training_step(cfg: TrainBenchConfig, variant: str):
    """The variant's drafter, batch and optimizer, and its training step (the kind's
    `training_step`, backward, AdamW) -> (model, batch, optimizer, step)."""
    kind, section, perf = cfg.kind, cfg.model, cfg.perf(variant)
    model = build_model(cfg)
    path = kind.train.prepare(model, perf, cfg.device)  # the attention, compile, the loss path
    ctx = StepContext(section, perf, path, seed=cfg.seed)
    batch = build_batch(cfg, cfg.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0)

    def step():
        # NOTE: gradients are cleared before the step, not after: they stay allocated between
        # steps, as a DeepSpeed engine's gradient buffers do, and count as resident.
        opt.zero_grad(set_to_none=True)
        out = kind.train.training_step(model, batch, ctx)
        out.loss.backward()
        opt.step()
        sums = dict(zip(out.names, out.sums.tolist()))
        return out.loss.item(), kind.train.metrics(sums, section)

    return model, batch, opt, step


def _timed_steps(cfg: TrainBenchConfig, step):
    """Warm-up steps, then `repeats` timed ones -> (first loss, last metrics, wall times, CPU
    times)."""
    first_loss, metrics = None, {}
    for _ in range(cfg.warmup_steps):
        first_loss, metrics = step()
    times, cpu_times = [], []
    for _ in range(cfg.repeats):
        _sync(cfg.device)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, metrics = step()
        _sync(cfg.device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        first_loss = loss if first_loss is None else first_loss
    return first_loss, metrics, times, cpu_times


def run_variant(cfg: TrainBenchConfig, variant: str) -> dict:
    """Builds, warms up and times one variant in this process."""
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    device = cfg.device
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    # the process before the model: nothing on a GPU, interpreter + libraries in RSS
    baseline = _memory_now(cuda)
    model, batch, opt, step = _training_step(cfg, variant)
    matmul_rate = matmul_flops_per_s(device, cfg.dtype, cfg.matmul_n)
    # the peak of the steps only (not the fp32 build, not the matmul's inputs)
    reset_peak_memory(cuda)
    # The idle process: imports, model, batch, optimizer (its state appears in step 1).
    idle = _memory_now(cuda)
    first_loss, metrics, times, cpu_times = _timed_steps(cfg, step)
    # NOTE: the peak covers warm-up and timed steps (the process high-water mark), so a
    # variant cannot look smaller because freed-but-retained heap hides its first step.
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM")
    resident = resident_bytes(model, opt)
    resident_total = sum(resident.values())
    step_time = statistics.median(times)
    flops = step_flops(cfg, variant)
    achieved = flops / step_time
    return {
        "variant": variant,
        "step_time_s": step_time,
        "step_times_s": times,
        # CPU seconds of this process per step: less sensitive than wall time to other
        # processes sharing the cores (wall time is the headline number).
        "step_cpu_time_s": statistics.median(cpu_times),
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": "cuda_max_allocated" if cuda else "process_peak_rss",
        "idle_memory_bytes": int(idle),
        # What the steps add on top of the idle process (activations, logits, gradients).
        "step_peak_memory_bytes": int(peak - idle),
        "baseline_memory_bytes": int(baseline),
        **resident,
        "resident_bytes": resident_total,
        # peak minus what stays allocated (weights, gradients, optimizer state) and minus the
        # process before the model: activations, logits, the batch, transients
        "working_memory_bytes": int(peak - baseline - resident_total),
        "tokens_per_s": metrics["supervised_tokens"] / step_time,
        "supervised_tokens": metrics["supervised_tokens"],
        "flops_per_step": flops,
        "achieved_flops": achieved,
        "matmul_flops": matmul_rate,
        "matmul_size": cfg.matmul_n,
        "matmul_dtype": cfg.dtype,
        "achieved_flops_ratio": achieved / matmul_rate,
        "loss_chunk_anchors": cfg.chunk_anchors,
        "loss_first_step": first_loss,
        "num_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark_ds.perf.bench_variant --_child`: one variant, its config as JSON on
    stdin, the result JSON on stdout (what `run_train_bench` starts per variant)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["--_child"]:
        print("the benchmark runs as `dspark-ds bench` (see --help)", file=sys.stderr)
        return 2
    data = json.loads(sys.stdin.read())
    cfg = TrainBenchConfig(**{**data, "sizes": DrafterSizes.from_dict(data["sizes"])})
    print(json.dumps(run_variant(cfg, cfg.variants[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
