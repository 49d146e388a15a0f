"""One job per run directory (`<run>/RUNNING`), and a run directory every rank sees."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_ds.train import rundir
from dspark_ds.train.rundir import RunDirBusy, RunDirNotShared, RunLock

from helpers.dist import run_distributed

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from dspark_ds.train.rundir import RunLock
lock = RunLock(sys.argv[1]); lock.acquire(); print("held", flush=True); time.sleep(120)
"""


def _holder(run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_job_is_refused_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunDirBusy) as err:
            RunLock(tmp_path / "run").acquire()
        text = str(err.value)
        assert "\n" not in text
        assert f"host {socket.gethostname()} pid {holder.pid}" in text
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (SIGKILL: no release): the next job takes over, saying so
    lock = RunLock(tmp_path / "run")
    note = lock.acquire()
    assert note is not None and f"its process {holder.pid}" in note and "is gone" in note
    assert json.loads((tmp_path / "run" / "RUNNING").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "run" / "RUNNING").exists()


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    other = {"host": "elsewhere", "pid": 1, "token": "x", "heartbeat": time.time()}
    (tmp_path / "RUNNING").write_text(json.dumps(other))
    lock.release()
    assert json.loads((tmp_path / "RUNNING").read_text())["token"] == "x"


def _lock(**fields) -> dict:
    base = {"host": "node7", "pid": 4242, "started": "2026-12-01 10:00:00"}
    return base | fields


def test_stale_reasons(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    now = time.time()
    # another host, no Slurm: alive while its heartbeat is fresh
    assert rundir.stale_reason(_lock(heartbeat=now - 10), now) is None
    why = rundir.stale_reason(_lock(heartbeat=now - rundir.STALE_AFTER_S - 5), now)
    assert why is not None and "heartbeat stopped" in why
    # this host: the pid decides
    here = socket.gethostname()
    assert "is gone" in rundir.stale_reason(_lock(host=here, pid=_dead_pid(), heartbeat=now), now)
    assert rundir.stale_reason(_lock(host=here, pid=os.getppid(), heartbeat=now), now) is None
    # the job's own earlier instance (a requeue keeps the job id)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    why = rundir.stale_reason(_lock(slurm_job_id="77", heartbeat=now), now)
    assert why is not None and "earlier instance" in why


def test_slurm_decides_for_another_hosts_job(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    now = time.time()
    states = {"11": "RUNNING", "12": "COMPLETED", "13": "GONE", "14": None}
    monkeypatch.setattr(rundir, "slurm_job_state", lambda job: states[job])
    assert rundir.stale_reason(_lock(slurm_job_id="11", heartbeat=0), now) is None
    assert "completed" in rundir.stale_reason(_lock(slurm_job_id="12", heartbeat=now), now)
    assert "gone" in rundir.stale_reason(_lock(slurm_job_id="13", heartbeat=now), now)
    # Slurm cannot be asked: the heartbeat decides
    assert rundir.stale_reason(_lock(slurm_job_id="14", heartbeat=now), now) is None


def test_scontrol_without_a_cluster_is_no_answer(monkeypatch):
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    monkeypatch.setattr(rundir, "SCONTROL_TIMEOUT_S", 0.5)  # its wait for a controller
    assert rundir.slurm_job_state("123") in (None, "GONE")


def _shared_check(rank, world, base):
    # NOTE: a directory per rank stands for a node-local disk: the ranks do not see each other
    local = Path(base) / f"node{rank}" / "run"
    try:
        rundir.check_shared(local, rank, wait_s=0.5)
    except RunDirNotShared as err:
        assert "is not shared between hosts" in str(err) and "\n" not in str(err)
    else:
        raise AssertionError("node-local run directories were taken for one")
    rundir.check_shared(Path(base) / "shared", rank)  # one directory: passes


@pytest.mark.slow
@pytest.mark.distributed
def test_node_local_run_directories_are_refused(tmp_path):
    run_distributed(_shared_check, world_size=2, args=(str(tmp_path),))


@pytest.mark.slow
def test_train_into_a_busy_run_directory_is_refused(tmp_path, monkeypatch, tiny_target):
    """What a re-submitted job sees while the first still trains: one line naming the holder,
    exit 2, nothing written into the run directory."""

    target = tiny_target
    run_dir = tmp_path / "runs" / "busy"
    env = {"SLURM_JOB_ID": "4711"}
    holder = _holder(run_dir, env)
    try:
        argv = [sys.executable, "-m", "dspark_ds.cli", "train", "--config", "tiny_cpu"]
        argv += ["--target.path", target, "--output_dir", str(tmp_path / "runs"), "--name", "busy"]
        argv += ["--checkpoint.resume", "auto"]
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_CONF": "/nonexistent"},
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dspark-ds: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        f"another job is training in this run directory (host {socket.gethostname()} "
        f"pid {holder.pid}, Slurm job 4711" in errors[0]
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["RUNNING"]
