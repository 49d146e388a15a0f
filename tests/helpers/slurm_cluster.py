"""A real one-node Slurm cluster for tests: munge + slurmctld + slurmd on this machine.

    from helpers.slurm_cluster import slurm_cluster  # noqa: F401  (the pytest fixture)

    def test_x(slurm_cluster):
        job = slurm_cluster.sbatch(["--wait", "slurm/train.sbatch"], env=...)
        assert slurm_cluster.job(job)["JobState"] == "COMPLETED"

Everything lives in a temp directory: a private munge key and socket, `slurm.conf` (no cgroups,
no systemd, no accounting), state / spool / logs / pid files, free TCP ports; commands reach this
cluster through `SLURM_CONF` (`cluster.env`). Debian's `slurm-wlm` and `munge` are installed
by `tools/install.sh`; when they are missing the fixture fails, naming them and that command
(tests install nothing). A daemon that does not come up fails the test with its log. The daemons are
stopped by their pid files when the session ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers.system import SBIN, require_binaries, which

APT_PACKAGES = ("slurm-wlm", "munge")
BINARIES = (
    "munged",
    "munge",
    "unmunge",
    "slurmctld",
    "slurmd",
    "sbatch",
    "squeue",
    "scontrol",
    "sinfo",
)


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    """One node (`hostname -s`, `cpus` CPUs), one default partition `debug`."""

    def __init__(
        self, root: str | Path, cpus: int = 2, real_memory_mb: int = 8000, cred_expire_s: int = 5
    ):
        self.root = Path(root)
        self.cpus = cpus
        self.real_memory_mb = real_memory_mb
        # NOTE: a requeued job may not start before now + cred_expire (Slurm's default 120 s);
        # a short credential lifetime keeps requeue tests quick. Needs a slurmctld (re)start.
        self.cred_expire_s = cred_expire_s
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.pid_files = {
            "slurmd": self.root / "slurmd.pid",
            "slurmctld": self.root / "slurmctld.pid",
            "munged": self.root / "munge" / "munged.pid",
        }

    # ---- environment for clients ---------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                f"{proc.stderr.strip()}{proc.stdout.strip()}"
            )
        return proc.stdout

    # ---- lifecycle -----------------------------------------------------------------------------
    def _make_dirs(self) -> None:
        """The root (others may traverse it) and its munge, state, spool and log folders."""
        self.root.mkdir(parents=True, exist_ok=True)
        # munged refuses sockets in directories others cannot traverse
        os.chmod(self.root, 0o755)
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(exist_ok=True)

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        self._make_dirs()
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            proc = subprocess.run(
                [which(daemon), "-f", str(self.conf)], capture_output=True, text=True, env=self.env
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{daemon} did not start ({proc.returncode}): {proc.stderr}"
                    f"\n{self.log_tail(daemon)}"
                )
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env
            )
            state = out.stdout.strip()
            if out.returncode == 0 and state in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        raise RuntimeError(
            f"the node never became idle (sinfo: {state!r})\n"
            f"{self.log_tail('slurmctld')}\n{self.log_tail('slurmd')}"
        )

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        cmd = [
            which("munged"),
            f"--key-file={key}",
            f"--socket={self.munge_socket}",
            f"--pid-file={self.pid_files['munged']}",
            f"--log-file={self.root / 'munge' / 'munged.log'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}",
        ]
        if os.geteuid() == 0:
            cmd.append("--force")  # munged refuses to run as root without it
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"munged did not start ({proc.returncode}): {proc.stderr}")
        enc = subprocess.run(
            [which("munge"), "-S", str(self.munge_socket), "-n"], capture_output=True, text=True
        )
        dec = subprocess.run(
            [which("unmunge"), "-S", str(self.munge_socket)],
            input=enc.stdout,
            capture_output=True,
            text=True,
        )
        if dec.returncode != 0 or "Success" not in dec.stdout:
            raise RuntimeError(f"munge -n | unmunge failed: {dec.stdout}{dec.stderr}")

    def _conf_settings(self, ctld_port: int, slurmd_port: int) -> dict[str, object]:
        """slurm.conf's settings, in the order written (the node and partition lines follow)."""
        r = self.root
        user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
        return {
            "ClusterName": "dsparktest",
            "SlurmctldHost": f"{self.host}(127.0.0.1)",
            "SlurmUser": user,
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            "SlurmctldPort": ctld_port,
            "SlurmdPort": slurmd_port,
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "SchedulerType": "sched/backfill",
            # NOTE: a requeued job may start cred_expire after its requeue, but waits for a
            # pass of the main scheduler (sched_interval, 60 s by default; seen: 20-35 s after
            # the requeue) or of the backfill one (heterogeneous jobs: bf_interval, 30 s):
            # both every second or two start it when it may start
            "SchedulerParameters": "bf_interval=1,sched_interval=2",
            "MpiDefault": "none",
            "JobRequeue": 1,
            "ReturnToService": 2,
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "KillWait": 30,
            "MinJobAge": 600,
            "InactiveLimit": 0,
            "SlurmctldTimeout": 60,
            "SlurmdTimeout": 60,
            "StateSaveLocation": r / "state",
            "SlurmdSpoolDir": r / "spool",
            "SlurmctldPidFile": self.pid_files["slurmctld"],
            "SlurmdPidFile": r / "slurmd.pid",
            "SlurmctldLogFile": r / "log" / "slurmctld.log",
            "SlurmdLogFile": r / "log" / "slurmd.log",
        }

    def _write_conf_text(self, comment: str, settings: dict[str, object], nodes: list[str]) -> None:
        """slurm.conf: the `comment` line, `settings`, the `nodes` lines, the partition."""
        lines = [f"# {comment}", *(f"{k}={v}" for k, v in settings.items()), *nodes]
        lines.append(
            f"PartitionName=debug Nodes={self.nodelist} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    @property
    def nodelist(self) -> str:
        return self.host

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        node = (
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={self.real_memory_mb} State=UNKNOWN"
        )
        self._write_conf_text(
            "written by tests/helpers/slurm_cluster.py: one node, no cgroups, no accounting",
            self._conf_settings(ctld_port, slurmd_port),
            [node],
        )

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons by their pid files."""
        if self.conf.exists() and self.pid_files["slurmctld"].exists():
            subprocess.run(
                ["scancel", "--full", "--user", str(os.geteuid())],
                env=self.env,
                capture_output=True,
                timeout=30,
            )
        for name in ("slurmd", "slurmctld", "munged"):
            path = self.pid_files[name]
            try:
                pid = int(path.read_text().strip())
            except (OSError, ValueError):
                continue
            _terminate(pid)

    def log_tail(self, daemon: str, lines: int = 30) -> str:
        path = self.root / "log" / f"{daemon}.log"
        if not path.exists():
            return f"({path} does not exist)"
        return f"--- {path} ---\n" + "\n".join(path.read_text().splitlines()[-lines:])

    # ---- jobs ----------------------------------------------------------------------------------
    def sbatch(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 600,
    ) -> tuple[int, subprocess.CompletedProcess]:
        """`sbatch --parsable <args>`; returns (job id, the finished sbatch process). With
        `--wait` in args it returns when the job (and every requeue of it) has ended."""
        full_env = self.env
        full_env.update(env or {})
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            timeout=timeout,
        )
        first = proc.stdout.strip().splitlines()[:1]
        if not first or not first[0].split(";")[0].isdigit():
            raise RuntimeError(
                f"sbatch {' '.join(args)} failed ({proc.returncode}): {proc.stderr}{proc.stdout}"
            )
        return int(first[0].split(";")[0]), proc

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).strip()
        info: dict[str, str] = {}
        for item in out.split():
            key, sep, value = item.partition("=")
            if sep:
                info[key] = value
        return info

    def wait_state(
        self, job_id: int, states: tuple[str, ...], timeout_s: float = 300, poll_s: float = 0.3
    ) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s}s: {info}")


# the states slurmctld leaves a job in once it is over (COMPLETING is not one of them)
ENDED_STATES = tuple(
    "COMPLETED FAILED CANCELLED NODE_FAIL TIMEOUT PREEMPTED OUT_OF_MEMORY BOOT_FAIL DEADLINE".split()
)


def _terminate(pid: int, timeout_s: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # reap it if it happens to be our child (the daemons fork, so normally it is not)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A started one-node cluster. Fails when Slurm or munge is not installed (with the command
    that installs them); skips when not root (slurmd must run as root)."""
    require_binaries(BINARIES, APT_PACKAGES)
    if os.geteuid() != 0:
        pytest.skip(
            "no Slurm cluster: slurmd must run as root (run the test as root, as .ci/run does)"
        )
    yield from serve(SlurmCluster(tmp_path_factory.mktemp("slurm")))


def serve(cluster):
    """Starts `cluster`, yields it, stops it (also when it does not come up)."""
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


def job_env(workdir, **extra: str) -> dict[str, str]:
    """The environment of a test job: CPU DeepSpeed, one thread, nothing downloaded, this
    checkout importable, the job running in `workdir`."""
    import sys

    repo = Path(__file__).resolve().parents[2]
    return {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "PYTHON": sys.executable,
        "DSPARK_WORKDIR": str(workdir),
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }
