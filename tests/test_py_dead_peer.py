"""Python API: peers that die or hang fail requests (no hang); the initiator carries on
with other peers and with a restarted target."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import freight
from test_py_transfer import TIMEOUT, Inbox, Target, pattern, sha

PEER_TIMEOUT = 2.0


def wait_outcome(req: freight.Request) -> str:
    """'done' or 'disconnected'; anything else (including a hang) fails the test."""
    try:
        req.wait(TIMEOUT)
        return "done"
    except freight.PeerDisconnectedError as e:
        assert isinstance(e, ConnectionError) and e.peer == "victim"
        return "disconnected"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_killed_target_fails_requests_and_can_be_replaced(spawn, transport):
    config = freight.AgentConfig(require=transport, peer_timeout=PEER_TIMEOUT)
    with freight.Agent("initiator", config) as agent:
        inbox = Inbox(agent)
        size = 8 << 20
        target_config = {"require": transport, "peer_timeout": PEER_TIMEOUT}
        victim = Target(spawn, agent, inbox, "victim", size, config=target_config)
        survivor = Target(spawn, agent, inbox, "survivor", size, config=target_config)
        victim.add()
        survivor.add()
        src = agent.alloc(size)
        agent.register(src)
        src[:] = pattern(1, size)
        for t in (victim, survivor):
            agent.transfer("WRITE", [src], t.name, [(t.addr, size, 0)]).wait(TIMEOUT)
            assert t.sha256() == sha(src)

        # Requests in flight while the target is killed: each finishes or fails with
        # PeerDisconnectedError, none hangs.
        in_flight = [
            agent.transfer("WRITE", [src], "victim", [(victim.addr, size, 0)]) for _ in range(8)
        ]
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait(timeout=TIMEOUT)
        outcomes = [wait_outcome(r) for r in in_flight]
        assert set(outcomes) <= {"done", "disconnected"}

        # New requests fail too, once the death is noticed (bounded, no timing asserted).
        failed = False
        for _ in range(200):
            try:
                req = agent.transfer("WRITE", [src[:4096]], "victim", [(victim.addr, 4096, 0)])
            except freight.PeerDisconnectedError:
                failed = True
                break
            if wait_outcome(req) == "disconnected":
                failed = True
                break
            time.sleep(0.05)
        assert failed, "requests to a killed peer kept succeeding"
        with pytest.raises(freight.PeerDisconnectedError):
            agent.transfer("WRITE", [src[:4096]], "victim", [(victim.addr, 4096, 0)]).wait(TIMEOUT)
        with pytest.raises(freight.PeerDisconnectedError):
            agent.notify("victim", b"anyone there?")

        # The other peer is unaffected.
        src[:] = pattern(2, size)
        agent.transfer("WRITE", [src], "survivor", [(survivor.addr, size, 0)]).wait(TIMEOUT)
        assert survivor.sha256() == sha(src)

        # A restarted target (new process, new metadata, same name) replaces the dead one.
        reborn = Target(spawn, agent, inbox, "victim", size, config=target_config)
        assert reborn.pid != victim.pid
        reborn.add()
        assert agent.peers == ["survivor", "victim"]
        src[:] = pattern(3, size)
        rid, msg = reborn.check_msg(0, size, seed=3)
        agent.transfer("WRITE", [src], "victim", [(reborn.addr, size, 0)], notif=msg).wait(TIMEOUT)
        assert inbox.reply("victim", rid)["ok"]
        back = np.zeros(size, dtype=np.uint8)
        agent.register(back)
        agent.transfer("READ", [back], "victim", [(reborn.addr, size, 0)]).wait(TIMEOUT)
        np.testing.assert_array_equal(back, pattern(3, size))
        reborn.stop()
        survivor.stop()


@pytest.mark.timeout(120)
def test_hung_target_fails_within_peer_timeout(spawn):
    """A target that stops answering (SIGSTOP) fails in-flight tcp requests with
    PeerDisconnectedError once peer_timeout passes, instead of hanging."""
    config = freight.AgentConfig(require="tcp", peer_timeout=PEER_TIMEOUT)
    with freight.Agent("initiator", config) as agent:
        inbox = Inbox(agent)
        size = 64 << 20
        t = Target(spawn, agent, inbox, "victim", size)
        t.add()
        src = np.zeros(size, dtype=np.uint8)
        agent.register(src)
        agent.transfer("WRITE", [src[:4096]], "victim", [(t.addr, 4096, 0)]).wait(TIMEOUT)
        os.kill(t.pid, signal.SIGSTOP)
        try:
            req = agent.transfer("WRITE", [src], "victim", [(t.addr, size, 0)])
            with pytest.raises(freight.PeerDisconnectedError):
                req.wait(TIMEOUT)
            assert req.status() == "ERROR" and isinstance(req.error, freight.PeerDisconnectedError)
        finally:
            os.kill(t.pid, signal.SIGKILL)
        # Removing the peer is allowed, and it is then unknown.
        agent.remove_peer("victim")
        with pytest.raises(freight.UnknownPeerError):
            agent.transfer("WRITE", [src[:16]], "victim", [(t.addr, 16, 0)])
