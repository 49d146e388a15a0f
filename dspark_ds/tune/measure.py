"""Real steps of one ZeRO option on this machine: peak memory and step time (`--measure`)."""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from pathlib import Path

import torch

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
    cfg.checkpoint.every_steps, cfg.checkpoint.resume = 0, None
    cfg.checkpoint.save_final = cfg.checkpoint.export_final = False
    cfg.train.progress_bar = False
    cfg.train.max_steps = steps + 1
    return cfg


def measure(
    option: ZeroOption, run_cfg, steps: int, workdir: str, memory: bool = True, probe=None
) -> dict[str, float | list[float] | None]:
    """Builds the trainer for this option and runs 1 + `steps` optimizer steps: peak memory of
    the build + first step (CUDA: max_memory_allocated; CPU: the profiler's allocation timeline;
    None without `memory`), then the median time of the next `steps`; both the maximum over
    ranks (a step is as slow as its slowest rank). `probe` (calibrate.Probe), if given, is
    timed between the timed steps (about eight times, and after the last): its median says how
    fast the machine ran meanwhile."""
    from torch.profiler import ProfilerActivity, profile

    from dspark_ds import distributed
    from dspark_ds.train.trainer import Trainer

    cfg = option_run_config(option, run_cfg, steps, workdir)
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
        trainer = Trainer(cfg)
        batches = iter(trainer.source)
        _one_step(trainer, batches)
    peak = 0.0
    if memory:
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else cpu_peak(prof)
    times, cpu_times, probes = [], [], []
    every = max(1, steps // 8)
    for i in range(steps):
        if probe is not None and i % every == 0:
            probes.append(probe())
        if cuda:
            torch.cuda.synchronize()
        distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        _one_step(trainer, batches)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    if probe is not None:
        probes.append(probe())
    peak, step_s, cpu_s = distributed.all_reduce_values(
        [peak, statistics.median(times), statistics.median(cpu_times)], op="max"
    )
    _release(trainer)
    return {
        "peak_bytes": peak if memory else None,
        "step_s": step_s,
        "cpu_step_s": cpu_s,
        "step_times_s": times,
        "probe_s": statistics.median(probes) if probes else None,
    }


def _one_step(trainer, batches) -> None:
    ctx = trainer.step_context(training=True)
    for _ in range(trainer.grad_accum):
        out = trainer.kind.training_step(trainer.engine, trainer.on_device(next(batches)), ctx)
        trainer.engine.backward(out.loss)
        trainer.engine.step()


def _release(trainer) -> None:
    trainer.release_run_dir()
    ds = trainer.engine.ds
    if hasattr(ds, "destroy"):
        ds.destroy()
    trainer.engine = None
    trainer.target = None
    gc.collect()
