"""Who am I in the job, and how the ranks talk: the one place for rank discovery, process-group
set-up, the device collectives need, rank-0 printing, free ports and leaving.

| launcher                                   | what it sets                           | rank comes from |
|--------------------------------------------|----------------------------------------|-----------------|
| `torchrun` / `deepspeed` (also under srun) | RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* | those variables |
| `mpirun` / `mpiexec` (Open MPI, MPICH...)  | OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK    | MPI itself (mpi4py), at `init()` |
| `srun`, one task per GPU                   | SLURM_PROCID, SLURM_STEP_NUM_TASKS...  | the SLURM_* variables |
| nothing (`python -m dspark_ds.cli train`)  | —                                      | a world of one  |

`discover()` reads the environment only; `prepare_env()` also exports torch's env:// variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Under MPI the master address is only
known after an MPI collective, so `init()` asks MPI for it. The precedence (torch launcher > MPI
> srun > single) matches what nests in practice: `srun torchrun`, `mpirun` inside an sbatch
allocation.

Collectives: NCCL only takes CUDA tensors of the process's own device, gloo CPU (or any)
tensors. `collective_device()` says which one the default group needs; `all_reduce_values()`
builds its tensor there, so callers hand it plain numbers and cannot get the device wrong.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from dspark_ds import logs

Launcher = Literal["torchrun", "mpi", "slurm", "single"]

DEFAULT_MASTER_PORT = 29500
"""torch.distributed's conventional default (also what MPI discovery uses without MASTER_PORT)."""


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job, as far as it is known before any collective."""

    launcher: Launcher
    """Which launcher started the process."""
    rank: int | None
    """Global rank; None under MPI until `init()` has asked MPI."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    master_addr: str | None
    """Rendezvous host (rank 0's node); None under MPI until `init()`."""
    master_port: int
    """Rendezvous TCP port."""


# ---- discovery (environment only) --------------------------------------------------------------
def _int(env: MutableMapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as err:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from err
    return None


def _in_mpi(env: MutableMapping[str, str]) -> bool:
    return any(
        k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
    )


def _in_srun_step(env: MutableMapping[str, str]) -> bool:
    # NOTE: the batch script itself also sees SLURM_PROCID=0 and SLURM_NTASKS=N; a plain
    # `python ...` there must not wait for N-1 peers that never start. Only srun sets
    # SLURM_STEP_NUM_TASKS (and the world of a step may be smaller than the allocation).
    return "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env


def slurm_head_node(nodelist: str) -> str:
    """The first host of a Slurm nodelist (`node[01-04]` → `node01`), via `scontrol show
    hostnames` as the sbatch scripts do; a plain host name is returned as is."""
    if not any(c in nodelist for c in "[],"):
        return nodelist
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with `scontrol show hostnames` "
            f"({err}); export MASTER_ADDR (the sbatch scripts in slurm/ do)"
        ) from err
    if not out:
        raise RuntimeError(f"`scontrol show hostnames {nodelist}` printed nothing")
    return out[0]


def slurm_default_port(job_id: str | int | None) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide (the sbatch
    scripts use the same formula)."""
    if job_id in (None, ""):
        return DEFAULT_MASTER_PORT
    return 20000 + int(str(job_id).split("_")[0]) % 20000


def discover(env: MutableMapping[str, str] | None = None) -> LaunchInfo:
    """Reads the environment only (no side effects, no network)."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK") or 0,
            env.get("MASTER_ADDR") or None,
            port or DEFAULT_MASTER_PORT,
        )
    if _in_mpi(env):
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
        local = _int(
            env,
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "MPI_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_RANK",
            "PMI_LOCAL_RANK",
        )
        return LaunchInfo(
            "mpi",
            None,
            world if world is not None else -1,
            local or 0,
            None,
            port or DEFAULT_MASTER_PORT,
        )
    if _in_srun_step(env):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (slurm_head_node(nodelist) if nodelist else None)
        return LaunchInfo(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_STEP_NUM_TASKS"),
            _int(env, "SLURM_LOCALID") or 0,
            addr,
            port or slurm_default_port(env.get("SLURM_JOB_ID")),
        )
    return LaunchInfo("single", 0, 1, 0, env.get("MASTER_ADDR") or "127.0.0.1", port or 0)


def prepare_env(env: MutableMapping[str, str] | None = None) -> LaunchInfo:
    """`discover()`, then export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for
    torch's env:// init (every launcher but MPI, whose rank `init()` asks MPI for)."""
    env = os.environ if env is None else env
    info = discover(env)
    if info.launcher in ("slurm", "single"):
        port = info.master_port or free_port()
        env["RANK"] = str(info.rank)
        env["WORLD_SIZE"] = str(info.world_size)
        env["LOCAL_RANK"] = str(info.local_rank)
        env["MASTER_ADDR"] = str(info.master_addr)
        env["MASTER_PORT"] = str(port)
        info = LaunchInfo(
            info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr, port
        )
    elif info.launcher == "torchrun":
        env.setdefault("LOCAL_RANK", str(info.local_rank))
        env.setdefault("MASTER_ADDR", info.master_addr or "127.0.0.1")
        env.setdefault("MASTER_PORT", str(info.master_port))
    return info


def _mpi_env(info: LaunchInfo, env: MutableMapping[str, str]) -> LaunchInfo:
    """Under mpirun: rank and world size from MPI, rank 0's address as the master, the local
    rank from the host names; exported as torch's env:// variables."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError(
            "launched by mpirun, but mpi4py is not importable; `pip install dspark-ds[mpi]` "
            "(it needs an MPI library, e.g. Debian's libopenmpi-dev)"
        ) from err
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    addr = None
    if rank == 0:
        try:
            addr = subprocess.check_output(["hostname", "-I"], text=True).split()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            addr = socket.gethostbyname(socket.gethostname())
    addr = comm.bcast(addr, root=0)
    host = MPI.Get_processor_name()
    local = sum(h == host for h in comm.allgather(host)[:rank])
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local),
        MASTER_ADDR=addr,
        MASTER_PORT=str(info.master_port),
    )
    return LaunchInfo("mpi", rank, world, local, addr, info.master_port)


# ---- the process group ------------------------------------------------------------------------
def rank_and_world() -> tuple[int, int]:
    """(rank, world size): from the process group once it exists, else what `discover()` says
    (so a data tool and the trainer agree on who they are before either has joined a group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    info = discover()
    if info.rank is None:  # MPI before init(): the launcher's own variables
        rank = _int(os.environ, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") or 0
        return rank, info.world_size
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"RANK={info.rank} is outside WORLD_SIZE={info.world_size}")
    return info.rank, info.world_size


def local_device() -> torch.device:
    """This process's compute device: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", discover().local_rank)
    return torch.device("cpu")


def init(
    backend: str | None = None, *, always: bool = True, timeout_s: float | None = None
) -> tuple[int, int, int]:
    """Joins (or creates) the default process group; returns (rank, world size, local rank).

    backend: None = nccl with CUDA, gloo without. The process's CUDA device is set before the
    group exists and handed to it (`device_id`), so NCCL never guesses cuda:0 and barriers know
    their device. always: False = a world of one gets no group (data tools); True = it gets a
    one-process group (DeepSpeed needs one), and so do ranks given by hand as RANK /
    WORLD_SIZE without a MASTER_ADDR (they coordinate through files).
    """
    found = discover()
    if not always and (
        found.world_size == 1 or (found.launcher == "torchrun" and found.master_addr is None)
    ):
        return found.rank or 0, found.world_size, found.local_rank
    info = prepare_env()
    if info.launcher == "mpi":
        info = _mpi_env(info, os.environ)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), info.local_rank
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    kwargs = {}
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", info.local_rank)
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, **kwargs)
    return dist.get_rank(), dist.get_world_size(), info.local_rank


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def has_group() -> bool:
    """A process group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device(group=None) -> torch.device:
    """The device whose tensors the group's collectives take: this process's CUDA device under
    NCCL, the CPU otherwise."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_values(
    values: Sequence[float], op: str = "sum", dtype: torch.dtype = torch.float64
) -> list[float]:
    """Plain numbers reduced over every rank (op "sum" | "max" | "min"); a world of one
    returns them unchanged. The tensor is built on `collective_device()`."""
    if not has_group():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=dtype, device=collective_device())
    dist.all_reduce(
        t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    )
    return t.tolist()


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of a tensor that already lives on the group's device (a step's
    loss terms); refuses any other device, so a CPU tensor never reaches NCCL."""
    if not has_group():
        return tensor
    want = collective_device()
    if tensor.device.type != want.type:
        raise RuntimeError(
            f"all_reduce_: tensor on {tensor.device}, but the process group needs {want}"
        )
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def barrier() -> None:
    if has_group():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Every rank's `obj`, as a list (a one-element list without a group)."""
    if not has_group():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_object(obj, dst: int = 0) -> list | None:
    """Every rank's `obj` on rank `dst` (None elsewhere); a one-element list without a group."""
    if not has_group():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def is_rank0() -> bool:
    return rank_and_world()[0] == 0


def print0(*args, file=None, sep: str = " ") -> None:
    """A status line on rank 0 only, with the time and the rank (`dspark_ds.logs`), flushed.
    `file`: the stream (stdout by default)."""
    rank, _ = rank_and_world()
    if rank == 0:
        logs.emit(sep.join(str(a) for a in args), rank, file)


def log(*args, file=None, sep: str = " ") -> None:
    """A status line from this rank (every rank prints), with the time and the rank."""
    logs.emit(sep.join(str(a) for a in args), rank_and_world()[0], file)


def free_port() -> int:
    """A TCP port free on the loopback interface right now (single-process rendezvous, tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy() -> None:
    """Destroys the default process group, if any (a subcommand run in-process that made one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int = 0) -> None:
    """End a multi-rank process that finished (or is leaving for requeue) in good order.

    All ranks meet at a barrier, destroy the process group, finalise MPI under mpirun, flush
    their output and leave with `os._exit(code)`. Skipping interpreter shutdown is deliberate:
    DeepSpeed keeps its process groups in module globals, so their gloo backends would be
    destroyed during finalization, where their worker threads can abort the process
    ("terminate called without an active exception", SIGABRT) after the job's work is done —
    the launcher then reports a failure and `srun --kill-on-bad-exit` kills the other ranks.
    Not called on errors (a barrier or a destroy while other ranks sit in a collective can
    hang). A world of one returns normally.
    """
    if not has_group():
        return
    dist.barrier()
    dist.destroy_process_group()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # what mpi4py's exit hook would do; mpirun counts a rank without it failed
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
