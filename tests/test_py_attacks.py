"""Attacks from another process of the same host: real processes, real sockets, real
shared memory. The attacker is tests/hostile_peer.py, which speaks the wire protocol
by hand (as an outsider would have to); its victims are agents (tests/victim_agent.py),
`freight serve` and KV clients.

What must hold:
- a process without the token gets nothing that lets it read or write: no metadata, no
  connection, and a KV client's values stay whole while it tries;
- a peer that offers memory it could pull away (a memfd without seals) is refused, one
  that offers sealed memory cannot shrink it, and the victim lives on, with a clear
  error for that peer only;
- across users (when the tests run as root): the same, with the attacker running as
  another uid, which also cannot open the victim's shared memory itself.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest

import freight
from conftest import free_port, spawn_python
from freight.kv import Client

HERE = Path(__file__).resolve().parent
HOSTILE = HERE / "hostile_peer.py"
VICTIM = HERE / "victim_agent.py"
TOKEN = "s3cret-token"
MIB = 1 << 20


def attack(name: str, user: Optional[int] = None, **args) -> dict:
    """Runs one attack of hostile_peer.py in a process of its own (as `user` where
    given, with the system's python3 from a directory that user may read)."""
    if user is None:
        cmd, kw = [sys.executable, str(HOSTILE)], {}
    else:
        cmd, kw = [SYSTEM_PYTHON, str(_copy_for_others())], {"user": user, "group": user, "extra_groups": [],
                                                               "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}}
    done = subprocess.run([*cmd, name, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120, **kw)
    assert done.returncode == 0, f"the attacker failed: {done.stderr}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if user is not None:
        assert result["uid"] == user, result
    return result


class Victim:
    """An agent in another process (tests/victim_agent.py)."""

    def __init__(self, token: Optional[str]) -> None:
        # Its log goes to a file (read at the end): a pipe read only then could fill.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, str(VICTIM), token or ""], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "FREIGHT_LOG": "warn", "PYTHONUNBUFFERED": "1"})
        line = self.proc.stdout.readline()
        assert line, f"the victim did not start: {self.stderr()}"
        info = json.loads(line)
        self.addr, self.key, self.at, self.len, self.pid = (info[k] for k in ("addr", "key", "at", "len", "pid"))
        self.metadata = bytes.fromhex(info["metadata"])
        stolen = _parse(self.metadata)
        self.agent_id, self.secret = stolen["agent_id"], stolen["secret"]

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def ping(self) -> dict:
        """Its answer: it is alive and its memory is as it was."""
        assert self.proc.poll() is None, f"the victim died ({self.proc.returncode}): {self.stderr()}"
        self.proc.stdin.write("ping\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the victim died ({self.proc.wait(10)}): {self.stderr()}"
        return json.loads(line)

    def alive_and_whole(self) -> None:
        answer = self.ping()
        assert answer["pong"] and answer["memory_whole"], answer

    def segment_fds(self) -> List[int]:
        fds = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                if os.readlink(f"/proc/{self.pid}/fd/{fd}").startswith("/memfd:freight-seg-"):
                    fds.append(int(fd))
            except OSError:
                pass
        return fds

    def close(self) -> str:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        err = self.stderr()
        self.proc.stdout.close()
        self.log.close()
        return err


@pytest.fixture
def victim():
    made = []

    def make(token: Optional[str] = TOKEN) -> Victim:
        v = Victim(token)
        made.append(v)
        return v

    yield make
    for v in made:
        if v.proc.poll() is None:
            v.proc.kill()
            v.proc.wait(timeout=10)


def _parse(metadata: bytes) -> dict:
    sys.path.insert(0, str(HERE))
    import hostile_peer

    return hostile_peer.parse_metadata(metadata)


def listening(pid: int) -> List[str]:
    """The tcp addresses process `pid` listens on (as any process of its user can see)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes:
            ip_hex, port_hex = local.split(":")
            ip = socket.inet_ntoa(struct.pack("<I", int(ip_hex, 16)))
            found.append(f"{'127.0.0.1' if ip == '0.0.0.0' else ip}:{int(port_hex, 16)}")
    return found


# ------------------------------------------------------------------ without the token


@pytest.mark.timeout(120)
def test_a_process_without_the_token_gets_nothing_from_a_guarded_agent(victim):
    v = victim()
    for token in ("", "a-guess"):
        got = attack("metadata", addr=v.addr, token=token)
        assert "stolen" not in got and "requires a token" in got.get("refused", ""), got
    # Even the real secret (metadata leaked some other way: an etcd directory, a log)
    # opens no connection without the token.
    for role in ("control", "data", "fabric"):
        got = attack("hello", addr=v.addr, role=role, agent_id=v.agent_id, secret=v.secret)
        assert not got.get("welcome") and "requires a token" in got.get("refused", ""), (role, got)
    got = attack("read", addr=v.addr, agent_id=v.agent_id, secret=v.secret, region=v.key, at=v.at, len=4096)
    assert not got["connected"], got
    v.alive_and_whole()
    # The token, and the secret, open it; each alone does not.
    got = attack("hello", addr=v.addr, role="control", agent_id=v.agent_id, secret="00" * 16, token=TOKEN)
    assert "wrong secret" in got.get("refused", ""), got
    got = attack("hello", addr=v.addr, role="control", agent_id=v.agent_id, secret=v.secret, token=TOKEN)
    assert got.get("welcome"), got
    v.alive_and_whole()


@pytest.mark.timeout(120)
def test_without_a_token_any_local_process_can_take_an_agents_metadata(victim):
    """What the docs say plainly: an agent without a token hands its metadata, secret
    included, to whoever reaches its listener, and that secret opens every region."""
    v = victim(token=None)
    got = attack("metadata", addr=v.addr)
    assert got["stolen"]["secret"] == v.secret, got
    stolen = got["stolen"]
    read = attack("read", addr=v.addr, agent_id=stolen["agent_id"], secret=stolen["secret"], region=v.key,
                  at=v.at, len=256)
    assert bytes.fromhex(read["read"]) == bytes(i % 251 for i in range(256)), read


def test_a_listener_beyond_loopback_without_a_token_warns_of_the_risk():
    code = ("import freight\n"
            "freight.Agent('exposed', freight.AgentConfig(listen='0.0.0.0:0')).close()\n"
            "freight.Agent('guarded', freight.AgentConfig(listen='0.0.0.0:0', token='t')).close()\n"
            "freight.Agent('local', freight.AgentConfig()).close()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FREIGHT_LOG": "warn"})
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "beyond loopback without a token" in line]
    assert len(warnings) == 1 and "exposed" in warnings[0], done.stderr
    assert "read and write every region" in warnings[0]


# ------------------------------------------------------------------ shared memory


@pytest.mark.timeout(120)
def test_an_outbox_that_could_shrink_is_refused_and_a_sealed_one_cannot(victim):
    """The attack that killed `freight serve` with SIGBUS: offer a notification outbox
    in a memfd of one's own, shrink it once it is mapped, and ring."""
    v = victim()
    got = attack("outbox", addr=v.addr, agent_id=v.agent_id, secret=v.secret, token=TOKEN, sealed=False,
                 shrink=True)
    assert got["connected"] and not got["mapped"], got
    assert "not sealed against shrinking" in got["refusal"], got
    v.alive_and_whole()
    got = attack("outbox", addr=v.addr, agent_id=v.agent_id, secret=v.secret, token=TOKEN, sealed=True,
                 shrink=True)
    assert got["mapped"], got
    assert not got["shrunk"] and got["shrink_error"] == "Operation not permitted", got
    assert got["still_connected"], got
    v.alive_and_whole()
    log = v.close()
    assert "refused a notification outbox" in log and "not sealed" in log, log


ATTACKER_SEGMENT = r"""
import json, os, sys
import numpy as np
import freight

with freight.Agent("swapper", freight.AgentConfig(token=sys.argv[1])) as agent:
    memory = agent.alloc(1 << 20)
    agent.register(memory)
    def segment(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:freight-seg-")
        except OSError:  # the descriptor listdir itself held
            return False
    fds = [int(fd) for fd in os.listdir("/proc/self/fd") if segment(fd)]
    print(json.dumps({"metadata": agent.metadata().hex(), "at": memory.ctypes.data}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "shrink":
            # Every segment of ours: sealed, none can shrink.
            errors = []
            for fd in fds:
                try:
                    os.ftruncate(fd, 0)
                    errors.append(None)
                except OSError as e:
                    errors.append(e.strerror)
            print(json.dumps({"errors": errors}), flush=True)
        elif command == "swap":
            # Each segment's descriptor now names a look-alike: same name, same size, no seals.
            for fd in fds:
                name = os.readlink(f"/proc/self/fd/{fd}")[len("/memfd:"):].split(" ")[0]
                fake = os.memfd_create(name, 0)
                os.ftruncate(fake, os.fstat(fd).st_size)
                os.dup2(fake, fd)
                os.close(fake)
            print(json.dumps({"swapped": len(fds)}), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_segment_that_could_shrink_is_not_written_and_a_sealed_one_cannot_shrink():
    """A peer whose memory this process writes into over shm: its segments cannot be
    shrunk, and segments swapped for look-alikes without seals are refused."""
    peer = spawn_python(ATTACKER_SEGMENT, TOKEN, stdin=True)
    info = json.loads(peer.stdout.readline())
    metadata = bytes.fromhex(info["metadata"])

    def command(c: str) -> dict:
        peer.stdin.write(c + "\n")
        peer.stdin.flush()
        return json.loads(peer.stdout.readline())

    def write(agent: freight.Agent) -> None:
        src = agent.alloc(MIB)
        src[:] = 7
        agent.register(src)
        agent.transfer("WRITE", [src], "swapper", [(info["at"], MIB, 0)]).wait(20)

    with freight.Agent("writer", freight.AgentConfig(require="shm")) as a:
        a.add_peer(metadata, token=TOKEN)
        write(a)
        errors = command("shrink")["errors"]
        assert errors and all(e == "Operation not permitted" for e in errors), errors
        write(a)  # the mapping stands
        assert command("swap")["swapped"] >= 1
        write(a)  # still the mapping of the real segment, made before the swap
    with freight.Agent("late-writer", freight.AgentConfig(require="shm")) as b:
        b.add_peer(metadata, token=TOKEN)
        with pytest.raises(freight.TransportUnavailableError, match="not sealed against shrinking"):
            write(b)
        assert "swapper" in b.peers
    assert peer.poll() is None


# ------------------------------------------------------------------ the KV server and its clients


def _serve(*extra: str):
    port = free_port()
    # Its log goes to a file: a pipe nobody drains would fill and stop the server.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "freight", "serve", "--listen", f"127.0.0.1:{port}", "--memory-mb", "64", *extra],
        stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    proc.log = log
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc, f"http://127.0.0.1:{port}", port
        if not line and proc.poll() is not None:
            break
    proc.kill()
    log.seek(0)
    pytest.fail(f"freight serve did not start: {log.read()}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    proc.stdout.close()
    proc.log.close()


def _siege_kv(server_token: Optional[str], attacker_token: str, user: Optional[int] = None) -> None:
    """A client GETs values over and over and checks each, while the attacker besieges
    the client's and the server's data-plane listeners."""
    extra = ("--token", server_token) if server_token else ()
    proc, url, port = _serve(*extra)
    try:
        with Client(url, token=server_token, buffer_size=4 * MIB, timeout=10.0) as c:
            values = {f"k{i}": np.frombuffer(os.urandom(64 << 10), np.uint8) for i in range(8)}
            for k, v in values.items():
                c.put(k, v)
            targets = c.engine_addresses + [a for a in listening(proc.pid) if not a.endswith(f":{port}")]
            assert len(targets) >= 2, targets
            stop, gets, bad = threading.Event(), [0], [0]

            def read() -> None:
                while not stop.is_set():
                    for k, v in values.items():
                        got = c.get(k)
                        gets[0] += 1
                        if got != v.tobytes():
                            bad[0] += 1

            reader = threading.Thread(target=read)
            reader.start()
            try:
                tally = attack("siege", user=user, addrs=targets, seconds=4, token=attacker_token)
            finally:
                stop.set()
                reader.join(timeout=30)
            assert tally["attempts"] > 0, tally
            assert (tally["metadata"], tally["welcomed"], tally["written"]) == (0, 0, 0), tally
            assert gets[0] > 0 and bad[0] == 0, (gets, bad)
            assert c.get("k0") == values["k0"].tobytes()
    finally:
        _stop(proc)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("server_token,attacker_token", [(TOKEN, ""), (TOKEN, TOKEN), (None, "")],
                         ids=["token-attacker-without", "token-attacker-with-it", "no-token"])
def test_the_kv_data_plane_gives_a_stranger_nothing_and_values_stay_whole(server_token, attacker_token):
    """The KV server's and clients' agents serve no metadata on their listeners (it
    travels over the control plane), so a stranger, even one that knows the server's
    token, cannot learn the secret that would open the client's receive buffer."""
    _siege_kv(server_token, attacker_token)


# ------------------------------------------------------------------ another user

SYSTEM_PYTHON = "/usr/bin/python3"
OTHER_UID = 65534


def _cross_user_missing() -> str:
    if os.geteuid() != 0:
        return "the cross-user attacks run only as root (to start the attacker as another uid)"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"no {SYSTEM_PYTHON} for the attacker to run as another user"
    return ""


_shared_dir: List[Path] = []


def _copy_for_others() -> Path:
    """hostile_peer.py where another user can read it (the checkout may not be)."""
    if not _shared_dir:
        d = Path(tempfile.mkdtemp(prefix="freight-attacker-"))
        os.chmod(d, 0o755)
        shutil.copy(HOSTILE, d / "hostile_peer.py")
        os.chmod(d / "hostile_peer.py", 0o644)
        _shared_dir.append(d)
    return _shared_dir[0] / "hostile_peer.py"


cross_user = pytest.mark.skipif(bool(_cross_user_missing()), reason=_cross_user_missing() or "runs")


@cross_user
@pytest.mark.timeout(180)
def test_another_user_cannot_crash_read_or_write_an_agent(victim):
    v = victim()
    got = attack("metadata", user=OTHER_UID, addr=v.addr)
    assert "requires a token" in got.get("refused", ""), got
    got = attack("hello", user=OTHER_UID, addr=v.addr, role="control", agent_id=v.agent_id, secret=v.secret)
    assert "requires a token" in got.get("refused", ""), got
    # Its own way into the victim's memory, around the agent: the kernel says no.
    fds = v.segment_fds()
    assert fds
    for fd in fds:
        got = attack("map", user=OTHER_UID, pid=v.pid, fd=fd)
        assert not got["opened"] and got["error"] == "Permission denied", got
    # Given the token (a peer of another user): memory it could pull away is refused,
    # memory it cannot is mapped and cannot shrink.
    got = attack("outbox", user=OTHER_UID, addr=v.addr, agent_id=v.agent_id, secret=v.secret, token=TOKEN,
                 sealed=False, shrink=True)
    assert not got["mapped"] and "not sealed" in got["refusal"], got
    got = attack("outbox", user=OTHER_UID, addr=v.addr, agent_id=v.agent_id, secret=v.secret, token=TOKEN,
                 sealed=True, shrink=True)
    assert got["mapped"] and not got["shrunk"] and got["still_connected"], got
    # ...and reaches what the owner registered, as over tcp, and nothing else.
    got = attack("read", user=OTHER_UID, addr=v.addr, agent_id=v.agent_id, secret=v.secret, token=TOKEN,
                 region=v.key, at=v.at, len=256)
    assert bytes.fromhex(got["read"]) == bytes(i % 251 for i in range(256)), got
    got = attack("read", user=OTHER_UID, addr=v.addr, agent_id=v.agent_id, secret=v.secret, token=TOKEN,
                 region=v.key, at=v.at + v.len - 128, len=256)
    assert "refusal" in got and "out of bounds" in got["refusal"], got
    v.alive_and_whole()


@cross_user
@pytest.mark.timeout(180)
def test_another_user_without_the_token_gets_nothing_from_freight_serve():
    _siege_kv(TOKEN, "", user=OTHER_UID)
