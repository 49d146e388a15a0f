"""`mpirun -np 2 dspark-ds train` with the tiny recipe: DeepSpeed's MPI discovery (mpi4py over the
system's Open MPI) gives the two processes ranks 0 and 1 of one gloo group."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.system import require_binaries, require_python_module
from helpers.tiny_models import build_tiny_target

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _require_mpi() -> None:
    """Open MPI and mpi4py, as tools/install.sh installs them; the test fails without them."""
    require_binaries(("mpirun", "mpicc"), ("openmpi-bin", "libopenmpi-dev"))
    require_python_module(
        "from mpi4py import MPI; print(MPI.Get_library_version())", "mpi4py", "mpi4py>=4.0"
    )


def test_mpirun_two_ranks_train_tiny(tmp_path):
    _require_mpi()
    target = build_tiny_target(tmp_path / "tiny_target")
    out = tmp_path / "runs"
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the ranks must come from MPI, not from us
    from helpers.dist import free_port

    mpirun = [
        shutil.which("mpirun") or "mpirun",
        "-np",
        "2",
        "--oversubscribe",
        "--mca",
        "btl",
        "self,tcp",
        "-x",
        "DS_ACCELERATOR",
        "-x",
        "OMP_NUM_THREADS",
        "-x",
        "PYTHONPATH",
        "-x",
        f"MASTER_PORT={free_port()}",
    ]
    if os.geteuid() == 0:
        mpirun.insert(1, "--allow-run-as-root")
    cmd = [
        *mpirun,
        sys.executable,
        "-m",
        "dspark_ds.cli",
        "train",
        "--config",
        str(TINY),
        "--target.path",
        target,
        "--output_dir",
        str(out),
        "--name",
        "mpi_tiny",
        "--train.max_steps",
        "4",
        "--train.progress_bar",
        "false",
        "--checkpoint.every_steps",
        "0",
        "--validation.every_steps",
        "0",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log

    run_dir = out / "mpi_tiny"
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines]
    assert steps == [1, 2, 3, 4], log
    tag = run_dir / "checkpoints" / "step_00000004"
    assert json.loads((tag / "meta.json").read_text())["world_size"] == 2, log
    # one ZeRO-2 optimizer partition per MPI rank: both ranks were in the same group
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.data.params["derived.world_size"] == "2"
    assert run.data.params["derived.grad_accum"] == "1"  # global 4 = 2 per rank × 2 ranks
    assert run.info.status == "FINISHED"
