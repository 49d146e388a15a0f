"""Rank discovery and the few collectives the data tools need (barrier, gather of small objects).

Data tools run under torchrun / srun / the deepspeed launcher (RANK, WORLD_SIZE in the env) or as
plain processes with RANK / WORLD_SIZE set by hand. A gloo process group is created only when a
rendezvous is configured (MASTER_ADDR); without one, ranks coordinate through files.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """(rank, world_size) from the default process group, else from RANK / WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world


def maybe_init_process_group(timeout_s: int = 1800) -> bool:
    """Join a gloo group when launched with a rendezvous (torchrun); return whether one exists."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and "MASTER_ADDR" in os.environ:
        # NOTE: gloo even on GPU nodes: only barriers and small Python objects travel here.
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        return True
    return False


def has_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if has_group():
        dist.barrier()


def all_gather_object(obj):
    """Every rank's ``obj`` as a list (a one-element list without a process group)."""
    if not has_group():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def print_rank0(*args, **kwargs) -> None:
    if rank_and_world()[0] == 0:
        print(*args, **kwargs, flush=True)
