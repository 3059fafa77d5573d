"""The P/D proxy (``freight proxy``): its choice of instance without I/O (pool.py), and
the proxy as a process before stand-in instances (tests/proxy_upstream.py), real
processes and sockets: the two halves of a request, streaming, request ids, least-
loaded choice, instances dying and coming back, the errors, /health and /metrics.
The proxy before real vLLM instances is in tests/test_vllm.py."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (scripts/setup.sh installs it into .venv)")
pytest.importorskip("prometheus_client", reason="the proxy needs prometheus_client (scripts/setup.sh installs it)")

from freight.proxy.bodies import decode_body, prefill_body  # noqa: E402
from freight.proxy.pool import NoInstance, Pool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))


# -- the pool, without I/O ------------------------------------------------------------


def test_the_pool_picks_the_least_loaded_alive_instance_and_goes_round_on_ties():
    pool = Pool.of("prefill", ["a", "b", "c"])
    # Nothing in flight: each in turn.
    assert [pool.pick().url for _ in range(4)] == ["a", "b", "c", "a"]
    a, b, c = pool.instances
    pool.acquire(a)
    pool.acquire(a)
    pool.acquire(b)
    assert pool.pick().url == "c"
    pool.acquire(c)
    assert pool.pick().url == "b"  # b and c hold one each; b comes next in turn after c
    pool.release(a)
    pool.release(a)
    assert pool.pick().url == "a"
    assert pool.pick(exclude=[a]).url in ("b", "c")
    pool.check()
    with pytest.raises(AssertionError, match="released more"):
        pool.release(a)


def test_the_pool_takes_an_instance_out_and_back_and_says_why_none_is_left():
    pool = Pool.of("decode", ["a", "b"], fails_to_down=2)
    a, b = pool.instances
    assert not pool.check_failed(a, "health check answered HTTP 500")  # one failure: still in use
    assert a.alive
    assert pool.check_failed(a, "health check answered HTTP 500")
    assert not a.alive and [i.url for i in pool.alive()] == ["b"]
    assert all(pool.pick() is b for _ in range(3))
    pool.connection_failed(b, "connection refused")
    with pytest.raises(NoInstance) as e:
        pool.pick()
    assert str(e.value) == ("no decode instance is alive (a: health check answered HTTP 500; "
                            "b: connection refused)")
    pool.check()
    assert pool.check_passed(a) and a.alive and a.reason is None and a.failed_checks == 0
    assert not pool.check_passed(a)
    assert pool.pick() is a
    # A passing check between failures starts the count again.
    pool.check_failed(a, "x")
    pool.check_passed(a)
    assert not pool.check_failed(a, "x") and a.alive


def test_with_none_alive_the_pool_falls_back_to_instances_whose_health_checks_went_unanswered():
    pool = Pool.of("prefill", ["busy", "dead", "sick"], fails_to_down=1)
    busy, dead, sick = pool.instances
    assert pool.check_failed(busy, "health check got no answer in 5 s", unanswered=True)
    pool.connection_failed(dead, "connection refused")
    assert pool.check_failed(sick, "health check answered HTTP 500")
    assert pool.alive() == [] and [i.silent for i in pool.instances] == [True, False, False]
    pool.check()
    # Only the silent one, never the refused or the sick one; not alive, so the caller knows.
    assert all(pool.pick() is busy for _ in range(4)) and not busy.alive
    assert pool.state()["busy"]["silent"] is True
    with pytest.raises(NoInstance, match="busy: failed this request"):
        pool.pick(exclude=[busy])
    # An alive instance wins over a silent one, however loaded.
    pool.acquire(busy)
    assert pool.check_passed(sick) and pool.pick() is sick
    pool.acquire(sick)
    pool.acquire(sick)
    assert pool.pick() is sick
    # The last failure decides: an error status, or a refused connection, ends the fallback.
    pool.check_failed(sick, "health check answered HTTP 500")
    assert pool.pick() is busy
    pool.check_failed(busy, "health check answered HTTP 503")
    assert not busy.silent
    with pytest.raises(NoInstance):
        pool.pick()
    pool.check_failed(busy, "health check got no answer in 5 s", unanswered=True)
    assert pool.pick() is busy
    pool.connection_failed(busy, "connection refused")
    with pytest.raises(NoInstance):
        pool.pick()
    assert pool.check_passed(busy) and busy.alive and not busy.silent
    pool.check()


def test_a_pool_refuses_no_instances_a_url_given_twice_and_a_threshold_under_one():
    with pytest.raises(ValueError, match="no prefill instance given"):
        Pool.of("prefill", [])
    with pytest.raises(ValueError, match="given twice"):
        Pool.of("prefill", ["http://a", "http://a"])
    with pytest.raises(ValueError, match="at least 1"):
        Pool.of("prefill", ["http://a"], fails_to_down=0)


def test_the_prefill_is_asked_for_one_unstreamed_token_and_its_kv_and_the_decode_gets_the_rest_unchanged():
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 3, "max_completion_tokens": 50}
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "stream_options" not in p and "min_tokens" not in p
    d = decode_body(body, {"do_remote_prefill": True, "x": 1})
    assert d == {**body, "kv_transfer_params": {"do_remote_prefill": True, "x": 1}}
    assert "kv_transfer_params" not in body  # the client's request is not changed


# -- the proxy as a process -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10) -> Tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    raise AssertionError(f"{what} did not start")


class Upstream:
    def __init__(self, name: str, *args: str, port: Optional[int] = None) -> None:
        self.name, self.args = name, args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> "Upstream":
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "proxy_upstream.py"), self.name,
                                      str(self.port), *self.args], env=ENV)
        wait_for(self.url + "/seen", self.proc, f"upstream {self.name}")
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def seen(self) -> List[Dict[str, Any]]:
        return get(self.url + "/seen")[1]


class ProxyUnderTest:
    def __init__(self, prefill: List[Upstream], decode: List[Upstream], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Its log, in a file: a pipe nobody reads would fill and stop it.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freight", "proxy", "--prefill", ",".join(u.url for u in prefill),
             "--decode", ",".join(u.url for u in decode), "--listen", f"127.0.0.1:{self.port}",
             "--health-interval", "0.2", "--health-timeout", "2", *args],
            env=ENV, stderr=self.log)
        wait_for(self.url + "/health", self.proc, "the proxy")

    def post(self, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None,
             path: str = "/v1/completions", raw: Optional[bytes] = None) -> Tuple[int, Dict[str, str], bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def health(self) -> Tuple[int, Dict[str, Any]]:
        return get(self.url + "/health")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def wait_health(self, role: str, url: str, alive: bool, timeout: float = 30) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.health()[1][role][url]
            if state["alive"] == alive:
                return state
            assert time.monotonic() < deadline, f"{role} {url} still {state}"
            time.sleep(0.05)

    def stop(self) -> str:
        """Stops the proxy; returns its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


class Cluster:
    """Stand-in instances and proxies of one test, all stopped at its end."""

    def __init__(self) -> None:
        self.made: List[Any] = []

    def __call__(self, prefill: int = 1, decode: int = 1, proxy_args=()):
        p = [self.upstream(f"p{i}") for i in range(prefill)]
        d = [self.upstream(f"d{i}") for i in range(decode)]
        return self.proxy(p, d, *proxy_args), p, d

    def upstream(self, name: str, *args: str) -> Upstream:
        self.made.append(Upstream(name, *args))
        return self.made[-1]

    def proxy(self, prefill: List[Upstream], decode: List[Upstream], *args: str) -> ProxyUnderTest:
        self.made.append(ProxyUnderTest(prefill, decode, *args))
        return self.made[-1]

    def close(self) -> None:
        for thing in self.made:
            if isinstance(thing, ProxyUnderTest):
                thing.stop()
            elif thing.proc.poll() is None:
                thing.kill()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def sse_texts(body: bytes) -> List[Dict[str, Any]]:
    events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", body
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.timeout(60)
def test_a_request_takes_the_prefills_kv_params_to_the_decode_streamed_or_not_with_its_request_id(cluster):
    proxy, (p,), (d,) = cluster()
    status, headers, body = proxy.post({"model": "tiny", "prompt": "one two three", "max_tokens": 7},
                                       {"X-Request-Id": "client-id-1"})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["instance"] == "d0" and answer["choices"][0]["text"] == "d0:one d0:two d0:three"
    assert answer["params"] == {"do_remote_prefill": True, "from": "p0"}
    assert answer["id"] == "client-id-1" and headers["X-Request-Id"] == "client-id-1"
    sent = p.seen()[-1]
    assert sent["request_id"] == "client-id-1" and sent["body"]["max_tokens"] == 1
    assert sent["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert d.seen()[-1]["body"]["max_tokens"] == 7
    # Streamed, through chat too; without a client id the proxy makes one, the same for both halves.
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, headers, body = proxy.post({"model": "tiny", "prompt": "a b c d", "stream": True}, path=path)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), (status, headers)
        chunks = sse_texts(body)
        assert [c["choices"][0]["text"] for c in chunks] == ["d0:a", "d0:b", "d0:c", "d0:d"]
        rid = headers["X-Request-Id"]
        assert len(rid) >= 16 and all(c["id"] == rid for c in chunks)
        assert p.seen()[-1]["request_id"] == rid and p.seen()[-1]["path"] == path
        assert p.seen()[-1]["body"]["stream"] is False
    status, models = get(proxy.url + "/v1/models")
    assert status == 200 and models["data"][0]["instance"] == "d0"


@pytest.mark.timeout(60)
def test_requests_go_round_the_instances_and_to_the_least_loaded_one(cluster):
    proxy, prefill, decode = cluster(prefill=2, decode=2)
    for i in range(8):
        assert proxy.post({"prompt": f"w{i}"})[0] == 200
    assert [len(u.seen()) for u in prefill + decode] == [4, 4, 4, 4]
    # One long request holds a decode instance: the next ones go to the other.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(proxy.post, {"prompt": "long", "hold": True})
        deadline = time.monotonic() + 30
        while not any(s["body"].get("prompt") == "long" for u in decode for s in u.seen()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy = next(u for u in decode if any(s["body"].get("prompt") == "long" for s in u.seen()))
        other = next(u for u in decode if u is not busy)
        before = len(other.seen())
        for i in range(3):
            status, _, body = proxy.post({"prompt": f"short{i}"})
            assert status == 200 and json.loads(body)["instance"] == other.name
        assert len(other.seen()) == before + 3
        get(busy.url + "/release")
        assert long.result()[0] == 200


@pytest.mark.timeout(90)
def test_a_killed_prefill_instance_is_taken_out_requests_keep_succeeding_and_it_comes_back(cluster):
    proxy, (p0, p1), (d,) = cluster(prefill=2)
    p0.kill()
    # At once, before any health check saw it: the refused connection takes it out and
    # the request goes to the other.
    for i in range(6):
        status, _, body = proxy.post({"prompt": f"after {i}"})
        assert status == 200, body
        assert json.loads(body)["params"]["from"] == "p1"
    state = proxy.wait_health("prefill", p0.url, alive=False)
    assert "Connect" in state["reason"] or "refused" in state["reason"], state
    assert proxy.health()[0] == 200  # each role still has an instance
    assert f'freight_proxy_instance_up{{instance="{p0.url}",role="prefill"}} 0.0' in proxy.metrics()
    # Back at the same address: the next health check puts it in use again.
    p0.start()
    proxy.wait_health("prefill", p0.url, alive=True)
    froms = {json.loads(proxy.post({"prompt": f"later {i}"})[2])["params"]["from"] for i in range(4)}
    assert froms == {"p0", "p1"}
    assert f'freight_proxy_instance_up{{instance="{p0.url}",role="prefill"}} 1.0' in proxy.metrics()
    err = proxy.stop()
    assert f"prefill instance {p0.url} is down" in err and f"prefill instance {p0.url} is back" in err, err


@pytest.mark.timeout(60)
def test_no_alive_instance_of_a_role_is_a_503_naming_each_and_why(cluster):
    proxy, (p,), (d,) = cluster()
    d.kill()
    proxy.wait_health("decode", d.url, alive=False)
    status, headers, body = proxy.post({"prompt": "x"}, {"X-Request-Id": "r-503"})
    assert status == 503, body
    message = json.loads(body)["error"]["message"]
    assert message.startswith("no decode instance is alive (") and d.url in message, message
    assert headers["X-Request-Id"] == "r-503"
    code, health = proxy.health()
    assert code == 503 and health["ok"] is False and health["decode"][d.url]["alive"] is False
    p.kill()
    proxy.wait_health("prefill", p.url, alive=False)
    status, _, body = proxy.post({"prompt": "x"})
    assert status == 503 and "no prefill instance is alive" in json.loads(body)["error"]["message"]
    metrics = proxy.metrics()
    assert 'freight_proxy_errors_total{reason="no_instance",role="decode"} 1.0' in metrics, metrics
    assert 'freight_proxy_errors_total{reason="no_instance",role="prefill"} 1.0' in metrics, metrics
    assert 'freight_proxy_requests_total{code="503",route="/v1/completions"} 2.0' in metrics, metrics


@pytest.mark.timeout(60)
def test_an_instance_whose_health_checks_go_unanswered_is_down_but_still_served_as_a_last_resort(cluster):
    busy = cluster.upstream("busy", "--health-delay", "30")
    decode = cluster.upstream("d0")
    proxy = cluster.proxy([busy], [decode], "--health-timeout", "0.3", "--health-interval", "0.2")
    state = proxy.wait_health("prefill", busy.url, alive=False)
    assert state["reason"] == "health check got no answer in 0.3 s" and state["silent"] is True, state
    assert proxy.health()[0] == 503
    for i in range(3):
        status, _, body = proxy.post({"prompt": f"q{i}"})
        assert status == 200, body
        assert json.loads(body)["params"]["from"] == "busy"
    assert f'freight_proxy_last_resort_total{{instance="{busy.url}",role="prefill"}} 3.0' in proxy.metrics()
    get(busy.url + "/heal")
    state = proxy.wait_health("prefill", busy.url, alive=True)
    assert state["silent"] is False and proxy.health()[0] == 200
    assert proxy.post({"prompt": "after"})[0] == 200
    assert f'freight_proxy_last_resort_total{{instance="{busy.url}",role="prefill"}} 3.0' in proxy.metrics()
    err = proxy.stop()
    assert f"no prefill instance is alive; sending it to {busy.url}, whose health checks go unanswered" in err, err


@pytest.mark.timeout(60)
def test_an_instance_whose_health_check_fails_is_taken_out_after_the_threshold(cluster):
    sick = cluster.upstream("sick", "--health-status", "503")
    well = cluster.upstream("well")
    decode = cluster.upstream("d0")
    proxy = cluster.proxy([sick, well], [decode], "--fails-to-down", "3")
    state = proxy.wait_health("prefill", sick.url, alive=False)
    assert state["reason"] == "health check answered HTTP 503", state
    for i in range(3):
        status, _, body = proxy.post({"prompt": f"q{i}"})
        assert status == 200 and json.loads(body)["params"]["from"] == "well"
    assert sick.seen() == []
    assert "prefill instance %s is down: health check answered HTTP 503" % sick.url in proxy.stop()


@pytest.mark.timeout(60)
def test_bad_requests_and_bad_answers_get_a_clear_error_and_an_instances_own_error_is_passed_on(cluster):
    proxy, (p,), (d,) = cluster()
    status, _, body = proxy.post({}, raw=b"{not json")
    assert status == 400 and "not JSON" in json.loads(body)["error"]["message"]
    status, _, body = proxy.post({}, raw=b"[1, 2]")
    assert status == 400 and "JSON object" in json.loads(body)["error"]["message"]
    # The instance's own 400 reaches the client as it is, and the instance stays in use.
    status, _, body = proxy.post({"prompt": "bad"})
    assert status == 400 and json.loads(body) == {"error": {"message": "bad prompt"}}
    assert proxy.health()[1]["prefill"][p.url]["alive"] is True
    assert d.seen() == []
    # A prefill instance started without a KV connector answers without params.
    plain = cluster.upstream("plain", "--no-params")
    other = cluster.proxy([plain], [d])
    status, _, body = other.post({"prompt": "x"})
    assert status == 502, body
    message = json.loads(body)["error"]["message"]
    assert plain.url in message and "no kv_transfer_params" in message and "kv_producer" in message, message
    assert 'freight_proxy_errors_total{reason="bad_answer",role="prefill"} 1.0' in other.metrics()


@pytest.mark.timeout(60)
def test_metrics_count_requests_by_status_and_time_each_role_and_the_client(cluster):
    proxy, (p,), (d,) = cluster()
    for i in range(3):
        assert proxy.post({"prompt": f"m{i} a b", "stream": i == 0})[0] == 200
    assert proxy.post({"prompt": "bad"})[0] == 400
    m = proxy.metrics()
    assert 'freight_proxy_requests_total{code="200",route="/v1/completions"} 3.0' in m, m
    assert 'freight_proxy_requests_total{code="400",route="/v1/completions"} 1.0' in m, m
    assert f'freight_proxy_upstream_total{{instance="{p.url}",outcome="ok",role="prefill"}} 3.0' in m, m
    assert f'freight_proxy_upstream_total{{instance="{p.url}",outcome="http_error",role="prefill"}} 1.0' in m, m
    assert f'freight_proxy_upstream_total{{instance="{d.url}",outcome="ok",role="decode"}} 3.0' in m, m
    for role in ("prefill", "decode", "client"):
        assert f'freight_proxy_ttft_seconds_count{{role="{role}"}} ' in m, (role, m)
        assert f'freight_proxy_latency_seconds_count{{role="{role}"}} ' in m, (role, m)
    assert 'freight_proxy_ttft_seconds_count{role="decode"} 3.0' in m
    assert 'freight_proxy_latency_seconds_count{role="client"} 3.0' in m
    assert f'freight_proxy_in_flight{{instance="{d.url}",role="decode"}} 0.0' in m


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freight", "proxy", *args], env=ENV, capture_output=True,
                          text=True, timeout=30)


def test_the_command_line_explains_itself_and_refuses_bad_arguments_by_name():
    out = run_cli("--help")
    assert out.returncode == 0
    for word in ("--prefill", "--decode", "--listen", "--health-interval", "/metrics", "503", "least-loaded"):
        assert word in out.stdout, (word, out.stdout)
    cases = [
        (("--decode", "http://a:1"), "--prefill"),
        (("--prefill", "a:1", "--decode", "http://b:1"), "'a:1': give a URL"),
        (("--prefill", "http://a:1", "--decode", "http://b:1", "--listen", "host:99999"), "the port 0 to 65535"),
        (("--prefill", "http://a:1,http://a:1", "--decode", "http://b:1"), "given twice"),
        (("--prefill", "http://a:1", "--decode", "http://b:1", "--health-interval", "0"), "above 0"),
        (("--prefill", "http://a:1", "--decode", "http://b:1", "--fails-to-down", "0"), "at least 1"),
    ]
    for args, words in cases:
        out = run_cli(*args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_cli("--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--listen",
                      f"127.0.0.1:{port}")
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_a_client_that_leaves_mid_stream_does_not_take_the_decode_instance_out(cluster):
    proxy, _, (d,) = cluster()
    body = json.dumps({"prompt": " ".join(f"w{i}" for i in range(300)), "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"d0:w1" not in got:
            got += s.recv(4096)
    # The answer had 3 s to go; the proxy sees the client gone at its next write.
    deadline = time.monotonic() + 30
    while 'freight_proxy_errors_total{reason="gone",role="client"} 1.0' not in proxy.metrics():
        assert time.monotonic() < deadline, proxy.metrics()
        time.sleep(0.1)
    assert proxy.health()[1]["decode"][d.url]["alive"] is True
    assert f'freight_proxy_in_flight{{instance="{d.url}",role="decode"}} 0.0' in proxy.metrics()
    assert proxy.post({"prompt": "still here"})[0] == 200


def test_freight_lists_the_proxy_and_without_aiohttp_says_what_to_install(tmp_path):
    out = subprocess.run([sys.executable, "-m", "freight", "--help"], env=ENV, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "proxy" in out.stdout and "P/D proxy" in out.stdout, out.stdout
    (tmp_path / "aiohttp.py").write_text("raise ImportError('No module named aiohttp', name='aiohttp')\n")
    env = dict(ENV, PYTHONPATH=str(tmp_path) + os.pathsep + ENV["PYTHONPATH"])
    out = subprocess.run([sys.executable, "-m", "freight", "proxy", "--prefill", "http://a:1", "--decode",
                          "http://b:1"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out
    assert out.stderr.strip() == ("freight proxy: aiohttp is not installed: pip install 'freight[serve]' "
                                  "(aiohttp and prometheus_client)"), out.stderr


@pytest.mark.timeout(60)
def test_a_decode_instance_dying_mid_answer_cuts_the_clients_answer_and_the_next_request_goes_elsewhere(cluster):
    proxy, _, decode = cluster(decode=2)
    body = json.dumps({"prompt": " ".join(f"w{i}" for i in range(50)), "stream": True, "crash": True}).encode()
    req = urllib.request.Request(proxy.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    got = b""
    with pytest.raises(http.client.IncompleteRead):
        with urllib.request.urlopen(req, timeout=30) as r:
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    break
                got += chunk
    assert b"[DONE]" not in got
    deadline = time.monotonic() + 10
    while not any(d.proc.poll() is not None for d in decode):
        assert time.monotonic() < deadline, "the stand-in did not die"
        time.sleep(0.05)
    dead = [d for d in decode if d.proc.poll() is not None]
    assert len(dead) == 1
    state = proxy.health()[1]["decode"][dead[0].url]
    assert state["alive"] is False and "Payload" in state["reason"], state
    alive = next(d for d in decode if d is not dead[0])
    for i in range(3):
        status, _, answer = proxy.post({"prompt": f"after {i}"})
        assert status == 200 and json.loads(answer)["instance"] == alive.name
    assert "broke off its answer" in proxy.stop()


@pytest.mark.timeout(60)
def test_a_connection_closed_before_its_answer_is_tried_again_and_its_instance_stays_in_use(cluster):
    proxy, (p,), (d,) = cluster()
    status, _, body = proxy.post({"prompt": "again please", "drop_once": True})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == "d0:again d0:please"
    # Each instance got the request twice: the dropped one, then the answered one.
    assert len(p.seen()) == 2 and len(d.seen()) == 2
    code, health = proxy.health()
    assert code == 200 and health["prefill"][p.url]["alive"] and health["decode"][d.url]["alive"], health
    m = proxy.metrics()
    for role, inst in (("prefill", p), ("decode", d)):
        assert f'freight_proxy_upstream_total{{instance="{inst.url}",outcome="connection_error",role="{role}"}} 1.0' \
            in m, m
