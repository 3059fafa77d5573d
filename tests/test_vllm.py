"""FreightConnector in real vLLM: prefill and decode ``vllm serve`` instances on this
machine's CPUs, a tiny model made here, the P/D proxy, and NixlConnector as a control.

Needs the virtualenv of scripts/vllm-env.sh (scripts/test.sh builds it, or takes it
from its cache, and names it in FREIGHT_VLLM_VENV); skipped, saying so, without it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import time
import urllib.error
import warnings
from pathlib import Path
from typing import Dict, Iterator, Optional

import pytest

import vllm_serving as vs

pytestmark = pytest.mark.skipif(vs.venv() is None, reason=f"no vLLM virtualenv ({vs.VENV_ENV} unset: scripts/test.sh "
                                "builds one with scripts/vllm-env.sh)")

PROMPT_WORDS = 150
ANSWER_TOKENS = 12


def make_model(out: Path, **shape: int) -> Path:
    args = [str(vs.venv() / "bin" / "python"), str(Path(__file__).with_name("vllm_model.py")), str(out)]
    for k, v in shape.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    subprocess.run(args, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


def by_source(metrics: Dict[str, float]) -> Dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if key.startswith("vllm:prompt_tokens_by_source_total{"):
            source = key.split('source="')[1].split('"')[0]
            out[source] = out.get(source, 0.0) + value
    return out


@pytest.mark.timeout(180)
def test_the_worker_path_on_host_memory_loads_every_byte_a_killed_prefill_worker_is_a_load_error_and_its_restart_serves():
    # The connector's worker code without vLLM serving (tests/vllm_cpu_worker.py, run in
    # the vLLM virtualenv for its PyTorch): the load after the kill must fail for
    # exactly its blocks, not read the dead worker's memory.
    run = subprocess.run([str(vs.venv() / "bin" / "python"), str(Path(__file__).with_name("vllm_cpu_worker.py"))],
                         capture_output=True, text=True, timeout=150,
                         env=dict(os.environ, PYTHONPATH=str(vs.ROOT / "python")))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["transport"] == "shm"
    assert out["loaded"] and out["load_errors"] == [] and out["bytes_ok"], out
    assert out["freed"] == {"freed": "r1"}
    assert out["after_kill_settled"] and out["after_kill_errors"] == [30, 31, 32], out
    assert out["in_flight_after"] == 0
    # A prefill worker restarted at the dead one's address serves the next load.
    assert out["restarted_at_the_same_address"], out
    assert out["after_restart_loaded"] and out["after_restart_errors"] == [] and out["after_restart_bytes_ok"], out
    assert "cannot load its KV" in run.stderr


SHARING = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.INFO)
import vllm_gpu_peer as peer
from freight.vllm.config import Settings
from freight.vllm.worker import WorkerSide
out = {}
for name, blocks in (("small", 64), ("large", 2048)):
    shape = peer.Shape(layout="HND", num_blocks=blocks)
    caches = peer.kv_caches(shape, "cpu")
    side = WorkerSide(Settings(role="kv_consumer", token="t"))
    side.register_kv_caches(caches, peer.instance(shape, name))
    first = next(iter(caches.values())).data_ptr()
    with open("/proc/self/maps") as f:
        where = [l.strip() for l in f if int(l.split("-")[0], 16) <= first < int(l.split()[0].split("-")[1], 16)]
    out[name] = {"segments": len(side.shared), "mapping": where[0] if where else None}
    side.close()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_host_kv_cache_too_small_to_own_its_pages_stays_private_and_a_large_one_is_shared():
    # 1 MiB a layer may lie in the allocator's heap beside other allocations: sharing
    # its pages would lose their writes meanwhile (a corrupted heap). 32 MiB has its own.
    run = subprocess.run([str(vs.venv() / "bin" / "python"), "-c", SHARING, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, PYTHONPATH=str(vs.ROOT / "python")))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["small"]["segments"] == 0 and "memfd" not in str(out["small"]["mapping"]), out
    # Layers allocated back to back meet inside a page and share one segment.
    assert out["large"]["segments"] >= 1 and "memfd:freight" in str(out["large"]["mapping"]), out
    assert run.stderr.count("4 KV cache region(s) of under 32 MiB") == 1, run.stderr[-3000:]
    assert run.stderr.count("stay private memory") == 1, run.stderr[-3000:]


class PD:
    """A prefill and a decode instance with one connector, and the proxy before them."""

    def __init__(self, model: Path, logs: Path, name: str, decode_extra: Optional[Dict[str, object]] = None,
                 connector: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        connector = connector or name
        self.prefill = vs.Instance(model, logs / f"{name}-prefill.log", connector, "kv_producer", env=env)
        self.decode = vs.Instance(model, logs / f"{name}-decode.log", connector, "kv_consumer", env=env,
                                  extra=decode_extra)
        self.proxy: Optional[vs.ProxyProcess] = None
        try:
            self.prefill.wait_ready()
            self.decode.wait_ready()
            self.proxy = vs.ProxyProcess(self.prefill, self.decode, logs / f"{name}-proxy.log")
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture(scope="module")
def freight_pd(model, logs) -> Iterator[PD]:
    """One FreightConnector pair for the module's tests (a vLLM instance takes most of
    a minute to start on two cores); the last test kills its prefill instance."""
    pd = PD(model, logs, "freight", decode_extra={"connect_timeout": 5})
    yield pd
    pd.stop()


@pytest.fixture
def nixl_pd(model, logs) -> Iterator[PD]:
    """A NixlConnector pair for one test. Its test runs first, before the module's
    FreightConnector pair starts: four instances at once on two cores starve NIXL's
    handshake (its side channel times out and the request fails)."""
    pd = PD(model, logs, "nixl")
    try:
        warm_up_nixl(pd)
        yield pd
    finally:
        pd.stop()


@pytest.fixture
def nixl_on_freight_pd(model, logs) -> Iterator[PD]:
    """vLLM's unmodified NixlConnector with ``import nixl`` resolving to freight's NIXL
    face (its alias directory first on PYTHONPATH), for one test."""
    from freight.nixl import shim_path

    pd = PD(model, logs, "nixl-on-freight", connector="nixl",
            env={"PYTHONPATH": os.pathsep.join([shim_path(), str(vs.ROOT / "python")]), "FREIGHT_TOKEN": vs.TOKEN})
    try:
        yield pd
    finally:
        pd.stop()


def warm_up_nixl(pd: PD, attempts: int = 3) -> None:
    """One request through the NixlConnector pair before the test's, repeated while it
    fails in NIXL's handshake. On two cores the first handshake times out now and then
    (vLLM waits 5 s for the prefill instance's side channel, which answers just
    after): the peer's start-up, not what the test compares. Any other failure fails."""
    assert pd.proxy is not None
    for attempt in range(1, attempts + 1):
        seen = pd.decode.text().count("handshake_failed")
        try:
            vs.complete(pd.proxy.url, vs.prompts(1, 40, seed=100 + attempt)[0], 1)
            return
        except urllib.error.HTTPError:
            if pd.decode.text().count("handshake_failed") == seen:
                raise
            warnings.warn(f"NixlConnector's handshake failed (attempt {attempt}); trying again")
    pytest.fail(f"NixlConnector's handshake failed {attempts} times:\n{pd.decode.tail(80)}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("connector", ["nixl", "nixl_on_freight", "freight"])
def test_pd_output_equals_a_single_instances_and_the_prompt_is_loaded_not_computed(connector, request):
    pd: PD = request.getfixturevalue(f"{connector}_pd")
    name, prefill, decode, proxy = pd.name, pd.prefill, pd.decode, pd.proxy
    assert proxy is not None
    texts = vs.prompts(4, PROMPT_WORDS, seed=1)
    before = by_source(decode.metrics())
    try:
        got = [vs.complete(proxy.url, t, ANSWER_TOKENS)["choices"][0]["text"] for t in texts]
    except urllib.error.HTTPError as e:
        pytest.fail(f"{name}: {e}\n--- the proxy's log:\n{proxy.log.read_text()[-4000:]}\n"
                    f"--- the decode instance's:\n{decode.tail(60)}")
    after = by_source(decode.metrics())
    # The prefill instance alone, as an aggregated instance, is the reference: its KV
    # of these prompts is its own.
    want = [vs.complete(prefill.url, t, ANSWER_TOKENS)["choices"][0]["text"] for t in texts]
    assert got == want, f"{name}: P/D output differs from a single instance's"
    assert len(set(want)) > 1, "the model answers every prompt alike: the comparison would prove little"
    external = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    local = after.get("local_compute", 0) - before.get("local_compute", 0)
    assert external > len(texts) * PROMPT_WORDS / 2, (name, before, after)
    assert local <= len(texts), f"{name}: the decode instance computed {local} prompt tokens itself"
    if name == "freight":
        log = decode.text()
        assert "freight connector: connected to prefill worker" in log, decode.tail()
        # Both on this host, the KV cache shared in place: shm, not tcp.
        assert "transport shm" in log, decode.tail()
        # The connector's own numbers reach vLLM's Prometheus metrics.
        metrics = decode.metrics()

        def total(prefix: str) -> float:
            return sum(v for k, v in metrics.items() if k.startswith(prefix))

        assert total("vllm:freight_xfer_time_seconds_count") >= len(texts), metrics
        assert total("vllm:freight_bytes_transferred_sum") >= len(texts) * PROMPT_WORDS * 1024, metrics
        assert total("vllm:freight_handshake_seconds_count") >= 1, metrics
    if name == "nixl-on-freight":
        # NixlConnector ran on freight's face, not on NIXL: freight's engine listened in
        # the prefill instance and the decode instance added it as its peer.
        assert "freight_core::server: listening" in prefill.text(), prefill.tail()
        assert "freight_core::agent: added peer" in decode.text(), decode.tail()


@pytest.mark.timeout(600)
def test_a_decode_instance_of_another_model_is_refused_naming_both_values(freight_pd, logs, tmp_path):
    other = make_model(tmp_path / "three-layers", layers=3)
    # A short lease, for blocks that nobody asks for.
    prefill = vs.Instance(other, logs / "mismatch-prefill.log", "freight", "kv_producer",
                          extra={"lease_seconds": 3}).wait_ready()
    decode = freight_pd.decode
    try:
        text = vs.prompts(1, PROMPT_WORDS, seed=9)[0]
        params = vs.complete(prefill.url, text, 1, {"kv_transfer_params": {"do_remote_decode": True}})[
            "kv_transfer_params"]
        with pytest.raises(urllib.error.HTTPError):
            vs.complete(decode.url, text, ANSWER_TOKENS, {"kv_transfer_params": params})
        log = decode.text()
        assert "does not match" in log and "num_layers: prefill 3, decode 2" in log, decode.tail()
        # The refused request tells the prefill instance to let its blocks go; blocks
        # handed out for a request that never reaches a decode instance go when
        # their lease ends.
        vs.complete(prefill.url, vs.prompts(1, PROMPT_WORDS, seed=10)[0], 1,
                    {"kv_transfer_params": {"do_remote_decode": True}})
        deadline = time.monotonic() + 60
        while "no decode instance read request" not in prefill.text():
            assert time.monotonic() < deadline, prefill.tail()
            time.sleep(1)
        usage = {k: v for k, v in prefill.metrics().items() if k.startswith("vllm:kv_cache_usage_perc")}
        assert usage and all(v == 0 for v in usage.values()), usage
        assert vs.complete(prefill.url, text, ANSWER_TOKENS)["choices"][0]["text"]
    finally:
        prefill.stop()


TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]


@pytest.mark.timeout(900)
def test_two_tensor_parallel_workers_a_side_load_rank_to_rank_and_a_decode_instance_of_one_is_refused(
        model, logs, freight_pd):
    prefill = vs.Instance(model, logs / "tp2-prefill.log", "freight", "kv_producer", args=TP2)
    decode = vs.Instance(model, logs / "tp2-decode.log", "freight", "kv_consumer", args=TP2)
    proxy = None
    try:
        prefill.wait_ready(600)
        decode.wait_ready(600)
        proxy = vs.ProxyProcess(prefill, decode, logs / "tp2-proxy.log")
        texts = vs.prompts(3, PROMPT_WORDS, seed=11)
        before = by_source(decode.metrics())
        got = [vs.complete(proxy.url, t, ANSWER_TOKENS)["choices"][0]["text"] for t in texts]
        after = by_source(decode.metrics())
        want = [vs.complete(prefill.url, t, ANSWER_TOKENS)["choices"][0]["text"] for t in texts]
        assert got == want, "P/D output with two tensor-parallel workers a side differs from a single instance's"
        external = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        assert external > len(texts) * PROMPT_WORDS / 2, (before, after)
        assert after.get("local_compute", 0) - before.get("local_compute", 0) <= len(texts)
        # Each decode worker reads its own heads from the prefill worker of its rank.
        log = decode.text()
        for rank in (0, 1):
            assert any("connected to prefill worker" in line and f"Worker_TP{rank}" in line and f"-tp{rank}-" in line
                       for line in log.splitlines()), decode.tail()
        # Unequal tensor parallelism is refused, naming both values.
        params = vs.complete(prefill.url, vs.prompts(1, PROMPT_WORDS, seed=12)[0], 1,
                             {"kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
        with pytest.raises(urllib.error.HTTPError):
            vs.complete(freight_pd.decode.url, vs.prompts(1, PROMPT_WORDS, seed=12)[0], ANSWER_TOKENS,
                        {"kv_transfer_params": params})
        assert "tensor_parallel: prefill 2, decode 1" in freight_pd.decode.text(), freight_pd.decode.tail()
    finally:
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.timeout(900)
def test_the_proxy_serves_five_at_once_streamed_or_not_and_a_killed_prefill_instance_is_taken_out(
        freight_pd, model, logs):
    # Two prefill instances (the shared one and another), one decode instance, the proxy
    # before them: concurrency 5, as a client would.
    other = vs.Instance(model, logs / "second-prefill.log", "freight", "kv_producer")
    proxy = None
    try:
        other.wait_ready()
        proxy = vs.ProxyProcess([freight_pd.prefill, other], freight_pd.decode, logs / "two-prefill-proxy.log",
                                args=["--health-interval", "0.5"])
        texts = vs.prompts(10, PROMPT_WORDS, seed=21)

        def ask(i_text):
            i, text = i_text
            if i % 2:
                return vs.complete_streamed(proxy.url, text, ANSWER_TOKENS)
            return vs.complete(proxy.url, text, ANSWER_TOKENS)["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            got = list(pool.map(ask, enumerate(texts)))
        want = [vs.complete(freight_pd.prefill.url, t, ANSWER_TOKENS)["choices"][0]["text"] for t in texts]
        assert got == want, "P/D output through the proxy differs from a single instance's"
        served = proxy.health()["prefill"]
        assert all(s["served"] >= 2 for s in served.values()), served
        # One prefill instance dies: the health check takes it out, requests go on.
        other.kill()
        deadline = time.monotonic() + 30
        while proxy.health()["prefill"][other.url]["alive"]:
            assert time.monotonic() < deadline, proxy.health()
            time.sleep(0.2)
        later = vs.prompts(5, PROMPT_WORDS, seed=22)
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            got = list(pool.map(ask, enumerate(later)))
        want = [vs.complete(freight_pd.prefill.url, t, ANSWER_TOKENS)["choices"][0]["text"] for t in later]
        assert got == want
        health = proxy.health()
        assert health["ok"] and health["prefill"][other.url]["alive"] is False, health
        metrics = proxy.metrics()
        assert metrics['freight_proxy_requests_total{code="200",route="/v1/completions"}'] == len(texts) + len(later)
        assert metrics[f'freight_proxy_instance_up{{instance="{other.url}",role="prefill"}}'] == 0
    finally:
        if proxy is not None:
            proxy.stop()
        other.stop()
    assert f"prefill instance {other.url} is down" in (logs / "two-prefill-proxy.log").read_text()


@pytest.mark.timeout(600)
def test_a_prefill_instance_killed_mid_request_fails_that_request_and_the_decode_instance_serves_on(freight_pd):
    # Last of the module: it kills the shared pair's prefill instance.
    prefill, decode = freight_pd.prefill, freight_pd.decode
    text = vs.prompts(1, PROMPT_WORDS, seed=7)[0]
    # The proxy's first half: the prefill instance computes the prompt and says where
    # its KV is; then it dies before the decode instance reads it.
    first = vs.complete(prefill.url, text, 1, {"kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["freight"]["ranks"], params
    prefill.kill()
    try:
        vs.complete(decode.url, text, ANSWER_TOKENS, {"kv_transfer_params": params})
    except urllib.error.HTTPError as failed:
        assert failed.code >= 400
    else:
        pytest.fail("the decode instance served a request whose prefill instance was dead:\n" + decode.tail(120))
    assert "cannot load its KV" in decode.text() or "reading request" in decode.text(), decode.tail()
    # Later requests are served, with the prompt computed here.
    later = vs.complete(decode.url, vs.prompts(1, 40, seed=8)[0], ANSWER_TOKENS)
    assert later["choices"][0]["text"]
