"""`--cluster.calibrate`: measures, on this machine and the launcher's ranks, every rate the
step-time model divides by, and returns them as Machine fields (a profile).

All ranks measure at once (ranks of a node share its cores, memory bandwidth and links, as in
training); each figure is the slowest rank's. What is measured:

- peak_flops: an [n × n] matmul in the compute dtype; sustained_fraction: a training
  micro-batch of the recipe's drafter kind, one draft layer at the recipe's widths, sequence
  and anchors (capped for the device: `reference_shape`), its FLOPs by the kind's own count
  over its time less its host time (the same step 32 wide), as a share of that peak;
  target_sustained_fraction: the same for a frozen target's forward, a few layers deep.
- the three collectives of ZeRO (all-reduce, all-gather, reduce-scatter) on the process group:
  latency from a one-element call, bus bandwidth from a large one.
- the optimizers: torch's AdamW per element (one flat tensor, as ZeRO-1/2/3 hand it) and per
  tensor (as plain data parallelism hands it the parameter list), DeepSpeed's CPU Adam per
  element (the optimizer of an offloaded run).
- host time per dispatched op: a small Qwen3 model's forward + backward (the stand-in,
  workload.py), whose ops are counted, at a width where the arithmetic takes no time; and the
  recipe's own host work in those ops (its drafter and target 32 wide, workload.NarrowCopies).
- what DeepSpeed adds, per engine mode (ZeRO stage × offload): the recipe's drafter 32 wide
  under a real engine of that mode against the same drafter in plain PyTorch, per micro-batch
  and per step; under ZeRO-3 per module call (forward and backward: its hooks run on every
  call; at 32 wide every parameter is under the persistence threshold, so none of it is
  all-gather traffic) and per module call of the target 32 wide under its own optimizer-less
  engine, called as training calls it. The module calls are counted on the same copies.
- once: host <-> device copies (pinned on CUDA; on a CPU-only machine a RAM-to-RAM copy, what
  DeepSpeed's offload does when the device is the host), NVMe write and read through
  DeepSpeed's asynchronous I/O on the directory NVMe offload would use (every rank at once,
  when one is given), and comm_overlap (a large all-gather issued during a matmul on CUDA; on
  a CPU the collectives' copies run on the cores that compute, so none is hidden: 0).

Everything but the "once" part is measured in samples (`Calibration.sample`), each a single
pass over every workload, and each figure is the median over the samples. `--measure`
interleaves them with each option's timed steps (a sample before each block of steps, with that
option's engine mode), so that an option's prediction and its measurement see the same
conditions on a machine shared with other jobs; a calibration on its own takes its samples
back to back, for every engine mode. Not measured: the network between nodes (one node); it
keeps the preset's figures and the profile leaves it out.

The workloads, by what they measure: calibrate_compute.py (the peak, the sustained fractions,
the optimizers), calibrate_transfers.py (the collectives, host <-> device copies, comm_overlap,
NVMe), calibrate_host.py (host time per op, the recipe's host work, what DeepSpeed adds);
calibrate_timing.py times each on every rank at once.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_ds import distributed
from dspark_ds.cost.flops import target_in_job
from dspark_ds.tune.calibrate_compute import Compute, Optimizers
from dspark_ds.tune.calibrate_host import EngineWindow, HostWork
from dspark_ds.tune.calibrate_transfers import (
    Collectives,
    comm_overlap,
    host_device_copy,
    nvme_rates,
)
from dspark_ds.tune.cluster import ENGINE_MODES, GIB, TUPLE_FIELDS
from dspark_ds.tune.workload import at_scale


def host_memory_bytes() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


ENGINE_KEYS = {
    "micro": "engine_micro_s",
    "step": "engine_step_s",
    "fwd_call": "engine_module_fwd_s",
    "bwd_call": "engine_module_bwd_s",
    "target_call": "engine_target_module_s",
}


class Calibration:
    """The measurements of one calibration on every rank of the group: the "once" part, then
    samples (`sample`), each with the engine mode of an open `window`; `values` turns samples
    into Machine fields and host work."""

    def __init__(self, run_cfg, device: torch.device, stages: tuple[int, ...]):
        self.run_cfg, self.device, self.stages = run_cfg, device, stages
        self.dtype = torch.bfloat16 if run_cfg.train.precision == "bf16" else torch.float32
        self.in_job = target_in_job(run_cfg)
        self.load = [os.getloadavg()[0]]
        self.spent = 0.0
        self.samples: list[dict] = []
        self.fixed: dict = {}
        t0 = time.perf_counter()
        self.host = HostWork(run_cfg, stages, device, self.dtype)
        self.compute = Compute(run_cfg, device, self.dtype)
        self.collectives = Collectives(device, self.dtype) if distributed.world_size() > 1 else None
        self.optimizers = Optimizers(device)
        self.spent += time.perf_counter() - t0

    def once(self, nvme_dir: str | Path | None = None, aio: dict | None = None) -> None:
        """What does not follow the load much: copies, overlap; NVMe under `nvme_dir`."""
        t0 = time.perf_counter()
        device, dtype = self.device, self.dtype
        self.fixed["host_device_bytes_per_s"] = host_device_copy(device)
        if device.type == "cuda" and distributed.world_size() > 1:
            self.fixed["comm_overlap"] = comm_overlap(device, dtype)
        elif device.type != "cuda":
            # NOTE: gloo's copies run on the cores that compute: a ZeRO-3 step on a CPU hides
            # none of its all-gathers (a matmul beside an idle core would suggest otherwise)
            self.fixed["comm_overlap"] = 0.0
        if nvme_dir is not None:
            self.fixed.update(nvme_rates(nvme_dir, aio, ranks_per_node()))
        self.spent += time.perf_counter() - t0

    def window(self, mode: int) -> EngineWindow:
        t0 = time.perf_counter()
        window = EngineWindow(self.run_cfg, self.host, mode, self.in_job)
        self.spent += time.perf_counter() - t0
        return window

    def sample(self, window: EngineWindow) -> dict:
        """One pass over every load-following workload and `window`'s engine."""
        t0 = time.perf_counter()
        got = {"mode": window.mode}
        got.update(self.compute.sample())
        if self.collectives is not None:
            got.update(self.collectives.sample())
        got.update(self.optimizers.sample())
        got.update(self.host.sample())
        got["engine"] = window.sample()
        self.samples.append(got)
        self.load.append(os.getloadavg()[0])
        self.spent += time.perf_counter() - t0
        return got

    def run(self, modes: list[int], samples: int = 3) -> None:
        """A calibration on its own: the once part, then `samples` samples in each mode."""
        self.once()
        for mode in tqdm(
            modes, desc="calibrating", unit="mode", disable=not distributed.is_rank0()
        ):
            window = self.window(mode)
            for _ in range(samples):
                self.sample(window)
            window.close()

    def values(self, samples: list[dict] | None = None) -> tuple[dict, dict]:
        """(Machine fields, the recipe's host work) from `samples` (default: every sample):
        each figure the median over them, each engine mode's from its own samples (modes
        without a sample: 0)."""
        samples = samples if samples is not None else self.samples

        def median(key):
            return statistics.median(s[key] for s in samples)

        values = dict(self.fixed)
        values["peak_flops"] = median("peak_flops")
        values["sustained_fraction"] = min(1.0, median("sustained") / values["peak_flops"])
        values["target_sustained_fraction"] = min(
            1.0, median("target_sustained") / values["peak_flops"]
        )
        values["op_overhead_s"] = median("op_overhead_s")
        for key in ("device_adam_params_per_s", "device_adam_tensor_s", "cpu_adam_params_per_s"):
            values[key] = median(key)
        if self.collectives is not None:
            for op in Collectives.OPS:
                values[f"{op}_bytes_per_s"] = median(f"{op}_bytes_per_s")
            values["collective_latency_s"] = median("collective_latency_s")
        values.update(engine_figures(samples))

        scale = self.host.copies.scale
        work = dict(self.host.counts, collectives_timed=distributed.has_group())
        work["drafter"] = {
            stage: at_scale(
                [
                    statistics.median(s["work"]["drafter"][stage][i] for s in samples)
                    for i in range(len(steps))
                ],
                scale,
            )
            for stage, steps in self.host.copies.steps.items()
        }
        work["target"] = statistics.median(s["work"]["target"] for s in samples)
        return values, work

    def meta(self) -> dict:
        """What was measured, where and when."""
        cuda = self.device.type == "cuda"
        device_name = torch.cuda.get_device_name(self.device) if cuda else platform.processor()
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "device": device_name or "cpu",
            "ranks": distributed.world_size(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads_per_rank": torch.get_num_threads(),
            "samples": len(self.samples),
            "load_average": [round(min(self.load), 2), round(max(self.load), 2)],
            "seconds": round(self.spent, 1),
            "torch": torch.__version__,
            "host_memory_gib": round(host_memory_bytes() / GIB, 1),
            "drafter_kind": self.run_cfg.model.kind,
            "nvme_measured": "nvme_read_bytes_per_s" in self.fixed,
            "compute_shape": dict(self.compute.shape),
        }

    def machine_values(self) -> dict:
        """The fields that describe the machine rather than a measurement."""
        cuda = self.device.type == "cuda"
        memory = host_memory_bytes()
        return dict(
            gpus_per_node=ranks_per_node(),
            gpu_memory_bytes=float(torch.cuda.get_device_properties(self.device).total_memory)
            if cuda
            else memory,
            host_memory_bytes=memory,
            dispatch_overlaps_compute=cuda,
        )


def engine_figures(samples: list[dict]) -> dict[str, tuple[float, ...]]:
    """The ENGINE_KEYS fields from calibration samples: per engine mode the median over its own
    samples (modes without one: 0), the step's less its refresh all-gathers under ZeRO-3 at
    the mode's median all-gather latency (param_gather counts them)."""
    by_mode = [[s for s in samples if s["mode"] == m] for m in range(len(ENGINE_MODES))]
    out = {
        key: tuple(
            statistics.median(s["engine"][part] for s in mine) if mine else 0.0 for mine in by_mode
        )
        for part, key in ENGINE_KEYS.items()
    }
    # NOTE: the difference of the medians, not each sample's step less its own latency times
    # the tensors (18 in the tiny recipe): one 2.2 ms latency among 0.24-0.9 ms took 40 ms out
    # of a 26 ms step, and that sample counted as 0
    out["engine_step_s"] = tuple(
        max(0.0, step - mine[0]["engine"]["refreshes"] * _gather_latency(mine)) if mine else 0.0
        for step, mine in zip(out["engine_step_s"], by_mode)
    )
    return out


def _gather_latency(samples: list[dict]) -> float:
    """The samples' median all-gather latency (0 on one rank: no collectives)."""
    return statistics.median(s.get("all_gather_latency_s", 0.0) for s in samples)


def ranks_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", distributed.world_size()))


def engine_values(values: dict, mode: int, base: dict) -> dict:
    """`values` with its engine tuples holding only `mode`'s entry from them, the other modes'
    from `base` (a machine's fields)."""
    out = dict(values)
    for key in TUPLE_FIELDS:
        merged = list(base[key])
        merged[mode] = values[key][mode]
        out[key] = tuple(merged)
    return out
