"""Real vLLM instances for the connector's tests and benchmark: ``vllm serve`` started
from the virtualenv of scripts/vllm-env.sh, the P/D proxy, and their metrics.

Not a test module: tests/test_vllm.py, bench/vllm_pd.py and bench/serve.py use it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

ROOT = Path(__file__).resolve().parents[1]
VENV_ENV = "FREIGHT_VLLM_VENV"
TOKEN = "vllm-test-token"


def venv() -> Optional[Path]:
    """The vLLM virtualenv (scripts/test.sh builds it and names it here)."""
    v = os.environ.get(VENV_ENV)
    return Path(v) if v and (Path(v) / ".complete").exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_config(connector: str, role: str, extra: Optional[Dict[str, Any]] = None) -> str:
    if connector == "freight":
        cfg: Dict[str, Any] = {"kv_connector": "FreightConnector", "kv_connector_module_path": "freight.vllm",
                               "kv_role": role}
    elif connector == "nixl":
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    else:
        raise ValueError(connector)
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


class Instance:
    """One ``vllm serve``; its output goes to ``log``. ``host``: the address it serves
    on; ``prefix``: a command it runs under (``scripts/netns.sh exec a``, to start it in
    another network namespace)."""

    def __init__(self, model: Path, log: Path, connector: Optional[str] = None, role: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, extra: Optional[Dict[str, Any]] = None,
                 max_model_len: int = 2048, args: Sequence[str] = (), host: str = "127.0.0.1",
                 prefix: Sequence[str] = ()) -> None:
        v = venv()
        assert v is not None, "no vLLM virtualenv"
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log = log
        cmd = [*prefix, str(v / "bin" / "vllm"), "serve", str(model), "--port", str(self.port), "--host", host,
               "--block-size", "32", "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
               "--enforce-eager", "--max-num-seqs", "8", "--seed", "0", "--served-model-name", "tiny"]
        cmd += list(args)
        if connector:
            cmd += ["--kv-transfer-config", connector_config(connector, role or "kv_both", extra)]
        full_env = dict(os.environ)
        full_env.update({
            "PYTHONPATH": str(ROOT / "python") + os.pathsep + full_env.get("PYTHONPATH", ""),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "FREIGHT_VLLM_TOKEN": TOKEN,
            # NIXL's side channel, one port per instance.
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            # Two instances share this machine's cores: vLLM's default pins each worker
            # (and every thread it starts, freight's included) to one core, the same one.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # The engine's own log (connections opened and lost) beside vLLM's.
            "FREIGHT_LOG": os.environ.get("FREIGHT_LOG", "info"),
        })
        full_env.update(env or {})
        self.out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> "Instance":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        self.out.flush()
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def text(self) -> str:
        self.out.flush()
        return self.log.read_text(errors="replace")

    def metrics(self) -> Dict[str, float]:
        return read_metrics(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.out.close()

    def kill(self) -> None:
        """SIGKILL to the instance's processes, and back once every one of them is dead
        (its workers too, which tear down gigabytes of memory before they close their
        sockets): only then do its peers learn of it at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while living(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of group {self.proc.pid} still alive 30 s after SIGKILL")
            time.sleep(0.05)


def read_metrics(url: str) -> Dict[str, float]:
    """A server's Prometheus metrics: each sample (name with its labels) to its value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        body = r.read().decode()
    out: Dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def living(group: int) -> List[int]:
    """The processes of process group ``group`` that still hold resources: any of whose
    threads is not dead. (A killed process's first thread can be a zombie while the
    others still tear down its memory, its sockets still open: the process is only
    gone once all are.)"""

    def state(stat_file: Path) -> Optional[Tuple[str, int]]:
        try:
            stat = stat_file.read_text()
        except OSError:
            return None
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        return fields[0], int(fields[2])

    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        leader = state(entry / "stat")
        if leader is None or leader[1] != group:
            continue
        try:
            threads = [state(t / "stat") for t in (entry / "task").iterdir()]
        except OSError:
            continue
        if any(t is not None and t[0] not in ("Z", "X") for t in threads):
            alive.append(int(entry.name))
    return alive


class ProxyProcess:
    """``freight proxy`` (from the vLLM virtualenv, which has aiohttp) before the
    instances given, on a port of its own."""

    def __init__(self, prefill: Union[Instance, Sequence[Instance]], decode: Union[Instance, Sequence[Instance]],
                 log: Path, args: Sequence[str] = ()) -> None:
        v = venv()
        assert v is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.out = open(log, "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))

        def urls(group: Union[Instance, Sequence[Instance]]) -> str:
            return ",".join(i.url for i in ([group] if isinstance(group, Instance) else group))

        self.proc = subprocess.Popen(
            [str(v / "bin" / "python"), "-m", "freight", "proxy", "--prefill", urls(prefill), "--decode",
             urls(decode), "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=self.out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers (503 while an instance is down)
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the proxy exited:\n{log.read_text()}")
                time.sleep(0.5)
        raise RuntimeError("the proxy did not start")

    def metrics(self) -> Dict[str, float]:
        return read_metrics(self.url)

    def health(self) -> Dict[str, Any]:
        """The proxy's /health: each role's instances and their state."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.out.close()


def complete(url: str, prompt: str, max_tokens: int, extra: Optional[Dict[str, Any]] = None,
             timeout: float = 300.0) -> Dict[str, Any]:
    """A greedy completion; raises urllib.error.HTTPError on an error status, its
    message followed by the answer's body (the proxy's says which instance failed, why)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **(extra or {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        e.msg = f"{e.msg}: {e.read()[:2000].decode(errors='replace')}"
        raise


def complete_streamed(url: str, prompt: str, max_tokens: int, timeout: float = 300.0) -> str:
    """A greedy completion streamed as server-sent events: the text of its chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, done = [], False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers.get("Content-Type", "").startswith("text/event-stream"), r.headers
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                done = True
                break
            text.append(json.loads(data)["choices"][0]["text"])
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(text)


def prompts(n: int, words: int, seed: int = 0) -> List[str]:
    """``n`` distinct prompts of about ``words`` words each (no two share a first block)."""
    import random

    vocab = ("prefill decode block layer cache memory token value key transfer engine host device "
             "request answer number one two three four five six seven eight nine ten").split()
    rng = random.Random(seed)
    return [f"{i} " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


if __name__ == "__main__":
    sys.exit("tests/vllm_serving.py is a helper of tests/test_vllm.py, bench/vllm_pd.py and bench/serve.py")
