"""Two hosts on one machine: network namespaces joined by veth pairs
(``scripts/netns.sh``), one pair per NIC. A transfer between a target in one namespace
and an initiator in the other must spread its bytes over both pairs: tcp streams bound
to both local addresses as configured, or as chosen automatically (every NIC on a subnet
of the peer), and fabric rails on both interfaces (libfabric's tcp provider).

Needs root and iproute2; skipped (with the reason) where either is missing.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
from conftest import libfabric_missing

ROOT = pathlib.Path(__file__).resolve().parent.parent
NETNS = ROOT / "scripts" / "netns.sh"
PREFIX = f"ft{os.getpid() % 100000}"
# The target listens beyond loopback: with a token, as such a listener should.
ENV = dict(os.environ, FREIGHT_NETNS=PREFIX, FREIGHT_AGENT_TOKEN="netns-token")


def _why_not() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    probe = f"{PREFIX}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)


def netns(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], env=ENV, capture_output=True, text=True, **kw)


@pytest.fixture
def two_hosts():
    up = netns("up", "2", timeout=60)
    assert up.returncode == 0, up.stderr
    yield
    down = netns("down", timeout=60)
    assert down.returncode == 0, down.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert PREFIX not in listed, "netns.sh down left a namespace behind"


def tx_bytes(side: str) -> dict:
    out = subprocess.run(["ip", "-n", f"{PREFIX}-{side}", "-j", "-s", "link", "show"], check=True,
                         capture_output=True, text=True).stdout
    return {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in json.loads(out) if link["ifname"] != "lo"}


# (initiator options, target options) per way of using both NICs.
WAYS = {
    "tcp, configured NICs": (["--transport", "tcp", "--local-addrs", "10.77.0.1,10.77.1.1"], []),
    "tcp, NICs chosen automatically": (["--transport", "tcp"], []),
    "fabric, one rail per NIC": (
        ["--transport", "fabric", "--fabric-provider", "tcp", "--fabric-domains", f"{PREFIX}a0,{PREFIX}a1",
         "--fabric-chunk-size", "1MiB"],
        ["--fabric-provider", "tcp", "--fabric-domains", f"{PREFIX}b0,{PREFIX}b1"],
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", list(WAYS))
def test_a_transfer_between_namespaces_spreads_over_both_veth_pairs(two_hosts, way):
    if way.startswith("fabric") and libfabric_missing():
        pytest.skip(libfabric_missing())
    initiator_opts, target_opts = WAYS[way]
    freight = [sys.executable, "-m", "freight"]
    target = subprocess.Popen(
        ["bash", str(NETNS), "exec", "b", *freight, "bench", "p2p", "--role", "target", "--listen", "0.0.0.0:7100",
         *target_opts],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = target.stdout.readline()
        assert "10.77.0.2:7100" in line and "10.77.1.2:7100" in line, line
        before = tx_bytes("a")
        run = netns("exec", "a", *freight, "bench", "p2p", "--connect", "10.77.0.2:7100", *initiator_opts,
                    "--streams", "4", "--block-sizes", "4MiB", "--batch-sizes", "1", "--iters", "20", "--json",
                    timeout=90)
        assert run.returncode == 0, run.stdout + run.stderr
        report = json.loads(run.stdout)
        assert all(row["verified"] for row in report["rows"]), report["rows"]
        after = tx_bytes("a")
        sent = {nic: after[nic] - before.get(nic, 0) for nic in after}
        total = sum(sent.values())
        assert total > 25 * (4 << 20), sent  # warm-up, checks and the timed iterations
        for nic, n in sent.items():
            assert n > 0.3 * total, f"{nic} carried {n} of {total} bytes: the streams did not spread over the NICs"
    finally:
        target.kill()
        target.wait(timeout=10)
        time.sleep(0.1)
