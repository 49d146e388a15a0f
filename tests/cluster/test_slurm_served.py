"""slurm/train_served.sbatch as a real heterogeneous job: a 2-host Slurm cluster of network
namespaces (tests/helpers/multihost.py), the servers' component on dsn1, the trainers' (2 tasks)
on dsn2. `$PYTHON` is a stand-in interpreter: `-m dspark_ds.cli serve-target` runs a server that
answers /health and records what it was given, `-m dspark_ds.launch train` records its command
and asks every URL it got for /health from its own host; anything else (the config check, the
head address, the port) runs the real Python. What is checked: the server count and GPUs per
server from the recipe's tensor-parallel size and the node's GPUs, the URLs built from the server
node's name and ports, the one storage directory on both sides, the trainers' world on their own
component with its own head, and a server that never answers failing the job in one line within
DSPARK_SERVE_WAIT_S. Last, the real thing (vLLM's CPU build on dsn1, 2 served-mode trainers on
dsn2, about 100 s): the job ends 0 with the losses of an online run of the same arguments, the
server gone and the storage empty.

NOTE: Slurm schedules heterogeneous jobs by backfill only, every 30 s by default; this cluster
backfills every second. Its components never share a node (Slurm plans the second one after the
first has ended), hence two hosts.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_ds.train.rundir import pid_alive

from helpers.multihost import (
    NETNS_DIR,
    MultiHostCluster,
    _ip,
    _kill_namespace_processes,
    require_multihost,
)
from helpers.slurm_cluster import ENDED_STATES, job_env, serve

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "train_served.sbatch"
PORT = 31000
TP = 2
NODE_GPUS = 4  # the server node's GPUs as the script reads them (SLURM_GPUS_ON_NODE)
PREFIX = "dspkhet"  # not the session cluster's `dspk<pid>`: both may exist at once
TIME_LIMIT_MIN = 30
"""The jobs' --time. NOTE: above the script's USR1 warning (`--signal=B:USR1@300`): a job of 5
minutes is warned at Slurm's first check (~20 s in) and requeues itself before it trains."""

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

STANDIN = r"""
import json, os, signal, socket, sys, time, urllib.request as u
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

role, argv = sys.argv[1], sys.argv[2:]
records = os.environ["STANDIN_RECORDS"]
host = socket.gethostname()

def value(name):
    return argv[argv.index(name) + 1]

if role == "serve":
    port = int(value("--port"))
    path = os.path.join(records, f"serve-{host}-{port}.json")
    record = {"host": host, "port": port, "argv": argv,
              "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "stopped": False}
    json.dump(record, open(path, "w"))

    def stop(*_):
        json.dump(dict(record, stopped=True), open(path, "w"))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if os.environ.get("STANDIN_SERVER") == "silent":  # never answers
        while True:
            time.sleep(1)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("0.0.0.0", port), Health).serve_forever()
else:
    urls = value("--data.served.urls").strip("[]").split(",")
    opener = u.build_opener(u.ProxyHandler({}))
    health = {url: opener.open(url.removesuffix("/v1") + "/health", timeout=5).status
              for url in urls}
    rank = os.environ["SLURM_PROCID"]
    json.dump({"host": host, "rank": int(rank), "world": int(os.environ["SLURM_NTASKS"]),
               "master": os.environ.get("MASTER_ADDR"), "argv": argv, "health": health},
              open(os.path.join(records, f"train-{rank}.json"), "w"))
"""

INTERPRETER = """#!/bin/bash
# $PYTHON of the test job: the two commands of slurm/train_served.sbatch run stand-ins
if [[ "$1 $2 $3" == "-m dspark_ds.cli serve-target" && " $* " != *" --print_config "* ]]; then
  shift 3; exec {python} {standin} serve "$@"
elif [[ "$1 $2 $3" == "-m dspark_ds.launch train" ]]; then
  shift 3; exec {python} {standin} train "$@"
fi
exec {python} "$@"
"""


class HetCluster(MultiHostCluster):
    """The 2-host cluster under its own namespace names (backfilling every second, as every
    test cluster does: helpers/slurm_cluster.py)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.namespaces = {h: f"{self.prefix}h{i}" for i, h in enumerate(self.hosts, start=1)}
        self.switch = f"{self.prefix}sw"


def remove_stale() -> None:
    """This module's namespaces left by a killed session."""
    names = {
        line.split()[0]
        for line in _ip("netns", "list", check=False).stdout.splitlines()
        if line.strip()
    }
    for name in names:
        m = re.fullmatch(rf"{PREFIX}(\d+)(?:h\d+|sw)", name)
        if m and not pid_alive(int(m.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_DIR / name, ignore_errors=True)


@pytest.fixture(scope="module")
def het_cluster(tmp_path_factory):
    require_multihost()
    remove_stale()
    yield from serve(HetCluster(tmp_path_factory.mktemp("het")))


def submit(cluster: HetCluster, tmp_path: Path, **env: str) -> tuple[dict, str, Path]:
    """The script as a 1 + 1 node job (1 task on dsn1, 2 on dsn2), its arguments the tiny recipe
    at tensor-parallel size TP; (its `scontrol show job` fields, its log, the records)."""
    records = tmp_path / "records"
    records.mkdir()
    standin = tmp_path / "standin.py"
    standin.write_text(STANDIN)
    python = tmp_path / "python"
    python.write_text(INTERPRETER.format(python=sys.executable, standin=standin))
    python.chmod(0o755)
    env = job_env(
        tmp_path,
        PYTHON=str(python),
        STANDIN_RECORDS=str(records),
        DSPARK_SERVE_STORAGE=str(tmp_path / "hidden"),
        DSPARK_SERVE_PORT=str(PORT),
        SLURM_GPUS_ON_NODE=str(NODE_GPUS),
        **env,
    )
    component = ["--nodes=1", "--cpus-per-task=1", "--gpus-per-node=0"]
    job, _ = cluster.sbatch(
        [
            "--job-name=served",
            f"--time={TIME_LIMIT_MIN}",
            f"--output={tmp_path / '%x-%j.out'}",
            *component,
            "--ntasks-per-node=1",
            ":",
            *component,
            "--ntasks-per-node=2",
            str(SCRIPT),
            "--config",
            "tiny_cpu",
            "--data.served.tensor_parallel_size",
            str(TP),
            "--output_dir",
            str(tmp_path / "runs"),
        ],
        env=env,
        cwd=str(tmp_path),
    )
    info = cluster.wait_state(job, ENDED_STATES, 120)
    return info, (tmp_path / f"served-{job}.out").read_text(), records


def records_of(records: Path, role: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(records.glob(f"{role}-*.json"))]


def after(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_script_parses():
    for path in (SCRIPT, REPO / "slurm" / "common.sh"):
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_servers_then_trainers(het_cluster, tmp_path):
    info, log, records = submit(het_cluster, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    urls = [f"http://dsn1:{PORT + k}/v1" for k in range(NODE_GPUS // TP)]
    storage = str(tmp_path / "hidden")

    servers = records_of(records, "serve")
    assert [(s["host"], s["port"]) for s in servers] == [("dsn1", PORT), ("dsn1", PORT + 1)]
    assert [s["cuda"] for s in servers] == ["0,1", "2,3"]  # TP GPUs each, apart
    assert all(s["stopped"] for s in servers), servers  # stopped once the trainers ended
    trainers = records_of(records, "train")
    assert [(t["host"], t["rank"], t["world"]) for t in trainers] == [
        ("dsn2", 0, 2),
        ("dsn2", 1, 2),
    ]
    assert {t["master"] for t in trainers} == {"198.18.0.2"}  # their own first node
    for t in trainers:  # every server answered the trainers' host before they started
        assert t["health"] == dict.fromkeys(urls, 200), t
        assert after(t["argv"], "--checkpoint.resume") == "auto"
    for argv in [s["argv"] for s in servers] + [t["argv"] for t in trainers]:
        assert after(argv, "--data.served.urls") == f"[{','.join(urls)}]"
        assert after(argv, "--data.served.storage") == storage  # named once, the same for all
        assert after(argv, "--data.mode") == "served"
        assert after(argv, "--data.served.tensor_parallel_size") == str(TP)
        assert after(argv, "--config") == "tiny_cpu"
    assert Path(storage).is_dir()
    assert "2 server(s) answer /health" in log and "stopping 2 server(s)" in log, log


def test_a_server_that_never_answers_fails_the_job(het_cluster, tmp_path):
    info, log, records = submit(
        het_cluster, tmp_path, STANDIN_SERVER="silent", DSPARK_SERVE_WAIT_S="3"
    )
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", (info, log)
    lines = [line for line in log.splitlines() if "/health" in line]
    assert len(lines) == 1, log
    assert (
        f"http://dsn1:{PORT}/v1 did not answer /health within DSPARK_SERVE_WAIT_S=3 s" in lines[0]
    )
    assert records_of(records, "train") == []  # no trainer started
    assert all(s["stopped"] for s in records_of(records, "serve"))


# ---- the real thing: vLLM on dsn1, 2 trainers on dsn2 ----------------------------------------
LAYERS = [0, 2, 3]
MAX_LENGTH = 96
STEPS = 4
REAL_PORT = 31100


def _train_args(target: str, prep: Path, out: Path) -> list[str]:
    """The recipe and overrides both `serve-target` and `train` get (the job adds the rest)."""
    return [
        "--config",
        "tiny_cpu",
        "--target.path",
        target,
        "--target.layer_ids",
        json.dumps(LAYERS),
        "--data.max_length",
        str(MAX_LENGTH),
        "--data.paths",
        f"[{prep}]",
        "--data.served.vllm_args",
        json.dumps(["--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 << 20)]),
        "--train.synthetic_samples",
        "0",
        "--train.max_steps",
        str(STEPS),
        "--train.progress_bar",
        "false",
        "--tracking.enabled",
        "false",
        "--checkpoint.save_final",
        "false",
        "--checkpoint.export_final",
        "false",
        "--output_dir",
        str(out),
    ]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _new_processes(cluster: HetCluster, host: str, before: set[int], timeout_s: float = 15):
    """The processes on `host` that were not there `before` (slurmctld's helpers were), once
    they are gone or `timeout_s` passed: ["<pid>: <command line>", ...]."""
    deadline = time.monotonic() + timeout_s
    while (pids := set(cluster.job_pids(host)) - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [_cmdline(pid) for pid in sorted(pids)]


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return f"{pid}: gone"


@pytest.mark.distributed
def test_real_vllm_on_one_host_trains_two_ranks_on_the_other(het_cluster, tmp_path):
    """The script as written, nothing standing in: `dspark-ds serve-target` (vLLM's CPU build, a
    float32 tiny target of hidden 128) on dsn1, `dspark-ds train` in served mode on 2 ranks of
    dsn2, the hidden states through a directory of the shared file system. Its losses are those
    of an online run of the same arguments, run meanwhile on this machine as 1 process with the
    global batch as one micro-batch (the steps of 2 ranks of 2: test_trainer_distributed.py's
    resume test); measured 1e-7 apart. On 2 cores 45 s alone, 100-115 s beside other tests'
    load, most of it vLLM's start."""
    from dspark_ds.data.config import DataConfig, PrepareConfig
    from dspark_ds.data.tokens import prepare

    from helpers.dist import _env
    from helpers.served_target import require_vllm
    from helpers.tiny_models import build_tiny_target, write_chat_jsonl

    vllm_python = require_vllm()
    # NOTE: hidden 128 (head_dim 32): vLLM's CPU attention has no kernel for head_dim 8
    target = build_tiny_target(tmp_path / "target", hidden_size=128)
    prep = tmp_path / "prep"
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", 24, seed=1)
    prepare(
        PrepareConfig(
            data=DataConfig(paths=[chat], tokenizer=target, max_length=MAX_LENGTH),
            output_dir=str(prep),
        )
    )
    out, storage = tmp_path / "runs", tmp_path / "hidden"
    args = _train_args(target, prep, out)
    online = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dspark_ds.cli",
            "train",
            *args,
            "--name",
            "online",
            "--data.batch_size",
            "4",
        ],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    before = set(het_cluster.job_pids("dsn1"))
    try:
        env = job_env(
            tmp_path,
            DSPARK_SERVE_STORAGE=str(storage),
            DSPARK_SERVE_PORT=str(REAL_PORT),
            DSPARK_SERVE_ARGS=f"--vllm_python {vllm_python}",
        )
        job, _ = het_cluster.sbatch(
            [
                "--job-name=real",
                f"--time={TIME_LIMIT_MIN}",
                f"--output={tmp_path / '%x-%j.out'}",
                "--nodes=1",
                "--ntasks-per-node=1",
                "--cpus-per-task=2",
                "--gpus-per-node=0",
                ":",
                "--nodes=1",
                "--ntasks-per-node=2",
                "--cpus-per-task=1",
                "--gpus-per-node=0",
                str(SCRIPT),
                *args,
                "--name",
                "served",
            ],
            env=env,
            cwd=str(tmp_path),
        )
        info = het_cluster.wait_state(job, ENDED_STATES, 300)
        reference = online.communicate(timeout=300)[0]
    finally:
        online.kill()
    log = (tmp_path / f"real-{job}.out").read_text()
    server_log = tmp_path / f"real-{job}-serve-dsn1-{REAL_PORT}.log"
    server_log = server_log.read_text() if server_log.exists() else "<no server log>"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (log, server_log[-3000:])
    assert online.returncode == 0, reference[-3000:]

    # Where each part ran: the components' nodes; the trainers' world on dsn2, their head its
    # address; the server answered the batch shell's /health over dsn1's own loopback (each
    # host's is its own) and the completions from dsn2's address; and it is gone with the job.
    lines = het_cluster.run("scontrol", "show", "job", "-o", str(job)).splitlines()
    assert [re.search(r" NodeList=(\S+)", line).group(1) for line in lines] == ["dsn1", "dsn2"]
    assert " BatchHost=dsn1 " in lines[0], lines[0]  # the shell that asked for /health
    assert "[launch] slurm: world_size=2 master=198.18.0.2:" in log, log
    # NOTE: no `[dist] host` line: a rank prints it only when it has to choose an interface
    assert "1 server(s) answer /health" in log and "stopping 1 server(s)" in log, log
    assert re.search(r'127\.0\.0\.1:\d+ - "GET /health HTTP', server_log), server_log[-3000:]
    clients = set(re.findall(r'([\d.]+):\d+ - "POST /v1/completions HTTP', server_log))
    assert clients == {"198.18.0.2"}, server_log[-3000:]
    assert _new_processes(het_cluster, "dsn1", before) == []  # vLLM's engine and worker too

    served, reference_losses = _losses(out / "served"), _losses(out / "online")
    assert sorted(served) == sorted(reference_losses) == list(range(1, STEPS + 1)), served
    assert all(math.isfinite(loss) for loss in served.values()), served
    for step, loss in reference_losses.items():
        assert served[step] == pytest.approx(loss, rel=1e-4), (step, served, reference_losses)
    assert os.listdir(storage) == []  # every file read and deleted
