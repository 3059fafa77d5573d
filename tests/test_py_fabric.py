"""The fabric transport between two real processes, chosen the way deployments switch
backends: FREIGHT_TRANSPORT=fabric and FREIGHT_FABRIC_PROVIDER, with libfabric's tcp
and shm providers (Debian's libfabric1; no RDMA hardware needed). Skipped where libfabric
is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import freight
from conftest import libfabric_missing


pytestmark = pytest.mark.skipif(bool(libfabric_missing()), reason=libfabric_missing() or "libfabric loads")

ENV = {"FREIGHT_TRANSPORT": "fabric", "FREIGHT_FABRIC_PROVIDER": "tcp", "FREIGHT_FABRIC_DOMAINS": "lo"}
SIZE = 8 << 20

# The target: host memory that is not in a shared segment, filled with seed 2; checks
# what arrived when the write's notification comes.
TARGET = r"""
import json, sys, numpy as np, freight
size = int(sys.argv[1])
agent = freight.Agent("target")
buf = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
agent.register(buf)
print(json.dumps({"listen": agent.addresses[0], "addr": buf.ctypes.data}), flush=True)
expected = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
while True:
    for sender, msg in agent.wait_notifs(30):
        if msg == b"bye":
            raise SystemExit(0)
        blocks = json.loads(msg)
        ok = all(np.array_equal(buf[o:o + n], expected[s:s + n]) for s, o, n in blocks)
        print(json.dumps({"ok": ok}), flush=True)
"""


@pytest.fixture
def fabric_env(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


# The name each provider goes by in path reasons.
PROVIDER_NAMES = {"tcp": "tcp;ofi_rxm", "shm": "shm"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
@pytest.mark.parametrize("docked", [False, True], ids=["direct", "through-the-peers-docks"])
def test_a_write_and_a_read_across_processes(fabric_env, monkeypatch, provider, docked):
    """Direct one-sided operations, and the same through the landing buffers the target
    lends (the way its GPU memory goes), here forced for its host memory. The shm
    provider's addresses are strings that hold the process id, so two processes' differ
    in length when their ids do."""
    monkeypatch.setenv("FREIGHT_FABRIC_PROVIDER", provider)
    if provider == "shm":
        monkeypatch.delenv("FREIGHT_FABRIC_DOMAINS")
    target = subprocess.Popen([sys.executable, "-c", TARGET, str(SIZE)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ))
    try:
        hello = json.loads(target.stdout.readline())
        agent = freight.Agent("initiator", freight.AgentConfig(fabric_stage_remote_host=docked))
        assert agent.connect(hello["listen"]) == "target"
        path = agent.path_to("target")
        assert path.transport == "fabric", path
        assert path.reason.startswith("required by FREIGHT_TRANSPORT=fabric"), path
        assert f"provider {PROVIDER_NAMES[provider]}," in path.reason, path

        src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
        agent.register(src)
        # Blocks of odd sizes to odd places, in an order of their own; the notification
        # names them, and the target checks them as soon as it arrives.
        blocks = [(0, 5 << 20, 1), (6 << 20, 7, (6 << 20) + 4113), (7 << 20, 1 << 20, (5 << 20) + 64)]
        local = freight.DescList([(src.ctypes.data + s, n, 0) for s, n, _ in blocks])
        remote = freight.DescList([(hello["addr"] + o, n, 0) for _, n, o in blocks])
        msg = json.dumps([[s, o, n] for s, n, o in blocks]).encode()
        req = agent.transfer("WRITE", local, "target", remote, notif=msg)
        assert req.wait(60) is None and req.transport == "fabric"
        assert json.loads(target.stdout.readline()) == {"ok": True}

        back = np.zeros(SIZE, dtype=np.uint8)
        agent.register(back)
        agent.transfer("READ", freight.DescList([back]), "target", freight.DescList([(hello["addr"], SIZE, 0)])).wait(60)
        expected = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
        for s, n, o in blocks:
            expected[o:o + n] = src[s:s + n]
        np.testing.assert_array_equal(back, expected)
        # The exchange, and the relay to the docks where they were used.
        conns = agent.connection_stats("target")
        assert (conns["fabric_connections"], conns["tcp_connections"]) == (2 if docked else 1, 0), conns
        agent.notify("target", b"bye")
        assert target.wait(30) == 0
    finally:
        target.kill()


def test_a_provider_that_does_not_exist_is_refused_at_start(fabric_env, monkeypatch):
    monkeypatch.setenv("FREIGHT_FABRIC_PROVIDER", "no-such-provider")
    with pytest.raises(freight.TransportUnavailableError, match="no-such-provider"):
        freight.Agent("a")
    # Named but not required: the agent starts without fabric and says why in path_to.
    monkeypatch.delenv("FREIGHT_TRANSPORT")
    cfg = freight.AgentConfig(transports=("fabric", "tcp"))
    a, b = freight.Agent("a", cfg), freight.Agent("b", cfg)
    buf = b.alloc(4096)
    b.register(buf)
    a.add_peer(b.metadata())
    path = a.path_to("b")
    assert path.transport == "tcp" and "fabric: the peer does not serve it" in path.reason, path


def test_registering_gpu_memory_with_the_provider_can_be_turned_off(fabric_env, monkeypatch):
    """fabric_gpu_direct (and FREIGHT_FABRIC_GPU_DIRECT, which overrides it) are checked:
    a value that is not a bool, or an environment value that means neither on nor off,
    is refused by name; a good one starts the agent."""
    with pytest.raises(TypeError, match="fabric_gpu_direct must be a bool"):
        freight.AgentConfig(fabric_gpu_direct="no")
    monkeypatch.setenv("FREIGHT_FABRIC_GPU_DIRECT", "maybe")
    with pytest.raises(freight.InvalidArgumentError, match="FREIGHT_FABRIC_GPU_DIRECT='maybe'"):
        freight.Agent("a")
    for value in ("0", "off", "1"):
        monkeypatch.setenv("FREIGHT_FABRIC_GPU_DIRECT", value)
        with freight.Agent("a", freight.AgentConfig(fabric_gpu_direct=False)) as a, freight.Agent("b") as b:
            a.add_peer(b.metadata())
            assert a.path_to("b").transport == "fabric"
