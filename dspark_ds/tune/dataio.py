"""The data term: what an offline run reads from its cache, the node's read bandwidth, and when
the step would wait for it.

An offline run reads, per token, its ids and mask and the target's tapped hidden states and
last hidden state in the cache's storage dtype (`data.cache.bytes_per_token`: (taps + 1) × H
features, fp8 half of bf16 plus its scales); a node's ranks read theirs together, at the node's
`cache_read_bytes_per_s` (a preset assumption, a flag, or calibrated on the cache's own
directory: `measure_read`). The step-time term (`steptime.data_read`) is that read time, less
what the loader's workers (`data.num_workers` > 0) run ahead under the rest of the step.
Online and hybrid runs (the target in the job) read no features: no term.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from dspark_ds import distributed
from dspark_ds.data.cache import bytes_per_token
from dspark_ds.tune.cluster import GB

READ_BLOCK = 8 * 2**20
READ_LIMIT = 512 * 2**20
"""The most bytes the calibration reads (all ranks of the node together)."""


def reads_cache(run_cfg) -> bool:
    return run_cfg.data.mode == "offline" and not run_cfg.train.synthetic_samples


def cache_storage(run_cfg) -> str:
    """The cache's storage dtype: its manifest's (or build.json's) when the directory has one,
    else what a build would write (data.cache_dtype, "auto" = the target's dtype)."""
    for name in ("manifest.json", "build.json"):
        path = Path(run_cfg.data.cache_dir or "") / name
        if run_cfg.data.cache_dir and path.is_file():
            try:
                return str(json.loads(path.read_text())["dtype"])
            except (OSError, ValueError, KeyError):
                pass
    dtype = run_cfg.data.cache_dtype
    return run_cfg.target.dtype if dtype == "auto" else dtype


def token_bytes(run_cfg, inv, storage: str | None = None) -> int:
    """Bytes one token takes in the cache (its storage dtype, or `storage`)."""
    return bytes_per_token(inv.hidden, inv.taps, storage or cache_storage(run_cfg))


def sequence_bytes(run_cfg, inv) -> float:
    """Bytes a training sequence of data.max_length tokens reads from the cache (0 when the run
    reads none)."""
    return (
        float(run_cfg.data.max_length * token_bytes(run_cfg, inv)) if reads_cache(run_cfg) else 0.0
    )


def _files(directory: Path) -> list[Path]:
    """The cache's files, its shards first (the bulk of what training reads)."""
    shards = sorted((directory / "shards").glob("*.safetensors"))
    rest = sorted(p for p in directory.rglob("*") if p.is_file() and p not in set(shards))
    return shards + rest


def _read(path: Path, limit: int) -> int:
    """Reads up to `limit` bytes of `path` after asking the kernel to drop its cached pages (a
    file read again would come from RAM); the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done = 0
        while done < limit:
            chunk = os.read(fd, min(READ_BLOCK, limit - done))
            if not chunk:
                break
            done += len(chunk)
        return done
    finally:
        os.close(fd)


def measure_read(directory: str | Path, limit: int = READ_LIMIT) -> tuple[float, float] | None:
    """The node's read bandwidth on `directory`, every rank of the launcher reading its own
    share of the files at once (as training's ranks do): (bytes read in all, seconds of the
    slowest rank), or None when the directory holds nothing to read."""
    files = _files(Path(directory)) if Path(directory).is_dir() else []
    if not files:
        return None
    world = distributed.world_size()
    rank = torch.distributed.get_rank() if world > 1 else 0
    mine = files[rank::world] or files[rank % len(files) :: len(files)]
    budget = limit // world
    distributed.barrier()
    t0 = time.perf_counter()
    done = 0
    for path in mine:
        if done >= budget:
            break
        done += _read(path, budget - done)
    seconds = time.perf_counter() - t0
    total, _ = distributed.all_reduce_values([done, 0.0], op="sum")
    (slowest,) = distributed.all_reduce_values([seconds], op="max")
    return (total, slowest) if total > 0 and slowest > 0 else None


def data_lines(best, run_cfg, inv, machine) -> list[str]:
    """The cache's read rate at the recommended point, and a warning when the step would wait
    for it (I/O-bound), pointing at an fp8 cache or online mode."""
    if best is None or not reads_cache(run_cfg):
        return []
    step = best.step
    nodes = step["nodes"]
    per_token = token_bytes(run_cfg, inv)
    fp8 = token_bytes(run_cfg, inv, "fp8")
    tokens = step["sequences"] * run_cfg.data.max_length / nodes  # per node and step
    rest = step["predicted_step_s"] - step["terms"].get("data_read", 0.0)
    need = tokens * per_token / rest  # bytes/s per node to keep up with the rest of the step
    have = machine.cache_read_bytes_per_s
    source = machine.sources.get("cache_read_bytes_per_s", "default")
    storage = cache_storage(run_cfg)
    line = (
        f"data: the offline cache ({storage}, {per_token} bytes per token) is read at "
        f"{need / GB:.3g} GB/s per node at {best.option}'s pace ({tokens / rest:.0f} tokens/s "
        f"per node); the cluster reads {have / GB:.3g} GB/s [{source}]"
    )
    read_s = tokens * per_token / have
    if need <= have:
        if run_cfg.data.num_workers or read_s < 0.05 * rest:  # NOTE: under 5 %: not worth a line
            return [line]
        return [
            line,
            f"warning: data.num_workers 0: the cache's reads ({read_s:.3g} s per step) run on the "
            "step's path; loader workers (data.num_workers > 0) read ahead under the rest of it",
        ]
    hidden = "" if run_cfg.data.num_workers else " (data.num_workers 0: nothing overlaps)"
    return [
        line,
        f"warning: I/O-bound: the cache's reads take {read_s:.3g} s per step "
        f"against {rest:.3g} s for the rest{hidden}; an fp8 cache (build-cache --data.cache_dtype "
        f"fp8: {fp8} bytes per token, {need * fp8 / per_token / GB:.3g} GB/s) or data.mode "
        "online (the target in the job: no features read) would not wait for it",
    ]
