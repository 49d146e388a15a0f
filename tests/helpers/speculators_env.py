"""speculators 0.9.0 in its own environment (tests/e2e/test_speculators_format.py).

- ``require_speculators() -> str``: the Python of the speculators environment ``tools/install.sh``
  makes (``$DSPARK_DS_SPECULATORS_ENV``, default ~/.cache/dspark-ds/speculators-venv); fails the
  test, naming the install command, when there is none.
- ``run_probe(jobs, work) -> str``: runs helpers/speculators_probe.py there on `jobs` (written to
  `work`/jobs.json); fails the test with the tail of its output when it does not finish.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers.system import INSTALL

DEFAULT_ENV = "~/.cache/dspark-ds/speculators-venv"
PROBE = Path(__file__).with_name("speculators_probe.py")


def require_speculators() -> str:
    env = Path(os.environ.get("DSPARK_DS_SPECULATORS_ENV") or DEFAULT_ENV).expanduser()
    python = env / "bin" / "python"
    if not python.exists() or not list(env.glob("lib/python*/site-packages/speculators")):
        pytest.fail(
            f"speculators not installed: run `{INSTALL}` (it makes the speculators "
            f"environment, {DEFAULT_ENV}; or set DSPARK_DS_SPECULATORS_ENV)",
            pytrace=False,
        )
    return str(python)


def run_probe(jobs: dict, work: Path, timeout_s: float = 240.0) -> str:
    python = require_speculators()
    jobs_file = Path(work) / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [python, str(PROBE), str(jobs_file)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=work,
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        pytest.fail("speculators probe failed:\n" + "\n".join(tail), pytrace=False)
    return proc.stdout
