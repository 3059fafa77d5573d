"""FREIGHT_TRANSPORT picks a process's transport without touching its code, as
deployments switch backends; the path report says who chose it, and a bad value is
refused when the agent starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, freight
try:
    a, b = freight.Agent("a"), freight.Agent("b")
except freight.InvalidArgumentError as e:
    print(json.dumps({"error": str(e)}))
    raise SystemExit(0)
buf = b.alloc(4096)
b.register(buf)
src = a.alloc(4096)
a.register(src)
a.add_peer(b.metadata())
path = a.path_to("b")
for _ in range(3):
    a.transfer("WRITE", [src], "b", [buf], notif=b"done").wait(30)
print(json.dumps({"transport": path.transport, "reason": path.reason, "conns": a.connection_stats("b")}))
"""


def run_with(value: str | None) -> dict:
    env = dict(os.environ)
    env.pop("FREIGHT_TRANSPORT", None)
    if value is not None:
        env["FREIGHT_TRANSPORT"] = value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_configuration_decides_without_the_variable():
    got = run_with(None)
    assert got["transport"] == "shm", got
    assert "required by" not in got["reason"]


def test_the_variable_switches_the_transport_and_the_path_says_so():
    got = run_with("tcp")
    assert got["transport"] == "tcp", got
    assert got["reason"].startswith("required by FREIGHT_TRANSPORT=tcp"), got
    # Three transfers, one tcp connection of four streams and one control connection.
    conns = got["conns"]
    assert (conns["control_connections"], conns["tcp_connections"], conns["handshakes"]) == (1, 1, 5), conns
    assert 0 < conns["last_setup_us"] <= conns["setup_us"], conns
    assert run_with("auto")["transport"] == "shm"


def test_an_unknown_transport_is_refused_at_start():
    got = run_with("carrier-pigeon")
    assert "FREIGHT_TRANSPORT=carrier-pigeon: unknown transport" in got.get("error", ""), got
