"""Python API: metadata exchange through etcd (EtcdDirectory)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import freight
from conftest import Interrupted, free_port
from test_py_transfer import TIMEOUT, Inbox, Target, pattern

def prefix() -> str:
    return f"/freight-test/{uuid.uuid4().hex}/"


@pytest.mark.etcd
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_two_processes_exchange_metadata_through_etcd(spawn, etcd_endpoint, transport):
    p = prefix()
    with freight.EtcdDirectory(etcd_endpoint, prefix=p, ttl=5.0) as directory, \
            freight.Agent("initiator", freight.AgentConfig(require=transport)) as agent:
        inbox = Inbox(agent)
        size = 2 << 20
        src = agent.alloc(size)
        agent.register(src)
        agent.publish_etcd(directory)
        t = Target(spawn, agent, inbox, "target", size, config={"require": transport},
                   etcd={"endpoint": etcd_endpoint, "prefix": p, "initiator": "initiator"})
        assert agent.add_peer_from_etcd(directory, "target", timeout=TIMEOUT) == "target"
        assert directory.list() == ["initiator", "target"]
        assert directory.fetch("target") == t.md
        src[:] = pattern(4, size)
        rid, msg = t.check_msg(0, size, seed=4)
        req = agent.transfer("WRITE", [src], "target", [(t.addr, size, 0)], notif=msg)
        req.wait(TIMEOUT)
        assert req.transport == transport
        assert inbox.reply("target", rid)["ok"]  # the target found us through etcd too
        t.command("fill", off=0, len=size, seed=5)
        back = np.zeros(size, dtype=np.uint8)
        agent.register(back)
        agent.transfer("READ", [back], "target", [(t.addr, size, 0)]).wait(TIMEOUT)
        np.testing.assert_array_equal(back, pattern(5, size))
        t.stop()
        agent.withdraw_etcd(directory)
        assert directory.fetch("initiator") is None


@pytest.mark.etcd
@pytest.mark.timeout(60)
def test_directory_api(etcd_endpoint):
    p = prefix()
    d = freight.EtcdDirectory([etcd_endpoint], prefix=p.rstrip("/"), ttl=3, timeout=5)
    assert d.prefix == p and d.endpoints == [etcd_endpoint] and not d.closed
    assert d.fetch("nobody") is None
    assert d.list() == []
    d.publish("a", b"\x00\x01binary")
    d.publish("b", b"bee")
    assert d.fetch("a") == b"\x00\x01binary"
    assert d.wait_for("b", 1.0) == b"bee"
    assert d.list() == ["a", "b"]
    d.withdraw("a")
    d.withdraw("a")  # absent: no error
    assert d.fetch("a") is None
    with pytest.raises(freight.TimeoutError):
        d.wait_for("never", 0.3)
    with pytest.raises(freight.InvalidArgumentError):
        d.publish("a/b", b"x")
    with pytest.raises(freight.InvalidArgumentError):
        d.fetch("")
    # A second directory sees the first one's entries; closing revokes them.
    with freight.EtcdDirectory(etcd_endpoint, prefix=p) as other:
        assert other.fetch("b") == b"bee"
        d.close()
        assert d.closed
        assert other.fetch("b") is None
    with pytest.raises(freight.InvalidStateError):
        d.fetch("b")
    d.close()  # idempotent


def test_unreachable_etcd_and_bad_arguments():
    """Needs no etcd server."""
    with pytest.raises(freight.EtcdError):
        freight.EtcdDirectory(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    with pytest.raises(freight.InvalidArgumentError):
        freight.EtcdDirectory([], timeout=1.0)
    with pytest.raises(freight.InvalidArgumentError):
        freight.EtcdDirectory("http://127.0.0.1:1", ttl=0.5)
    with pytest.raises(freight.InvalidArgumentError):
        freight.EtcdDirectory("http://127.0.0.1:1", timeout=-1)


@pytest.mark.etcd
@pytest.mark.timeout(30)
def test_ctrl_c_interrupts_a_wait_for_a_name(etcd_endpoint, ctrl_c_soon):
    with freight.EtcdDirectory(etcd_endpoint, prefix=prefix()) as d:
        start = time.monotonic()
        with pytest.raises(Interrupted):
            d.wait_for("never", 20.0)
        assert time.monotonic() - start < 5
        # The directory goes on.
        d.publish("late", b"x")
        assert d.wait_for("late", 1.0) == b"x"
