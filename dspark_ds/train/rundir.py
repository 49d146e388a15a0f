"""What a training job checks about its run directory before it writes there: that no other job
is using it (`RunLock`) and that every host of the job sees the same directory (`check_shared`).

    <run>/RUNNING   {"host", "pid", "slurm_job_id", "slurm_restart", "started", "heartbeat"}

One job holds `<run>/RUNNING` while it trains (rank 0 creates it atomically and refreshes its
heartbeat every `HEARTBEAT_S`). A second job is refused, naming the holder. A lock whose holder
is gone is taken over, saying why: its pid is dead on this host, Slurm says its job is no longer
running (or it is this job's own earlier instance, before a requeue), or its heartbeat stopped
more than `STALE_AFTER_S` ago (a holder on another host that nothing else can vouch for).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

from dspark_ds import distributed
from dspark_ds.distributed import print0
from dspark_ds.errors import ConfigError

LOCK_FILE = "RUNNING"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
_LIVE_SLURM_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING"}


class RunDirBusy(ConfigError):
    """Another job holds the run directory (the CLI prints it as one line, exit 2)."""


class RunDirNotShared(ConfigError):
    """The ranks of one job see different run directories (node-local disks); one line, exit 2."""


def _holder_text(info: dict) -> str:
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return f"host {info.get('host')} pid {info.get('pid')}{job}, started {info.get('started')}"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


SCONTROL_TIMEOUT_S = 5.0
"""How long `slurm_job_state` waits for scontrol's answer."""


def slurm_job_state(job_id: str) -> str | None:
    """The job's state as `scontrol` reports it ("RUNNING", ...), "GONE" for a job Slurm no
    longer knows, None when Slurm cannot be asked."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job_id)],
            capture_output=True,
            text=True,
            # NOTE: without a slurm.conf, scontrol looks for a controller in DNS (configless
            # Slurm) and can wait a long time for an answer that never comes
            timeout=SCONTROL_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return "GONE" if "Invalid job id" in proc.stderr else None
    for item in proc.stdout.split():
        key, _, value = item.partition("=")
        if key == "JobState":
            return value
    return None


def stale_reason(info: dict, now: float | None = None) -> str | None:
    """Why the lock `info` describes no longer protects a live job (None: its holder may be
    alive)."""
    now = time.time() if now is None else now
    job = str(info.get("slurm_job_id") or "")
    mine = os.environ.get("SLURM_JOB_ID", "")
    if job and job == mine:
        return f"it is this job's earlier instance (Slurm job {job} restarted)"
    if info.get("host") == socket.gethostname():
        pid = int(info.get("pid") or 0)
        if pid and not pid_alive(pid):
            return f"its process {pid} on {info['host']} is gone"
        if pid == os.getpid():
            return "it is this process's own"
    if job:
        state = slurm_job_state(job)
        if state is not None and state not in _LIVE_SLURM_STATES:
            return f"Slurm job {job} is {state.lower()}"
        if state is not None:
            return None  # Slurm vouches for it
    beat = float(info.get("heartbeat") or 0)
    if beat and now - beat > STALE_AFTER_S:
        return f"its heartbeat stopped {now - beat:.0f} s ago"
    return None


class RunLock:
    """Rank 0's hold on `<run_dir>/RUNNING` (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.info: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
            "heartbeat": now,
            "token": secrets.token_hex(8),
        }

    def _create(self, info: dict) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def acquire(self) -> str | None:
        """Takes the lock; returns a note when a stale one was taken over. RunDirBusy when a
        live job holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(3):  # NOTE: two jobs taking over the same stale lock: one create wins
            info = self._record()
            if self._create(info):
                self.info = info
                self._start_heartbeat()
                return note
            try:
                held = json.loads(self.path.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                held = {}
            if not held:
                # a holder between its create and its write, or a lock emptied by a crash
                age = time.time() - _mtime(self.path)
                if age < 10:
                    time.sleep(1)
                    continue
                why = "it is empty"
            else:
                why = stale_reason(held)
            if why is None:
                raise RunDirBusy(
                    f"{self.path.parent}: another job is training in this run directory "
                    f"({_holder_text(held)}); wait for it, stop it, or choose another --name "
                    f"(remove {self.path} only if that job is really gone)"
                )
            note = f"took over {self.path} from {_holder_text(held)}: {why}"
            stale = self.path.with_name(f"{LOCK_FILE}.stale-{secrets.token_hex(4)}")
            try:
                os.replace(self.path, stale)
                stale.unlink()
            except FileNotFoundError:
                pass  # another job took it over first; try to create again
        raise RunDirBusy(f"{self.path}: could not take the lock (another job keeps taking it)")

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    info = json.loads(self.path.read_text())
                    if info.get("token") != self.info["token"]:
                        return  # taken over: not ours to refresh any more
                    info["heartbeat"] = time.time()
                    tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(info))
                    os.replace(tmp, self.path)
                except (OSError, json.JSONDecodeError, KeyError):
                    pass

        self._thread = threading.Thread(target=beat, name="dspark-runlock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Removes the lock if it is still this job's."""
        self._stop.set()
        if not self.info:
            return
        try:
            held = json.loads(self.path.read_text())
            if held.get("token") == self.info["token"]:
                self.path.unlink()
        except (OSError, json.JSONDecodeError):
            pass
        self.info = {}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def acquire_collectively(run_dir: str | Path, rank: int) -> RunLock | None:
    """Collective: rank 0 takes the lock, every rank learns the outcome; RunDirBusy on every
    rank when another job holds it. Returns rank 0's lock (None elsewhere)."""
    lock, error, note = None, None, None
    if rank == 0:
        lock = RunLock(run_dir)
        try:
            note = lock.acquire()
        except RunDirBusy as err:
            error = str(err)
    error, note = distributed.broadcast_object((error, note))
    if error:
        raise RunDirBusy(error)
    if note:
        print0(f"[train] {note}")
    return lock


def check_shared(run_dir: str | Path, rank: int, wait_s: float = 5.0) -> None:
    """Collective: every rank must see the file rank 0 writes into `run_dir`; otherwise
    RunDirNotShared on every rank, naming the hosts that do not. A run directory on node-local
    disks would let the ranks choose different checkpoints to resume from, and the job stall."""
    if not distributed.has_group():
        return
    token = secrets.token_hex(8)
    name = ".shared-check"
    path = Path(run_dir) / name
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
    token = distributed.broadcast_object(token)
    deadline = time.monotonic() + wait_s
    seen = False
    while True:
        try:
            seen = path.read_text() == token
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    views = distributed.all_gather_object((socket.gethostname(), seen))
    if rank == 0:
        path.unlink(missing_ok=True)
    ranks_of: dict[str, list[int]] = {}
    blind: dict[str, list[int]] = {}
    for r, (host, ok) in enumerate(views):
        ranks_of.setdefault(host, []).append(r)
        if not ok:
            blind.setdefault(host, []).append(r)
    if blind:
        # a host all of whose ranks are blind is named alone; otherwise its blind ranks
        who = ", ".join(
            host if ranks == ranks_of[host] else f"{host} (rank {', '.join(map(str, ranks))})"
            for host, ranks in sorted(blind.items())
        )
        raise RunDirNotShared(
            f"the run directory {Path(run_dir).resolve()} is not shared between hosts: "
            f"{who} cannot see what rank 0 ({views[0][0]}) wrote there; put output_dir on a "
            "file system every node mounts"
        )
