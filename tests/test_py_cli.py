"""The command line through Python: ``python -m freight`` (the ``freight`` script runs
the same ``freight.cli:main``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args: str, env: "dict | None" = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freight", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=60, env=env,
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        ("bench", "ep", "--num-processes", "2"),
        ("bench", "ep", "--help"),
        ("--log-level", "debug", "bench", "ep"),
        ("bench", "--log-level", "debug", "ep"),
        ("bench", "ep", "--log-level", "debug"),
        ("bench", "ep", "--log-level=debug"),
    ],
    ids=["options", "help", "log-level-before-bench", "log-level-before-ep", "log-level-after-ep",
         "log-level-after-ep-equals"],
)
def test_bench_ep_says_the_benchmark_is_a_script_of_the_source_tree(args):
    """The EP benchmark needs PyTorch and NCCL, which the wheel does not ship: it is
    bench/ep_bench.py, and `freight bench ep` (--log-level anywhere) says so and fails."""
    p = run(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stdout == "", p.stdout
    assert "freight bench ep: " in p.stderr, p.stderr
    assert "python bench/ep_bench.py" in p.stderr and "PyTorch and NCCL" in p.stderr, p.stderr


@pytest.mark.timeout(120)
def test_a_benchmark_target_with_an_agent_token_serves_only_initiators_that_present_it():
    env = dict(os.environ, FREIGHT_AGENT_TOKEN="bench-t0ken")
    target = subprocess.Popen([sys.executable, "-m", "freight", "bench", "p2p", "--role", "target", "--listen",
                               "127.0.0.1:0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True)
    try:
        line = target.stdout.readline()
        assert "listening on" in line, (line, target.stderr.read() if target.poll() is not None else "")
        addr = line.split("listening on ")[1].split(" (pid")[0].split(", ")[0]
        initiator = ("bench", "p2p", "--connect", addr, "--transport", "tcp", "--block-sizes", "64KiB",
                     "--batch-sizes", "1", "--iters", "5", "--json")
        plain = {k: v for k, v in os.environ.items() if k != "FREIGHT_AGENT_TOKEN"}
        for given in ((), ("--agent-token", "a-guess")):
            refused = run(*initiator, *given, env=plain)
            assert refused.returncode != 0, refused.stdout
            assert "requires a token" in refused.stdout + refused.stderr, (refused.stdout, refused.stderr)
        done = run(*initiator, "--agent-token", "bench-t0ken", env=plain)
        assert done.returncode == 0, done.stderr
        assert all(row["verified"] for row in json.loads(done.stdout)["rows"])
        empty = run(*initiator, "--agent-token", "", env=plain)
        assert empty.returncode == 2 and "empty token" in empty.stderr, empty.stderr
    finally:
        target.kill()
        target.wait(timeout=10)
        target.stdout.close()
        target.stderr.close()
    # A benchmark that starts its own target hands the token on (never on a command line).
    spawned = run("bench", "p2p", "--transport", "tcp", "--block-sizes", "64KiB", "--batch-sizes", "1", "--iters",
                  "5", "--json", env=env)
    assert spawned.returncode == 0, spawned.stderr
    assert all(row["verified"] for row in json.loads(spawned.stdout)["rows"])
    piped = run("bench", "pipe", "--num-objs", "4", "--obj-size", "256KiB", "--buffer-size", "1MiB", env=env)
    assert piped.returncode == 0, piped.stderr
