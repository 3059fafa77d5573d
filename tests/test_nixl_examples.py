"""NIXL's own Python examples and tests, vendored unmodified in tests/third_party/nixl/
(see its README.md), run as real processes against two implementations of the `nixl`
package:

    "nixl"     the real NIXL of the vLLM virtualenv (PYTHONPATH unset), as the reference;
    "freight"  freight.nixl, through the alias: PYTHONPATH=python/freight/nixl/shim:python
               makes `import nixl`, `nixl._api`, `nixl._bindings`, `nixl._utils` and
               `nixl.logging` resolve to freight's implementation.

The programs run under the virtualenv's python (it has torch, numpy, pytest and NIXL);
skipped, saying so, without it. What each program must print to pass is what real NIXL
prints: several of them exit 0 even when their check fails (`exit()` after an error), so
their success lines are asserted too.

Real NIXL's wheel crashes (SIGSEGV in libnl-route's destructor, in _dl_fini, after the
program is done) at exit on this kind of machine: its bundled UCX loads its IB transport,
whose bundled libibverbs loads the system's verbs providers, which bring a second copy of
libnl. The "nixl" runs therefore get UCX_MODULES=^ib (no IB transport; TCP and shared memory
stay), which changes nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

import vllm_serving as vs

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "tests" / "third_party" / "nixl"
EXAMPLES = VENDOR / "examples" / "python"
NIXL_TESTS = VENDOR / "test" / "python"
SHIM = ROOT / "python" / "freight" / "nixl" / "shim"
TIMEOUT_S = 120.0
TAIL_LINES = 60

IMPLS = ["nixl", "freight"]

pytestmark = [
    pytest.mark.skipif(vs.venv() is None, reason=f"no vLLM virtualenv with real NIXL ({vs.VENV_ENV} unset: "
                       "scripts/test.sh builds one with scripts/vllm-env.sh)"),
    pytest.mark.timeout(300),
]


def python() -> str:
    v = vs.venv()
    assert v is not None
    return str(v / "bin" / "python")


# --------------------------------------------------------------------------- environments


def base_env(impl: str) -> Dict[str, str]:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "NIXL_LOG_LEVEL", "NIXL_PLUGIN_DIR", "NIXL_ETCD_ENDPOINTS", "NIXL_ETCD_NAMESPACE"):
        env.pop(k, None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if impl == "nixl":
        # See the module docstring: real NIXL's wheel segfaults at exit with UCX's IB module.
        env["UCX_MODULES"] = "^ib"
    elif impl == "freight":
        env["PYTHONPATH"] = f"{SHIM}{os.pathsep}{ROOT / 'python'}"
    else:
        raise ValueError(impl)
    return env


_PROBE = """
import json, sys
import nixl, nixl._api, nixl._bindings, nixl._utils, nixl.logging
mods = ("nixl", "nixl._api", "nixl._bindings", "nixl._utils", "nixl.logging")
print(json.dumps({m: getattr(sys.modules[m], "__file__", None) for m in mods}))
"""

_probed: Dict[str, str] = {}


def check_resolution(impl: str) -> None:
    """`import nixl` and its modules must come from the implementation under test: from
    freight's shim for "freight" (not silently from the real NIXL beside it), from the
    virtualenv for "nixl"."""
    if impl in _probed:
        if _probed[impl]:
            pytest.fail(_probed[impl], pytrace=False)
        return
    problem = ""
    if impl == "freight" and not (SHIM / "nixl" / "__init__.py").is_file():
        problem = f"freight's alias is not there: {SHIM / 'nixl' / '__init__.py'} is missing"
    else:
        r = subprocess.run([python(), "-c", _PROBE], env=base_env(impl), cwd=str(ROOT), capture_output=True,
                           text=True, timeout=TIMEOUT_S)
        if r.returncode != 0:
            problem = f"importing nixl ({impl}) failed, rc={r.returncode}:\n{tail(r.stdout + r.stderr)}"
        else:
            files = json.loads(r.stdout.strip().splitlines()[-1])
            for mod, f in files.items():
                f = str(f)
                if impl == "freight" and not f.startswith(str(ROOT / "python")):
                    problem += f"{mod} resolved to {f}, not to freight (python/)\n"
                if impl == "nixl" and "site-packages" not in f:
                    problem += f"{mod} resolved to {f}, not to the virtualenv's NIXL\n"
    _probed[impl] = problem
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    check_resolution(request.param)
    return request.param


# --------------------------------------------------------------------------- processes


def tail(text: str, n: int = TAIL_LINES) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-n:]) if lines else "<no output>"


class Proc:
    """One program, its stdout and stderr together in `log`."""

    def __init__(self, name: str, args: Sequence[str], env: Dict[str, str], cwd: Path, log: Path) -> None:
        self.name = name
        self.log = log
        self.args = [python(), *args]
        with open(log, "wb") as f:
            self.p = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, cwd=str(cwd), start_new_session=True)
        self.rc: Optional[int] = None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, deadline: float) -> Optional[int]:
        try:
            self.rc = self.p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            self.rc = None
        return self.rc

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def report(self) -> str:
        rc = "still running: killed" if self.p.poll() is None else f"rc={self.p.returncode}"
        return f"--- {self.name} ({rc}): {' '.join(self.args[1:])}\n{tail(self.output())}"


def report(procs: Sequence[Proc], what: str) -> str:
    return what + "\n" + "\n".join(p.report() for p in procs)


def run_all(procs: Sequence[Proc], timeout_s: float = TIMEOUT_S) -> None:
    """Waits for every process (killing all of them at the deadline, or when one fails, or
    on any error), then asserts that each exited 0."""
    deadline = time.monotonic() + timeout_s
    try:
        pending = list(procs)
        while pending and time.monotonic() < deadline:
            for p in list(pending):
                if p.p.poll() is not None:
                    p.rc = p.p.returncode
                    pending.remove(p)
                    if p.rc != 0:
                        raise AssertionError(report(procs, f"{p.name} exited with rc={p.rc}"))
            time.sleep(0.05)
        if pending:
            raise AssertionError(report(procs, f"{', '.join(p.name for p in pending)} still running after "
                                        f"{timeout_s:.0f} s"))
    finally:
        for p in procs:
            p.kill()


def run_one(name: str, args: Sequence[str], env: Dict[str, str], cwd: Path, tmp: Path,
            timeout_s: float = TIMEOUT_S) -> str:
    p = Proc(name, args, env, cwd, tmp / f"{name}.log")
    run_all([p], timeout_s)
    return p.output()


def listening(port: int) -> bool:
    """A TCP socket listens on `port` (read from /proc: connecting would disturb the
    program's listener)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_listening(proc: Proc, port: int, others: Sequence[Proc], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not listening(port):
        if proc.p.poll() is not None:
            raise AssertionError(report(others, f"{proc.name} exited (rc={proc.p.returncode}) before listening "
                                        f"on port {port}"))
        if time.monotonic() > deadline:
            raise AssertionError(report(others, f"{proc.name} is not listening on port {port} after "
                                        f"{timeout_s:.0f} s"))
        time.sleep(0.05)


def two_peers(program: str, impl: str, tmp: Path, extra: Sequence[str] = ()) -> Dict[str, str]:
    """The target (`--mode target`) listening on a free port, then the initiator."""
    port = vs.free_port()
    env = base_env(impl)
    script = str(EXAMPLES / program)
    procs: List[Proc] = []
    try:
        target = Proc("target", [script, "--mode", "target", "--ip", "127.0.0.1", "--port", str(port), *extra],
                      env, tmp, tmp / "target.log")
        procs.append(target)
        wait_listening(target, port, procs)
        initiator = Proc("initiator", [script, "--ip", "127.0.0.1", "--port", str(port), *extra], env, tmp,
                         tmp / "initiator.log")
        procs.append(initiator)
        run_all(procs)
    finally:
        for p in procs:
            p.kill()
    return {p.name: p.output() for p in procs}


def must_contain(out: str, lines: Sequence[str], what: str, count: Optional[int] = None) -> None:
    for line in lines:
        n = out.count(line)
        ok = n == count if count is not None else n >= 1
        assert ok, f"{what}: {line!r} printed {n} times (expected {count if count is not None else '>= 1'}):\n" \
                   f"{tail(out)}"


# --------------------------------------------------------------------------- examples/python


def test_basic_two_peers(impl, tmp_path):
    out = two_peers("basic_two_peers.py", impl, tmp_path)
    # Its initiator exit()s with status 0 when verification fails: the lines say it passed.
    must_contain(out["initiator"], ["initiator Data verification passed", "Test Complete."], "initiator")
    must_contain(out["target"], ["Waiting for transfer", "Test Complete."], "target")


def test_expanded_two_peers(impl, tmp_path):
    out = two_peers("expanded_two_peers.py", impl, tmp_path)
    must_contain(out["initiator"], ["Ready for transfers", "Initiator final data verification passed",
                                    "Test Complete."], "initiator")
    must_contain(out["target"], ["Target data verification passed (zeros found in last 4 tensors)",
                                 "Test Complete."], "target")


def check_partial_md(out: str) -> None:
    # Both transfers done on both sides; the second descriptor list refused (nixlNotFoundError)
    # before its partial metadata was sent. A transfer error exit()s with status 0.
    must_contain(out, ["Initiator done", "Target done"], "partial_md_example", count=2)
    must_contain(out, ["Correct exception", "Test Complete."], "partial_md_example", count=1)
    assert "Transfer got to Error state" not in out and "Incorrect success" not in out, tail(out)


def test_partial_md_socket(impl, tmp_path):
    init_port = vs.free_port()
    target_port = vs.free_port()
    while target_port == init_port:
        target_port = vs.free_port()
    env = base_env(impl)
    # In socket mode the program does `del os.environ["NIXL_ETCD_ENDPOINTS"]`: it must be set
    # (a KeyError otherwise, with real NIXL too); empty means "no etcd" to NIXL.
    env["NIXL_ETCD_ENDPOINTS"] = ""
    out = run_one("partial_md_example", [str(EXAMPLES / "partial_md_example.py"), "--init-port", str(init_port),
                                         "--target-port", str(target_port)], env, tmp_path, tmp_path)
    must_contain(out, ["NIXL_ETCD_ENDPOINTS is not set, using socket exchange"], "partial_md_example")
    check_partial_md(out)


@pytest.mark.etcd
def test_partial_md_etcd(impl, tmp_path, etcd_endpoint):
    env = base_env(impl)
    env["NIXL_ETCD_ENDPOINTS"] = etcd_endpoint
    # Its agents are always "target" and "initiator" and it leaves their keys behind: one
    # namespace a run.
    env["NIXL_ETCD_NAMESPACE"] = f"/freight-test/nixl-examples/{impl}/{uuid.uuid4().hex}"
    out = run_one("partial_md_example", [str(EXAMPLES / "partial_md_example.py"), "--etcd"], env, tmp_path,
                  tmp_path)
    must_contain(out, [f"NIXL_ETCD_ENDPOINTS is set, using endpoints: {etcd_endpoint}"], "partial_md_example")
    check_partial_md(out)


def test_query_mem_example(impl, tmp_path):
    # It writes files_for_query/ into its working directory (and removes the files).
    out = run_one("query_mem_example", [str(EXAMPLES / "query_mem_example.py")], base_env(impl), tmp_path,
                  tmp_path)
    assert "Skipping example - NIXL bindings not available" not in out, tail(out)
    must_contain(out, ["Created backend: POSIX", "Query results (4 responses):", "Example completed successfully!"],
                 "query_mem_example")
    # Three files of 23 bytes ("Test content for file N"), and the one that does not exist.
    must_contain(out, ["File size: 23 bytes"], "query_mem_example", count=3)
    must_contain(out, ["File does not exist or is not accessible"], "query_mem_example", count=1)


# --------------------------------------------------------------------------- test/python


@pytest.mark.parametrize("mode", ["list", "array"])
def test_prep_xfer_perf(impl, mode, tmp_path):
    # Its sizes are fixed (256 descriptors of 1 KiB): a second or so.
    out = run_one(f"prep_xfer_perf-{mode}", [str(NIXL_TESTS / "prep_xfer_perf.py"), mode], base_env(impl),
                  tmp_path, tmp_path)
    must_contain(out, [f"Starting {mode} test...", "register_memory:", "make_prepped_xfer:"], "prep_xfer_perf")


def test_desc_perf(impl, tmp_path):
    # Fixed size too: 24 * 64 Ki descriptors in one get_xfer_descs.
    out = run_one("desc_perf", [str(NIXL_TESTS / "desc_perf.py")], base_env(impl), tmp_path, tmp_path)
    must_contain(out, ["Time per desc add in us:"], "desc_perf")


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")


@pytest.mark.parametrize("tests", ["test_nixl_api.py", "test_nixl_bindings.py"])
def test_nixl_pytest(impl, tests, tmp_path):
    """NIXL's pytest suite, in a pytest of its own: in its directory so that its conftest.py
    (--backend, default UCX) applies, and with none of freight's configuration (-c /dev/null,
    rootdir and confcutdir there: freight's tests/conftest.py stays out)."""
    made = not (NIXL_TESTS / "files_for_query").exists()
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", ".", "--confcutdir", ".",
            "-rfEs", tests]
    try:
        p = Proc("pytest", args, base_env(impl), NIXL_TESTS, tmp_path / "pytest.log")
        try:
            p.wait(time.monotonic() + 180.0)  # kills it at the deadline (rc None)
        finally:
            p.kill()
        out = p.output()
    finally:
        # test_nixl_bindings.py's test_query_mem leaves files_for_query/ (empty) in its cwd.
        if made:
            try:
                (NIXL_TESTS / "files_for_query").rmdir()
            except OSError:
                pass
    found = _SUMMARY.findall(tail(out, 3))
    counts = {k.rstrip("s") if k.startswith(("error", "warning")) else k: int(n) for n, k in found}
    summary = ", ".join(f"{n} {k}" for n, k in found) or "no summary line"
    skipped = "\n".join(line for line in out.splitlines() if line.startswith("SKIPPED"))
    assert p.rc == 0 and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error"), \
        f"NIXL's {tests} with {impl}: rc={p.rc if p.rc is not None else 'none (killed after 180 s)'}, {summary}\n{tail(out, 120)}"
    print(f"NIXL's {tests} with {impl}: {summary}\n{skipped}")
