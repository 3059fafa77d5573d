"""The command line through Python: ``python -m freight`` (the ``freight`` script runs
the same ``freight.cli:main``)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freight", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=60,
    )


@pytest.mark.timeout(120)
def test_help_and_usage_errors():
    p = run("--help")
    assert p.returncode == 0, p.stderr
    assert "freight" in p.stdout.lower() and "usage" in p.stdout.lower()
    p = run("--definitely-not-an-option")
    assert p.returncode == 2, (p.stdout, p.stderr)


def test_self_command():
    from freight import cli

    assert cli.self_command() == [sys.executable, "-m", "freight"]
