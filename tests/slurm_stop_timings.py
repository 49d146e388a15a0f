"""What Slurm's ways of ending a job do to a training run, measured on the 2-host test cluster
(tests/helpers/multihost.py), for docs/multi-node.md ("Site settings"). Not a test: it prints a
table. Run as root:

    python3 tests/slurm_stop_timings.py [--save_s 8] [--kill_waits 30,5]

Each case trains the tiny recipe on 2 hosts x 2 tasks with every checkpoint save slowed to
--save_s seconds (standing in for a large model's checkpoint) and a checkpoint every 20 steps,
then ends the job one way, mid-run:

- scancel            TERM to every step, KILL after KillWait
- scontrol requeue   the same, and Slurm requeues the job
- time limit         the batch script's own --signal=B:USR1@<lead> warning (the main path)
- time limit, no warning   the same script without the USR1 line: TERM at the limit

and reports whether the checkpoint at the stop was written, how many steps were lost (trained
but not in any complete checkpoint) and how long the job took to end after the signal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers.multihost import MultiHostCluster  # noqa: E402
from helpers.tiny_models import build_tiny_target  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def newest_complete(run_dir: Path) -> int:
    tags = [
        int(p.name[5:13])
        for p in (run_dir / "checkpoints").glob("step_????????")
        if (p / "COMPLETE").exists()
    ]
    return max(tags, default=0)


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "train_log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def run_case(
    cluster, root: Path, target: str, how: str, save_s: float, lead_s: int, launcher: str
) -> dict:
    work = root / how.replace(" ", "_").replace(",", "")
    work.mkdir(parents=True)
    script = REPO / "slurm" / "train.sbatch"
    if how == "time limit, no warning":
        text = script.read_text().replace("#SBATCH --signal=B:USR1@300\n", "")
        script = work / "train_no_warning.sbatch"
        script.write_text(text)
    run_dir = work / "runs" / "stop"
    fault = [{"kind": "sleep_in_save", "seconds": save_s}]
    env = {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHON": sys.executable,
        "DSPARK_WORKDIR": str(work),
        "DSPARK_SLURM_DIR": str(REPO / "slurm"),
        "DSPARK_TEST_FAULTS": json.dumps(fault),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "helpers" / "faults_site"), str(REPO)]),
    }
    env["DSPARK_LAUNCHER"] = launcher
    env["DSPARK_NPROC_PER_NODE"] = "2"
    tasks = ["--ntasks-per-node=2", "--cpus-per-task=1"]
    if launcher == "torchrun":
        tasks = ["--ntasks-per-node=1", "--cpus-per-task=2"]
    limit = ["--time=3"] if how.startswith("time limit") else ["--time=30"]
    signal_opt = [f"--signal=B:USR1@{lead_s}"] if how == "time limit" else []
    name = f"stop-{os.getpid()}-{len(list(root.iterdir()))}"
    args = ["--config", str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")]
    args += ["--target.path", target, "--output_dir", str(work / "runs"), "--name", "stop"]
    args += ["--train.max_steps", "100000", "--train.synthetic_samples", "100000"]
    args += ["--checkpoint.every_steps", "20", "--validation.every_steps", "0"]
    args += ["--train.progress_bar", "false", "--data.batch_size", "1"]
    args += ["--train.global_batch_size", "4"]
    requeue = "--no-requeue" if how != "scontrol requeue" else "--requeue"
    sbatch = ["--wait", f"--job-name={name}", f"--output={work}/%x-%j.out", "--nodes=2", *tasks]
    sbatch += ["--gpus-per-node=0", requeue, *limit, *signal_opt, str(script), *args]
    proc = cluster.sbatch_popen(sbatch, env=env, cwd=str(work))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and len(steps(run_dir)) < 30:
        time.sleep(0.2)
    job_id = cluster.run("squeue", "-h", f"--name={name}", "-o", "%i").split()[0]
    t_signal = None
    if how == "scancel":
        t_signal = time.monotonic()
        cluster.run("scancel", job_id)
    elif how == "scontrol requeue":
        t_signal = time.monotonic()
        cluster.run("scontrol", "requeue", job_id)
    at_signal = max(steps(run_dir), default=0)
    if how == "scontrol requeue":
        # the requeued job starts again; wait for the first instance to end
        while time.monotonic() < deadline:
            info = cluster.job(int(job_id))
            if info.get("Restarts") == "1":
                break
            time.sleep(0.2)
        cluster.run("scancel", job_id)
    proc.wait(timeout=900)
    # NOTE: `sbatch --wait` can return while the ranks still write their checkpoint (the job
    # is already "ended" for Slurm when a requeued or cancelled instance is); the job's end is
    # when its last rank is gone
    while time.monotonic() < deadline and any(
        _is_rank(p) for host in cluster.hosts for p in cluster.job_pids(host)
    ):
        time.sleep(0.1)
    ended = time.monotonic()
    info = cluster.job(int(job_id))
    trained = max(steps(run_dir), default=0)
    saved = newest_complete(run_dir)
    log = next(work.glob("*.out")).read_text()
    if t_signal is None:  # the time limit: from the warning / TERM the log shows
        t_signal = _signal_time(log, ended)
    return {
        "how": how,
        "launcher": launcher,
        "kill_wait_s": cluster.kill_wait_s,
        "save_s": save_s,
        "state": info.get("JobState"),
        "trained": trained,
        "saved": saved,
        "lost_steps": max(0, trained - saved),
        "saved_at_stop": saved >= max(at_signal, 1) and saved % 20 != 0,
        "end_after_signal_s": round(ended - t_signal, 1),
    }


def _signal_time(log: str, now_monotonic: float) -> float:
    """The monotonic time of the batch log's first USR1 / TERM line (its HH:MM:SS, today)."""
    import re

    found = re.findall(r"\[slurm (\d\d):(\d\d):(\d\d)\] (?:USR1|TERM)", log)
    if not found:
        return float("nan")
    h, m, s = (int(x) for x in found[0])
    now = time.localtime()
    stamp = time.mktime((now.tm_year, now.tm_mon, now.tm_mday, h, m, s, 0, 0, -1))
    return now_monotonic - (time.time() - stamp)


def _is_rank(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return False
    # python itself, not srun's command line that names it
    python = bool(argv) and "python" in Path(argv[0]).name
    return python and ("dspark_ds.launch" in argv or "torch.distributed.run" in argv)


def main() -> int:
    # NOTE: a TERM (or Ctrl-C) still stops the clusters: daemons and namespaces go
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("--save_s", type=float, default=8.0)
    parser.add_argument("--kill_waits", default="30,5")
    parser.add_argument("--lead_s", type=int, default=60)
    parser.add_argument("--launchers", default="srun")
    parser.add_argument(
        "--cases", default="scancel,scontrol requeue,time limit,time limit no warning"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="slurm_stop_"))
    target = build_tiny_target(root / "target")
    rows = []
    for kill_wait in (int(k) for k in args.kill_waits.split(",")):
        cluster = MultiHostCluster(root / f"cluster{kill_wait}", kill_wait_s=kill_wait)
        try:
            cluster.start()
            for launcher in args.launchers.split(","):
                for how in args.cases.split(","):
                    how = "time limit, no warning" if how == "time limit no warning" else how
                    case_root = root / f"kw{kill_wait}-{launcher}"
                    row = run_case(
                        cluster, case_root, target, how, args.save_s, args.lead_s, launcher
                    )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            cluster.stop()
    print(
        f"\n{'stop':<24} {'launcher':<9} {'KillWait':>8} {'save':>5} {'state':<10} "
        f"{'ckpt at stop':<12} {'lost':>5} {'ended after':>11}"
    )
    for r in rows:
        print(
            f"{r['how']:<24} {r['launcher']:<9} {r['kill_wait_s']:>7}s {r['save_s']:>4.0f}s "
            f"{r['state']:<10} "
            f"{'written' if r['saved_at_stop'] else 'NOT written':<12} {r['lost_steps']:>5} "
            f"{r['end_after_signal_s']:>10}s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
