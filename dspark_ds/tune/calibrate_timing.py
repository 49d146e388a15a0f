"""Timing a calibration's workload on every rank at once: each rank starts it together, times it
on its own, and the figures kept are the slowest rank's (`max_over_ranks`, several at once)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dspark_ds import distributed

REPEATS = 3
"""Timings of a host-bound workload per sample (the median is kept)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(values: list[float]) -> list[float]:
    return distributed.all_reduce_values(values, op="max")


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 1) -> float:
    """Median seconds of `fn` over `repeats` calls, every rank starting each together; this
    rank's (callers take the slowest rank's, several figures at once)."""
    times = []
    for _ in range(repeats):
        distributed.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
