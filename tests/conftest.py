"""Shared fixtures. Tests are CPU-only; DeepSpeed runs with DS_ACCELERATOR=cpu.

Helpers shared by several test modules live in tests/helpers/ and are imported as
`from helpers.<module> import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
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

pytest_plugins = ["pytester"]  # tests/unit/test_layers.py runs the checks below on files of its own

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    """The tiny random Qwen3 target and its tokenizer (`helpers.tiny_models.build_tiny_target`'s
    defaults: hidden 32, 4 layers, vocabulary 384), built once for the session. Tests read it
    and never write into it (a run never modifies what it reads); a test that needs other
    widths or weights builds its own."""
    from helpers.tiny_models import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("session") / "tiny_target")


# ---- the suite on workers (`-n 3`; the fast lane `-n 2`; `--dist loadgroup` in pyproject.toml) ---
# A file's tests run on one worker, so that its module-scoped fixtures (a 2-rank training, a
# server) are made once; every test under tests/cluster/ runs on the same worker: they share the
# session's Slurm daemons and namespace hosts, whose names and ports two copies would both take.
@pytest.hookimpl(tryfirst=True)  # NOTE: before xdist's own hook rewrites the node ids
def pytest_collection_modifyitems(config, items):
    slow_groups = set()
    for item in items:
        path = Path(item.fspath)
        group = "cluster" if path.parent.name == "cluster" else str(path.relative_to(REPO))
        if item.get_closest_marker("run_alone") is not None:
            group = RUN_ALONE_GROUP
        item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("slow") is not None:
            slow_groups.add(group)
    if hasattr(config, "workerinput"):  # for the controller's scheduler (below)
        listing = _slow_groups_file(config)
        part = listing.with_name(f"{listing.name}.{config.workerinput['workerid']}")
        part.write_text(json.dumps(sorted(slow_groups)))
        part.replace(listing)


# Which groups go first. A test marked `run_alone` (it times the machine) runs while no other
# test does (helpers/run_alone.py); what it waited for its turn is listed at the end of the
# run. Those tests are one group, handed out first: started with the run, they wait for no
# more than the other workers' first tests (in the middle of a run one waited 74 s for two long
# ones, a worker idle meanwhile). Then the groups that hold a slow test, then the rest, each
# the largest first (xdist's order): the many short in-process tests fill the end of the run,
# where a compile-heavy file of 3 tests, handed out last for its count, ran 134 s alone.
RUN_ALONE_GROUP = "run_alone"


def _slow_groups_file(config) -> Path:
    """In the controller's temporary directory (the run's: a worker's is its popen-gwN)."""
    base = Path(config._tmp_path_factory.getbasetemp())
    if hasattr(config, "workerinput"):
        base = base.parent
    return base / "slow_groups.json"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SlowGroupsFirst(LoadGroupScheduling):
        """`--dist loadgroup` (whole groups), run_alone first, then the groups with a slow
        test, then the others; within each, the largest first."""

        ordered = False

        def _assign_work_unit(self, node):
            if not self.ordered:
                self.ordered = True
                listing = _slow_groups_file(config)
                slow = set(json.loads(listing.read_text())) if listing.exists() else set()
                rank = {RUN_ALONE_GROUP: 0, **dict.fromkeys(slow - {RUN_ALONE_GROUP}, 1)}
                order = sorted(self.workqueue, key=lambda scope: rank.get(scope, 2))  # stable
                for scope in order:
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return SlowGroupsFirst(config, log)


_ALONE_WAITED = "waited for its turn (s)"
_alone_waits: list[tuple[str, float, float]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not hasattr(item.config, "workerinput"):  # one process: every test runs alone
        yield
        return
    from helpers.run_alone import lock_dir, turn

    alone = item.get_closest_marker("run_alone") is not None
    with turn(lock_dir(item.config), alone) as waited:
        if alone:
            item.user_properties.append((_ALONE_WAITED, round(waited, 1)))
        yield


@pytest.fixture
def golden_dir() -> Path:
    """The reference implementation's golden folders (tests/golden, see its README)."""
    return GOLDEN


# ---- markers that match what a test does ---------------------------------------------------------
# A test that launches several processes (helpers.dist.run_distributed / torchrun) must be marked
# `distributed` and `slow` (the fast lane is in-process), and none under tests/unit/ may launch.
# Fast-lane tests that took long are listed at the end of the run.
import helpers.dist as _dist  # noqa: E402

_LAUNCHED_BEFORE = pytest.StashKey[int]()
FAST_LANE_LIMIT_S = 5.0
_slow_fast_lane: list[tuple[float, str]] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_LAUNCHED_BEFORE] = len(_dist.LAUNCHES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    launched = _dist.LAUNCHES[item.stash.get(_LAUNCHED_BEFORE, len(_dist.LAUNCHES)) :]
    if not launched:
        return
    problems = [
        f"not marked {m!r}" for m in ("distributed", "slow") if not item.get_closest_marker(m)
    ]
    if Path(item.fspath).parent.name == "unit":
        problems.append("in tests/unit/, which is in-process only (move it to tests/multiprocess/)")
    if problems:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} launched {len(launched)} multi-process run(s) (first: {launched[0]}) "
            f"but is {'; '.join(problems)}"
        )


def pytest_runtest_logreport(report):
    # NOTE: called where the run is reported (the controller, under xdist), with each worker's
    # reports; their keywords carry the markers' names
    waited = dict(report.user_properties).get(_ALONE_WAITED)
    if report.when == "call" and waited is not None:
        _alone_waits.append((report.nodeid, waited, report.duration))
    if (
        report.when == "call"
        and "slow" not in report.keywords
        and report.duration > FAST_LANE_LIMIT_S
    ):
        _slow_fast_lane.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _alone_waits:
        terminalreporter.write_sep("-", "tests run alone (marked run_alone)")
        for nodeid, waited, seconds in _alone_waits:
            terminalreporter.write_line(
                f"{seconds:6.1f} s  {nodeid} (waited {waited:.0f} s for the tests running)"
            )
    if _slow_fast_lane:
        terminalreporter.write_sep(
            "-", f"fast-lane tests over {FAST_LANE_LIMIT_S:.0f} s (mark them slow?)"
        )
        for seconds, nodeid in sorted(_slow_fast_lane, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
