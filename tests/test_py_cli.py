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
        ("--log-level", "debug", "bench", "ep"),
        ("bench", "--log-level", "debug", "ep"),
        ("bench", "ep", "--log-level", "debug"),
        ("bench", "ep", "--log-level=debug"),
    ],
    ids=["before-bench", "before-ep", "after-ep", "after-ep-equals"],
)
def test_bench_ep_takes_the_global_log_level_anywhere(args):
    """--log-level is global, as `freight help bench ep` lists it: wherever it is written,
    `bench ep` gets to its own checks (an invalid --num-processes, so that no GPU is needed)."""
    p = run(*args, "--num-processes", "0")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == "freight bench ep: --num-processes must be positive", p.stderr


# Stand-ins for PyTorch, first on the path: one that does not import, one without a GPU.
NO_TORCH = "raise ImportError('No module named torch (hidden by the test)')\n"
NO_GPU = """
__version__ = "0.0-test"
class version:
    cuda = None
class cuda:
    is_available = staticmethod(lambda: False)
    device_count = staticmethod(lambda: 0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "torch_source, message",
    [(NO_TORCH, "needs PyTorch, which cannot be imported here"), (NO_GPU, "needs a GPU that PyTorch can use")],
    ids=["no-torch", "no-gpu"],
)
def test_bench_ep_without_what_it_needs_says_so_once(tmp_path, torch_source, message):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(torch_source)
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    p = run("bench", "ep", "--num-processes", "2", env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"freight bench ep: {message}") and p.stderr.count("\n") == 1, p.stderr
    assert "ranks passed" not in p.stdout, p.stdout


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
