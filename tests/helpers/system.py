"""System components that some tests need: Slurm and munge, Open MPI and mpi4py.

Tests install nothing: `bash tools/install.sh` does (apt-get as root, pip). A test whose
component is missing fails, naming what is missing and the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

INSTALL = "bash tools/install.sh"
SBIN = ("/usr/sbin", "/sbin", "/usr/bin")


def which(name: str) -> str | None:
    """`shutil.which` that also looks in the sbin directories (daemons live there)."""
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
    return shutil.which(name, path=path)


def missing_message(missing: list[str], apt_packages: tuple[str, ...] = (), pip: str = "") -> str:
    how = [
        f"apt-get install {' '.join(apt_packages)}" if apt_packages else "",
        f"pip install '{pip}'" if pip else "",
    ]
    detail = "; ".join(h for h in how if h)
    return f"{', '.join(missing)} not installed: run `{INSTALL}` as root ({detail})"


def require_binaries(binaries: tuple[str, ...], apt_packages: tuple[str, ...]) -> None:
    """Fails the test (with the install command) unless every binary is on PATH or in sbin."""
    missing = [b for b in binaries if which(b) is None]
    if missing:
        pytest.fail(missing_message(missing, apt_packages), pytrace=False)


def require_python_module(probe: str, name: str, pip: str) -> None:
    """Fails the test unless `probe` (Python code importing `name`) runs in a fresh interpreter;
    a fresh one because some imports (mpi4py.MPI) initialise a runtime."""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        pytest.fail(f"{missing_message([name], pip=pip)}: {tail[0]}", pytrace=False)


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout_s: float, poll_s: float, request_s: float
) -> bool:
    """Asks `url` (a server's /health) every `poll_s` seconds: True once it answers 200, False
    when `proc` (the server) exited first or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=request_s) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(poll_s)
    return False
