"""Tests install nothing: a missing system component fails the test that needs it, naming the
component and the command that installs it (tests/helpers/system.py)."""

from __future__ import annotations

import sys

import pytest

from helpers.system import INSTALL, require_binaries, require_python_module, which


def test_a_missing_binary_fails_with_the_install_command():
    with pytest.raises(pytest.fail.Exception) as err:
        require_binaries(("dspark-no-such-daemon", "sh"), ("slurm-wlm", "munge"))
    text = str(err.value)
    assert text.startswith("dspark-no-such-daemon not installed")  # sh is found
    assert INSTALL in text and "apt-get install slurm-wlm munge" in text


def test_present_binaries_pass():
    require_binaries(("sh",), ("dash",))
    assert which("sh") is not None


def test_a_module_that_does_not_import_fails_with_the_pip_command():
    with pytest.raises(pytest.fail.Exception) as err:
        require_python_module("import dspark_no_such_module", "dspark_no_such_module", "x>=1")
    text = str(err.value)
    assert INSTALL in text and "pip install 'x>=1'" in text and "ModuleNotFoundError" in text
    require_python_module(f"import sys; assert sys.executable == {sys.executable!r}", "sys", "")
