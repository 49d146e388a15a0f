"""Who am I in the job? Rank discovery for every launcher dspark-ds supports.

| launcher                                   | what it sets                         | rank comes from |
|--------------------------------------------|--------------------------------------|-----------------|
| `torchrun` / `deepspeed` (also under srun) | RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* | those variables |
| `mpirun` / `mpiexec` (Open MPI, MPICH...)  | OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK  | DeepSpeed's MPI discovery (mpi4py) |
| `srun`, one task per GPU                   | SLURM_PROCID, SLURM_STEP_NUM_TASKS...  | the SLURM_* variables |
| nothing (`python -m dspark_ds.cli train`)  | —                                    | a world of one  |

`prepare_env()` fills the torch.distributed env:// variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) for every launcher except MPI, where rank and master address are only
known after an MPI collective: there it leaves them to `deepspeed.init_distributed(
auto_mpi_discovery=True, distributed_port=info.master_port)` (engine.py; this module never
imports deepspeed). The precedence (torch launcher > MPI > srun > single) matches what nests in
practice: `srun torchrun`, `mpirun` inside an sbatch allocation.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["torchrun", "mpi", "slurm", "single"]

DEFAULT_MASTER_PORT = 29500
"""torch.distributed's conventional default (also DeepSpeed's MPI discovery default)."""


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job, as far as it is known before any collective."""

    launcher: Launcher
    """Which launcher started the process."""
    rank: int | None
    """Global rank; None under MPI until DeepSpeed's discovery has run."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    master_addr: str | None
    """Rendezvous host (rank 0's node); None under MPI until discovery."""
    master_port: int
    """Rendezvous TCP port."""


def _int(env: MutableMapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as err:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") \
                    from err
    return None


def _in_mpi(env: MutableMapping[str, str]) -> bool:
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                  "MV2_COMM_WORLD_SIZE"))


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
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with `scontrol show hostnames` "
            f"({err}); export MASTER_ADDR (the sbatch scripts in slurm/ do)") from err
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
        return LaunchInfo("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                          _int(env, "LOCAL_RANK") or 0, env.get("MASTER_ADDR") or None,
                          port or DEFAULT_MASTER_PORT)
    if _in_mpi(env):
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MPI_LOCAL_RANK",
                     "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK")
        return LaunchInfo("mpi", None, world if world is not None else -1, local or 0, None,
                          port or DEFAULT_MASTER_PORT)
    if _in_srun_step(env):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (slurm_head_node(nodelist) if nodelist else None)
        return LaunchInfo("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS"),
                          _int(env, "SLURM_LOCALID") or 0, addr,
                          port or slurm_default_port(env.get("SLURM_JOB_ID")))
    return LaunchInfo("single", 0, 1, 0, env.get("MASTER_ADDR") or "127.0.0.1",
                      port or _free_port())


def prepare_env(env: MutableMapping[str, str] | None = None) -> LaunchInfo:
    """`discover()`, then export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for
    torch's env:// init (all launchers but MPI, see the module docstring)."""
    env = os.environ if env is None else env
    info = discover(env)
    if info.launcher in ("slurm", "single"):
        env["RANK"] = str(info.rank)
        env["WORLD_SIZE"] = str(info.world_size)
        env["LOCAL_RANK"] = str(info.local_rank)
        env["MASTER_ADDR"] = str(info.master_addr)
        env["MASTER_PORT"] = str(info.master_port)
    elif info.launcher == "torchrun":
        env.setdefault("LOCAL_RANK", str(info.local_rank))
        env.setdefault("MASTER_ADDR", info.master_addr or "127.0.0.1")
        env.setdefault("MASTER_PORT", str(info.master_port))
    return info


def leave_distributed(code: int = 0) -> None:
    """End a multi-rank process that finished (or is leaving for requeue) in good order.

    All ranks meet at a barrier, destroy the process group, flush their output and leave with
    `os._exit(code)`. Skipping interpreter shutdown is deliberate: DeepSpeed keeps its process
    groups in module globals, so their gloo backends would be destroyed during finalization,
    where their worker threads can abort the process ("terminate called without an active
    exception", SIGABRT) after the job's work is done — the launcher then reports a failure and
    `srun --kill-on-bad-exit` kills the other ranks. Not called on errors (a barrier or a
    destroy while other ranks sit in a collective can hang). A world of one returns normally.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size() == 1:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark_ds.launch <subcommand> [args]`: export the env:// variables for this
    launcher (srun tasks get RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from SLURM_*), then run
    `dspark-ds <subcommand> [args]` in this process. What every slurm/*.sbatch script runs per
    task, so each subcommand (train, build-cache, regenerate, eval) sees the same world."""
    from dspark_ds import cli

    info = prepare_env()
    if os.environ.get("DSPARK_LAUNCH_VERBOSE", "1") != "0" and info.rank in (0, None):
        print(f"[launch] {info.launcher}: world_size={info.world_size} "
              f"master={info.master_addr}:{info.master_port}", file=sys.stderr, flush=True)
    return cli.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
