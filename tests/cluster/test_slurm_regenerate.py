"""slurm/regenerate.sbatch through servers, on the real one-node Slurm cluster
(tests/helpers/slurm_cluster.py): with DSPARK_SERVE the job starts two `transformers serve` steps,
waits for their /health, runs one client over both and stops them at the end; with
--server.urls it drives servers that already run, as one process on a 2-task allocation."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.openai_servers import MisbehavingServer
from helpers.slurm_cluster import ENDED_STATES, slurm_cluster  # noqa: F401 - the fixture
from helpers.tiny_models import write_chat_jsonl

REPO = Path(__file__).resolve().parents[2]
NUM_ROWS = 12

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("slurm_regen")
    return tiny_target, write_chat_jsonl(root / "chat.jsonl", NUM_ROWS)


def job_env(workdir: Path, **extra: str) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHON": sys.executable,
        "DSPARK_WORKDIR": str(workdir),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    } | extra


def two_free_ports() -> int:
    """A port p with p and p + 1 free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def sbatch(cluster, tmp_path: Path, env: dict, args: list[str]) -> tuple[dict, str]:
    """Submit, wait for the job to end, return (its `scontrol show job` fields, its log)."""
    name = f"dspark-regen-{os.getpid()}-{len(list(tmp_path.glob('*.out')))}"
    cmd = ["sbatch", "--parsable", f"--job-name={name}", "--nodes=1", "--ntasks-per-node=2"]
    cmd += ["--cpus-per-task=1", "--gpus-per-node=0"]
    cmd += ["--time=10", f"--output={tmp_path / '%x-%j.out'}"]
    cmd += [str(REPO / "slurm" / "regenerate.sbatch"), *args]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=cluster.env | env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    job_id = int(proc.stdout.strip().split(";")[0])
    # NOTE: polled here: `sbatch --wait` checks with growing pauses, ~20 s late on a 20 s job
    info = cluster.wait_state(job_id, ENDED_STATES)
    return info, (tmp_path / f"{name}-{job_id}.out").read_text()


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_regenerate_sbatch_starts_servers_and_stops_them(slurm_cluster, inputs, tmp_path):  # noqa: F811
    target, src = inputs
    out = tmp_path / "regen.jsonl"
    port = two_free_ports()
    env = job_env(
        tmp_path,
        DSPARK_SERVE="transformers",
        DSPARK_SERVERS_PER_NODE="2",
        DSPARK_SERVE_PORT=str(port),
        DSPARK_SERVE_ARGS="--device cpu",
    )
    args = ["--data.paths", f"[{src}]", "--target.path", target, "--output", str(out)]
    args += ["--temperature", "0", "--max_new_tokens", "8", "--data.max_length", "256"]
    args += ["--server.concurrency", "4"]
    info, log = sbatch(slurm_cluster, tmp_path, env, args)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert "2 server(s) answer /health" in log and "stopping 2 server(s)" in log, log
    assert "[launch] slurm: world_size=1" in log, log  # one client over both servers
    assert [r["id"] for r in rows_of(out)] == list(range(NUM_ROWS))
    shares = [line for line in log.splitlines() if "% of the answers" in line]
    assert len(shares) == 2 and all(f":{p}/v1: " in " ".join(shares) for p in (port, port + 1))
    assert all(" 0.0 % " not in line for line in shares), shares  # both answered
    assert not listening(port) and not listening(port + 1)  # stopped with the job
    assert len(list(tmp_path.glob("*-serve-*.log"))) == 2


def test_regenerate_sbatch_drives_running_servers(slurm_cluster, inputs, tmp_path):  # noqa: F811
    target, src = inputs
    out = tmp_path / "regen.jsonl"
    with MisbehavingServer("ok", model="tiny") as server:
        args = ["--data.paths", f"[{src}]", "--target.path", target, "--output", str(out)]
        args += ["--server.urls", f"[{server.url}]"]
        info, log = sbatch(slurm_cluster, tmp_path, job_env(tmp_path), args)
    assert info["JobState"] == "COMPLETED", (info, log)
    assert "[launch] slurm: world_size=1" in log, log
    rows = rows_of(out)
    assert [r["id"] for r in rows] == list(range(NUM_ROWS))
    assert all(r["messages"][-1]["content"] == "pong" for r in rows)
    assert server.chats >= 1 + NUM_ROWS
