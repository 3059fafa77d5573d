"""Shared pytest fixtures and helpers for freight's Python tests.

Helpers (importable from tests as ``from conftest import free_port, spawn_python, libfabric_missing``):
    free_port()                      -> an unused TCP port on 127.0.0.1
    spawn_python(code, *args, ...)   -> subprocess.Popen running ``code`` in a new process
                                        (``stdin=True``: a pipe to its stdin)

Fixtures:
    etcd_endpoint   (session) URL of a private etcd server, e.g. "http://127.0.0.1:40123"
    spawn           spawn_python, as a fixture
    (autouse)       kills any process started by spawn_python that a test left running
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import List, Optional

import pytest

ETCD_BIN = os.environ.get("FREIGHT_ETCD_BIN", "/usr/bin/etcd")
ETCD_START_TIMEOUT_S = 20.0
collect_ignore = ["third_party"]  # vendored programs: tests/test_nixl_examples.py runs them


# --------------------------------------------------------------------------- helpers


def libfabric_missing() -> str:
    """Why the fabric transport cannot run here ("" where libfabric loads)."""
    import ctypes

    try:
        ctypes.CDLL("libfabric.so.1")
        return ""
    except OSError:
        return "libfabric is not installed (apt-get install libfabric1)"


def check_kernel_compile(compile_for) -> None:
    """`compile_for(arch)` builds a cubin through NVRTC (no GPU needed): it must for
    Hopper, and an architecture that does not exist must raise CudaError. Skips, saying
    why, where NVRTC is not installed."""
    import freight

    try:
        size = compile_for("sm_90")
    except freight.TransportUnavailableError as e:
        pytest.skip(f"NVRTC is not installed: {e}")
    assert size > 1000
    with pytest.raises(freight.CudaError):
        compile_for("sm_1")  # no such architecture


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_children: List[subprocess.Popen] = []


def spawn_python(
    code: str,
    *args: str,
    env: Optional[dict] = None,
    cwd: Optional[str] = None,
    text: bool = True,
    stdin: bool = False,
) -> subprocess.Popen:
    """Run a Python snippet in a separate, real process (``sys.executable -c code args...``).

    stdout and stderr are pipes (text mode by default); output is unbuffered. stdin is
    empty, or with ``stdin=True`` a pipe for the test to write to.
    The child runs in its own session so that it and its own children can be
    killed together; whatever a test leaves running is killed when it ends.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *[str(a) for a in args]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        env=child_env,
        cwd=cwd,
        text=text,
        start_new_session=True,
    )
    _children.append(proc)
    return proc


def _kill(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    if proc.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


@pytest.fixture
def spawn():
    """spawn_python as a fixture."""
    return spawn_python


@pytest.fixture(autouse=True)
def _kill_leftover_children():
    """Kill processes started by spawn_python that are still running after a test."""
    start = len(_children)
    yield
    leftovers = _children[start:]
    del _children[start:]
    for proc in leftovers:
        _kill(proc)


# --------------------------------------------------------------------------- etcd


def _etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as resp:
            return resp.status == 200 and b"true" in resp.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, "r", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "<no log>"


@pytest.fixture(scope="session")
def etcd_endpoint():
    """A private single-node etcd on free loopback ports; yields "http://127.0.0.1:PORT"."""
    binary = ETCD_BIN if os.path.exists(ETCD_BIN) else shutil.which("etcd")
    if not binary:
        pytest.skip(
            f"etcd binary not found at {ETCD_BIN} or on PATH "
            "(apt-get install etcd-server, or run scripts/setup.sh)"
        )

    env = dict(os.environ)
    if platform.machine().lower() in ("aarch64", "arm64"):
        env.setdefault("ETCD_UNSUPPORTED_ARCH", "arm64")  # etcd 3.4 refuses to start otherwise

    tmp = tempfile.mkdtemp(prefix="freight-etcd-")
    last_error = ""
    proc = None
    url = ""
    for _attempt in range(3):  # a port may be taken between free_port() and etcd's bind
        client, peer = free_port(), free_port()
        url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        data_dir = os.path.join(tmp, f"data-{client}")
        log_path = os.path.join(tmp, f"etcd-{client}.log")
        cmd = [
            binary,
            "--name", "freight-test",
            "--data-dir", data_dir,
            "--listen-client-urls", url,
            "--advertise-client-urls", url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"freight-test={peer_url}",
            "--initial-cluster-state", "new",
        ]
        log = open(log_path, "wb")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _etcd_healthy(url):
                break
            time.sleep(0.1)
        if proc.poll() is None and _etcd_healthy(url):
            break
        last_error = (
            f"etcd ({' '.join(cmd)}) did not become healthy within "
            f"{ETCD_START_TIMEOUT_S:.0f}s (exit={proc.poll()}); log tail:\n{_tail(log_path)}"
        )
        _kill(proc)
        proc = None
    if proc is None:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(last_error, pytrace=False)

    try:
        yield url
    finally:
        _kill(proc, grace_s=5.0)
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- report header


def _gpu_status() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "no (nvidia-smi not found): tests marked 'gpu' will be skipped"
    try:
        out = subprocess.run(
            [smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, timeout=15,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"no (nvidia-smi -L failed: {e.__class__.__name__}): tests marked 'gpu' will be skipped"
    gpus = [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        return f"no (nvidia-smi -L: rc={out.returncode}, no GPU listed): tests marked 'gpu' will be skipped"
    first = gpus[0].split(" (UUID")[0]
    more = f" (+{len(gpus) - 1} more)" if len(gpus) > 1 else ""
    return f"yes, {len(gpus)} visible: {first}{more}"


def pytest_report_header(config):
    etcd = ETCD_BIN if os.path.exists(ETCD_BIN) else shutil.which("etcd")
    return [
        f"freight: CUDA GPU: {_gpu_status()}",
        f"freight: etcd: {etcd or 'not found: tests using etcd_endpoint will be skipped'}",
    ]


class Interrupted(Exception):
    """What `ctrl_c_soon`'s SIGINT handler raises."""


def _interrupted(*_) -> None:
    raise Interrupted()


@pytest.fixture
def ctrl_c_soon():
    """Sends this process SIGINT in 0.3 s; its handler raises Interrupted (not
    KeyboardInterrupt, which would end the whole test session)."""
    previous = signal.signal(signal.SIGINT, _interrupted)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    yield
    timer.cancel()
    signal.signal(signal.SIGINT, previous)
