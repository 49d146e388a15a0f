"""The test suite's own shape (docs/testing.md): every test file sits in one of the four layers,
and a test that launches several processes carries the markers that take it out of the fast lane
(the check in tests/conftest.py, run here on small test files of its own)."""

from __future__ import annotations

from pathlib import Path

import helpers.dist

TESTS = Path(__file__).resolve().parents[1]
LAYERS = ("unit", "multiprocess", "cluster", "e2e")


def test_every_test_file_is_in_a_layer():
    stray = [
        p.relative_to(TESTS)
        for p in TESTS.rglob("test_*.py")
        if p.relative_to(TESTS).parts[0] not in LAYERS
    ]
    assert not stray, f"test files outside {LAYERS}: {stray}"
    for layer in LAYERS:
        assert list((TESTS / layer).glob("test_*.py")), layer


LAUNCHING = """
import pytest
import helpers.dist


def _launch():
    helpers.dist.LAUNCHES.append("torchrun --nproc_per_node=2 fake")  # what torchrun() records


def test_unmarked():
    _launch()


@pytest.mark.slow
@pytest.mark.distributed
def test_marked():
    _launch()


@pytest.mark.distributed
def test_distributed_but_in_the_fast_lane():
    _launch()


def test_in_process():
    pass
"""


def test_a_launching_test_without_its_markers_fails(pytester):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.mkdir("multiprocess")
    pytester.mkdir("unit")
    (pytester.path / "multiprocess" / "test_launching.py").write_text(LAUNCHING)
    (pytester.path / "unit" / "test_launching_unit.py").write_text(LAUNCHING)
    before = len(helpers.dist.LAUNCHES)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    del helpers.dist.LAUNCHES[before:]  # the small files' pretend launches are not this test's
    outcomes = {
        r.nodeid: r.outcome
        for r in result.reprec.getreports("pytest_runtest_logreport")
        if r.when == "call"
    }
    assert outcomes == {
        "multiprocess/test_launching.py::test_unmarked": "failed",
        "multiprocess/test_launching.py::test_marked": "passed",
        "multiprocess/test_launching.py::test_distributed_but_in_the_fast_lane": "failed",
        "multiprocess/test_launching.py::test_in_process": "passed",
        "unit/test_launching_unit.py::test_unmarked": "failed",
        "unit/test_launching_unit.py::test_marked": "failed",
        "unit/test_launching_unit.py::test_distributed_but_in_the_fast_lane": "failed",
        "unit/test_launching_unit.py::test_in_process": "passed",
    }
    text = result.stdout.str()
    assert (
        "test_unmarked launched 1 multi-process run(s) (first: torchrun --nproc_per_node=2 fake)"
        " but is not marked 'distributed'; not marked 'slow'" in text
    )
    assert "in tests/unit/, which is in-process only" in text


def test_a_run_alone_test_waits_for_the_running_and_the_next_wait_for_it(tmp_path):
    """helpers/run_alone.py's turns: a test marked run_alone starts when the test already
    running has ended, and a test that asks after it starts when it has ended (one thread per
    test, as the workers of `pytest -n 3` take their turns)."""
    import threading
    import time

    from helpers.run_alone import turn

    spans: dict[str, list[float]] = {}

    def test(name: str, alone: bool, hold_s: float) -> None:
        with turn(tmp_path, alone):
            start = time.monotonic()
            time.sleep(hold_s)
            spans[name] = [start, time.monotonic()]

    running = threading.Thread(target=test, args=("running", False, 0.6))
    running.start()
    time.sleep(0.15)
    alone = threading.Thread(target=test, args=("alone", True, 0.3))
    alone.start()
    time.sleep(0.15)  # the run_alone test is waiting: the next one queues behind it
    after = threading.Thread(target=test, args=("after", False, 0.0))
    after.start()
    for t in (running, alone, after):
        t.join(timeout=10)
    assert spans["running"][1] <= spans["alone"][0]
    assert spans["alone"][1] <= spans["after"][0]
    # shared turns overlap
    with turn(tmp_path, False), turn(tmp_path, False):
        pass
