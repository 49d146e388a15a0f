"""The one exception type for what the user must fix.

`ConfigError`: an option, a path, a file or a data set that cannot be used as given. Its message
starts with what to change (the dotted option, or the file and line) and says why. The CLI prints
it as one line, `dspark-ds: error: <message>`, and exits 2; any other exception is a bug and keeps
its traceback (exit 1).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Something the user must fix (see the module docstring)."""
