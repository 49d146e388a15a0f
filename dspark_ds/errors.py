"""The exceptions the CLI turns into one line and an exit code.

`ConfigError`: an option, a path, a file or a data set that cannot be used as given. Its message
starts with what to change (the dotted option, or the file and line) and says why. The CLI prints
it as one line, `dspark-ds: error: <message>`, and exits 2; any other exception is a bug and keeps
its traceback (exit 1).

`TrainingStopped`: a run (training, or the regeneration that feeds it) cannot go on; raised on
every rank together, after what could be saved was saved; one line, exit 1. It lives here, not in
train/, so that data/ raises it without importing the trainer's package.
"""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """Something the user must fix (see the module docstring)."""


def require_at_least_one(config: object, names: Iterable[str], section: str = "") -> None:
    """A ConfigError naming the first of `config`'s fields `names` below 1 (as the option
    `<section><name>`)."""
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ConfigError(f"{section}{name}: must be >= 1, got {value}")


class TrainingStopped(RuntimeError):
    """The run cannot go on (a checkpoint that cannot be written, a loss that stays NaN); raised
    on every rank together, after whatever could be saved was saved. The CLI prints the message
    as one line and exits with `exit_code`."""

    exit_code = 1
