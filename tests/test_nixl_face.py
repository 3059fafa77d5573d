"""freight's NIXL face (freight.nixl): NIXL's API on freight's engine.

In-process checks of the API's behaviour and errors, then real processes: a target
serving its metadata on a listener port, initiators fetching it (with and without the
token), a hostile client on that port, a target that dies mid-transfer, etcd, and the
alias that makes ``import nixl`` land here. NIXL's own examples and tests run in
tests/test_nixl_examples.py.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import freight
from freight import nixl
from freight.nixl import _bindings as nb
from freight.nixl import _utils

from conftest import free_port
from gpu_env import needs_gpu, torch  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 30.0


def agent(**cfg) -> nixl.nixl_agent:
    return nixl.nixl_agent(f"t-{uuid.uuid4().hex[:8]}", nixl.nixl_agent_config(**cfg))


def wait_state(a, h, timeout: float = TIMEOUT) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = a.check_xfer_state(h)
        if state != "PROC":
            return state
        time.sleep(0.001)
    raise AssertionError("transfer still in progress after the timeout")


@pytest.fixture
def pair():
    a, b = agent(), agent()
    src, dst = np.arange(1 << 16, dtype=np.uint32).view(np.uint8).copy(), np.zeros(1 << 18, np.uint8)
    ra = a.register_memory([(src.ctypes.data, src.nbytes, 0, "src")], "DRAM")
    rb = b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "dst")], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    b.add_remote_agent(a.get_agent_metadata())
    yield a, b, src, dst
    a.deregister_memory(ra)
    b.deregister_memory(rb)


# --------------------------------------------------------------------------- transfers


def test_initialize_transfer_and_notify_write_then_read_back(pair):
    a, b, src, dst = pair
    local = a.get_xfer_descs([(src.ctypes.data, 1024, 0), (src.ctypes.data + 1024, src.nbytes - 1024, 0)], "DRAM")
    remote = a.get_xfer_descs(np.array([[dst.ctypes.data, src.nbytes, 0]], dtype=np.uint64), "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, b.name, b"written")
    assert a.transfer(h) in ("DONE", "PROC")
    assert wait_state(a, h) == "DONE"
    assert np.array_equal(dst[:src.nbytes], src)
    end = time.monotonic() + TIMEOUT
    while not b.check_remote_xfer_done(a.name, b"writ"):  # a prefix of the message
        assert time.monotonic() < end
    assert b.get_new_notifs() == {}  # consumed
    # The same request again with this round's own message.
    assert a.transfer(h, b"second") in ("DONE", "PROC") and wait_state(a, h) == "DONE"
    end = time.monotonic() + TIMEOUT
    while not b.check_remote_xfer_done(a.name, b"cond", tag_is_prefix=False):
        assert time.monotonic() < end
    a.release_xfer_handle(h)

    back = np.zeros_like(src)
    a.register_memory(back)  # a numpy array registers whole
    h = a.initialize_xfer("READ", a.get_xfer_descs([(back.ctypes.data, back.nbytes, 0)], "DRAM"), remote, b.name)
    a.transfer(h)
    assert wait_state(a, h) == "DONE" and np.array_equal(back, src)
    a.release_xfer_handle(h)


def test_prepared_lists_strided_rows_and_loopback(pair):
    a, b, src, dst = pair
    block, count = 256, 64
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[src.ctypes.data, block, 0, block * 2, count]],
                                                          dtype=np.uint64), "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(dst.ctypes.data + i * block, block, 0) for i in range(count)], "DRAM")
    idx = np.arange(count, dtype=np.int32)
    h = a.make_prepped_xfer("WRITE", local, idx, remote, idx[::-1].copy(), b"")
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    for i in range(count):  # source block i (every other block) lands at count-1-i
        j = count - 1 - i
        assert np.array_equal(dst[j * block:(j + 1) * block], src[2 * i * block:(2 * i + 1) * block]), i
    # Loopback: the agent's own name as the remote side.
    mine = np.zeros(block * count, np.uint8)
    reg = a.register_memory([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM")
    loop = a.prep_xfer_dlist(a.name, [(mine.ctypes.data, mine.nbytes, 0)], "DRAM")
    whole = a.prep_xfer_dlist("", [(src.ctypes.data, mine.nbytes, 0)], "DRAM")
    h2 = a.make_prepped_xfer("WRITE", whole, [0], loop, [0])
    a.transfer(h2)
    assert wait_state(a, h2) == "DONE" and np.array_equal(mine, src[:mine.nbytes])
    for handle in (h, h2):
        a.release_xfer_handle(handle)
    for d in (local, remote, loop, whole):
        a.release_dlist_handle(d)
    a.deregister_memory(reg)


def test_telemetry_follows_the_config_and_nixls_environment_variable(monkeypatch, pair):
    _, b, src, dst = pair

    def one_transfer(**cfg):
        c = agent(**cfg)
        c.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        c.add_remote_agent(b.get_agent_metadata())
        h = c.initialize_xfer("WRITE", c.get_xfer_descs([(src.ctypes.data, 2048, 0),
                                                         (src.ctypes.data + 2048, 2048, 0)], "DRAM"),
                              c.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), b.name)
        c.transfer(h)
        assert wait_state(c, h) == "DONE"
        return c, h

    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    c, h = one_transfer()
    with pytest.raises(nb.nixlNoTelemetryError, match="capture_telemetry=True"):
        c.get_xfer_telemetry(h)
    c, h = one_transfer(capture_telemetry=True)
    t = c.get_xfer_telemetry(h)
    assert (t.totalBytes, t.descCount) == (4096, 2)
    assert t.startTime > 1.7e15 and t.postDuration > 0 and t.xferDuration >= t.postDuration
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "no")  # the variable wins over the config
    c, h = one_transfer(capture_telemetry=True)
    with pytest.raises(nb.nixlNoTelemetryError):
        c.get_xfer_telemetry(h)
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    c, h = one_transfer()
    assert c.get_xfer_telemetry(h).totalBytes == 4096


# --------------------------------------------------------------------------- errors


def test_backends_freight_lacks_are_refused_naming_them_and_unknown_ones_are_not_found():
    a = agent(backends=[])
    assert a.get_plugin_list() == ["UCX", "LIBFABRIC", "POSIX"]
    with pytest.raises(nb.nixlNotSupportedError, match="GPUDirect Storage"):
        a.create_backend("GDS")
    with pytest.raises(nb.nixlNotSupportedError, match="object stores"):
        agent(backends=["UCX", "OBJ"])
    with pytest.raises(nb.nixlNotFoundError, match="UVX"):
        a.create_backend("UVX")
    assert agent(backends=["UVX"]).backends == {}  # NIXL skips a missing plugin, warning
    with pytest.raises(nb.nixlNotFoundError, match="no backend"):
        a.register_memory([(1, 1, 0, "")], "DRAM")


def test_errors_are_nixls_with_freights_as_their_cause(pair):
    a, b, src, dst = pair
    with pytest.raises(nb.nixlNotFoundError) as e:
        a.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data, 16, 0)], "DRAM")  # b's memory, not a's
    assert isinstance(e.value.__cause__, freight.NotRegisteredError)
    with pytest.raises(nb.nixlNotFoundError, match="knows no remote agent 'nobody'"):
        a.prep_xfer_dlist("nobody", [(1, 1, 0)], "DRAM")
    with pytest.raises(nb.nixlNotFoundError) as e:
        a.prep_xfer_dlist(b.name, [(dst.ctypes.data + dst.nbytes - 8, 16, 0)], "DRAM")  # past its end
    assert isinstance(e.value.__cause__, freight.FreightError)
    with pytest.raises(nb.nixlInvalidParamError, match="already registered"):
        a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    with pytest.raises(nb.nixlNotFoundError, match="not registered"):
        a.deregister_memory(a.get_reg_descs([(src.ctypes.data, 8, 0, "")], "DRAM"))
    with pytest.raises(nb.nixlNotSupportedError, match="BLK_SEG"):
        a.register_memory([(src.ctypes.data, 8, 0, "")], "BLOCK")
    with pytest.raises(KeyError):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    local = a.prep_xfer_dlist("", [(src.ctypes.data, 64, 0)], "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(dst.ctypes.data, 32, 0)], "DRAM")
    with pytest.raises(nb.nixlInvalidParamError):  # 64 bytes against 32
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(nb.nixlInvalidParamError, match="local side must be"):
        a.make_prepped_xfer("WRITE", remote, [0], local, [0])
    with pytest.raises(ValueError, match="must hold integers"):
        a.make_prepped_xfer("WRITE", local, np.array([0.0]), remote, [0])
    with pytest.raises(ValueError, match="1-D"):
        a.make_prepped_xfer("WRITE", local, np.zeros((1, 1), np.int32), remote, [0])
    a.release_dlist_handle(local)
    with pytest.raises(nb.nixlInvalidParamError, match="released already"):
        a.agent.releasedDlistH(local._handle)  # where NIXL would use freed memory
    with pytest.raises(nb.nixlNotFoundError):
        a.send_notif("nobody", b"x")
    assert a.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None and a.get_reg_descs([(1, 2, 3)], "DRAM") is None
    with pytest.raises(ValueError):
        nixl.nixl_agent("")


def test_metadata_that_is_not_an_agents_is_refused_and_changes_nothing(pair):
    a, b, _, _ = pair
    md = b.get_agent_metadata()
    for bad in (b"", b"garbage", md[:12], md[:40], b"FRTNXMD1" + b"\xff\xff\xff\x7f", md[:-1] + b"",
                md.replace(b'"name":"', b'"name":"X', 1)):
        with pytest.raises((nb.nixlMismatchError, nb.nixlInvalidParamError)):
            a.add_remote_agent(bad)
    with pytest.raises(nb.nixlInvalidParamError, match="its own metadata"):
        a.add_remote_agent(a.get_agent_metadata())
    assert a.check_remote_metadata(b.name)  # still known, as before
    assert a.agent.invalidateRemoteMD("nobody") == nb.NIXL_ERR_NOT_FOUND


def test_partial_metadata_shows_only_its_ranges():
    a, b = agent(), agent()
    bufs = [np.zeros(4096, np.uint8) for _ in range(2)]
    regs = [b.register_memory([(x.ctypes.data, x.nbytes, 0, "")], "DRAM") for x in bufs]
    first = a.get_xfer_descs([(bufs[0].ctypes.data, 4096, 0)], "DRAM")
    second = a.get_xfer_descs([(bufs[1].ctypes.data, 4096, 0)], "DRAM")
    a.add_remote_agent(b.get_partial_agent_metadata(regs[0], True))
    assert a.check_remote_metadata(b.name, first) and not a.check_remote_metadata(b.name, second)
    with pytest.raises(nb.nixlNotFoundError, match="partial metadata"):
        a.prep_xfer_dlist(b.name, second)
    a.add_remote_agent(b.get_partial_agent_metadata(regs[1], False))
    assert a.check_remote_metadata(b.name, second)
    with pytest.raises(nb.nixlNotFoundError, match="not registered"):
        b.get_partial_agent_metadata(a.get_reg_descs([(1, 2, 0, "")], "DRAM"))


def test_deserialize_descs_reads_descriptor_lists_never_code(tmp_path, pair):
    a = pair[0]
    xl = a.get_xfer_descs([(1, 2, 3), (4, 5, 6)], "VRAM")
    rl = a.get_reg_descs([(1, 2, 3, "meta"), (4, 5, 6, b"\x00\xff")], "DRAM")
    for dl in (xl, rl):
        back = a.deserialize_descs(a.get_serialized_descs(dl))
        assert type(back) is type(dl) and back == dl
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for hostile in (pickle.dumps(Evil()), pickle.dumps(xl), a.get_serialized_descs(xl)[:-3],
                    a.get_serialized_descs(rl) + b"x", b"FRTNXDL1" + bytes([9, 0]) + bytes(8)):
        with pytest.raises(nb.nixlInvalidParamError):
            a.deserialize_descs(hostile)
    assert not marker.exists()


def test_query_memory_reports_files_through_posix(tmp_path):
    a = agent(backends=["POSIX"])
    f = tmp_path / "kv.bin"
    f.write_bytes(b"x" * 123)
    got = a.query_memory([(0, 0, 0, str(f)), (0, 0, 0, str(tmp_path / "absent"))], "POSIX", mem_type="FILE")
    assert got[0]["size"] == "123" and int(got[0]["mode"]) == f.stat().st_mode and got[1] is None
    with pytest.raises(ValueError, match="not found"):
        a.query_memory([(0, 0, 0, str(f))], "UCX", mem_type="FILE")


# --------------------------------------------------------------------------- processes

TARGET = r"""
import json, sys, time
import numpy as np
from freight.nixl import nixl_agent, nixl_agent_config
port, name = int(sys.argv[1]), sys.argv[2]
agent = nixl_agent(name, nixl_agent_config(True, True, port))
buf = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
agent.register_memory(buf)
print(json.dumps({"addr": buf.ctypes.data, "size": buf.nbytes}), flush=True)
while True:
    for peer, msgs in agent.get_new_notifs().items():
        if b"bye" in msgs:
            sys.exit(0)
    time.sleep(0.01)
"""


def start_target(spawn, token=None):
    port = free_port()
    env = dict(os.environ)
    env.pop("FREIGHT_TOKEN", None)
    if token:
        env["FREIGHT_TOKEN"] = token
    name = f"target-{uuid.uuid4().hex[:6]}"
    proc = spawn(TARGET, str(port), name, env=env)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, port, name, json.loads(line)


def read_from(a, name, info):
    out = np.zeros(info["size"], np.uint8)
    a.register_memory(out)
    h = a.initialize_xfer("READ", a.get_xfer_descs(out), a.get_xfer_descs([(info["addr"], info["size"], 0)], "DRAM"),
                          name)
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    return out


def wait_known(a, name, timeout=TIMEOUT) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if a.check_remote_metadata(name):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(120)
def test_another_process_fetches_metadata_from_the_listener_reads_and_invalidates(spawn):
    proc, port, name, info = start_target(spawn)
    a = agent()
    a.fetch_remote_metadata(name, "127.0.0.1", port)
    a.send_local_metadata("127.0.0.1", port)
    assert wait_known(a, name)
    got = read_from(a, name, info)
    assert np.array_equal(got, np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20])
    a.send_notif(name, b"bye")
    assert proc.wait(TIMEOUT) == 0
    a.remove_remote_agent(name)
    assert not a.check_remote_metadata(name)


@pytest.mark.timeout(120)
def test_the_listener_of_an_agent_with_a_token_serves_no_one_without_it(spawn, monkeypatch, caplog):
    proc, port, name, info = start_target(spawn, token="sesame")
    monkeypatch.delenv("FREIGHT_TOKEN", raising=False)
    stranger = agent()
    stranger.fetch_remote_metadata(name, "127.0.0.1", port)
    assert not wait_known(stranger, name, timeout=3)
    # Fake metadata pushed at it is refused too: the target knows no 'stranger'.
    stranger.send_local_metadata("127.0.0.1", port)
    monkeypatch.setenv("FREIGHT_TOKEN", "sesame")
    friend = agent()
    friend.fetch_remote_metadata(name, "127.0.0.1", port)
    assert wait_known(friend, name)
    assert read_from(friend, name, info)[4] == 1
    friend.send_notif(name, b"bye")
    assert proc.wait(TIMEOUT) == 0


@pytest.mark.timeout(120)
def test_garbage_on_the_listener_port_leaves_the_agent_serving(spawn):
    proc, port, name, info = start_target(spawn)
    for junk in (b"", b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096), b"FNXS\x01\x02\x00\x00\xff\xff\xff\xff"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except (ConnectionResetError, socket.timeout):
                pass
    a = agent()
    a.fetch_remote_metadata(name, "127.0.0.1", port)
    assert wait_known(a, name)
    a.send_notif(name, b"bye")
    assert proc.wait(TIMEOUT) == 0


@pytest.mark.timeout(120)
def test_a_target_that_dies_fails_the_transfer_instead_of_hanging(spawn):
    proc, port, name, info = start_target(spawn)
    a = agent()
    a.fetch_remote_metadata(name, "127.0.0.1", port)
    assert wait_known(a, name)
    first = read_from(a, name, info)  # connected (and registered: kept alive)
    proc.kill()
    proc.wait(TIMEOUT)
    out = np.zeros(info["size"], np.uint8)
    a.register_memory(out)
    h = a.initialize_xfer("READ", a.get_xfer_descs(out), a.get_xfer_descs([(info["addr"], info["size"], 0)], "DRAM"),
                          name)
    end = time.monotonic() + TIMEOUT
    with pytest.raises(nb.nixlRemoteDisconnectError):
        a.transfer(h)
        while a.check_xfer_state(h) == "PROC":
            assert time.monotonic() < end, "a transfer to a dead peer hangs"
            time.sleep(0.01)
    assert first[4] == 1


@pytest.mark.timeout(120)
def test_metadata_travels_through_etcd(etcd_endpoint, monkeypatch):
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd_endpoint)
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", f"/nixl-test/{uuid.uuid4().hex[:8]}/")
    a, b = agent(), agent()
    buf = np.full(8192, 7, np.uint8)
    reg = b.register_memory(buf)
    b.send_local_metadata()
    b.send_partial_agent_metadata(reg, True, ["UCX"], label="kv")
    a.fetch_remote_metadata(b.name, label="kv")
    assert wait_known(a, b.name)
    assert read_from(a, b.name, {"addr": buf.ctypes.data, "size": buf.nbytes})[0] == 7
    c = agent()
    c.fetch_remote_metadata(b.name)
    assert wait_known(c, b.name)
    b.invalidate_local_metadata()
    late = agent()
    late.fetch_remote_metadata(b.name)
    assert not wait_known(late, b.name, timeout=7)  # etcd's watch gives up after 5 s


def test_without_an_address_or_etcd_the_exchange_calls_say_so(monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    a = agent()
    for call in (a.send_local_metadata, lambda: a.fetch_remote_metadata("x"), a.invalidate_local_metadata):
        with pytest.raises(nb.nixlInvalidParamError, match="NIXL_ETCD_ENDPOINTS"):
            call()


# --------------------------------------------------------------------------- the alias


def test_the_alias_makes_import_nixl_freights_face():
    shim = subprocess.run([sys.executable, "-m", "freight.nixl", "--shim-path"], capture_output=True, text=True,
                          check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "python"))).stdout.strip()
    assert shim == nixl.shim_path() and (Path(shim) / "nixl" / "__init__.py").is_file()
    code = ("from nixl._api import nixl_agent; import nixl, nixl._bindings as b, nixl._utils, nixl.logging; "
            "print(nixl_agent.__module__, b.nixlAgent.__module__, nixl.nixl_agent is nixl_agent, "
            "nixl._utils.__name__, nixl.logging.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([shim, str(ROOT / "python")]))).stdout
    assert out.split() == ["freight.nixl._api", "freight.nixl._agent", "True", "freight.nixl._utils",
                           "freight.nixl.logging"]
    code = "import freight.nixl as f; f.install(); import nixl._api as a; print(a.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "python"))).stdout
    assert out.strip() == "freight.nixl._api"


def test_utils_allocate_fill_and_compare():
    a, b = _utils.malloc_passthru(8192), _utils.malloc_passthru(8192)
    try:
        assert a % 4096 == 0
        _utils.ba_buf(a, 8192)
        _utils.ba_buf(b, 8192)
        _utils.verify_transfer(a, b, 8192)
        _utils.ba_buf(b + 100, 0)
        import ctypes

        ctypes.memset(b + 100, 0, 1)
        with pytest.raises(AssertionError, match="byte 100"):
            _utils.verify_transfer(a, b, 8192)
    finally:
        _utils.free_passthru(a)
        _utils.free_passthru(b)


# --------------------------------------------------------------------------- GPU memory

GPU_TARGET = r"""
import sys, time
import torch
from freight.nixl import nixl_agent, nixl_agent_config
name = sys.argv[1]
agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
kv = torch.zeros(8, 1 << 18, dtype=torch.uint8, device="cuda")   # 8 blocks of 256 KiB
agent.register_memory(kv)
print(agent.get_agent_metadata().hex(), kv.data_ptr(), flush=True)
while True:
    msgs = agent.get_new_notifs()
    for peer, got in msgs.items():
        for m in got:
            if m == b"check":
                torch.cuda.synchronize()
                # what the initiator wrote: block i holds the byte i + 1
                ok = all(int(kv[i].min()) == int(kv[i].max()) == i + 1 for i in range(8))
                print("ok" if ok else "bad", flush=True)
            if m == b"bye":
                sys.exit(0)
    time.sleep(0.005)
"""


@needs_gpu
@pytest.mark.timeout(120)
def test_gpu_tensors_move_through_the_face_between_two_processes_over_cuda(spawn):
    """The NixlConnector's case: KV blocks in GPU memory of two processes, registered
    as tensors, prepared as N x 3 rows and moved block by block through the face; on
    one host that is freight's cuda transport, checked on both sides."""
    proc = spawn(GPU_TARGET, f"gpu-target-{uuid.uuid4().hex[:6]}")
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    md_hex, remote_base = line.split()
    remote_base = int(remote_base)
    a = agent(backends=["UCX"])
    name = a.add_remote_agent(bytes.fromhex(md_hex)).decode()
    block = 1 << 18
    src = torch.stack([torch.full((block,), i + 1, dtype=torch.uint8) for i in range(8)]).cuda()
    back = torch.zeros_like(src)
    a.register_memory(src)
    a.register_memory(back)
    torch.cuda.synchronize()
    rows = lambda base: np.array([(base + i * block, block, 0) for i in range(8)], np.uint64)  # noqa: E731
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src.data_ptr()), "VRAM")
    remote = a.prep_xfer_dlist(name, rows(remote_base), "VRAM")
    order = np.arange(8)[::-1].copy()   # the blocks in another order than the rows: indices work
    h = a.make_prepped_xfer("WRITE", local, order, remote, order, b"written")
    assert a.agent._xfers[h._handle].request.transport == "cuda"
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    a.send_notif(name, b"check")
    answer = proc.stdout.readline().strip()
    assert answer == "ok", f"the target saw {answer or proc.stderr.read()!r} in its GPU memory"
    back_local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(back.data_ptr()), "VRAM")
    r = a.make_prepped_xfer("READ", back_local, list(range(8)), remote, list(range(8)))
    a.transfer(r)
    assert wait_state(a, r) == "DONE"
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    for x in (h, r):
        a.release_xfer_handle(x)
    for d in (local, remote, back_local):
        a.release_dlist_handle(d)
    a.send_notif(name, b"bye")
    assert proc.wait(timeout=TIMEOUT) == 0, proc.stderr.read()
