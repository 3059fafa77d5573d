"""Notifications to a same-host peer through the shared-memory outbox (docs/engine.md,
"Notifications"): order, a full ring, wake-ups of a sleeping target, dead targets.

The target runs in its own process. It prints one JSON line (metadata, buffer address,
pid), then obeys commands on stdin, one JSON object per line, answering each on stdout:
    {"op": "collect", "count", "timeout"} -> {"notifs": [[peer, msg], ...]}: polls
                                             get_notifs until `count` arrived
    {"op": "wait", "timeout"}             -> {"notifs": ..., "elapsed": s, "at": t}: one
                                             wait_notifs, returned at monotonic time t
    {"op": "sleep", "seconds"}            -> {}: neither polls nor waits meanwhile
    {"op": "exit"}
It logs the engine's inbox at debug level on stderr, so that tests can tell which path
the notifications took.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

import freight
from test_py_transfer import TIMEOUT, readline

TARGET = r"""
import json, os, sys, time
import freight

args = json.loads(sys.argv[1])
agent = freight.Agent(args["name"], freight.AgentConfig(**args.get("config", {})))
buf = agent.alloc(1 << 20)
agent.register(buf)
print(json.dumps({"md": agent.metadata().hex(), "addr": int(buf.ctypes.data), "pid": os.getpid()}), flush=True)

def text(notifs):
    return [[peer, msg.decode()] for peer, msg in notifs]

for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "exit":
        break
    if op == "collect":
        got, deadline = [], time.monotonic() + cmd["timeout"]
        while len(got) < cmd["count"] and time.monotonic() < deadline:
            got.extend(text(agent.get_notifs()))
        reply = {"notifs": got}
    elif op == "wait":
        t = time.monotonic()
        got = agent.wait_notifs(cmd["timeout"])
        reply = {"notifs": text(got), "elapsed": time.monotonic() - t, "at": time.monotonic()}
    elif op == "sleep":
        time.sleep(cmd["seconds"])
        reply = {}
    print(json.dumps(reply), flush=True)
agent.close()
"""

# The engine's ring holds 1 MiB of records; a 1000-byte notification takes 1008 bytes.
RING_BYTES = 1 << 20
OUTBOX_LOG = "reading notifications from the sender's outbox"


class Target:
    def __init__(self, spawn, name: str = "target", **config: Any) -> None:
        env = dict(os.environ, FREIGHT_LOG="freight_core::inbox=debug,warn")
        self.proc = spawn(TARGET, json.dumps({"name": name, "config": config}), env=env, stdin=True)
        info = json.loads(readline(self.proc))
        self.name, self.md, self.addr, self.pid = name, bytes.fromhex(info["md"]), info["addr"], info["pid"]

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = TIMEOUT) -> Dict[str, Any]:
        return json.loads(readline(self.proc, timeout))

    def command(self, **cmd: Any) -> Dict[str, Any]:
        self.send(**cmd)
        return self.reply()

    def collect(self, count: int, timeout: float = TIMEOUT) -> List[List[str]]:
        return self.command(op="collect", count=count, timeout=timeout)["notifs"]

    def stderr(self) -> str:
        """Everything the target logged (it must have exited)."""
        return self.proc.stderr.read()

    def exit(self) -> str:
        self.send(op="exit")
        self.proc.wait(timeout=TIMEOUT)
        return self.stderr()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + TIMEOUT
    while not stopped(pid):
        assert time.monotonic() < deadline, "the target did not stop"
        time.sleep(0.01)


class Sender(threading.Thread):
    """Sends notifications from a thread, counting them, so that a blocked call can be
    watched; `error` is what the first failure raised."""

    def __init__(self, agent: freight.Agent, peer: str, msgs: List[bytes]) -> None:
        super().__init__(daemon=True)
        self.agent, self.peer, self.msgs = agent, peer, msgs
        self.sent = 0
        self.error: Optional[BaseException] = None
        self.failed_after: Optional[float] = None

    def run(self) -> None:
        start = time.monotonic()
        try:
            for m in self.msgs:
                self.agent.notify(self.peer, m)
                self.sent += 1
        except Exception as e:  # the tests look at which
            self.error = e
            self.failed_after = time.monotonic() - start


@pytest.mark.timeout(180)
def test_transfer_and_standalone_notifications_arrive_once_and_in_order(spawn):
    with freight.Agent("initiator") as agent:
        t = Target(spawn)
        agent.add_peer(t.md)
        src = agent.alloc(4096)
        agent.register(src)
        local = agent.prepare_local([src])
        remote = agent.prepare_remote(t.name, [(t.addr, 4096, 0)])
        reqs = [agent.make_request("WRITE", local, None, remote, None, notif=f"{i}:t".encode())
                for i in range(0, 2000, 3)]
        expected = []
        for i in range(2000):
            if i % 3 == 0:
                req = reqs[i // 3]
                assert req.transport == "shm"
                req.post()
                req.wait(TIMEOUT)
                expected.append(f"{i}:t")
            else:
                agent.notify(t.name, f"{i}:n".encode())
                expected.append(f"{i}:n")
        got = t.collect(2000)
        assert [p for p, _ in got] == ["initiator"] * len(got), "every notification names its sender"
        msgs = [m for _, m in got]
        assert len(msgs) == 2000, f"{len(msgs)} of 2000 arrived"
        assert msgs == expected
        # Exactly once: nothing more comes.
        assert t.command(op="wait", timeout=0.3)["notifs"] == []
        log = t.exit()
        assert OUTBOX_LOG in log, f"the notifications did not go through the outbox:\n{log}"


@pytest.mark.timeout(180)
def test_more_than_the_ring_holds_reaches_a_target_that_polls_only_later(spawn):
    with freight.Agent("initiator") as agent:
        t = Target(spawn)
        agent.add_peer(t.md)
        # The target is busy with something else: its connection thread drains the ring
        # into the queue on every wake-up, so nothing waits for it.
        t.send(op="sleep", seconds=1.0)
        msgs = [f"{i:06d}:".encode().ljust(1000, b"x") for i in range(3 * RING_BYTES // 1000)]
        for m in msgs:
            agent.notify(t.name, m)
        assert t.reply() == {}
        got = t.collect(len(msgs))
        assert [m.encode() for _, m in got] == msgs

        # The target stopped altogether: the ring fills and the sender waits for room
        # (while over tcp the kernel's buffers would take more), then goes on once the
        # target runs again. Everything arrives, in order.
        stop(t.pid)
        try:
            sender = Sender(agent, t.name, msgs)
            sender.start()
            time.sleep(1.5)
            held = sender.sent
            assert sender.is_alive() and sender.error is None
            assert 0 < held <= RING_BYTES // 1008 + 1, f"{held} notifications sent while the target was stopped"
        finally:
            os.kill(t.pid, signal.SIGCONT)
        sender.join(TIMEOUT)
        assert not sender.is_alive() and sender.error is None, sender.error
        got = t.collect(len(msgs))
        assert [m.encode() for _, m in got] == msgs
        t.exit()


@pytest.mark.timeout(120)
def test_a_target_asleep_in_wait_notifs_wakes_at_once(spawn):
    with freight.Agent("initiator") as agent:
        t = Target(spawn)
        agent.add_peer(t.md)
        # The first notification sets the outbox up; the later ones find it drained, with
        # the target asleep again, and must ring.
        delays = []
        for i in range(15):
            t.send(op="wait", timeout=10)
            # Let it fall asleep. Python's wait_notifs also looks every 100 ms (for
            # Ctrl-C): a random phase, so that those looks alone would take 50 ms on average.
            time.sleep(0.15 + random.random() * 0.1)
            sent = time.monotonic()  # one clock for every process of the host
            agent.notify(t.name, f"wake {i}".encode())
            r = t.reply()
            assert r["notifs"] == [["initiator", f"wake {i}"]]
            assert r["elapsed"] < 10.0 and r["at"] - sent < 2.0, f"round {i}: woke {r['at'] - sent:.3f} s after"
            delays.append(r["at"] - sent)
        median = sorted(delays)[len(delays) // 2]
        assert median < 0.02, f"woken after {median * 1e3:.1f} ms (median); all: {delays}"
        assert OUTBOX_LOG in t.exit()


@pytest.mark.timeout(120)
def test_a_stopped_target_fails_notifications_with_a_timeout(spawn):
    config = freight.AgentConfig(peer_timeout=2.0)
    with freight.Agent("initiator", config) as agent:
        t = Target(spawn, name="sleeper")
        agent.add_peer(t.md)
        agent.notify(t.name, b"hello")
        assert t.collect(1) == [["initiator", "hello"]]
        stop(t.pid)
        try:
            sender = Sender(agent, t.name, [b"y" * 1000] * (2 * RING_BYTES // 1000))
            sender.start()
            sender.join(TIMEOUT)
            assert not sender.is_alive(), "the sender hangs on a full ring"
            assert isinstance(sender.error, freight.TimeoutError), repr(sender.error)
            assert "sleeper" in str(sender.error)
            assert 2.0 <= sender.failed_after < 10.0
        finally:
            os.kill(t.pid, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_a_killed_target_fails_notifications_quickly(spawn):
    config = freight.AgentConfig(peer_timeout=20.0)
    with freight.Agent("initiator", config) as agent:
        t = Target(spawn, name="victim")
        agent.add_peer(t.md)
        agent.notify(t.name, b"hello")
        assert t.collect(1) == [["initiator", "hello"]]

        # Killed while the sender waits for room in a full ring: the sender learns of
        # the death from the control connection, long before peer_timeout.
        stop(t.pid)
        sender = Sender(agent, t.name, [b"z" * 1000] * (2 * RING_BYTES // 1000))
        sender.start()
        time.sleep(0.5)
        assert sender.is_alive()
        os.kill(t.pid, signal.SIGKILL)
        t.proc.wait(timeout=TIMEOUT)
        sender.join(TIMEOUT)
        assert not sender.is_alive()
        assert isinstance(sender.error, freight.PeerDisconnectedError), repr(sender.error)
        assert sender.error.peer == "victim"
        assert sender.failed_after < 10.0

        # Later notifications and transfers with one fail at once, naming the peer.
        start = time.monotonic()
        with pytest.raises(freight.PeerDisconnectedError):
            agent.notify(t.name, b"anyone?")
        assert time.monotonic() - start < 1.0
