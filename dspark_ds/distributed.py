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
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dspark_ds import logs, network

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
    """Started by mpirun / mpiexec. NOTE: srun under `MpiDefault=pmi2` or `pmix` (or `--mpi=`)
    also puts PMI_* / PMIX_* into every task; inside an srun step those mean MPI only when their
    world is not the step's (Hydra's mpiexec starts one proxy per node through srun)."""
    if "OMPI_COMM_WORLD_SIZE" in env or "MV2_COMM_WORLD_SIZE" in env:
        return True
    if not any(k in env for k in ("PMI_SIZE", "PMI_RANK", "PMIX_RANK")):
        return False
    if not _in_srun_step(env):
        return True
    pmi_size = env.get("PMI_SIZE")
    return pmi_size not in (None, "") and pmi_size != env.get("SLURM_STEP_NUM_TASKS")


def _in_srun_step(env: MutableMapping[str, str]) -> bool:
    # NOTE: the batch script itself also sees SLURM_PROCID=0 and SLURM_NTASKS=N; a plain
    # `python ...` there must not wait for N-1 peers that never start. Only srun sets
    # SLURM_STEP_NUM_TASKS (and the world of a step may be smaller than the allocation).
    return "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env


def expand_nodelist(nodelist: str) -> list[str]:
    """A Slurm node list (`node[01-04],gpu7`) as host names, via `scontrol show hostnames`; a
    plain host name is returned as is."""
    if not any(c in nodelist for c in "[],"):
        return [nodelist]
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
    return out


def slurm_head_node(nodelist: str) -> str:
    """The first host of a Slurm nodelist (`node[01-04]` → `node01`), as the sbatch scripts
    take it."""
    return expand_nodelist(nodelist)[0]


def slurm_default_port(job_id: str | int | None) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide, outside the
    kernel's ephemeral range (`network.job_port`; the sbatch scripts use the same formula)."""
    if job_id in (None, ""):
        return DEFAULT_MASTER_PORT
    return network.job_port(job_id)


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
        # lazy: optional dependency mpi4py (the [mpi] extra)
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError(
            "launched by mpirun, but mpi4py is not importable; `pip install dspark-ds[mpi]` "
            "(it needs an MPI library, e.g. Debian's libopenmpi-dev)"
        ) from err
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    host = MPI.Get_processor_name()
    hosts = comm.allgather(host)
    addr = None
    if rank == 0:
        addr = _mpi_head_address([host, *(h for h in dict.fromkeys(hosts) if h != host)])
    addr = comm.bcast(addr, root=0)
    local = sum(h == host for h in hosts[:rank])
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local),
        MASTER_ADDR=addr,
        MASTER_PORT=str(info.master_port),
    )
    return LaunchInfo("mpi", rank, world, local, addr, info.master_port)


def _mpi_head_address(hosts: list[str]) -> str:
    """Rank 0's address as the other hosts reach it (`network.head_address`); when its host
    name does not resolve, its first non-loopback address."""
    try:
        return network.head_address(hosts)
    except network.NetworkError:
        up = [i for i in network.interfaces().values() if i.up and not i.loopback and i.addresses]
        return up[0].addresses[0] if up else "127.0.0.1"


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
    """This process's compute device: a CUDA device when CUDA is available, else the CPU.

    Which CUDA device: the local rank among the devices this process can see. One visible device
    (`srun --gpus-per-task=1`, `--gpu-bind=single:1`, a CUDA_VISIBLE_DEVICES per task) is
    cuda:0 whatever the local rank; several (one task per node, or all of the node's GPUs
    visible to each task) are indexed by LOCAL_RANK modulo their count."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError(
            f"rank {discover().rank}: CUDA is available but this process sees no device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    return torch.device("cuda", discover().local_rank % count)


@dataclass
class DistributedConfig:
    """How the ranks of a multi-process job reach each other."""

    ifname: str | None = None
    """Network interface gloo and NCCL use (exported as GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME unless those are set). None = $DSPARK_IFNAME, else the interface that
    routes to MASTER_ADDR (docs/multi-node.md)."""
    timeout_s: float = 600.0
    """Bounds the start (every rank reaching MASTER_ADDR and joining) and every collective: a
    rank that waits longer for a lost or cut-off peer fails with one line instead of hanging.
    Raise it when one rank legitimately works alone for longer (a very slow disk)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"distributed.timeout_s: must be > 0, got {self.timeout_s}")


def init(
    backend: str | None = None,
    *,
    always: bool = True,
    settings: DistributedConfig | None = None,
) -> tuple[int, int, int]:
    """Joins (or creates) the default process group; returns (rank, world size, local rank).

    backend: None = nccl with CUDA, gloo without. The process's CUDA device is set before the
    group exists and handed to it (`device_id`), so NCCL never guesses cuda:0 and barriers know
    their device. always: False = a world of one gets no group (data tools); True = it gets a
    one-process group (DeepSpeed needs one), and so do ranks given by hand as RANK /
    WORLD_SIZE without a MASTER_ADDR (they coordinate through files). settings: the interface
    and the timeout (`DistributedConfig`; its defaults when None).

    Before joining, the network interface is exported (`configure_network`) and every rank
    but 0 waits, at most the timeout, until MASTER_ADDR:MASTER_PORT answers; a rendezvous that
    fails raises `network.NetworkError`, one line naming the host, address, port and interface.
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
        device = local_device()
        torch.cuda.set_device(device)
        if backend == "nccl":
            kwargs["device_id"] = device
    net = settings or DistributedConfig()
    choice = configure_network(info, net.ifname)
    timeout = timedelta(seconds=net.timeout_s)
    # NOTE: groups made later without a timeout (DeepSpeed's data-parallel clones of the world)
    # take torch's module default (30 min for gloo), not the world's: a lost peer would hold
    # them that long. The default follows the world's so every collective has the same bound.
    c10d.default_pg_timeout = timeout
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timeout
    t0 = time.monotonic()
    try:
        if info.rank not in (0, None) and info.master_addr:
            network.wait_reachable(
                info.master_addr, info.master_port, net.timeout_s, choice.ifname if choice else None
            )
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    except network.NetworkError:
        raise
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError are RuntimeErrors
        via = f" via {choice.ifname} ({choice.address})" if choice else ""
        raise network.NetworkError(
            f"host {socket.gethostname()} rank {info.rank}: the rendezvous at "
            f"{info.master_addr}:{info.master_port}{via} failed after "
            f"{time.monotonic() - t0:.0f} s (distributed.timeout_s {net.timeout_s:g}): "
            f"{_one_line(err)}"
        ) from err
    return dist.get_rank(), dist.get_world_size(), info.local_rank


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def multi_host(env: MutableMapping[str, str] | None = None) -> bool | None:
    """Whether the job's ranks span several hosts, from the launcher's variables (None: the
    launcher does not say)."""
    env = os.environ if env is None else env
    nodes = _int(env, "SLURM_STEP_NUM_NODES") if _in_srun_step(env) else None
    if nodes is not None and not _int(env, "LOCAL_WORLD_SIZE"):
        return nodes > 1
    for local, world in (
        ("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
    ):
        lw, w = _int(env, local), _int(env, world)
        if lw is not None and w is not None:
            return lw < w
    return None


def _peer_hosts(env: MutableMapping[str, str]) -> list[str]:
    """The job's other hosts (from the Slurm step's node list), for the interface choice."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if not nodelist:
        return []
    try:
        hosts = expand_nodelist(nodelist)
    except RuntimeError:
        return []
    me = socket.gethostname().split(".")[0]
    return [h for h in hosts if h.split(".")[0] != me]


def configure_network(
    info: LaunchInfo, ifname: str | None = None, env: MutableMapping[str, str] | None = None
) -> network.Choice | None:
    """Exports the interface gloo and NCCL bind to (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME),
    each unless the user set it: `ifname` (distributed.ifname), else DSPARK_IFNAME, else the
    rule of `dspark_ds.network` (the route to MASTER_ADDR). Returns the choice, None for a world
    of one or when both variables were set by hand. One line per host says what was chosen."""
    env = os.environ if env is None else env
    if info.world_size <= 1 or not info.master_addr:
        return None
    user = [k for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if env.get(k)]
    if len(user) == 2:
        return None
    chosen = ifname or env.get("DSPARK_IFNAME") or None
    if chosen:
        here = network.interfaces()
        if chosen not in here:
            raise network.NetworkError(
                f"host {socket.gethostname()}: network interface {chosen!r} (distributed.ifname "
                f"/ DSPARK_IFNAME) does not exist here; interfaces: {', '.join(sorted(here))}"
            )
        addrs = here[chosen].addresses
        choice = network.Choice(chosen, addrs[0] if addrs else "?", "given")
    else:
        spans = multi_host(env)
        choice = network.choose_interface(
            info.master_addr,
            _peer_hosts(env) if spans is not False else [],
            multi_host=spans is not False,
        )
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if key not in user:
            env[key] = choice.ifname
    if _int(env, "LOCAL_RANK") in (0, None):
        logs.emit(
            f"[dist] host {socket.gethostname()}: interface {choice.ifname} ({choice.address}): "
            f"{choice.why}; MASTER {info.master_addr}:{info.master_port}",
            info.rank,
            sys.stderr,
        )
    return choice


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


def ranks_per_node() -> int:
    """Ranks on a host of the job, the same answer on every rank: LOCAL_WORLD_SIZE where the
    launcher sets it (torchrun), else the fewest ranks any host runs (the hosts' names
    gathered: one collective)."""
    local = _int(os.environ, "LOCAL_WORLD_SIZE")
    if local or not has_group():
        return local or 1
    hosts = all_gather_object(socket.gethostname())
    return min(hosts.count(h) for h in set(hosts))


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


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank (`obj` itself without a group)."""
    if not has_group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


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


def leave(code: int = 0, whole_process: bool = False) -> None:
    """End a multi-rank process that finished (or is leaving for requeue) in good order.

    All ranks meet at a barrier, destroy the process group, finalise MPI under mpirun, flush
    their output and leave with `os._exit(code)`. Skipping interpreter shutdown is deliberate:
    DeepSpeed keeps its process groups in module globals, so their gloo backends would be
    destroyed during finalization, where their worker threads can abort the process
    ("terminate called without an active exception", SIGABRT) after the job's work is done —
    the launcher then reports a failure and `srun --kill-on-bad-exit` kills the other ranks.
    Not called on errors (a barrier or a destroy while other ranks sit in a collective can
    hang). A world of one returns normally, unless `whole_process` (the process's own entry
    point, not a call from inside another program such as a test): a single-process run's
    DeepSpeed groups can abort its finalization the same way.
    """
    if has_group():
        dist.barrier()
    elif not whole_process:
        return
    destroy()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # what mpi4py's exit hook would do; mpirun counts a rank without it failed
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
