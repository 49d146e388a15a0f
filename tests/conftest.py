"""Shared fixtures. Tests are CPU-only; DeepSpeed runs with DS_ACCELERATOR=cpu.

Helpers shared by several test modules live in tests/helpers/ and are imported as
`from helpers.<module> import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# NOTE: the tracker honours these (docs/tracking.md#the-environment): a shell's own must not
# send the tests' runs to another store or into another run
for _name in (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_RUN_ID",
):
    os.environ.pop(_name, None)
# NOTE: tiny models gain nothing from intra-op threads, and on 2 cores a 2-rank test with
# default threading oversubscribes the CPU (10-30x slower). Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from helpers.multihost import multihost_cluster  # noqa: E402, F401 - the 2-host cluster fixture

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


@pytest.fixture
def golden_dir() -> Path:
    """The reference implementation's golden folders (tests/golden, see its README)."""
    return GOLDEN
