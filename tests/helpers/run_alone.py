"""A test that times this machine runs alone, even on pytest-xdist's workers.

`pytest -n 3` runs three tests at once on the same cores; a test that holds a model of the
machine against measured step times (tests/multiprocess/test_tuner_speed.py) then measures the
other workers' load. Such a test is marked `run_alone` (tests/conftest.py): while it runs, no
other test runs, and it starts once the tests already running have ended.

The workers of one run share a folder (in the run's temporary directory, the parent of each
worker's `popen-gwN`, which pytest prunes as it prunes the rest) and two locked files in it:

- `running`: every test holds it shared while it runs; a `run_alone` test holds it exclusive, so
  it waits for the tests running and they for it;
- `gate`: a test takes it before `running` (shared, and lets go at once; a `run_alone` test
  exclusive, for its whole run), so that the next tests of the other workers queue behind a
  waiting `run_alone` test instead of passing it forever.

flock(2) locks belong to an open file, so the same holds between threads of one process
(tests/unit/test_layers.py checks the order that way).
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def lock_dir(config) -> Path:
    """The folder the workers of this run share, beside their own temporary directories."""
    # NOTE: pytest's own TempPathFactory (what tmp_path uses); xdist gives each worker a
    # --basetemp of <the run's directory>/popen-gwN
    path = Path(config._tmp_path_factory.getbasetemp()).parent / "run_alone"
    path.mkdir(exist_ok=True)
    return path


@contextmanager
def turn(directory: Path, alone: bool) -> Iterator[float]:
    """Hold a test's turn: shared, or alone; yields the seconds it waited for it."""
    t0 = time.monotonic()
    mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    with open(directory / "gate", "a") as gate, open(directory / "running", "a") as running:
        fcntl.flock(gate, mode)
        fcntl.flock(running, mode)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield time.monotonic() - t0
