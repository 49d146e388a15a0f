"""Real steps of one ZeRO option on this machine: peak memory and step time (`--measure`), run
through training's public entry point for it (train/timed.py's `TimedSteps`)."""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark_ds import distributed
from dspark_ds.train.timed import PHASES, TimedSteps
from dspark_ds.tune.config import ZeroOption
from dspark_ds.tune.estimate import option_overrides


def cpu_peak(prof) -> float:
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


def option_run_config(option: ZeroOption, run_cfg, steps: int, workdir: str):
    """The recipe turned into a short, silent run of this option under `workdir`."""
    cfg = copy.deepcopy(run_cfg)
    cfg.deepspeed.config = option.config
    overrides = copy.deepcopy(option_overrides(option, run_cfg) or {})
    zero = overrides.get("zero_optimization", {})
    for part in ("offload_optimizer", "offload_param"):
        if option.name == "zero3+nvme" and "nvme_path" not in zero.get(part, {}):
            # the shipped config's /local_nvme exists on no machine by default: the swap
            # files go under the short run's own directory unless the recipe names a path
            zero.setdefault(part, {})["nvme_path"] = str(Path(workdir) / "nvme")
    if zero:
        overrides["zero_optimization"] = zero
    cfg.deepspeed.overrides = overrides or None
    cfg.name = "tuner_" + option.name.replace("+", "_")
    cfg.output_dir = workdir
    cfg.tracking.enabled = False
    cfg.tracking.system_metrics = False  # no monitor thread beside the timed steps
    cfg.checkpoint.every_steps, cfg.checkpoint.resume = 0, None
    cfg.checkpoint.save_final = cfg.checkpoint.export_final = False
    cfg.train.progress_bar = False
    cfg.train.max_steps = steps + 1
    return cfg


def measure(
    option: ZeroOption,
    run_cfg,
    steps: int,
    workdir: str,
    memory: bool = True,
    between: Callable[[], object] | None = None,
    blocks: int = 1,
) -> dict:
    """Builds the trainer for this option and runs 1 + `steps` optimizer steps: peak memory of
    the build + first step (CUDA: max_memory_allocated; CPU: the profiler's allocation timeline;
    None without `memory`), then the median time of the next `steps` and of each of their
    PHASES; each the maximum over ranks (a step is as slow as its slowest rank); the loss of
    every step (its micro-batches' and ranks' mean: two options' runs see the same data). With
    `between` (a calibration sample), the timed steps are split into `blocks` blocks and
    `between` runs before each: what it measures sees the same conditions as the steps."""
    cfg = option_run_config(option, run_cfg, steps, workdir)
    losses: list[torch.Tensor] = []
    run, peak = _built(cfg, memory, losses)
    times, cpu_times, waited, phases = _timed(run, steps, losses, between, blocks)
    summary = [statistics.median(times), statistics.median(cpu_times), statistics.median(waited)]
    summary += [statistics.median(p[i] for p in phases) for i in range(len(PHASES))]
    peak, *summary = distributed.all_reduce_values([peak, *summary], op="max")
    grad_accum, hpz = run.grad_accum, run.hpz_partition_size
    step_losses = _step_losses(losses, grad_accum)
    run.close()
    return {
        "micro_batch": cfg.data.batch_size,
        "grad_accum": grad_accum,
        "peak_bytes": peak if memory else None,
        "step_s": summary[0],
        "cpu_step_s": summary[1],
        "waited_s": summary[2],
        "phase_s": dict(zip(PHASES, summary[3:])),
        "step_times_s": times,
        "losses": step_losses,
        "hpz_partition_size": hpz,
    }


def _built(cfg, memory: bool, losses: list) -> tuple[TimedSteps, float]:
    """The trainer of `cfg` built and its first step run: (its steps, the peak memory of both;
    0 without `memory`)."""
    gc.collect()
    cuda = torch.cuda.is_available()
    base = 0
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    prof_ctx = (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        if memory and not cuda
        else contextlib.nullcontext()
    )
    with prof_ctx as prof:
        run = TimedSteps(cfg)
        run.step(losses=losses)
    peak = 0.0
    if memory:
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else cpu_peak(prof)
    return run, peak


def _timed(
    run: TimedSteps,
    steps: int,
    losses: list,
    between: Callable[[], object] | None,
    blocks: int,
) -> tuple[list[float], list[float], list[float], list[list[float]]]:
    """`steps` steps, each started together on every rank: (the wall seconds of each, its CPU
    seconds, its seconds waiting for a core, its PHASES' seconds); `between` before each of
    `blocks` blocks of them."""
    cuda = torch.cuda.is_available()
    times, cpu_times, phases, waited = [], [], [], []
    blocks = max(1, min(blocks, steps)) if between is not None else 1
    starts = {round(i * steps / blocks) for i in range(blocks)}
    for i in range(steps):
        if between is not None and i in starts:
            between()
        if cuda:
            torch.cuda.synchronize()
        distributed.barrier()
        parts = [0.0] * len(PHASES)
        w0 = waited_s()
        t0, c0 = time.perf_counter(), time.process_time()
        run.step(parts, losses)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        waited.append(waited_s() - w0)
        phases.append(parts)
    return times, cpu_times, waited, phases


def _step_losses(losses: list[torch.Tensor], grad_accum: int) -> list[float]:
    """Each step's loss: the mean of its micro-batches' and of the ranks'."""
    # read after the timed steps (a host sync each on a GPU)
    per_step = [
        float(sum(losses[i : i + grad_accum])) / grad_accum
        for i in range(0, len(losses), grad_accum)
    ]
    world = distributed.world_size()
    return [v / world for v in distributed.all_reduce_values(per_step)]


def waited_s() -> float:
    """Seconds this thread has spent runnable but waiting for a core (other processes on the
    machine; Linux's schedstat), or 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0
