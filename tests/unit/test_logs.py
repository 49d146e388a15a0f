"""Status lines carry the time and the rank; rank-0 lines come from rank 0 only; signals."""

from __future__ import annotations

import io
import os
import re
import signal

import pytest

from dspark_ds import distributed, logs
from dspark_ds.train.signals import (
    INTERRUPT_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    Signals,
    exit_code_for,
)


def stamp(rank: int) -> str:
    return r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d rank " + str(rank) + r"\] "


def test_every_line_is_stamped():
    text = logs.format_lines("[train] one\n[train] two", 3)
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n")
    assert all(re.match(stamp(3) + r"\[train\] ", line) for line in lines)


def test_print0_on_rank_0_only_and_log_on_every_rank(monkeypatch):
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        out = io.StringIO()
        distributed.print0("[x] hello", file=out)
        distributed.log("[x] mine", file=out)
        lines = out.getvalue().splitlines()
        expected = (["[x] hello"] if rank == 0 else []) + ["[x] mine"]
        assert [re.sub(stamp(rank), "", line) for line in lines] == expected


@pytest.fixture
def signals():
    s = Signals()
    s.install()
    yield s
    s.restore()
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_requeue_signals(signals):
    assert exit_code_for(signals.request()) is None
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGINT)  # a later Ctrl-C does not turn a requeue into a stop
    assert exit_code_for(signals.request()) == REQUEUE_EXIT_CODE


def test_ctrl_c_then_the_default_action(signals, capfd):
    os.kill(os.getpid(), signal.SIGINT)
    assert exit_code_for(signals.request()) == INTERRUPT_EXIT_CODE
    assert "Ctrl-C: finishing this step" in capfd.readouterr().err
    # the second Ctrl-C is the kernel's: it would end the process at once
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's TERM after the Ctrl-C changes nothing
    assert exit_code_for(signals.request()) == INTERRUPT_EXIT_CODE
