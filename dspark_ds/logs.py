"""How the package's status lines look: a timestamp and the rank on every line, so that a
Slurm log interleaving many ranks and many days reads like any batch log:

    [2026-05-01 12:00:03 rank 0] [train] resumed from runs/x/checkpoints/step_00000100 at step 100

Only the format lives here (a leaf module, imported by `dspark_ds.distributed`, whose
`print0` / `log` are the package's two ways of printing a status line). What a command
produces as its result — `--print_config` YAML, `--help`, tables of `eval` / `compare` /
`tune`, the one-line `dspark-ds: error:` of the CLI — is printed as is.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import TextIO


def prefix(rank: int | None) -> str:
    """`[YYYY-MM-DD HH:MM:SS rank R] ` in local time (the time zone of the job's logs)."""
    where = "" if rank is None else f" rank {rank}"
    return f"[{time.strftime('%Y-%m-%d %H:%M:%S')}{where}] "


_PREFIX = re.compile(r"\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?: rank \d+)?\] ")


def strip_prefix(line: str) -> str:
    """A status line without its `prefix` (a line without one as it is): what a program that
    reads another command's output matches against."""
    found = _PREFIX.match(line)
    return line[found.end() :] if found else line


def format_lines(message: str, rank: int | None) -> str:
    """Every line of `message` prefixed, ending with a newline."""
    head = prefix(rank)
    return "".join(head + line + "\n" for line in (message.splitlines() or [""]))


def emit(message: str, rank: int | None, stream: TextIO | None = None) -> None:
    """Write `message` (one or more lines) with the prefix, flushed: batch logs of several
    ranks interleave whole lines only when each process flushes its own."""
    stream = sys.stdout if stream is None else stream
    stream.write(format_lines(message, rank))
    stream.flush()


def emit_from_signal_handler(message: str, rank: int | None) -> None:
    """The same line on stderr from inside a signal handler.

    NOTE: a handler may interrupt a `print` on the same stream, and re-entering a buffered
    writer raises RuntimeError; os.write on the file descriptor is safe."""
    try:
        os.write(2, format_lines(message, rank).encode("utf-8", "replace"))
    except OSError:
        pass
