"""slurm/train.sbatch on a real one-node Slurm cluster (tests/helpers/slurm_cluster.py), 2 tasks:
`sbatch --wait` trains the tiny recipe; mid-run a USR1 pre-emption warning makes the trainer
checkpoint and the script requeue the job; in the requeued job an outside `scontrol requeue`
does the same through SIGTERM; the second requeue finishes. Every step is trained exactly once,
in one MLflow run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers.slurm_cluster import job_env, slurm_cluster  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml"
MAX_STEPS = 60  # NOTE: enough for both signals to land mid-run on an idle machine

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "train_log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(
                f"sbatch --wait ended ({proc.returncode}) while waiting for {what}:\n"
                f"{log.read_text() if log.exists() else ''}"
            )
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text() if log.exists() else ''}")


def test_train_sbatch_preempt_requeue_resume(slurm_cluster, tiny_target, tmp_path):  # noqa: F811
    cluster = slurm_cluster
    out_dir, run_dir = tmp_path / "runs", tmp_path / "runs" / "slurm_tiny"
    log_pattern = tmp_path / "%x-%j.out"
    name = f"dspark-test-{os.getpid()}"
    cmd = [
        "sbatch",
        "--wait",
        f"--job-name={name}",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--gpus-per-node=0",
        "--time=15",
        f"--output={log_pattern}",
        str(REPO / "slurm" / "train.sbatch"),
        "--config",
        str(TINY),
        "--target.path",
        tiny_target,
        "--output_dir",
        str(out_dir),
        "--name",
        "slurm_tiny",
        "--train.max_steps",
        str(MAX_STEPS),
        "--train.progress_bar",
        "false",
        "--checkpoint.every_steps",
        "0",
        "--validation.every_steps",
        "0",
    ]
    env = cluster.env | job_env(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # NOTE: sbatch's "Submitted batch job N" may sit in its stdout buffer until it exits
    wait_for(
        lambda: bool(cluster.run("squeue", "-h", f"--name={name}", "-o", "%i").strip()),
        "the job to be queued",
        proc,
        tmp_path / "none",
    )
    job_id = int(cluster.run("squeue", "-h", f"--name={name}", "-o", "%i").split()[0])
    log = tmp_path / f"{name}-{job_id}.out"

    # 1) the pre-emption warning (what --signal=B:USR1@300 sends), mid-run
    wait_for(lambda: len(steps_logged(run_dir)) >= 1, "a trained step", proc, log)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    wait_for(
        lambda: cluster.job(job_id).get("Restarts") == "1" and "resumed from" in log.read_text(),
        "the requeued job to resume",
        proc,
        log,
    )
    first_resume = int(re.findall(r"resumed from \S+ at step (\d+)", log.read_text())[0])

    # 2) an outside requeue (SIGTERM to every process of the job) in the requeued job
    wait_for(
        lambda: max(steps_logged(run_dir), default=0) > first_resume,
        "a step after the resume",
        proc,
        log,
    )
    cluster.run("scontrol", "requeue", str(job_id))

    try:
        _, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"job {job_id} did not finish:\n{log.read_text()}")
    text = log.read_text()
    assert proc.returncode == 0, f"sbatch --wait: {proc.returncode} {err}\n{text}"
    print(f"slurm job {job_id}: {time.monotonic() - t0:.0f}s")

    # the job: completed after two restarts, with exit code 0
    info = cluster.job(job_id)
    assert info["JobState"] == "COMPLETED", (info, text)
    assert info["Restarts"] == "2", (info, text)
    assert info["ExitCode"] == "0:0", (info, text)
    assert "USR1: pre-emption" in text and "requeueing job" in text, text
    assert "TERM: Slurm is stopping the job" in text, text
    assert "[launch] slurm: world_size=2" in text, text
    resumes = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]
    assert len(resumes) == 2 and 0 < resumes[0] < resumes[1] < MAX_STEPS, (resumes, text)

    # every step trained exactly once: the checkpoint at the signal lost nothing
    assert steps_logged(run_dir) == list(range(1, MAX_STEPS + 1)), text

    # the final checkpoint
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{MAX_STEPS:08d}"
    tag = run_dir / "checkpoints" / latest
    assert (tag / "COMPLETE").exists()
    assert json.loads((tag / "meta.json").read_text())["world_size"] == 2
    assert len(list(tag.glob("*optim_states.pt"))) == 2  # one ZeRO partition per rank
    assert (run_dir / "export" / "model.safetensors").exists()
    assert not (run_dir / "REQUEUE").exists()

    # one MLflow run across the three job instances, finished, with every step's loss
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dspark-ds")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.run_id == (run_dir / "mlflow_run_id").read_text().strip()
    assert run.info.status == "FINISHED"
    assert run.data.tags["slurm_job_id"] == str(job_id)
    assert run.data.params["derived.world_size"] == "2"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, MAX_STEPS + 1))
