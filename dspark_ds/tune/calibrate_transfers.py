"""The calibration's transfer rates: the three collectives of ZeRO on the process group
(latency from a one-element call, bus bandwidth from a large one), host <-> device copies, the
share of an all-gather a matmul hides (comm_overlap), NVMe write and read through DeepSpeed's
asynchronous I/O."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from dspark_ds import distributed
from dspark_ds.engine.probes import aio_bandwidth
from dspark_ds.tune.calibrate_timing import max_over_ranks, timed

NVME_PROBE_BYTES = 32 * 2**20
"""Bytes each rank writes and reads to measure NVMe."""


class Collectives:
    """Latency (1 element) and bus bandwidth (a large buffer) of each ZeRO collective."""

    OPS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.world = device, distributed.world_size()
        self.numel = (64 if device.type == "cuda" else 2) * 2**20
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.calls = {}
        for n in (1, self.numel):
            full = torch.zeros(n * self.world, device=device, dtype=dtype)
            part = torch.zeros(n, device=device, dtype=dtype)
            self.calls[n] = {
                "all_reduce": lambda p=part: dist.all_reduce(p),
                "all_gather": lambda f=full, p=part: dist.all_gather_into_tensor(f, p),
                "reduce_scatter": lambda f=full, p=part: dist.reduce_scatter_tensor(p, f),
            }
        self.sample()  # warm-up

    def sample(self) -> dict[str, float]:
        t = []
        for op in self.OPS:
            t += [
                timed(self.calls[1][op], self.device, 3),
                timed(self.calls[self.numel][op], self.device),
            ]
        t = max_over_ranks(t)
        out: dict[str, float] = {}
        world = self.world
        for i, op in enumerate(self.OPS):
            small, large = t[2 * i], t[2 * i + 1]
            out[f"{op}_latency_s"] = small
            # bytes each rank moves over its link: ring all-reduce 2(N-1)/N of the buffer, the
            # others (N-1)/N of the gathered / scattered whole
            factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            moved = factor * self.numel * self.elem * (1 if op == "all_reduce" else world)
            out[f"{op}_bytes_per_s"] = moved / max(large - small, 1e-9)
        out["collective_latency_s"] = statistics.median(out[f"{op}_latency_s"] for op in self.OPS)
        return out


def host_device_copy(device: torch.device) -> float:
    """Bytes/s of one rank's host <-> device copies (the slower direction); on a CPU-only
    machine a RAM-to-RAM copy (what DeepSpeed's offload does when the device is the host)."""
    numel = 32 * 2**20
    if device.type == "cuda":
        host = torch.empty(numel, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(numel, dtype=torch.float32, device=device)
        h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, repeats=5)
        d2h = timed(lambda: host.copy_(dev, non_blocking=True), device, repeats=5)
        return numel * 4 / max_over_ranks([max(h2d, d2h)])[0]
    src, dst = torch.ones(numel), torch.empty(numel)
    return numel * 4 / max_over_ranks([timed(lambda: dst.copy_(src), device, repeats=5)])[0]


def comm_overlap(device: torch.device, dtype: torch.dtype) -> float:
    """Share of an all-gather hidden behind a matmul issued while it runs (0..1)."""
    world = distributed.world_size()
    n = 4096 if device.type == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dtype)
    part = torch.zeros(2**20 * (16 if device.type == "cuda" else 1), device=device, dtype=dtype)
    full = torch.zeros(part.numel() * world, device=device, dtype=dtype)

    def both():
        work = dist.all_gather_into_tensor(full, part, async_op=True)
        a @ a
        work.wait()

    t_mm, t_comm, t_both = max_over_ranks(
        [
            timed(fn, device, repeats=3)
            for fn in (lambda: a @ a, lambda: dist.all_gather_into_tensor(full, part), both)
        ]
    )
    hidden = t_mm + t_comm - t_both
    return float(min(1.0, max(0.0, hidden / max(min(t_mm, t_comm), 1e-9))))


def nvme_rates(directory: str | Path, aio: dict | None, ranks_per_node: int) -> dict[str, float]:
    """A node's NVMe write and read bytes/s through DeepSpeed's asynchronous I/O under
    `directory`, every rank at once (the node's drives serve its ranks): the median of three
    write + read pairs per rank, the slowest rank's, times the ranks."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    pairs = []
    for _ in range(3):
        distributed.barrier()
        pairs.append(aio_bandwidth(directory, NVME_PROBE_BYTES, aio))
    write, read = max_over_ranks([statistics.median(p[i] for p in pairs) for i in (0, 1)])
    return {
        "nvme_write_bytes_per_s": ranks_per_node * NVME_PROBE_BYTES / write,
        "nvme_read_bytes_per_s": ranks_per_node * NVME_PROBE_BYTES / read,
    }
