"""The command line through Python: ``python -m freight`` (the ``freight`` script runs
the same ``freight.cli:main``)."""

from __future__ import annotations

import json
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        ("pipe", "--num-objs", "20", "--obj-size", "1MiB", "--buffer-size", "4MiB", "--num-rounds", "2"),
        ("channel", "--num-objs", "30", "--obj-size", "512KiB", "--buffer-size", "4MiB", "--batch-size", "8"),
    ],
    ids=["pipe", "channel"],
)
def test_stream_benchmarks_verify_and_report_throughput(args):
    """The pipe and channel benchmarks (receiver in a child process) check every byte
    of their first round and report positive throughput."""
    p = run("bench", *args, "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["benchmark"] == f"freight bench {args[0]}"
    assert report["verified"] is True
    rounds = report["rounds"]
    assert [r["kind"] for r in rounds][0] == "verify"
    timed = [r for r in rounds if r["kind"] == "transfer"]
    assert len(timed) == (2 if args[0] == "pipe" else 1)
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in rounds)
    assert report["throughput_gbps"]["mean"] > 0
    assert report["num_objs"] == int(args[2])
