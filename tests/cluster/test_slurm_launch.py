"""Rank discovery (dspark_ds/launch.py) from the variables each launcher really sets, and the
sbatch scripts' static contract (headers, syntax)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dspark_ds import network
from dspark_ds.distributed import discover, prepare_env, rank_and_world, slurm_default_port

REPO = Path(__file__).resolve().parents[2]

# what `srun` sets in task 1 of a 2-node x 2-task step (seen with slurm 22.05)
SRUN_TASK = {
    "SLURM_JOB_ID": "1234",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu01",
    "SLURM_STEP_NODELIST": "gpu01",
}
# the batch shell of the same job: SLURM_PROCID=0 and SLURM_NTASKS=4 but no step
BATCH_SHELL = {
    "SLURM_JOB_ID": "1234",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NODELIST": "gpu01",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "PMIX_RANK": "1",
}
TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "n0",
    "MASTER_PORT": "29400",
}


def test_srun_task_gets_env_from_slurm():
    env = dict(SRUN_TASK, MASTER_ADDR="gpu01", MASTER_PORT="23456")
    info = prepare_env(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 3, 4, 1)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "gpu01" and env["MASTER_PORT"] == "23456"


def test_srun_defaults_head_node_and_job_port():
    info = discover(dict(SRUN_TASK))
    assert info.master_addr == "gpu01"  # a single host needs no scontrol
    assert info.master_port == slurm_default_port("1234") == network.job_port(1234)


def test_batch_shell_is_a_world_of_one(monkeypatch):
    # NOTE: python run directly in the batch script must not wait for 3 peers
    info = discover(dict(BATCH_SHELL))
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)
    # ...and the data tools' view (no process group) is the same world
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in BATCH_SHELL.items():
        monkeypatch.setenv(k, v)
    assert rank_and_world() == (0, 1)


def test_mpi_is_left_to_deepspeed_discovery():
    env = dict(OPEN_MPI)
    info = prepare_env(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("mpi", None, 2, 1)
    assert "RANK" not in env and "MASTER_ADDR" not in env  # mpi4py fills them in
    assert info.master_port == 29500
    assert discover(dict(OPEN_MPI, MASTER_PORT="31000")).master_port == 31000


def test_precedence_torchrun_over_mpi_over_srun():
    # `srun torchrun`: torchrun's variables win over SLURM_*
    info = discover(dict(SRUN_TASK, **TORCHRUN))
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 5, 8)
    # mpirun inside an allocation: the batch shell's SLURM_* are inherited, MPI wins
    assert discover(dict(BATCH_SHELL, **OPEN_MPI)).launcher == "mpi"
    assert discover(dict(SRUN_TASK, **OPEN_MPI)).launcher == "mpi"


def test_single_process_gets_a_free_port():
    env: dict[str, str] = {}
    info = prepare_env(env)
    assert info.launcher == "single"
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert int(env["MASTER_PORT"]) > 0


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        discover(dict(SRUN_TASK, SLURM_PROCID="x"))


# ---- srun under a PMI plugin ------------------------------------------------------------------
@pytest.mark.parametrize(
    "pmi",
    [
        {"PMI_SIZE": "4", "PMI_RANK": "3", "PMI_FD": "11", "PMI_JOBID": "7.0"},  # MpiDefault=pmi2
        {"PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.7.0"},  # MpiDefault=pmix
    ],
    ids=["pmi2", "pmix"],
)
def test_srun_with_a_pmi_plugin_is_slurm(pmi):
    info = discover(dict(SRUN_TASK, MASTER_ADDR="10.0.0.1") | pmi)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 3, 4, 1)


def test_mpi_launchers_keep_their_path():
    # Hydra's mpiexec starts one proxy per node through srun: its PMI world is not the step's
    hydra = {"PMI_SIZE": "16", "PMI_RANK": "9"}
    assert discover(dict(SRUN_TASK) | hydra).launcher == "mpi"
    # PMI outside an srun step is MPI
    assert discover({"PMI_SIZE": "2", "PMI_RANK": "1"}).launcher == "mpi"


SCRIPTS = ["train", "build_cache", "regenerate", "eval"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_sbatch_headers_and_syntax(name):
    path = REPO / "slurm" / f"{name}.sbatch"
    text = path.read_text()
    headers = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", text, flags=re.M))
    for key in (
        "job-name",
        "nodes",
        "ntasks-per-node",
        "gpus-per-node",
        "cpus-per-task",
        "time",
        "output",
        "signal",
        "requeue",
        "open-mode",
    ):
        assert key in headers, (name, key)
    assert "%j" in headers["output"]
    assert re.fullmatch(r"B:USR1@\d+", headers["signal"])
    assert "source " in text and "dspark_launch " in text and "dspark_finish" in text
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_common_refuses_to_run_outside_slurm(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "slurm" / "common.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "sbatch" in proc.stderr
