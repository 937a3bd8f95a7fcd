"""The `kvbaton` command itself: usage, version, unknown commands (each command's own flags:
test_config.py and the simulator's tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from router.cli import main


def test_a_bare_kvbaton_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: kvbaton {serve,sim,demo,session}")


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_usage_and_succeeds(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out.startswith("usage: kvbaton {serve,sim,demo,session}")


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvbaton {version('kvbaton')}\n"


def test_an_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route"]) == 2
    assert "unknown command 'route'" in capsys.readouterr().err


def test_the_entry_point_exits_with_mains_status() -> None:
    """`python -m router` is `kvbaton`: a bare call exits 2, `--version` 0."""
    bare = subprocess.run([sys.executable, "-m", "router"], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: kvbaton")
    ver = subprocess.run(
        [sys.executable, "-m", "router", "--version"], capture_output=True, text=True
    )
    assert ver.returncode == 0 and re.fullmatch(r"kvbaton \S+\n", ver.stdout)
