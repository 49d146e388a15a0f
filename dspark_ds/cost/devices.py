"""The GPUs known by name (torch.cuda's device name): their datasheet figures, which a training
run's MFU is against when `train.peak_tflops` is unset (`peak_flops`) and which the tuner's
cluster presets are built around (tune/cluster.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    """One GPU's datasheet figures."""

    peak_flops: float
    """Dense bf16 matmul FLOP/s (tensor cores)."""
    memory_bytes: float
    """Its memory (the datasheet's GB taken as GiB, as the tuner's presets always have)."""
    memory_bytes_per_s: float
    """Its memory's (HBM) bandwidth."""


# NVIDIA H100 / H200 SXM datasheets (docs/tuner.md has the sources): 989 dense bf16 TFLOP/s,
# 80 / 141 GB, 3.35 / 4.8 TB/s. The SXM parts only: the PCIe and NVL parts run at lower clocks
# and peaks, and are not known by name.
GPUS = {  # torch.cuda's name: Gpu(peak_flops, memory_bytes, memory_bytes_per_s)
    "NVIDIA H100 80GB HBM3": Gpu(989e12, 80 * GIB, 3.35e12),
    "NVIDIA H200": Gpu(989e12, 141 * GIB, 4.8e12),
}


def device_peak_flops(device_name: str) -> float | None:
    """The dense bf16 FLOP/s of a known GPU (`GPUS`), or None."""
    gpu = GPUS.get(device_name)
    return None if gpu is None else gpu.peak_flops


def peak_flops(peak_tflops: float | None, precision: str, device: torch.device) -> float | None:
    """The peak MFU is measured against: `train.peak_tflops`, else a known GPU's dense bf16
    figure under bf16 (`GPUS`), else None (no MFU: a CPU, another GPU, fp32)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda" or precision != "bf16":
        return None
    return device_peak_flops(torch.cuda.get_device_name(device))
